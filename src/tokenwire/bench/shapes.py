"""Random-weight GGUF files at the widths of the models users bring, for `bench engine --shape`.

The shipped model is 135M parameters; the speed that matters to users is at 1B-8B. A real
checkpoint of that size cannot be downloaded here (no model hub), and speed does not depend on
the weights' values, so the benchmark writes one: a Llama-architecture GGUF with the named
model's widths, random weights (normal, std 0.02, seeded) and SmolLM2's tokenizer (vocabulary
49,152) copied from the shipped file, for every shape: the 8B shape's head and embedding are
49,152 rows, not Llama-3's 128,256 (0.4 of its 1 GB of Q8_0 head), and no shape carries Llama-3's
RoPE scaling (speed does not depend on it). llama.cpp loads the file like any converted model, so
both engines run the very same bytes.

Two ways to a weight type (`--quant`):
- what gguf-py's own quantiser writes (WRITTEN: F32, F16, BF16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0):
  written directly, every layer matrix in that type; the embedding, and the head where it is not
  tied, stay at Q8_0 below 8 bits (llama.cpp's own recipes keep the head at >= 6 bits; gguf-py
  cannot write their Q6_K);
- llama.cpp's mixes (LLAMA_CPP_QUANTS: the K-quants, IQ4_NL, IQ4_XS): written as an F16 file
  (Q8_0 for shapes above 4B parameters, to halve the disk and the time), then quantised by
  llama.cpp's own quantiser through llama-cpp-python (the `bench` extra), which picks each
  tensor's type exactly as `llama-quantize` does (Q4_K_M: Q6_K for half the attn_v/ffn_down and
  the head, Q4_K elsewhere); the intermediate file is deleted.

Files are written tensor by tensor (the tensor table first, then each tensor's bytes as it is
made), so memory stays at one tensor's quantised bytes plus a 64 MB float chunk, whatever the
file's size. Written once into `<cache-dir>/shapes/` (1B Q4_0: 0.7 GB, ~20 s on 2 cores).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np

from tokenwire.bench.llamacpp_baseline import llama_cpp_module, quiet_llama_cpp
from tokenwire.model.gguf_header import read_header
from tokenwire.model.loader import resolve_model

log = logging.getLogger("tokenwire.bench.shapes")

Q = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class Shape:
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    context: int = 8192
    rope_theta: float = 500000.0
    tied: bool = True  # the head is the embedding (no output.weight)
    experts: int = 0  # a mixture of `experts` MLPs of width `ffn` in every layer (OLMoE's layout)
    experts_used: int = 0
    head_dim: int = 0  # 0: hidden / heads
    window: int = 0  # Gemma 3: local layers' sliding window (every sixth layer global), GELU, sandwich norms

    @property
    def architecture(self) -> str:
        """llama.cpp's name for the file: a Llama, OLMoE (q/k norms, experts in every layer) or
        Gemma 3."""
        return "gemma3" if self.window else "olmoe" if self.experts else "llama"

    @property
    def head_size(self) -> int:
        return self.head_dim or self.hidden // self.heads

    def parameters(self, vocab: int) -> int:
        q, kv = self.heads * self.head_size, self.kv_heads * self.head_size
        mlp = 3 * self.ffn * self.hidden * max(self.experts, 1) + self.experts * self.hidden
        layer = 2 * q * self.hidden + 2 * kv * self.hidden + mlp
        return self.layers * layer + vocab * self.hidden * (1 if self.tied else 2)


# fmt: off
SHAPES = {
    # SmolLM2-135M (the shipped model's widths, from its GGUF's metadata)
    "smollm2-135m": Shape(hidden=576, layers=30, heads=9, kv_heads=3, ffn=1536, rope_theta=100000.0),
    # Llama-3.2-1B and 3B (issue 24's "1B shape", and a second point on the curve): tied heads
    "llama-1b": Shape(hidden=2048, layers=16, heads=32, kv_heads=8, ffn=8192),
    "llama-3b": Shape(hidden=3072, layers=28, heads=24, kv_heads=8, ffn=8192),
    # Qwen2.5-1.5B (issue 42's real-file comparison): GQA 12/2 heads of 128, an untied head
    # (its 151,936-token vocabulary is SmolLM2's 49,152 here, as every shape's), Qwen's RoPE base
    "qwen2.5-1.5b": Shape(
        hidden=1536, layers=28, heads=12, kv_heads=2, ffn=8960, rope_theta=1000000.0, tied=False,
    ),
    # Llama-3.1-8B: an output matrix of its own
    "llama-8b": Shape(hidden=4096, layers=32, heads=32, kv_heads=8, ffn=14336, tied=False),
    # OLMoE-1B-7B (issue 25's mixture of experts): 64 experts of width 1024, 8 used a token
    "olmoe-1b-7b": Shape(
        hidden=2048, layers=16, heads=16, kv_heads=16, ffn=1024, context=4096, rope_theta=10000.0, tied=False,
        experts=64, experts_used=8,
    ),
    # Gemma-3-1B: heads of 256 (q 1024 wide of a 1152 hidden), local layers with a window of 512
    # beside every sixth global one, the local ones in the KV cache's window pool
    "gemma3-1b": Shape(
        hidden=1152, layers=26, heads=4, kv_heads=1, ffn=6912, context=32768, rope_theta=1000000.0,
        head_dim=256, window=512,
    ),
}
# fmt: on
# what gguf-py's Python quantiser writes
WRITTEN = ("F32", "F16", "BF16", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
# llama.cpp's mixes, quantised by llama.cpp itself (its LLAMA_FTYPE_MOSTLY_<name>)
LLAMA_CPP_QUANTS = (
    "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M", "Q5_K_S", "Q5_K_M", "Q6_K",
    "IQ4_NL", "IQ4_XS",
)  # fmt: skip
QUANTS = WRITTEN + LLAMA_CPP_QUANTS
_FLOATS = ("F32", "F16", "BF16")
_BIG = 4_000_000_000  # parameters above which llama.cpp's input is Q8_0 rather than F16
_CHUNK = 16 << 20  # floats made and quantised at a time
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
BENCH_EXTRA = "install the bench extra (`make bench`, or pip install '.[bench]')"


def shape_path(name: str, quant: str, cache_dir: Path) -> Path:
    return cache_dir / "shapes" / f"{name}-random-{quant}.gguf"


def check(name: str, quant: str) -> None:
    """One line naming what is valid, for an unknown shape or type, or a llama.cpp mix without
    llama.cpp; raised before anything is written."""
    if name not in SHAPES:
        raise ValueError(f"unknown --shape {name!r}: one of {', '.join(SHAPES)}")
    if quant not in QUANTS:
        raise ValueError(f"unknown --quant {quant!r}: one of {', '.join(QUANTS)}")
    if quant in LLAMA_CPP_QUANTS:
        _llama_ftype(quant)


def _llama_ftype(quant: str) -> int:
    """llama.cpp's LLAMA_FTYPE_MOSTLY_<quant>, or one line saying what is missing."""
    try:
        llama_cpp = llama_cpp_module()
    except ImportError:
        raise ValueError(f"--quant {quant} is quantised by llama.cpp: {BENCH_EXTRA}") from None
    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{quant}", None)
    if ftype is None:
        raise ValueError(f"--quant {quant}: this llama-cpp-python has no LLAMA_FTYPE_MOSTLY_{quant}")
    return int(ftype)


