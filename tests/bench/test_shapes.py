"""`bench engine --shape`: the random-weight file is a real Llama GGUF our engine loads and runs
with the shipped tokenizer, quantised as asked (tiny shapes stand in for the real ones here)."""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path

import gguf
import numpy as np
import pytest

from tokenwire.bench import shapes
from tokenwire.bench.llamacpp_baseline import available as llama_cpp_available
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams

# rows of 256: llama.cpp's K-quants take 256-wide blocks (narrower rows fall back to other types)
TINY = shapes.Shape(hidden=256, layers=2, heads=4, kv_heads=2, ffn=512, context=512, rope_theta=10000.0)
VOCAB = 49152  # SmolLM2's tokenizer, copied from the shipped file
SMALL = 1024  # the first tokens of it, for files that are only read back (GGUFReader: ~3 s per 49k)


@pytest.fixture
def small_vocab(monkeypatch: pytest.MonkeyPatch) -> None:
    cut = {"tokenizer.ggml.tokens": SMALL, "tokenizer.ggml.token_type": SMALL, "tokenizer.ggml.merges": 16}
    fields = tuple(
        (key, kind, values[: cut[key]] if key in cut else values)
        for key, kind, values in shapes._shipped_tokenizer()
    )
    monkeypatch.setattr(shapes, "_shipped_tokenizer", lambda: fields)


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
        assert engine.tokenizer.vocab_size == VOCAB
        options = GenerateOptions(max_tokens=4, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        tokens = engine.generate(None, engine.tokenizer.encode("Hello there"), options).result()[0]
        assert len(tokens) == 4
    finally:
        engine.shutdown()


@pytest.mark.usefixtures("small_vocab")
@pytest.mark.parametrize(("quant", "matrix", "embedding"), [("Q5_1", "Q5_1", "Q8_0"), ("F16", "F16", "F16")])
def test_the_writer_gives_the_types_widths_and_metadata(
    tmp_path: Path, quant: str, matrix: str, embedding: str
) -> None:
    path = tmp_path / "tiny.gguf"
    shapes.write(path, TINY, quant)
    reader = gguf.GGUFReader(path)
    tensors = {t.name: t for t in reader.tensors}
    assert len(tensors) == 2 + 9 * TINY.layers  # tied: no output.weight
    expected = Counter({matrix: 7 * TINY.layers, "F32": 1 + 2 * TINY.layers})
    expected[embedding] += 1
    assert Counter(t.tensor_type.name for t in reader.tensors) == expected
    # ggml's order: columns first
    assert list(tensors["token_embd.weight"].shape) == [256, SMALL]
    assert list(tensors["blk.1.attn_k.weight"].shape) == [256, 2 * 64]
    assert list(tensors["blk.0.ffn_down.weight"].shape) == [512, 256]
    fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
    assert fields["general.architecture"] == "llama"
    assert fields["llama.embedding_length"] == 256 and fields["llama.block_count"] == 2
    assert fields["llama.feed_forward_length"] == 512
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert fields["llama.rope.freq_base"] == 10000.0 and fields["llama.rope.dimension_count"] == 64
    assert fields["general.file_type"] == int(gguf.LlamaFileType[f"MOSTLY_{quant}"])
    assert len(reader.fields["tokenizer.ggml.tokens"].data) == fields["llama.vocab_size"] == SMALL
    assert reader.fields["tokenizer.ggml.model"].contents() == "gpt2"
    assert reader.fields["tokenizer.ggml.eos_token_id"].contents() == 2
    # the data is what it says: normal(0, 0.02) weights, norms of ones
    up = tensors["blk.1.ffn_up.weight"]
    values = gguf.quants.dequantize(up.data, up.tensor_type)
    assert values.shape == (512, 256) and abs(float(values.std()) - 0.02) < 0.001
    assert np.all(tensors["blk.0.attn_norm.weight"].data == 1.0)
    assert path.stat().st_size >= shapes.planned_bytes(TINY, quant) == sum(t.n_bytes for t in reader.tensors)


@pytest.mark.usefixtures("small_vocab")
def test_an_untied_shape_writes_its_head(tmp_path: Path) -> None:
    path = tmp_path / "untied.gguf"
    shapes.write(path, shapes.Shape(hidden=128, layers=1, heads=2, kv_heads=1, ffn=256, tied=False), "Q4_1")
    kinds = {t.name: t.tensor_type.name for t in gguf.GGUFReader(path).tensors}
    assert kinds["output.weight"] == kinds["token_embd.weight"] == "Q8_0"
    assert kinds["blk.0.ffn_gate.weight"] == "Q4_1"


def test_shapes_are_the_published_widths() -> None:
    # SmolLM2-135M's are the shipped model's own (read from its GGUF in the test below)
    assert shapes.SHAPES["llama-8b"] == shapes.Shape(
        hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False
    )
    assert shapes.SHAPES["llama-1b"].tied and shapes.SHAPES["llama-3b"].tied
    # Llama-3.1-8B with SmolLM2's vocabulary: 7.0B in the layers, 0.4B in the head and embedding
    assert shapes.SHAPES["llama-8b"].parameters(VOCAB) == 32 * 218_103_808 + 2 * VOCAB * 4096


def test_the_smollm2_shape_matches_the_shipped_file() -> None:
    from tokenwire.model.loader import resolve_model

    reader = gguf.GGUFReader(resolve_model(None).source)
    f = {k: reader.fields[f"llama.{k}"].contents() for k in
         ("embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
          "feed_forward_length", "rope.freq_base")}  # fmt: skip
    s = shapes.SHAPES["smollm2-135m"]
    assert (s.hidden, s.layers, s.heads, s.kv_heads, s.ffn, s.rope_theta) == tuple(f.values())
    assert s.tied == ("output.weight" not in {t.name for t in reader.tensors})


@pytest.mark.usefixtures("small_vocab")
def test_weight_bytes_count_the_head_once(tmp_path: Path) -> None:
    """Every layer matrix, and the head: the embedding read as the head where tied, else only
    looked up (not counted) beside output.weight; norms are not matrices."""
    small = dict(hidden=128, layers=2, heads=4, kv_heads=2, ffn=256)
    tied, untied = tmp_path / "tied.gguf", tmp_path / "untied.gguf"
    shapes.write(tied, shapes.Shape(**small), "Q8_0")
    shapes.write(untied, shapes.Shape(**small, tied=False), "Q8_0")
    q8 = 34 / 32  # bytes per weight
    layer = (2 * 128 * 128 + 2 * 64 * 128 + 3 * 256 * 128) * q8
    head = SMALL * 128 * q8
    assert shapes.weight_bytes(tied) == shapes.weight_bytes(untied) == 2 * layer + head
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(untied).tensors}
    assert sizes["output.weight"] == sizes["token_embd.weight"] == head
    assert sum(sizes.values()) - shapes.weight_bytes(untied) == head + (1 + 2 * 2) * 128 * 4  # embd, norms


