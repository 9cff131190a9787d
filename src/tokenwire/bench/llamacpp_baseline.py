"""llama.cpp on the same GGUF, through llama-cpp-python's low-level API (the `bench` extra).

The same three measures as `tokenwire bench engine`, on the same token ids and thread count:
greedy single-stream decode (first token's time excluded), N streams as many sequence ids in
one batch per step (llama.cpp's batched decode; wall clock including the prefill), and the
prefill of one long prompt (time until its last logits).

The baseline runs in its own process (`LlamaCppProcess`, this module run with -m). Measured in
one process with our engine: both link `libgomp.so.1`, the loader maps torch's copy for both,
and with more OpenMP threads alive than cores libgomp cuts its spin-wait to ~1,000 iterations,
so every barrier sleeps in the kernel: llama.cpp's single-stream decode fell from 117-125 tok/s
alone to 50-55 tok/s once an engine existed beside it (and back to 114 after its shutdown). A
user runs llama.cpp in its own process; so does the benchmark.
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenwire.bench.divergence import kl_divergence

KV_TYPES = {"f16": 1, "q8_0": 8}  # llama.cpp's cache types: their ggml_type numbers


def llama_cpp_module() -> Any:
    """llama-cpp-python, imported when first needed; ImportError where it is not installed."""
    # local: llama-cpp-python is the `bench` extra, absent from `make test`'s environment
    import llama_cpp

    return llama_cpp


def quiet_llama_cpp() -> None:
    """llama.cpp's backend initialised, with its per-load (and per-tensor quantise) chatter off."""
    lc = llama_cpp_module()
    lc.llama_backend_init()
    lc.llama_log_set(_quiet, ctypes.c_void_p())


# llama.cpp built for AVX2 only (`make bench-peer-avx2`): the like-for-like peer of our AVX2 build
# run on an AVX-512 machine (TOKENWIRE_KERNELS_ISA=avx2, the stand-in for an AVX2-only CPU). The
# installed llama-cpp-python is built for the machine it was built on; against it, our AVX2 build
# was measured beside llama.cpp's AVX-512 kernels, which an AVX2-only CPU does not have.
AVX2_PEER_DIR = Path(sys.prefix) / "llama-cpp-avx2"


def peer_build(our_isa: str) -> Path | None:
    """Where the baseline imports llama-cpp-python from: the AVX2-only build when our kernels run
    the AVX2 stand-in (`our_isa`: kernels.isa_choice()) and that build is installed; None (the
    installed one) otherwise."""
    if our_isa == "avx2" and (AVX2_PEER_DIR / "llama_cpp").is_dir():
        return AVX2_PEER_DIR
    return None


def kernels_of(system_info: str) -> str:
    """llama.cpp's CPU kernels in words, from llama_print_system_info()'s feature list."""
    features = {part.split("=")[0].strip(): part.split("=")[-1].strip() for part in system_info.split("|")}
    if features.get("AVX512") == "1":
        return "AVX-512"
    if features.get("AVX2") == "1":
        return "AVX2"
    return "portable"


def available() -> bool:
    try:
        llama_cpp_module()
    except ImportError:
        return False
    return True


