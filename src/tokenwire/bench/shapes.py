"""Random-weight GGUF files at the widths of the models users bring, for `bench engine --shape`.

The shipped model is 135M parameters; the speed that matters to users is at 1B-8B. A real
checkpoint of that size cannot be downloaded here (no model hub), and speed does not depend on
the weights' values, so the benchmark writes one: a Llama-architecture GGUF with the named
model's widths, random weights (normal, std 0.02, seeded), quantised with gguf's reference
quantiser, and SmolLM2's tokenizer (vocabulary 49,152) copied from the shipped file. llama.cpp
loads it like any converted model, so both engines run the very same bytes.

Written once into `<cache-dir>/shapes/` (a 1B Q4_0 file: ~0.7 GB, ~1 min on 2 cores).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np

from tokenwire.model.loader import resolve_model

log = logging.getLogger("tokenwire.bench.shapes")


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int = 8192
    rope_theta: float = 500000.0


# Llama-3.2-1B's widths (issue 24's "1B shape"); 3B for a second point on the curve
SHAPES = {
    "llama-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
}
# what gguf's Python quantiser writes (and our engine runs without re-quantising)
QUANTS = ("Q4_0", "Q4_1", "Q8_0")
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.ggml.add_space_prefix",
    "tokenizer.chat_template",
)


def shape_file(name: str, quant: str, cache_dir: Path) -> Path:
    """The GGUF for `name` at `quant`, written on first use."""
    if name not in SHAPES:
        raise ValueError(f"unknown --shape {name!r}: one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise ValueError(f"--quant {quant!r}: random-weight files are written as one of {', '.join(QUANTS)}")
    path = cache_dir / "shapes" / f"{name}-random-{quant}.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".partial")
        log.info("writing %s (random weights at %s's widths, once)", path, name)
        _write(tmp, SHAPES[name], quant)
        tmp.rename(path)
    return path


def copy_shipped_tokenizer(writer: gguf.GGUFWriter) -> int:
    """Copies the shipped model's tokenizer into `writer`; returns the vocabulary size."""
    reader = gguf.GGUFReader(resolve_model(None).source)
    vocab = 0
    for key in TOKENIZER_KEYS:
        field = reader.fields.get(key)
        if field is None:
            continue
        kind = field.types[0]
        if kind == gguf.GGUFValueType.ARRAY:
            values = field.contents()
            writer.add_array(key, values)
            if key == "tokenizer.ggml.tokens":
                vocab = len(values)
        else:
            writer.add_key_value(key, field.contents(), kind)
    return vocab


def _write(path: Path, s: Shape, quant: str) -> None:
    qtype = gguf.GGMLQuantizationType[quant]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("random weights, bench shape")
    vocab = copy_shipped_tokenizer(w)
    head_dim = s.hidden // s.heads
    w.add_block_count(s.layers)
    w.add_context_length(s.context)
    w.add_embedding_length(s.hidden)
    w.add_feed_forward_length(s.ffn)
    w.add_head_count(s.heads)
    w.add_head_count_kv(s.kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_rope_freq_base(s.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_file_type(int(gguf.LlamaFileType[f"MOSTLY_{quant}"]))
    rng = np.random.default_rng(0)

    def matrix(name: str, rows: int, cols: int, kind: gguf.GGMLQuantizationType = qtype) -> None:
        x = rng.standard_normal((rows, cols), dtype=np.float32) * np.float32(0.02)
        w.add_tensor(name, gguf.quants.quantize(x, kind), raw_dtype=kind)

    def norm(name: str) -> None:
        w.add_tensor(name, np.ones(s.hidden, dtype=np.float32))

    # the tied embedding as Q8_0, as llama.cpp's own quantisations keep it at >= 6 bits
    matrix("token_embd.weight", vocab, s.hidden, gguf.GGMLQuantizationType.Q8_0)
    norm("output_norm.weight")
    kv = s.kv_heads * head_dim
    for i in range(s.layers):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        matrix(p + "attn_q.weight", s.hidden, s.hidden)
        matrix(p + "attn_k.weight", kv, s.hidden)
        matrix(p + "attn_v.weight", kv, s.hidden)
        matrix(p + "attn_output.weight", s.hidden, s.hidden)
        matrix(p + "ffn_gate.weight", s.ffn, s.hidden)
        matrix(p + "ffn_up.weight", s.ffn, s.hidden)
        matrix(p + "ffn_down.weight", s.hidden, s.ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
