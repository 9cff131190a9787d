"""Evergreen image chunks end to end on a tiny random Qwen2-VL through the client library: GENERATE
with an image inside a user turn, COUNT_TOKENS counting the image's block, bad images refused."""

from __future__ import annotations

import argparse
import asyncio

import pytest

from tests.protocols.evergreen.conftest import ServerThread
from tests.vision_models import VISION_START, hf_vl_model, png, save_vl_model
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.engine.vision import ImageInput
from tokenwire.evergreen import EvergreenError, EvergreenSession, GenerateConfig

GREEDY = GenerateConfig(temperature=0, max_tokens=6)
IMG_X, IMG_Y = png(84, 56, seed=41), png(84, 56, seed=42)  # 6 pads each


@pytest.fixture(scope="module")
def vl(tmp_path_factory, smollm2_source):
    directory = save_vl_model(
        hf_vl_model("qwen2_vl"), tmp_path_factory.mktemp("vl"), smollm2_source.model_dir
    )
    engine = build_engine(EngineSettings(model=str(directory), progress=False, kv_cache_mb=16))
    args = argparse.Namespace(
        allow_ref_root=[], evergreen_max_depth=8, evergreen_max_nodes=200, evergreen_max_tokens=12
    )
    server = ServerThread(engine, args)
    yield engine, server
    server.stop()
    engine.shutdown()


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def _engine_text(engine, before: str, image: bytes, after: str) -> str:
    """What the engine generates for a user turn holding the image's block between two texts."""
    n = engine.image_tokens(image)
    block = "<|vision_start|>" + "<|image_pad|>" * n + "<|vision_end|>"
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": before + block + after}])
    start = prompt.index(VISION_START)
    opts = GenerateOptions(max_tokens=6, sampling=SamplingParams(temperature=0))
    tokens, _ = engine.generate(None, prompt, opts, images=[ImageInput(start, start + n + 2, image)]).result()
    return "".join(t.text for t in tokens)


def test_generate_with_an_image_chunk(vl):
    engine, server = vl

    async def main():
        async with await EvergreenSession.connect(server.target) as session:
            outs = []
            for image in (IMG_X, IMG_Y):  # same pad run, different pixels: no shared KV
                prompt = [
                    session.text("Describe "),
                    session.data(image, "image/png"),
                    session.text(" briefly."),
                ]
                outs.append(await session.generate(prompt, GREEDY).text())
            return outs

    x, y = run(main())
    assert x == _engine_text(engine, "Describe ", IMG_X, " briefly.")
    assert y == _engine_text(engine, "Describe ", IMG_Y, " briefly.")


def test_count_tokens_includes_the_image_expansion(vl):
    engine, server = vl

    async def main():
        async with await EvergreenSession.connect(server.target) as session:
            parts = [session.text("two words"), session.data(IMG_X, "image/png"), session.text("and more")]
            return await session.count_tokens(session.node(*parts))

    encode = engine.tokenizer.encode
    expected = (
        len(encode("two words", add_special_tokens=False))
        + 6
        + 2
        + len(encode("and more", add_special_tokens=False))
    )
    assert run(main()) == expected


@pytest.mark.parametrize(
    ("data", "mimetype", "words"),
    [(b"\x89PNG\r\n\x1a\n garbage", "image/png", "cannot be decoded"), (IMG_X, "image/gif", "image/gif")],
)
def test_bad_images_are_invalid_argument(vl, data, mimetype, words):
    _, server = vl

    async def main():
        async with await EvergreenSession.connect(server.target) as session:
            session.set_options(partial_failures=True)
            with pytest.raises(EvergreenError) as info:
                await session.generate(session.data(data, mimetype), GREEDY).text()
            return info.value

    error = run(main())
    assert error.code == "INVALID_ARGUMENT" and words in error.details
