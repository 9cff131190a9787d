"""Each family's tiny model written to GGUF as llama.cpp's converter writes it
(tests/model/converter_gguf.py) loads into the model its Hugging Face directory gives: F32 to
1e-4 of transformers with the same greedy tokens through the engine; Q8_0, run as its blocks,
gives the greedy tokens transformers gives with the file's weights dequantised. The writer's metadata
and tensor table are those llama.cpp's real converter wrote for the same models
(tests/data/llama_cpp_converter_tables.json)."""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
import torch

from tests.model.converter_gguf import write_like_llama_cpp
from tests.model.test_llama_parity import dense_logits
from tests.tiny_models import hf_model
from tokenwire.bench.hf_baseline import transformers_model
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import load_model
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.model.loader import resolve_model

FAMILIES = ["smollm3", "qwen3_gguf", "gemma3_gguf", "phi3", "mixtral", "qwen3_moe_gguf", "olmoe"]
QUANTS = ["F32", "Q8_0"]
CONVERTER_TABLES = Path(__file__).parents[1] / "data" / "llama_cpp_converter_tables.json"


def gguf_table(path: Path) -> dict[str, dict]:
    """A file's model metadata (all but general.* and the tokenizer's: the file's name and the
    shipped vocabulary) and its tensors' shapes and types."""
    reader = gguf.GGUFReader(path)
    skip = ("GGUF.", "general.", "tokenizer.")
    return {
        "metadata": {k: f.contents() for k, f in reader.fields.items() if not k.startswith(skip)},
        "tensors": {t.name: [[int(n) for n in t.shape], t.tensor_type.name] for t in reader.tensors},
    }


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_our_writer_writes_what_llama_cpps_converter_wrote(tmp_path: Path, arch: str, quant: str) -> None:
    path = tmp_path / "tiny.gguf"
    write_like_llama_cpp(hf_model(arch), path, quant, tokenizer=False)  # the table leaves it out
    assert gguf_table(path) == json.loads(CONVERTER_TABLES.read_text())[f"{arch}/{quant}"]


def hf_greedy(hf: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    with torch.inference_mode():
        ids = torch.tensor([prompt])
        out = hf.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0, len(prompt) :].tolist()


def engine_greedy(model: torch.nn.Module, tokenizer, prompt: list[int], n: int) -> list[int]:
    engine = Engine(model, tokenizer, name="tiny-gguf", kv_cache_mb=8, max_batch_tokens=16)
    try:
        opts = GenerateOptions(max_tokens=n, sampling=SamplingParams(temperature=0.0), ignore_eos=True)
        return [e.token_id for e in engine.generate(None, prompt, opts).result()[0]]
    finally:
        engine.shutdown()


@pytest.mark.parametrize("quant", QUANTS)
@pytest.mark.parametrize("arch", FAMILIES)
def test_gguf_as_llama_cpp_writes_it_loads_as_its_hf_directory(
    tmp_path: Path, shared_cache: Path, arch: str, quant: str
) -> None:
    hf = hf_model(arch)
    path = tmp_path / f"tiny-{arch}-{quant}.gguf"
    write_like_llama_cpp(hf, path, quant)
    assert_loads_as(hf, path, quant, shared_cache)


