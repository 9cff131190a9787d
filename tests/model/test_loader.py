"""Model loading (GGUF conversion, cache, directories) and the Tokenizer wrapper."""

from __future__ import annotations

import json
import math
import os
import re
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import tokenwire.model.gguf as gguf_module
from tests.model.conftest import TinyGGUF
from tokenwire.model.config import UnsupportedArchitectureError
from tokenwire.model.gguf_weights import GgufWeights
from tokenwire.model.loader import (
    DEFAULT_MODEL_NAME,
    ModelSource,
    default_cache_dir,
    default_model_path,
    load_weights,
    model_name_for,
    resolve_model,
)
from tokenwire.model.tokenizer import IncrementalDecoder, Tokenizer


def dequantized(src: ModelSource) -> dict[str, torch.Tensor]:
    """A GGUF's weights as `--weights fp32` loads them, read from the file."""
    assert src.gguf is not None
    return dict(GgufWeights(src.gguf, src.config, dense=True))


SMOLLM2_SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"


def llamacpp_llama3_factors(
    theta: float, dim: int, factor: float, low: float, high: float, old: int
) -> np.ndarray:
    """llama.cpp's rope_freqs tensor for Llama 3.1-style rope scaling (its converter's loop)."""
    out = []
    for i in range(0, dim, 2):
        wavelen = 2 * math.pi * theta ** (i / dim)
        smooth = (old / wavelen - low) / (high - low)
        medium = 1 / ((1 - smooth) / factor + smooth)
        out.append(1.0 if wavelen < old / high else factor if wavelen > old / low else medium)
    return np.array(out, dtype=np.float32)


# --- GGUF conversion ---------------------------------------------------------------------------


def test_default_model_converts_like_transformers(smollm2_source: ModelSource) -> None:
    """Our weights equal transformers' own GGUF loading (same dequantisation and q/k un-permute).

    AutoModelForCausalLM.from_pretrained(..., gguf_file=...) needs `accelerate` in transformers 5.23,
    so we call the loader it uses, load_gguf_checkpoint, with a meta-device model for the names."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src = smollm2_source
    assert src.name == DEFAULT_MODEL_NAME and src.source == default_model_path()
    cfg = LlamaConfig.from_pretrained(src.model_dir)
    with torch.device("meta"):
        meta_model = LlamaForCausalLM(cfg)
    ref = load_gguf_checkpoint(str(src.source), return_tensors=True, model_to_load=meta_model)
    ours = dequantized(src)
    assert set(ours) == set(ref["tensors"])
    for name, tensor in ours.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, ref["tensors"][name], rtol=0, atol=0, msg=name)
    for key in (
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "vocab_size",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert getattr(cfg, key) == ref["config"][key], key
    assert cfg.rms_norm_eps == pytest.approx(ref["config"]["rms_norm_eps"])
    c = src.config
    assert (c.architecture, c.num_layers, c.num_heads, c.num_kv_heads) == ("LlamaForCausalLM", 30, 9, 3)
    assert (c.head_dim, c.hidden_size, c.intermediate_size) == (64, 576, 1536)
    assert (c.rope_theta, c.rms_norm_eps, c.tie_word_embeddings) == (100000.0, 1e-5, True)
    assert (c.bos_token_id, c.eos_token_ids, c.vocab_size) == (1, [2], 49152)


def test_converted_model_answers_sensibly(smollm2_source: ModelSource, smollm2_hf) -> None:
    """End to end through transformers' LlamaForCausalLM: a wrong q/k permutation gives gibberish."""
    model = smollm2_hf
    tok = smollm2_source.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False)
    assert "Paris" in tok.decode(out[0, len(ids) :].tolist())


def test_second_load_reuses_cache(smollm2_source: ModelSource, monkeypatch: pytest.MonkeyPatch) -> None:
    weights = smollm2_source.model_dir / "config.json"
    mtime = weights.stat().st_mtime_ns

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("reconverted a cached GGUF")

    monkeypatch.setattr(gguf_module, "convert_gguf_apart", no_conversion)
    start = time.perf_counter()
    again = resolve_model(None)  # smollm2_source used the default cache dir too
    print(f"cached default load: {time.perf_counter() - start:.2f}s")
    assert again.model_dir == smollm2_source.model_dir and weights.stat().st_mtime_ns == mtime
    assert again.config == smollm2_source.config