class LlamaCpp:
    def __init__(self, gguf: Path, threads: int, streams: int, stream_ctx: int) -> None:
        lc = llama_cpp_module()
        self.lc = lc
        started = time.perf_counter()
        quiet_llama_cpp()
        self.model = lc.llama_model_load_from_file(str(gguf).encode(), lc.llama_model_default_params())
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.threads = threads
        self.path = str(gguf)
        self.high_level: dict[bool, Any] = {}  # lookup_decode's llama_cpp.Llama, with and without lookup
        # (KV type, prompt length) -> (context, its prompt, the first token after it)
        self.long: dict[tuple[str, int], tuple[Any, list[int], int]] = {}
        # room for bench engine's --prefill-tokens 4096 (issue 42's prefill 4k): llama.cpp keeps
        # only the positions in use in its attention, so a larger context costs memory, not time
        self.single = self._context(seqs=1, n_ctx=8192)
        self.multi = self._context(seqs=streams, n_ctx=streams * stream_ctx)
        self.batch = lc.llama_batch_init(512, 0, max(streams, 1))
        # what Llama(...) does: the model (mmap'd: its pages are read by the first steps) and contexts
        self.load_s = time.perf_counter() - started

    def _context(self, seqs: int, n_ctx: int, kv_type: str | None = None) -> Any:
        p = self.lc.llama_context_default_params()
        p.n_ctx, p.n_batch, p.n_ubatch, p.n_seq_max = n_ctx, 512, 512, seqs
        p.n_threads = p.n_threads_batch = self.threads
        if kv_type is not None:  # f16 is llama.cpp's default; a quantised V cache needs flash attention
            p.type_k = p.type_v = KV_TYPES[kv_type]
            if kv_type != "f16":
                p.flash_attn_type = self.lc.LLAMA_FLASH_ATTN_TYPE_ENABLED
        ctx = self.lc.llama_init_from_model(self.model, p)
        if not ctx:
            raise RuntimeError("llama.cpp could not create a context")
        return ctx

    def close(self) -> None:
        lc = self.lc
        lc.llama_batch_free(self.batch)
        for ctx, _, _ in self.long.values():
            lc.llama_free(ctx)
        for llm in self.high_level.values():
            llm.close()
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
        return self._greedy_tok_s(self.single, self._prefill(self.single, [prompt])[0], len(prompt), n)

    def _greedy_tok_s(self, ctx: Any, token: int, position: int, n: int) -> float:
        """Greedy decode of sequence 0 from `token` at `position`: tok/s over n - 1 steps (the
        first token, which came from the prefill, excluded)."""
        stamps = [time.perf_counter()]
        for i in range(n - 1):
            self._decode(ctx, [(token, position + i, 0, True)])
            token = self._argmax(ctx, 0)
            stamps.append(time.perf_counter())
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def teacher_forced(
        self, tokens: list[int], kv_type: str, reference_rows: str | None = None
    ) -> list[tuple[float, int, float]]:
        """Each position p >= 1's (logprob of tokens[p], top-1 id, KL divergence) from the
        logits before it, the text prefilled in 512-token batches with the cache in `kv_type`
        (bench quality). KL(reference || llama.cpp) where `reference_rows` names a .npy of the
        reference's log-softmax rows (nan otherwise)."""
        ctx = self._context(seqs=1, n_ctx=len(tokens) + 16, kv_type=kv_type)
        reference = None if reference_rows is None else np.load(reference_rows, mmap_mode="r")
        out: list[tuple[float, int, float]] = []
        try:
            for start in range(0, len(tokens) - 1, 512):
                chunk = tokens[start : min(start + 512, len(tokens) - 1)]
                self._decode(ctx, [(t, start + i, 0, True) for i, t in enumerate(chunk)])
                for i in range(len(chunk)):
                    ptr = self.lc.llama_get_logits_ith(ctx, i)
                    row = np.ctypeslib.as_array(ptr, shape=(self.n_vocab,)).astype(np.float64)
                    top = row.max()
                    logp = row - (top + np.log(np.exp(row - top).sum()))
                    kl = math.nan if reference is None else kl_divergence(reference[start + i], logp)
                    out.append((float(logp[tokens[start + i + 1]]), int(row.argmax()), kl))
        finally:
            self.lc.llama_free(ctx)
        return out

    def lookup_decode(self, prompt: list[int], n: int, lookup: bool) -> float:
        """Greedy tok/s (first token excluded) through llama-cpp-python's own generation loop,
        with its prompt-lookup speculation (LlamaPromptLookupDecoding, 10 tokens a guess) or
        without: the high-level API a user of its speculation runs."""
        llm = self.high_level.get(lookup)
        if llm is None:
            lookup_decoding = self.lc.llama_speculative.LlamaPromptLookupDecoding  # loaded by llama_cpp
            draft = lookup_decoding(num_pred_tokens=10) if lookup else None
            llm = self.lc.Llama(
                self.path, n_ctx=4096, n_threads=self.threads, n_threads_batch=self.threads,
                draft_model=draft, logits_all=lookup, verbose=False,  # its lookup reads every row's logits
            )  # fmt: skip
            self.high_level[lookup] = llm
        stamps = []
        for _ in llm.generate(prompt, temp=0.0, top_k=1, reset=True):
            stamps.append(time.perf_counter())
            if len(stamps) == n:
                break
        return (len(stamps) - 1) / (stamps[-1] - stamps[0])

    def long_decode(self, prompt: list[int], n: int, kv_type: str) -> float:
        """single_decode after a long prompt, with the KV cache in `kv_type` (f16, q8_0): a context
        per type and prompt length, the prompt prefilled once; later calls drop only the tokens
        decoded after it."""
        key = (kv_type, len(prompt))
        ctx, prefilled, token = self.long.get(key, (None, [], 0))
        if ctx is None or len(prompt) + n > self.lc.llama_n_ctx(ctx):
            if ctx is not None:
                self.lc.llama_free(ctx)
            ctx, prefilled = self._context(seqs=1, n_ctx=len(prompt) + n + 16, kv_type=kv_type), []
        if prefilled != prompt:
            self._clear(ctx)
            token = self._prefill(ctx, [prompt])[0]
        else:
            self.lc.llama_memory_seq_rm(self.lc.llama_get_memory(ctx), 0, len(prompt), -1)
        self.long[key] = (ctx, prompt, token)
        return self._greedy_tok_s(ctx, token, len(prompt), n)

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


