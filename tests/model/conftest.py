"""Tiny GGUF files for the model tests (written with gguf-py, as llama.cpp's converter lays them out)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

TinyGGUF = Callable[..., tuple[Path, dict[str, np.ndarray]]]


def llamacpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf q/k row permutation (HF rotate-half -> interleaved pairs)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def byte_alphabet() -> list[str]:
    """GPT-2's byte-level spelling of bytes 0..255."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> TinyGGUF:
    """Factory writing a small random GGUF; returns (path, the HF-named float32 weights it encodes).

    Byte-level BPE vocabulary: the 256 byte tokens, "hi" (256, merge "h i"), "<s>" (257), "</s>" (258).
    With spm=True a sentencepiece one: <unk> <s> </s>, 256 byte-fallback tokens, ▁ h i ▁h hi ▁hi.
    `quantize`: HF module names ("self_attn.q_proj", "lm_head") -> a GGUF type gguf-py can
    quantise to; those weights are written as its blocks, and returned as their exact values."""
    import gguf

    def make(
        arch: str = "llama",
        *,
        name: str = "tiny.gguf",
        tied: bool = False,
        add_bos: bool = True,
        rope_freqs: np.ndarray | None = None,
        extra_kv: dict[str, Any] | None = None,
        theta: float = 10000.0,
        spm: bool = False,
        quantize: dict[str, str] | None = None,
    ) -> tuple[Path, dict[str, np.ndarray]]:
        rng = np.random.default_rng(0)
        hidden, heads, kv_heads, ffn, head_dim = 128, 2, 1, 96, 64
        w = gguf.GGUFWriter(str(tmp_path / name), arch)
        if spm:
            byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
            tokens = ["<unk>", "<s>", "</s>", *byte_tokens, *"▁ h i ▁h hi ▁hi".split()]
            w.add_tokenizer_model("llama")
            w.add_token_types([2, 3, 3] + [6] * 256 + [1] * 6)
            w.add_token_scores([0.0] * 259 + [-float(i) for i in range(6)])
            w.add_bos_token_id(1)
            w.add_eos_token_id(2)
        else:
            tokens = [*byte_alphabet(), "hi", "<s>", "</s>"]
            w.add_tokenizer_model("gpt2")
            w.add_tokenizer_pre("default")
            w.add_token_types([1] * 257 + [3, 3])
            w.add_token_merges(["h i"])
            w.add_bos_token_id(257)
            w.add_eos_token_id(258)
        w.add_token_list(tokens)
        w.add_block_count(1)
        w.add_context_length(256)
        w.add_embedding_length(hidden)
        w.add_feed_forward_length(ffn)
        w.add_head_count(heads)
        w.add_head_count_kv(kv_heads)
        w.add_rope_dimension_count(head_dim)
        w.add_rope_freq_base(theta)
        w.add_layer_norm_rms_eps(1e-6)
        w.add_add_bos_token(add_bos)
        w.add_chat_template("{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}")
        for key, value in (extra_kv or {}).items():
            (w.add_string if isinstance(value, str) else w.add_float32)(key, value)

        def rand(*shape: int) -> np.ndarray:
            return rng.standard_normal(shape).astype(np.float32)

        p = "model.layers.0."
        hf = {"model.embed_tokens.weight": rand(len(tokens), hidden), "model.norm.weight": rand(hidden)}
        hf |= {} if tied else {"lm_head.weight": rand(len(tokens), hidden)}
        hf |= {f"{p}{norm}.weight": rand(hidden) for norm in ("input_layernorm", "post_attention_layernorm")}
        for proj, rows, cols in (
            ("self_attn.q_proj", hidden, hidden),
            ("self_attn.k_proj", 64, hidden),
            ("self_attn.v_proj", 64, hidden),
            ("self_attn.o_proj", hidden, hidden),
            ("mlp.gate_proj", ffn, hidden),
            ("mlp.up_proj", ffn, hidden),
            ("mlp.down_proj", hidden, ffn),
        ):
            hf[f"{p}{proj}.weight"] = rand(rows, cols)
            if arch == "qwen2" and proj[-6:] in ("q_proj", "k_proj", "v_proj"):
                hf[f"{p}{proj}.bias"] = rand(rows)
        hf[p + "mlp.up_proj.weight"] = hf[p + "mlp.up_proj.weight"].astype(np.float16)  # an F16 tensor
        globals_ = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
        for hf_name, value in hf.items():
            stem, kind = hf_name.rsplit(".", 1)
            gname = f"blk.0.{_LAYER_NAMES[stem[len(p) :]]}" if stem.startswith(p) else globals_[stem]
            module = stem[len(p) :] if stem.startswith(p) else stem
            kind_of = (quantize or {}).get(module) if kind == "weight" else None
            if kind_of is not None:  # its blocks in the file; the expected weight their exact values
                qtype = gguf.GGMLQuantizationType[kind_of]
                blocks = gguf.quants.quantize(value.astype(np.float32), qtype)
                hf[hf_name] = gguf.quants.dequantize(blocks, qtype).astype(np.float32)
            if arch == "llama" and gname.endswith(("attn_q", "attn_k")):
                value = llamacpp_permute(value, heads if gname.endswith("q") else kv_heads)
                if kind_of is not None:
                    blocks = llamacpp_permute(blocks, heads if gname.endswith("q") else kv_heads)
            if kind_of is not None:
                w.add_tensor(f"{gname}.{kind}", blocks, raw_dtype=qtype)
            else:
                w.add_tensor(f"{gname}.{kind}", value)
        if rope_freqs is not None:
            w.add_tensor("rope_freqs.weight", rope_freqs)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name, {k: v.astype(np.float32) for k, v in hf.items()}

    return make


@pytest.fixture
def fp32_activations():
    """The kernels' fp32-activation path (the exact comparison with a float matmul)."""
    from tokenwire.model.kernels import ops

    ops().set_int16_activations(False)
    yield
    ops().set_int16_activations(True)