def test_tiny_llama_gguf(tiny_gguf: TinyGGUF, tmp_path: Path) -> None:
    path, expected = tiny_gguf("llama", name="Tiny-Llama-Q8_0.gguf", add_bos=True)
    calls = []
    real = gguf_module.convert_gguf_apart

    def counting(*args: object, **kwargs: object) -> None:
        calls.append(args)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_module, "convert_gguf_apart", counting)
        src = resolve_model(path, cache_dir=tmp_path / "cache")
        again = resolve_model(str(path), cache_dir=tmp_path / "cache", name="custom")
    assert len(calls) == 1 and again.model_dir == src.model_dir
    stat = path.stat()  # a changed file converts again, and its old entry is removed
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gguf_module, "convert_gguf_apart", counting)
        changed = resolve_model(path, cache_dir=tmp_path / "cache")
    assert len(calls) == 2 and changed.model_dir != src.model_dir and not src.model_dir.exists()
    src = changed
    assert (src.name, again.name, src.source) == ("Tiny-Llama", "custom", path)
    assert src.model_dir.parent == tmp_path / "cache" and not list(src.model_dir.parent.glob(".tmp-*"))
    assert not list(src.model_dir.glob("*.safetensors"))  # no weights copied: read from the GGUF
    ours = dequantized(src)
    assert set(ours) == set(expected)  # incl. an untied lm_head, q/k un-permuted (GQA k too)
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name].numpy(), value, err_msg=name)
    c = src.config
    assert (c.architecture, c.tie_word_embeddings, c.attention_bias, c.rope_scaling) == (
        "LlamaForCausalLM",
        False,
        False,
        None,
    )
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.rms_norm_eps) == (2, 1, 64, 1e-6)
    tok = src.tokenizer  # add_bos_token=True in the GGUF: BOS is prepended
    assert tok.encode("hi") == [257, 256] and tok.encode("hi", add_special_tokens=False) == [256]
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (257, [258], 259)
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == [257, 256, 258]


def test_a_conversion_directory_names_its_gguf(smollm2_source: ModelSource) -> None:
    """A GGUF's conversion directory given as the model (the AICI runtime's --tokenizer, the
    transformers baseline): the same model, its weights read from the GGUF it names."""
    again = resolve_model(smollm2_source.model_dir)
    assert again.gguf == smollm2_source.source and again.model_dir == smollm2_source.model_dir
    assert again.config == smollm2_source.config


def test_tiny_qwen2_gguf_is_not_permuted(tiny_gguf: TinyGGUF, tmp_path: Path) -> None:
    path, expected = tiny_gguf("qwen2", tied=True, add_bos=False)
    src = resolve_model(path, cache_dir=tmp_path / "cache")
    ours = dequantized(src)
    assert set(ours) == set(expected) and "lm_head.weight" not in ours
    for name, value in expected.items():
        np.testing.assert_array_equal(ours[name].numpy(), value, err_msg=name)
    c = src.config
    assert (c.architecture, c.tie_word_embeddings, c.attention_bias) == ("Qwen2ForCausalLM", True, True)
    assert src.tokenizer.encode("hi") == [256]


def test_llama3_rope_freqs_become_rope_scaling(tiny_gguf: TinyGGUF, tmp_path: Path) -> None:
    freqs = llamacpp_llama3_factors(500000.0, 64, factor=8.0, low=1.0, high=4.0, old=8192)
    path, _ = tiny_gguf(rope_freqs=freqs, theta=500000.0)
    c = resolve_model(path, cache_dir=tmp_path / "cache").config
    assert c.rope_theta == 500000.0
    assert c.rope_scaling == {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }
    ours = gguf_module.llama3_rope_factors(500000.0, 64, c.rope_scaling)
    np.testing.assert_allclose(ours, freqs, rtol=1e-6)