def shape_file(name: str, quant: str, cache_dir: Path) -> Path:
    """The GGUF for `name` at `quant`, written on first use."""
    check(name, quant)
    path = shape_path(name, quant, cache_dir)
    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    shape = SHAPES[name]
    started = time.perf_counter()
    if quant in WRITTEN:
        _room(path.parent, planned_bytes(shape, quant))
        log.info("writing %s (random weights at %s's widths, once)", path, name)
        write(tmp, shape, quant)
    else:
        source = "Q8_0" if shape.parameters(vocab_size()) > _BIG else "F16"
        _room(path.parent, 2 * planned_bytes(shape, source))
        between = path.with_name(f"{path.stem}-{source}.partial")
        log.info("writing %s as %s, then llama.cpp's %s (random weights at %s's widths, once)",
                 path, source, quant, name)  # fmt: skip
        try:
            write(between, shape, source)
            log.info(
                "wrote the %s file in %.1fs; llama.cpp quantises it", source, time.perf_counter() - started
            )
            llama_quantize(between, tmp, quant, allow_requantize=source != "F16")
        finally:
            between.unlink(missing_ok=True)
    tmp.rename(path)
    log.info("wrote %s (%.0f MiB) in %.1fs", path, path.stat().st_size / 2**20, time.perf_counter() - started)
    return path