class LlamaCppProcess:
    """LlamaCpp in a child process: each call is one JSON line to it and one back."""

    def __init__(
        self, gguf: Path, threads: int, streams: int, stream_ctx: int, our_isa: str = "native"
    ) -> None:
        env = dict(os.environ)
        build = peer_build(our_isa)
        if build is not None:  # found before the installed one
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(build), env.get("PYTHONPATH", "")) if p)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", __name__, str(gguf), str(threads), str(streams), str(stream_ctx)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=env,
        )
        self.load_s = float(self._call("ready"))  # LlamaCpp's constructor, timed in the child
        self.kernels = str(self._call("kernels"))  # the instruction set its build runs

    def _call(self, method: str, *args: Any) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps([method, args]) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the llama.cpp baseline process exited ({self.proc.wait()})")
        reply = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"llama.cpp baseline: {reply['error']}")
        return reply["result"]

    def single_decode(self, prompt: list[int], n: int) -> float:
        return float(self._call("single_decode", prompt, n))

    def streams(self, prompts: list[list[int]], n: int) -> float:
        return float(self._call("streams", prompts, n))

    def prefill(self, prompt: list[int]) -> float:
        return float(self._call("prefill", prompt))

    def long_decode(self, prompt: list[int], n: int, kv_type: str) -> float:
        return float(self._call("long_decode", prompt, n, kv_type))

    def lookup_decode(self, prompt: list[int], n: int, lookup: bool) -> float:
        return float(self._call("lookup_decode", prompt, n, lookup))

    def teacher_forced(
        self, tokens: list[int], kv_type: str, reference_rows: Path | None = None
    ) -> list[tuple[float, int, float]]:
        rows = None if reference_rows is None else str(reference_rows)
        reply = self._call("teacher_forced", tokens, kv_type, rows)
        return [(float(lp), int(top), math.nan if kl is None else float(kl)) for lp, top, kl in reply]

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(timeout=30)


def _child(argv: list[str]) -> None:
    gguf, threads, streams, stream_ctx = Path(argv[0]), int(argv[1]), int(argv[2]), int(argv[3])
    llama = LlamaCpp(gguf, threads, streams, stream_ctx)
    kernels = kernels_of(llama.lc.llama_print_system_info().decode())
    calls = {"ready": lambda: llama.load_s, "kernels": lambda: kernels,
             "single_decode": llama.single_decode, "streams": llama.streams, "prefill": llama.prefill,
             "long_decode": llama.long_decode, "lookup_decode": llama.lookup_decode,
             "teacher_forced": llama.teacher_forced}  # fmt: skip
    try:
        for line in sys.stdin:
            method, args = json.loads(line)
            try:
                reply = {"result": calls[method](*args)}
            except Exception as exc:  # reported to the parent, which raises it
                reply = {"error": f"{type(exc).__name__}: {exc}"}
            sys.stdout.write(json.dumps(reply) + "\n")
            sys.stdout.flush()
    finally:
        llama.close()


@ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)
def _quiet(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: its per-load chatter would bury the benchmark table."""


if __name__ == "__main__":
    _child(sys.argv[1:])
