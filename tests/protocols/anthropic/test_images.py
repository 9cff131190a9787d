"""Image blocks on a tiny random Qwen2-VL through the real `anthropic` client: the same
conversation gives what OpenAI's image_url path gives on the same server, and count_tokens
counts the image's vision block."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import Iterator
from typing import Any

import anthropic
import openai
import pytest

from tests.vision_models import hf_vl_model, png, save_vl_model
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.protocols.openai.transport import OpenAIServer

IMG = png(56, 84, seed=51)
DATA = base64.b64encode(IMG).decode()


@pytest.fixture(scope="module")
def vl(tmp_path_factory: Any, smollm2_source: Any) -> Iterator[tuple[Any, str]]:
    directory = save_vl_model(
        hf_vl_model("qwen2_vl"), tmp_path_factory.mktemp("vl"), smollm2_source.model_dir
    )
    engine = build_engine(EngineSettings(model=str(directory), progress=False, kv_cache_mb=16))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(OpenAIServer(engine, port=0).start(), loop).result(30)
    yield engine, server.url.removesuffix("/v1")
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    engine.shutdown()


def test_an_image_block_generates_what_openai_image_url_does(vl: tuple[Any, str]) -> None:
    engine, root = vl
    client = anthropic.Anthropic(base_url=root, api_key="unused", max_retries=0, timeout=60)
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": DATA}}
    content = [{"type": "text", "text": "What is in "}, image, {"type": "text", "text": "?"}]
    ours = client.messages.create(
        model=engine.name,
        max_tokens=6,
        messages=[{"role": "user", "content": content}],
        extra_body={"temperature": 0},
    )
    parts = [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{DATA}"}},
        {"type": "text", "text": "?"},
    ]
    oai = openai.OpenAI(base_url=f"{root}/v1", api_key="unused", max_retries=0, timeout=60)
    theirs = oai.chat.completions.create(
        model=engine.name, max_tokens=6, temperature=0, messages=[{"role": "user", "content": parts}]
    )
    assert "".join(b.text for b in ours.content) == theirs.choices[0].message.content
    counted = client.messages.count_tokens(model=engine.name, messages=[{"role": "user", "content": content}])
    assert counted.input_tokens == theirs.usage.prompt_tokens
    assert counted.input_tokens > engine.image_tokens(IMG)
