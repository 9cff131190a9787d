"""Writes tests/data/tiny-llama-Q4_K_M.gguf: a tiny random Llama quantised by llama.cpp's own
quantiser (llama-cpp-python, the `bench` extra), so the tests hold a K-quant mix exactly as
llama.cpp writes it (Q4_K beside Q6_K v and down projections in some layers).

    PYTHONPATH=src .venv/bin/python tests/data/make_tiny_kquant.py

The F16 source: hidden 256 (K-quants take rows of 256), 4 layers, 4 query / 2 KV heads of 64,
FFN 512, a byte-level vocabulary of 259 tokens, untied output; weights normal with std 0.05,
norms near 1, seeded. Not run by the tests (they read the committed file).
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import gguf
import numpy as np

from tests.model.conftest import byte_alphabet
from tokenwire.bench.shapes import llama_quantize

OUT = Path(__file__).with_name("tiny-llama-Q4_K_M.gguf")
HIDDEN, LAYERS, HEADS, KV_HEADS, FFN, HEAD_DIM = 256, 4, 4, 2, 512, 64


def write_f16(path: Path) -> None:
    rng = np.random.default_rng(24)
    tokens = [*byte_alphabet(), "hi", "<s>", "</s>"]
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny random llama")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([1] * 257 + [3, 3])
    w.add_token_merges(["h i"])
    w.add_bos_token_id(257)
    w.add_eos_token_id(258)
    w.add_block_count(LAYERS)
    w.add_context_length(512)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_dimension_count(HEAD_DIM)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_file_type(int(gguf.LlamaFileType.MOSTLY_F16))

    def matrix(name: str, rows: int, cols: int) -> None:
        w.add_tensor(name, (rng.standard_normal((rows, cols)) * 0.05).astype(np.float16))

    def norm(name: str) -> None:
        w.add_tensor(name, (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32))

    matrix("token_embd.weight", len(tokens), HIDDEN)
    matrix("output.weight", len(tokens), HIDDEN)
    norm("output_norm.weight")
    for i in range(LAYERS):
        p = f"blk.{i}."
        norm(p + "attn_norm.weight")
        norm(p + "ffn_norm.weight")
        matrix(p + "attn_q.weight", HEADS * HEAD_DIM, HIDDEN)
        matrix(p + "attn_k.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(p + "attn_v.weight", KV_HEADS * HEAD_DIM, HIDDEN)
        matrix(p + "attn_output.weight", HIDDEN, HEADS * HEAD_DIM)
        matrix(p + "ffn_gate.weight", FFN, HIDDEN)
        matrix(p + "ffn_up.weight", FFN, HIDDEN)
        matrix(p + "ffn_down.weight", HIDDEN, FFN)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "tiny-f16.gguf"
        write_f16(source)
        llama_quantize(source, OUT, "Q4_K_M")
    kinds = sorted({t.tensor_type.name for t in gguf.GGUFReader(OUT).tensors})
    print(f"{OUT}: {OUT.stat().st_size} bytes, types {kinds}")


if __name__ == "__main__":
    main()