def _room(folder: Path, needed: int) -> None:
    free = shutil.disk_usage(folder).free
    if free < needed + (1 << 30):
        raise ValueError(
            f"{folder}: {free / 2**30:.1f} GiB free, the file needs {needed / 2**30:.1f} GiB + 1"
        )


@functools.cache
def _shipped_tokenizer() -> tuple[tuple[str, gguf.GGUFValueType, Any], ...]:
    """The shipped GGUF's tokenizer fields: key, type, contents (its reader takes ~3 s: read once)."""
    reader = gguf.GGUFReader(resolve_model(None).source)
    fields = (reader.fields.get(key) for key in TOKENIZER_KEYS)
    return tuple((f.name, f.types[0], f.contents()) for f in fields if f is not None)


def vocab_size() -> int:
    return next(len(values) for key, _, values in _shipped_tokenizer() if key == "tokenizer.ggml.tokens")


def copy_shipped_tokenizer(writer: gguf.GGUFWriter, chat_template: str | None = None) -> int:
    """Copies the shipped model's tokenizer into `writer` (with `chat_template` in place of its
    own where given); returns the vocabulary size."""
    for key, kind, values in _shipped_tokenizer():
        if key == "tokenizer.chat_template" and chat_template is not None:
            values = chat_template
        if kind == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, values)
        else:
            writer.add_key_value(key, values, kind)
    return vocab_size()


def tensors(s: Shape, vocab: int, quant: str) -> Iterator[tuple[str, tuple[int, ...], Q]]:
    """Every tensor of the file: name, shape (rows, columns: numpy's order) and type."""
    kind = Q[quant]
    # the embedding (and an untied head) at >= 8 bits, as llama.cpp's own recipes keep the head
    wide = kind if quant in _FLOATS or quant == "Q8_0" else Q.Q8_0
    q, kv = s.heads * s.head_size, s.kv_heads * s.head_size
    yield "token_embd.weight", (vocab, s.hidden), wide
    yield "output_norm.weight", (s.hidden,), Q.F32
    if not s.tied:
        yield "output.weight", (vocab, s.hidden), wide
    for i in range(s.layers):
        p = f"blk.{i}."
        yield p + "attn_norm.weight", (s.hidden,), Q.F32
        yield p + "ffn_norm.weight", (s.hidden,), Q.F32
        yield p + "attn_q.weight", (q, s.hidden), kind
        yield p + "attn_k.weight", (kv, s.hidden), kind
        yield p + "attn_v.weight", (kv, s.hidden), kind
        yield p + "attn_output.weight", (s.hidden, q), kind
        if s.window:  # Gemma 3: q/k RMSNorms per head and the sandwich norms
            yield p + "attn_q_norm.weight", (s.head_size,), Q.F32
            yield p + "attn_k_norm.weight", (s.head_size,), Q.F32
            yield p + "post_attention_norm.weight", (s.hidden,), Q.F32
            yield p + "post_ffw_norm.weight", (s.hidden,), Q.F32
        if not s.experts:
            yield p + "ffn_gate.weight", (s.ffn, s.hidden), kind
            yield p + "ffn_up.weight", (s.ffn, s.hidden), kind
            yield p + "ffn_down.weight", (s.hidden, s.ffn), kind
            continue
        # OLMoE: RMSNorms over the whole q and k; the router in F32 (llama.cpp never quantises
        # it); each projection's experts stacked in one tensor
        yield p + "attn_q_norm.weight", (s.hidden,), Q.F32
        yield p + "attn_k_norm.weight", (kv,), Q.F32
        yield p + "ffn_gate_inp.weight", (s.experts, s.hidden), Q.F32
        yield p + "ffn_gate_exps.weight", (s.experts, s.ffn, s.hidden), kind
        yield p + "ffn_up_exps.weight", (s.experts, s.ffn, s.hidden), kind
        yield p + "ffn_down_exps.weight", (s.experts, s.hidden, s.ffn), kind


def _nbytes(shape: tuple[int, ...], kind: Q) -> int:
    return math.prod(gguf.quants.quant_shape_to_byte_shape(shape, kind))


