"""Writing one mid_process step's bias rows into the bin region, vectorised.

Most controllers constrain by a token *mask* (allowed or not), not by arbitrary biases. Their
MidResults carry the mask as 32-bit words, or the llguidance matcher that computes it; this
module computes every matcher's mask of the step in one parallel llguidance call (Rust
threads, GIL released), clears the `disallow` ids, and expands all word rows to float32
(allowed 0, else -inf) directly into the bin region with one table lookup: each mask byte
selects a precomputed run of 8 floats. No per-token Python loop, no intermediate float copy.
Rows given as float `bias` are copied as they are; rows with no constraint are zeros.
"""

from __future__ import annotations

from typing import Any

import llguidance
import numpy as np
import torch

from tokenwire.protocols.aici.controller import MidResult

__all__ = ["BiasWriter", "dense_row", "expand_words"]

# byte value -> its 8 bits (least significant first) as floats: 0 allowed, -inf not
_LUT8 = torch.tensor(
    [[0.0 if (b >> i) & 1 else float("-inf") for i in range(8)] for b in range(256)], dtype=torch.float32
)


def _words_for(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def expand_words(words: np.ndarray, out: np.ndarray) -> None:
    """out[r, t] = 0 if bit t of words[r] is set else -inf; words int32/uint32 [n, W], out
    float32 [n, V] (C-contiguous rows, V <= 32 W); ids past 32 W are -inf."""
    n, vocab = out.shape
    if n == 0:
        return
    full = min(vocab, 32 * words.shape[1]) // 8  # whole bytes that land inside the row
    as_bytes = np.ascontiguousarray(words).view(np.uint8).reshape(n, -1)[:, :full]
    index = torch.from_numpy(as_bytes.astype(np.int32)).reshape(-1)
    if vocab == 8 * full and out.flags["C_CONTIGUOUS"]:
        torch.index_select(_LUT8, 0, index, out=torch.from_numpy(out).view(n * full, 8))
        return
    tmp = torch.index_select(_LUT8, 0, index).view(n, 8 * full).numpy()
    out[:, : 8 * full] = tmp
    rest = out[:, 8 * full :]
    rest[:] = -np.inf
    for t in range(8 * full, min(vocab, 32 * words.shape[1])):  # < 8 ids: the odd tail byte
        w = words.view(np.uint32)[:, t // 32]
        rest[:, t - 8 * full] = np.where((w >> np.uint32(t % 32)) & 1, 0.0, -np.inf)


def _clear_bits(row: np.ndarray, ids: tuple[int, ...]) -> None:
    u = row.view(np.uint32)
    for t in ids:
        if 0 <= t < 32 * u.size:
            u[t >> 5] &= np.uint32(~(1 << (t & 31)) & 0xFFFFFFFF)


def dense_row(result: MidResult, vocab_size: int) -> np.ndarray | None:
    """One result's float row (None = no bias), computed alone (tests, simulators)."""
    if result.matcher is None and result.mask is None:
        return None if result.bias is None else np.asarray(result.bias, dtype=np.float32)
    words = np.zeros((1, _words_for(vocab_size)), dtype=np.int32)
    if result.matcher is not None:
        m = np.frombuffer(result.matcher.compute_bitmask(), dtype=np.int32)
    else:
        m = np.asarray(result.mask).view(np.int32)
    words[0, : min(m.size, words.shape[1])] = m[: words.shape[1]]
    _clear_bits(words[0], result.disallow)
    out = np.empty((1, vocab_size), dtype=np.float32)
    expand_words(words, out)
    return out[0]


class BiasWriter:
    """Collects a step's MidResults by row, then writes all rows into the bin region."""

    def __init__(self, vocab_size: int, mask_vocab: int, *, threads: int | None = None) -> None:
        self.vocab_size = vocab_size
        self.mask_words = _words_for(max(vocab_size, mask_vocab))
        self.matcher_bytes = 4 * _words_for(mask_vocab)  # one llguidance mask
        self._words = np.full((0, self.mask_words), -1, dtype=np.int32)
        self._executor: llguidance.LLExecutor | None = None
        self._threads = threads
        self._n = 0
        self._matchers: list[tuple[Any, int]] = []
        self._floats: list[tuple[int, np.ndarray]] = []
        self._disallow: list[tuple[int, tuple[int, ...]]] = []

    def begin(self, n: int) -> None:
        if self._words.shape[0] < n:  # grows once to the largest step seen, then reused
            self._words = np.full((max(n, 2 * self._words.shape[0]), self.mask_words), -1, dtype=np.int32)
        self._words[:n] = -1  # neutral rows: every token allowed (bias 0)
        self._n = n
        self._matchers.clear()
        self._floats.clear()
        self._disallow.clear()

    def add(self, row: int, result: MidResult) -> None:
        if result.matcher is not None:
            self._matchers.append((result.matcher, row))
        elif result.mask is not None:
            m = np.asarray(result.mask).view(np.int32)
            k = min(m.size, self.mask_words)
            self._words[row, :k] = m[:k]
            self._words[row, k:] = 0
        elif result.bias is not None:
            self._floats.append((row, np.asarray(result.bias, dtype=np.float32).reshape(-1)))
            return
        else:
            return
        if result.disallow:
            self._disallow.append((row, tuple(result.disallow)))

    def finish(self, bias: np.ndarray) -> dict[int, str]:
        """Write rows [0, n) of `bias` (flat float32); returns {row: error} for matchers that
        failed while computing their mask (those rows are left neutral)."""
        errors: dict[int, str] = {}
        words = self._words
        if self._matchers:
            if self._executor is None:
                self._executor = llguidance.LLExecutor(self._threads)
            # llguidance writes one mask per matcher at row * stride; our rows may be wider
            if self.matcher_bytes == 4 * self.mask_words:
                self._executor.unsafe_compute_mask_ptr(
                    self._matchers, words.ctypes.data, self.matcher_bytes, words.shape[0]
                )
            else:
                tmp = np.full((words.shape[0], self.matcher_bytes // 4), 0, dtype=np.int32)
                self._executor.unsafe_compute_mask_ptr(
                    self._matchers, tmp.ctypes.data, self.matcher_bytes, tmp.shape[0]
                )
                for _, row in self._matchers:
                    words[row] = 0
                    words[row, : tmp.shape[1]] = tmp[row]
            for matcher, row in self._matchers:
                if matcher.is_error():
                    errors[row] = f"mask computation failed: {matcher.get_error()}"
                    words[row] = -1
        for row, ids in self._disallow:
            if row not in errors:
                _clear_bits(words[row], ids)
        n, vocab = self._n, self.vocab_size
        rows = bias[: n * vocab].reshape(n, vocab)
        expand_words(words[:n], rows)
        for row, values in self._floats:
            k = min(values.size, vocab)
            rows[row, :k] = values[:k]
            rows[row, k:] = 0.0
        self._matchers.clear()  # do not keep matchers alive past the step
        return errors
