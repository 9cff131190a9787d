"""`tokenwire generate --image FILE` (in process, through cli.main) on a tiny random Qwen2-VL, and the
refusal of a text-only model."""

from __future__ import annotations

import json
import logging

import pytest

from tests.vision_models import hf_vl_model, png, save_vl_model
from tokenwire.cli import main
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.generate_cmd import image_prompt


@pytest.fixture(autouse=True)
def _keep_logging():
    """cli.main sets up logging for a process: give pytest's handlers and levels back after."""
    root, ours = logging.getLogger(), logging.getLogger("tokenwire")
    saved = (root.handlers[:], root.level, ours.level)
    yield
    root.handlers[:], root.level = saved[0], saved[1]
    ours.setLevel(saved[2])


@pytest.fixture(scope="module")
def vl_dir(tmp_path_factory, smollm2_source):
    return save_vl_model(hf_vl_model("qwen2_vl"), tmp_path_factory.mktemp("vl"), smollm2_source.model_dir)


def test_generate_with_two_images(vl_dir, tmp_path, capsys):
    images = [png(56, 56, seed=61), png(84, 56, seed=62)]
    paths = []
    for i, data in enumerate(images):
        paths += ["--image", str(tmp_path / f"{i}.png")]
        (tmp_path / f"{i}.png").write_bytes(data)
    argv = ["generate", "Compare them.", "--model", str(vl_dir), "--temperature", "0", "--max-tokens", "5"]
    assert main([*argv, *paths, "--kv-cache-mb", "16", "--json"]) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    got = [e["id"] for e in events if e["type"] == "token"]

    engine = build_engine(EngineSettings(model=str(vl_dir), progress=False, kv_cache_mb=16))
    try:
        tokens, attached = image_prompt(engine, "Compare them.", False, images)
        assert [b.end - b.start for b in attached] == [4 + 2, 6 + 2]
        opts = GenerateOptions(max_tokens=5, sampling=SamplingParams(temperature=0))
        expected, done = engine.generate(None, tokens, opts, images=attached).result()
    finally:
        engine.shutdown()
    assert got == [t.token_id for t in expected]
    assert events[-1]["prompt_tokens"] == done.prompt_tokens == len(tokens)


def test_text_only_model_refuses_images(tiny_model_dir, tmp_path, capsys):
    image = tmp_path / "x.png"
    image.write_bytes(png(56, 56))
    argv = [
        "generate",
        "hi",
        "--model",
        str(tiny_model_dir),
        "--image",
        str(image),
        "--kv-cache-mb",
        "8",
    ]
    assert main(argv) == 2
    assert "this model has no vision encoder: images are not accepted" in capsys.readouterr().err
    assert main(["generate", "hi", "--image", str(tmp_path / "missing.png")]) == 2
    assert "--image" in capsys.readouterr().err