def planned_bytes(s: Shape, quant: str, vocab: int | None = None) -> int:
    """The tensor data's size (the file's, less its tokenizer and padding)."""
    return sum(_nbytes(shape, kind) for _, shape, kind in tensors(s, vocab or vocab_size(), quant))


def write(path: Path, s: Shape, quant: str) -> None:
    """A Llama GGUF at `s`'s widths with every matrix at `quant` (one of WRITTEN), streamed:
    the tensor table first, then each tensor's bytes as they are made."""
    if quant not in WRITTEN:
        raise ValueError(f"gguf-py writes {', '.join(WRITTEN)}, not {quant}")
    w = gguf.GGUFWriter(str(path), s.architecture)
    w.add_name("random weights, bench shape")
    vocab = copy_shipped_tokenizer(w)
    head_dim = s.head_size
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
    if s.experts:
        w.add_expert_count(s.experts)
        w.add_expert_used_count(s.experts_used)
    if s.window:
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_sliding_window(s.window)
        w.add_float32(f"{s.architecture}.rope.freq_base_swa", 10000.0)
    w.add_file_type(int(gguf.LlamaFileType["ALL_F32" if quant == "F32" else f"MOSTLY_{quant}"]))
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    plan = list(tensors(s, vocab, quant))
    for name, shape, kind in plan:
        # the logical shape with a raw type: the writer stores it as given (reversed, ggml's order)
        w.add_tensor_info(name, shape, np.dtype(np.float32), _nbytes(shape, kind), raw_dtype=kind)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(0)
    try:
        for _, shape, kind in plan:
            w.write_tensor_data(_make(rng, shape, kind))
    finally:
        w.close()


def _make(rng: np.random.Generator, shape: tuple[int, ...], kind: Q) -> np.ndarray:
    """One tensor's bytes: ones for a norm, else normal(0, 0.02) made and quantised in chunks."""
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32).view(np.uint8)
    rows, cols = math.prod(shape[:-1]), shape[-1]  # stacked experts: one expert's rows after another's
    out = np.empty(gguf.quants.quant_shape_to_byte_shape((rows, cols), kind), dtype=np.uint8)
    step = max(1, _CHUNK // cols)
    for r in range(0, rows, step):
        n = min(step, rows - r)
        x = rng.standard_normal((n, cols), dtype=np.float32)
        x *= np.float32(0.02)
        out[r : r + n] = gguf.quants.quantize(x, kind).view(np.uint8).reshape(n, -1)
    return out


def llama_quantize(source: Path, dest: Path, quant: str, allow_requantize: bool = False) -> None:
    """llama.cpp's own quantiser (llama-cpp-python, the `bench` extra): `quant`'s per-tensor mix."""
    ftype = _llama_ftype(quant)
    llama_cpp = llama_cpp_module()  # installed: _llama_ftype said so
    quiet_llama_cpp()
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = os.cpu_count() or 1
    params.allow_requantize = allow_requantize
    status = llama_cpp.llama_model_quantize(str(source).encode(), str(dest).encode(), ctypes.byref(params))
    if status != 0:
        raise RuntimeError(f"llama.cpp could not quantise {source} to {quant} (status {status})")


def weight_bytes(path: Path) -> int:
    """Bytes of weight matrices one forward step reads: every matrix of the layers, and the head
    (output.weight; the embedding where the head is tied to it). The embedding is otherwise only
    looked up (a row a token), and norms and biases are vectors; from the file's own tensor sizes,
    so it is the same figure for every engine that runs the file. A mixture of experts: a token
    reads its `expert_used_count` of `expert_count` experts (the active-parameter bound)."""
    header = read_header(path)
    arch = header.fields.get("general.architecture")
    experts = int(header.fields.get(f"{arch}.expert_count") or 0)
    share = int(header.fields.get(f"{arch}.expert_used_count") or 0) / experts if experts else 1.0
    sizes = {name: t.nbytes for name, t in header.tensors.items() if len(t.shape) >= 2}
    head = sizes.get("output.weight", sizes.get("token_embd.weight", 0))
    layers = sum(
        n * (share if name.endswith("_exps.weight") else 1)
        for name, n in sizes.items()
        if name not in ("output.weight", "token_embd.weight")
    )
    return round(layers) + head