def test_sentencepiece_gguf_token_bytes(tiny_gguf: TinyGGUF, tmp_path: Path) -> None:
    """Llama-2-style vocabulary: ▁ for spaces, <0xNN> byte fallback, first space stripped on decode."""
    path, _ = tiny_gguf(spm=True)
    tok = resolve_model(path, cache_dir=tmp_path / "cache").tokenizer
    assert tok.token_bytes(tok.encode("hi", add_special_tokens=False)[0]) == b" hi"
    assert tok.token_bytes(3 + 0xE4) == b"\xe4" and tok.token_bytes(1) == b"<s>"
    for text in ["hi hi", "héllo 世界 🎉", "hi  hi"]:
        ids = tok.encode(text)
        assert ids[0] == tok.bos_token_id == 1 and tok.decode(ids, skip_special_tokens=True) == text
        for skip in (False, True):
            decoder = tok.incremental_decoder(skip_special_tokens=skip)
            assert decoder.feed_many(ids) + decoder.flush() == tok.decode(ids, skip_special_tokens=skip)


# --- errors ------------------------------------------------------------------------------------


def test_unsupported_gguf_architecture_leaves_no_cache(tiny_gguf: TinyGGUF, tmp_path: Path) -> None:
    path, _ = tiny_gguf("gpt2")
    with pytest.raises(UnsupportedArchitectureError, match="'gpt2'"):
        resolve_model(path, cache_dir=tmp_path / "cache")
    assert not (tmp_path / "cache").exists() or not list((tmp_path / "cache").iterdir())
    linear, _ = tiny_gguf(
        name="linear.gguf", extra_kv={"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0}
    )
    with pytest.raises(UnsupportedArchitectureError, match="linear"):
        resolve_model(linear, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_crash_mid_conversion_leaves_no_entry(
    tiny_gguf: TinyGGUF, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path, _ = tiny_gguf()

    def crash(gguf_path: Path, out_dir: Path, **kwargs: object) -> None:
        (out_dir / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(gguf_module, "convert_gguf_apart", crash)
    with pytest.raises(KeyboardInterrupt):
        resolve_model(path, cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").iterdir())


def test_unsupported_architecture_in_directory(smollm2_source: ModelSource, tmp_path: Path) -> None:
    model_dir = tmp_path / "gpt2-model"
    model_dir.mkdir()
    cfg = json.loads((smollm2_source.model_dir / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="GPT2LMHeadModel"):
        resolve_model(model_dir)


def test_missing_and_unreadable_models(tmp_path: Path) -> None:
    missing = tmp_path / "nope" / "model.gguf"
    with pytest.raises(FileNotFoundError, match=re.escape(str(missing))):
        resolve_model(missing, cache_dir=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        resolve_model(tmp_path)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"definitely not a gguf file" * 10)
    with pytest.raises(ValueError, match=r"bad\.gguf"):
        resolve_model(bad, cache_dir=tmp_path / "cache")
    other = tmp_path / "weights.bin"
    other.write_bytes(b"x")
    with pytest.raises(ValueError, match=r"weights\.bin"):
        resolve_model(other)
    with pytest.raises(FileNotFoundError, match="safetensors"):
        load_weights(tmp_path)


def test_directory_model_used_in_place(smollm2_source: ModelSource, tmp_path: Path) -> None:
    import shutil

    from tests.tiny_models import hf_model

    directory = tmp_path / "tiny-llama"
    hf_model("smollm2").save_pretrained(directory)
    for name in ("tokenizer.json", "tokenizer_config.json"):  # a tokenizer beside the weights
        shutil.copy(smollm2_source.model_dir / name, directory / name)
    src = resolve_model(directory)
    assert src.model_dir == directory and src.name == "tiny-llama" and src.gguf is None
    saved = set(load_weights(directory))  # the tied lm_head is saved as the embedding alone
    assert saved == set(hf_model("smollm2").state_dict()) - {"lm_head.weight"}


def test_model_names(tmp_path: Path) -> None:
    assert model_name_for(Path("SmolLM2-135M-Instruct.Q4_1.gguf")) == "SmolLM2-135M-Instruct"
    assert model_name_for(Path("/m/Llama-3.2-1B-Instruct-Q4_K_M.gguf")) == "Llama-3.2-1B-Instruct"
    assert model_name_for(Path("qwen2.5-0.5b-instruct-iq3_xs.gguf")) == "qwen2.5-0.5b-instruct"
    assert model_name_for(Path("mistral.f16.gguf")) == "mistral"
    assert model_name_for(Path("plain.gguf")) == "plain"
    (tmp_path / "Qwen2.5-0.5B").mkdir()
    assert model_name_for(tmp_path / "Qwen2.5-0.5B") == "Qwen2.5-0.5B"
    assert model_name_for(Path("models/tiny-model/")) == "tiny-model"


# --- tokenizer ---------------------------------------------------------------------------------

TEXTS = ["Hello, world!", "héllo 世界 🎉", "a  1 + 22 = 333\n\tdone", "<|im_start|>user\nhi<|im_end|>", ""]


def test_tokenizer_matches_hf(smollm2_source: ModelSource) -> None:
    from transformers import AutoTokenizer

    tok = smollm2_source.tokenizer
    hf = AutoTokenizer.from_pretrained(smollm2_source.model_dir, local_files_only=True)
    for text in TEXTS:
        assert tok.encode(text) == hf(text)["input_ids"]
        assert tok.decode(tok.encode(text)) == text
    assert tok.encode("hi") == tok.encode("hi", add_special_tokens=False)  # GGUF: add_bos_token false
    assert (tok.bos_token_id, tok.eos_token_ids, tok.vocab_size) == (1, [2], 49152)
    # SmolLM2 splits every digit off first (llama.cpp pre-tokenizer "smollm"), so two spaces stay together.
    assert tok.hf.convert_ids_to_tokens(tok.encode("a  1")) == ["a", "ĠĠ", "1"]
    assert tok.encode("<|im_start|>") == [1]


def test_token_bytes_and_incremental_decoding(smollm2_source: ModelSource) -> None:
    tok = smollm2_source.tokenizer
    text = "héllo 世界 🎉"
    ids = tok.encode(text)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()
    assert tok.token_bytes(2) == b"<|im_end|>" and tok.token_bytes(tok.encode(" the")[0]) == b" the"
    assert tok.token_bytes(10**9) == b""
    decoder = tok.incremental_decoder()
    pieces = [decoder.feed(i) for i in ids]
    assert "".join(pieces) + decoder.flush() == tok.decode(ids) == text
    assert "" in pieces  # some character was split across tokens and held back
    assert all("\ufffd" not in p for p in pieces)
    chat = tok.apply_chat_template([{"role": "user", "content": text}])
    skip = IncrementalDecoder(tok, skip_special_tokens=True)
    assert skip.feed_many(chat) == tok.decode(chat, skip_special_tokens=True)
    assert Tokenizer.IncrementalDecoder is IncrementalDecoder  # type: ignore[attr-defined]


def test_chat_template(smollm2_source: ModelSource) -> None:
    tok = smollm2_source.tokenizer
    assert tok.has_chat_template
    ids = tok.apply_chat_template([{"role": "user", "content": "Hi there"}])
    expected = (
        f"<|im_start|>system\n{SMOLLM2_SYSTEM}<|im_end|>\n"
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    )
    assert tok.decode(ids) == expected and ids[0] == 1
    assert ids == tok.hf.apply_chat_template(
        [{"role": "user", "content": "Hi there"}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    convo = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Yo"}]
    no_prompt = tok.decode(tok.apply_chat_template(convo, add_generation_prompt=False))
    assert no_prompt == "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nYo<|im_end|>\n"


def test_cache_dir_from_environment(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TOKENWIRE_CACHE_DIR", str(tmp_path / "c"))
    assert default_cache_dir() == tmp_path / "c"
    monkeypatch.delenv("TOKENWIRE_CACHE_DIR")
    assert default_cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "tokenwire"
