"""`bench engine --shape`: the random-weight file is a real Llama GGUF our engine loads and runs
with the shipped tokenizer, quantised as asked (a tiny shape stands in for the 1B one here)."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from tokenwire.bench import shapes
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams


def test_a_shape_file_loads_and_generates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tiny = shapes.Shape(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256, context=512)
    monkeypatch.setitem(shapes.SHAPES, "tiny", tiny)
    path = shapes.shape_file("tiny", "Q4_0", tmp_path)
    assert path == shapes.shape_file("tiny", "Q4_0", tmp_path)  # written once, then reused
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert kinds["blk.1.ffn_down.weight"] == "Q4_0" and kinds["token_embd.weight"] == "Q8_0"
    assert reader.fields["llama.block_count"].contents() == 2
    engine = build_engine(EngineSettings(model=str(path), progress=False, kv_cache_mb=8, cache_dir=tmp_path))
    try:
        assert engine.tokenizer.vocab_size == 49152  # SmolLM2's, copied from the shipped file
        options = GenerateOptions(max_tokens=4, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        tokens = engine.generate(None, engine.tokenizer.encode("Hello there"), options).result()[0]
        assert len(tokens) == 4
    finally:
        engine.shutdown()


def test_unknown_shape_and_type_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown --shape 'llama-70b'"):
        shapes.shape_file("llama-70b", "Q4_0", tmp_path)
    with pytest.raises(ValueError, match="--quant 'Q4_K'"):
        shapes.shape_file("llama-1b", "Q4_K", tmp_path)
