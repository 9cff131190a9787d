"""llama.cpp on the same GGUF, through llama-cpp-python's low-level API (the `bench` extra).

The same three measures as `tokenwire bench engine`, on the same token ids and thread count:
greedy single-stream decode (first token's time excluded), N streams as many sequence ids in
one batch per step (llama.cpp's batched decode; wall clock including the prefill), and the
prefill of one long prompt (time until its last logits).
"""

from __future__ import annotations

import ctypes
import time
from pathlib import Path
from typing import Any

import numpy as np


def available() -> bool:
    try:
        import llama_cpp  # noqa: F401
    except ImportError:
        return False
    return True


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, streams: int, stream_ctx: int) -> None:
        import llama_cpp as lc

        self.lc = lc
        lc.llama_backend_init()
        lc.llama_log_set(_quiet, ctypes.c_void_p())
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.single = self._context(seqs=1, n_ctx=2048)
        self.multi = self._context(seqs=streams, n_ctx=streams * stream_ctx)
        self.batch = lc.llama_batch_init(512, 0, max(streams, 1))

    def _context(self, seqs: int, n_ctx: int) -> Any:
        p = self.lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, seqs
        p.n_threads = p.n_threads_batch = self.threads
        ctx = self.lc.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        lc.llama_free(self.single)
        lc.llama_free(self.multi)
        lc.llama_model_free(self.model)

    def _decode(self, ctx: Any, entries: list[tuple[int, int, int, bool]]) -> None:
        """entries: (token, position, sequence id, wants logits), at most 512."""
        b = self.batch
        b.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            b.token[i], b.pos[i], b.n_seq_id[i], b.logits[i] = token, pos, 1, logits
            b.seq_id[i][0] = seq
        if self.lc.llama_decode(ctx, b) != 0:
            raise RuntimeError("llama_decode failed")

    def _argmax(self, ctx: Any, row: int) -> int:
        ptr = self.lc.llama_get_logits_ith(ctx, row)
        return int(np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).argmax())

    def _prefill(self, ctx: Any, sequences: list[list[int]]) -> list[int]:
        """Every prompt in 512-token batches; returns each sequence's greedy next token."""
        entries = [(t, p, s, p == len(seq) - 1) for s, seq in enumerate(sequences) for p, t in enumerate(seq)]
        firsts: list[int] = []
        for start in range(0, len(entries), 512):
            chunk = entries[start : start + 512]
            self._decode(ctx, chunk)
            firsts += [self._argmax(ctx, i) for i, e in enumerate(chunk) if e[3]]
        return firsts

    def _clear(self, ctx: Any) -> None:
        self.lc.llama_memory_clear(self.lc.llama_get_memory(ctx), True)

    def single_decode(self, prompt: list[int], n: int) -> float:
        self._clear(self.single)
        token = self._prefill(self.single, [prompt])[0]
        stamps = [time.perf_counter()]
        for i in range(n - 1):
            self._decode(self.single, [(token, len(prompt) + i, 0, True)])
            token = self._argmax(self.single, 0)
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def streams(self, prompts: list[list[int]], n: int) -> float:
        self._clear(self.multi)
        start = time.perf_counter()
        tokens = self._prefill(self.multi, prompts)
        for i in range(n - 1):
            self._decode(
                self.multi,
                [(t, len(p) + i, s, True) for s, (t, p) in enumerate(zip(tokens, prompts, strict=True))],
            )
            tokens = [self._argmax(self.multi, s) for s in range(len(prompts))]
        return len(prompts) * n / (time.perf_counter() - start)

    def prefill(self, prompt: list[int]) -> float:
        self._clear(self.single)
        start = time.perf_counter()
        self._prefill(self.single, [prompt])
        return len(prompt) / (time.perf_counter() - start)


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its per-load chatter would bury the benchmark table."""