@pytest.fixture(scope="module")
def shared_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One conversions' cache for the module: each family's F32 and Q8_0 files share a
    tokenizer, converted once (model/gguf.py's tokenizer cache)."""
    return tmp_path_factory.mktemp("cache")


def assert_loads_as(hf: torch.nn.Module, path: Path, quant: str, cache_dir: Path) -> None:
    """The file at `path`, written from `hf` as `quant`, gives its logits and greedy tokens
    (make_converter_tables.py runs this on the real converter's files too)."""
    source = resolve_model(path, cache_dir=cache_dir)
    assert source.config.architecture == type(hf).__name__
    ids = torch.randint(3, 49152, (1, 40), generator=torch.Generator().manual_seed(6))
    prompt = ids[0, :24].tolist()
    quantised = load_model(source, "gguf", torch.device("cpu"), None)
    if quant == "F32":
        with torch.inference_mode():
            assert (dense_logits(quantised, ids) - hf(ids).logits).abs().max() <= 1e-4
        reference = hf
    else:  # transformers with the file's weights dequantised: the same numbers, its arithmetic
        reference = transformers_model(str(source.model_dir))
        dense = load_model(source, "fp32", torch.device("cpu"), None)
        with torch.inference_mode():
            assert (dense_logits(dense, ids) - reference(ids).logits).abs().max() <= 1e-4
        # int8 activations (a scale per 32) in the tiled types' matmuls: seen 8.6e-3 (int16: 1e-3)
        assert (dense_logits(quantised, ids) - dense_logits(dense, ids)).abs().max() <= 3e-2
    ours, theirs = engine_greedy(quantised, source.tokenizer, prompt, 24), hf_greedy(reference, prompt, 24)
    if quant == "F32":
        assert ours == theirs
    else:  # the int8 activations may part from the exact model only where it is torn (a random model's top
        # two logits can be closer than the rounding above): at the first difference, within 2 x 3e-2
        assert parts_only_at_a_near_tie(reference, prompt, ours, theirs, 6e-2), (ours, theirs)


def parts_only_at_a_near_tie(
    reference: torch.nn.Module, prompt: list[int], ours: list[int], theirs: list[int], gap: float
) -> bool:
    first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
    if first is None:
        return True
    with torch.inference_mode():
        logits = reference(torch.tensor([prompt + theirs[:first]])).logits[0, -1]
    top = logits.topk(2).values
    return bool(top[0] - top[1] <= gap) and logits[ours[first]] >= top[0] - gap


def test_a_turn_end_the_chat_template_writes_ends_generation(tmp_path: Path) -> None:
    """Converters often record only <eos>; llama.cpp also stops at turn-ending tokens it knows
    by text (Gemma's <end_of_turn>). We take those the file's chat template writes: here a
    template ending turns with <|endoftext|> (id 0 of the shipped vocabulary) adds it; the
    shipped model's own template does not write it, so SmolLM2 keeps [2] (tests/model/test_loader)."""
    template = "{% for m in messages %}{{ m['content'] }}<|endoftext|>{% endfor %}"
    path = tmp_path / "tiny-gemma3-turns.gguf"
    write_like_llama_cpp(hf_model("gemma3_gguf"), path, "F32", chat_template=template)
    source = resolve_model(path, cache_dir=tmp_path / "cache")
    assert source.config.eos_token_ids == [2, 0]
    assert source.tokenizer.chat_prompt([{"role": "user", "content": "hi"}]) == "hi<|endoftext|>"


def test_a_mixture_of_experts_file_without_its_expert_counts_is_refused_by_name(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen3moe-damaged.gguf"
    write_like_llama_cpp(hf_model("qwen3_moe_gguf"), path, "F32", drop="expert_used_count")
    with pytest.raises(ValueError, match=r"qwen3moe\.expert_used_count is missing"):
        resolve_model(path, cache_dir=tmp_path / "cache")


def test_a_tokenizer_is_converted_once_for_every_file_that_shares_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two quantisations of one model: the second file's tokenizer is the first's, copied from the
    tokenizer cache with no child process; the same files and turn ends either way."""
    import subprocess

    from tokenwire.model import gguf as gguf_module

    monkeypatch.delenv(gguf_module.TOKENIZER_CACHE_ENV, raising=False)  # this test's own cache
    cache = tmp_path / "cache"
    hf = hf_model("qwen3_gguf")
    first, second = tmp_path / "a-F32.gguf", tmp_path / "a-Q8_0.gguf"
    write_like_llama_cpp(hf, first, "F32")
    write_like_llama_cpp(hf, second, "Q8_0")
    key = gguf_module.tokenizer_key(gguf_module.read_header(first))
    assert key == gguf_module.tokenizer_key(gguf_module.read_header(second))
    gguf_module.convert_gguf_apart(first, tmp_path / "one", cache)
    assert (cache / ".tokenizers" / key / "tokenizer.json").is_file()
    monkeypatch.setenv(gguf_module.TOKENIZER_CACHE_ENV, str(tmp_path / "shared"))  # one for every cache
    assert gguf_module.tokenizer_cache(key, cache) == tmp_path / "shared" / key
    monkeypatch.delenv(gguf_module.TOKENIZER_CACHE_ENV)

    def no_child(*args: object, **kw: object) -> None:
        raise AssertionError("a cached tokenizer was converted again")

    monkeypatch.setattr(subprocess, "run", no_child)
    gguf_module.convert_gguf_apart(second, tmp_path / "two", cache)
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "generation_config.json"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes(), name
    assert not (tmp_path / "two" / ".turn_ends.json").exists()
    other = tmp_path / "b.gguf"  # another vocabulary's template: another key
    write_like_llama_cpp(hf, other, "F32", chat_template="{{ messages[0]['content'] }}")
    assert gguf_module.tokenizer_key(gguf_module.read_header(other)) != key
