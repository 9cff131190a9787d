"""`image_url` parts on a tiny random Qwen2-VL through the official openai client: a data: URL
image generates what the engine generates for that image; remote URLs and bad data are 400s."""

from __future__ import annotations

import asyncio
import base64
import threading

import openai
import pytest

from tests.vision_models import VISION_START, hf_vl_model, png, save_vl_model
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.engine.vision import ImageInput
from tokenwire.protocols.openai.transport import OpenAIServer

IMG = png(56, 84, seed=51)  # 6 pads


@pytest.fixture(scope="module")
def vl(tmp_path_factory, smollm2_source):
    directory = save_vl_model(
        hf_vl_model("qwen2_vl"), tmp_path_factory.mktemp("vl"), smollm2_source.model_dir
    )
    engine = build_engine(EngineSettings(model=str(directory), progress=False, kv_cache_mb=16))
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    server = asyncio.run_coroutine_threadsafe(OpenAIServer(engine, port=0).start(), loop).result(30)
    client = openai.OpenAI(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    yield engine, client
    asyncio.run_coroutine_threadsafe(server.stop(), loop).result(30)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)
    engine.shutdown()


def _parts(url: str) -> list[dict]:
    return [
        {"type": "text", "text": "What is in "},
        {"type": "image_url", "image_url": {"url": url}},
        {"type": "text", "text": "?"},
    ]


def test_data_url_image_generates_what_the_engine_does(vl):
    engine, client = vl
    url = "data:image/png;base64," + base64.b64encode(IMG).decode()
    reply = client.chat.completions.create(
        model=engine.name, messages=[{"role": "user", "content": _parts(url)}], max_tokens=6, temperature=0
    )
    n = engine.image_tokens(IMG)
    block = "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>"
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": "What is in " + block + "?"}])
    start = prompt.index(VISION_START)
    opts = GenerateOptions(max_tokens=6, sampling=SamplingParams(temperature=0))
    tokens, _ = engine.generate(None, prompt, opts, images=[ImageInput(start, start + n + 2, IMG)]).result()
    assert reply.choices[0].message.content == "".join(t.text for t in tokens)
    assert reply.usage.prompt_tokens == len(prompt)


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("https://example.com/cat.png", "does not fetch remote images"),
        ("data:image/png;base64,@@not base64@@", "invalid base64"),
        (
            "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nbroken").decode(),
            "cannot be decoded",
        ),
        ("data:text/plain;base64," + base64.b64encode(IMG).decode(), "not an image type"),
    ],
)
def test_bad_image_urls_are_400(vl, url, words):
    engine, client = vl
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(
            model=engine.name, messages=[{"role": "user", "content": _parts(url)}], max_tokens=2
        )
    body = err.value.body
    assert words in body["message"] and body["param"] == "messages.0.content.1.image_url.url"
