"""The KL divergence `bench quality` scores a path by, in one place for our passes and for
llama.cpp's child process (numpy only: the child imports no torch)."""

from __future__ import annotations

import numpy as np


def kl_divergence(reference: np.ndarray, logp: np.ndarray) -> float:
    """KL(reference || candidate) of one position's two log-softmax rows, in float64."""
    ref = reference.astype(np.float64)
    return float((np.exp(ref) * (ref - logp.astype(np.float64))).sum())