@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp's quantiser is the bench extra (make bench)")
def test_llama_cpp_mixes_go_through_its_quantiser(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(shapes.SHAPES, "tiny", TINY)
    path = shapes.shape_file("tiny", "Q4_K_M", tmp_path)
    assert sorted(p.name for p in path.parent.iterdir()) == [path.name]  # the F16 intermediate is gone
    reader = gguf.GGUFReader(path)
    kinds = {t.name: t.tensor_type.name for t in reader.tensors}
    assert reader.fields["general.file_type"].contents() == int(gguf.LlamaFileType.MOSTLY_Q4_K_M)
    # llama.cpp's Q4_K_M recipe: Q6_K for the (tied) head and for half the layers' attn_v and
    # ffn_down, Q4_K for the rest
    assert kinds["token_embd.weight"] == "Q6_K"
    rest = {
        kinds[f"blk.{i}.{m}.weight"] for i in range(2) for m in ("attn_q", "attn_k", "ffn_up", "ffn_gate")
    }
    assert rest == {"Q4_K"}
    assert {kinds["blk.0.ffn_down.weight"], kinds["blk.1.ffn_down.weight"]} == {"Q4_K", "Q6_K"}
    assert reader.fields["llama.embedding_length"].contents() == 256


@pytest.mark.usefixtures("small_vocab")
@pytest.mark.skipif(not llama_cpp_available(), reason="llama.cpp's quantiser is the bench extra (make bench)")
def test_llama_cpp_requantises_a_q8_0_intermediate(tmp_path: Path) -> None:
    source, dest = tmp_path / "q8.gguf", tmp_path / "q6.gguf"
    shapes.write(source, TINY, "Q8_0")
    with pytest.raises(RuntimeError, match="could not quantise"):  # not without allow_requantize
        shapes.llama_quantize(source, dest, "Q6_K")
    shapes.llama_quantize(source, dest, "Q6_K", allow_requantize=True)
    kinds = Counter(t.tensor_type.name for t in gguf.GGUFReader(dest).tensors)
    assert kinds == {"Q6_K": 1 + 7 * TINY.layers, "F32": 1 + 2 * TINY.layers}


def test_unknown_shape_and_type_are_named(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown --shape 'llama-70b': one of smollm2-135m, llama-1b"):
        shapes.shape_file("llama-70b", "Q4_0", tmp_path)
    with pytest.raises(ValueError, match=r"unknown --quant 'Q4_K': one of F32, .*Q8_0, Q2_K, .*Q4_K_M"):
        shapes.shape_file("llama-1b", "Q4_K", tmp_path)
    assert not (tmp_path / "shapes").exists()


def test_a_llama_cpp_mix_without_llama_cpp_names_the_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # import llama_cpp raises ImportError
    with pytest.raises(ValueError, match=r"^--quant Q4_K_M is quantised by llama.cpp: .*`make bench`"):
        shapes.shape_file("llama-1b", "Q4_K_M", tmp_path)
    assert not (tmp_path / "shapes").exists()


def test_steps_behind_each_measure() -> None:
    from tokenwire.bench.engine_bench import prefill_key, steps_per_s

    assert steps_per_s("single_stream", 20.0, 4, 1000, 512) == 20.0
    assert steps_per_s("streams_4", 80.0, 4, 1000, 512) == 20.0
    # a 1,000-token prompt is two 512-token steps: at 500 tok/s, half a prompt (one step) a second
    assert math.isclose(steps_per_s("prefill_1k", 500.0, 4, 1000, 512), 1.0)
    # --prefill-tokens 4096 names its own measure: eight steps a prompt
    assert (prefill_key(1000), prefill_key(4096)) == ("prefill_1k", "prefill_4096")
    assert math.isclose(steps_per_s("prefill_4096", 512.0, 4, 4096, 512), 1.0)


def test_a_mixture_of_experts_shape_loads_as_olmoe_and_counts_its_active_experts(tmp_path: Path) -> None:
    """OLMoE's layout at tiny widths: llama.cpp's tensor names and metadata, experts stacked and
    read expert by expert in the file's blocks; a token reads 2 of its 4 experts."""
    widths = dict(hidden=128, layers=2, heads=4, kv_heads=4, ffn=64, context=512)
    moe = shapes.Shape(**widths, experts=4, experts_used=2)
    path = tmp_path / "tiny-moe.gguf"
    shapes.write(path, moe, "Q8_0")
    sizes = {t.name: int(t.n_bytes) for t in gguf.GGUFReader(path).tensors}
    assert sizes["blk.0.ffn_gate_exps.weight"] == 4 * 64 * 136  # 4 experts x 64 rows x 4 Q8_0 blocks
    experts = sum(n for name, n in sizes.items() if name.endswith("_exps.weight"))
    # attention and routers whole, the tied head (the embedding table), half the experts
    dense = sum(n for name, n in sizes.items() if "norm" not in name and "_exps" not in name)
    assert shapes.weight_bytes(path) == dense + experts // 2
    engine = build_engine(EngineSettings(model=str(path), progress=False, kv_cache_mb=8, cache_dir=tmp_path))
    try:
        assert engine.config.architecture == "OlmoeForCausalLM"
        options = GenerateOptions(max_tokens=4, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        tokens = engine.generate(None, engine.tokenizer.encode("Hello there"), options).result()[0]
        assert len(tokens) == 4
    finally:
        engine.shutdown()


def test_a_gemma3_shape_runs_fused_with_its_local_layers_in_the_window_pool(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The Gemma 3 shape: heads wider than hidden / heads, q/k and sandwich norms, five local
    layers in six (a window of 16) whose keys and values the fused stack keeps in the window pool."""
    widths = dict(hidden=128, layers=6, heads=4, kv_heads=1, ffn=256, context=512)
    tiny = shapes.Shape(**widths, head_dim=64, window=16)
    monkeypatch.setitem(shapes.SHAPES, "tiny-gemma3", tiny)
    path = shapes.shape_file("tiny-gemma3", "Q8_0", tmp_path)
    reader = gguf.GGUFReader(path)
    assert reader.fields["general.architecture"].contents() == "gemma3"
    kinds = {t.name: tuple(int(n) for n in t.shape) for t in reader.tensors}
    assert kinds["blk.0.attn_q.weight"] == (128, 256) and kinds["blk.5.post_ffw_norm.weight"] == (128,)
    engine = build_engine(EngineSettings(model=str(path), progress=False, kv_cache_mb=8, cache_dir=tmp_path))
    try:
        assert engine.model.config.architecture == "Gemma3ForCausalLM"
        assert engine.model.fusion_blocker is None
        assert engine.kv.window == 16 and engine.kv.window_pool is not None
        assert engine.kv.window_pool.k.shape[0] == 5 and engine.kv.k.shape[0] == 1
        options = GenerateOptions(max_tokens=40, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        tokens = engine.generate(None, list(range(100, 160)), options).result()[0]
        assert len(tokens) == 40
    finally:
        engine.shutdown()
