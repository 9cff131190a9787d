"""What the model thread builds before the engine runs: the model (from its factory, on that
thread) and its paged KV cache, sized from the budget (engine.py starts the thread)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from tokenwire.engine.kv_cache import KVCache, resolve_kv_dtype
from tokenwire.model.config import ModelConfig
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.quant import has_quantized_weights


@dataclass
class Loaded:
    """What the model thread builds before the engine can run."""

    model: torch.nn.Module
    kv: KVCache
    max_model_len: int
    kv_cache_mb: float  # what the blocks take (the budget rounded down to whole blocks)


def load_model_and_cache(
    model: DecoderModel | torch.nn.Module | Callable[[], torch.nn.Module],
    kv_cache_mb: float,
    block_size: int,
    max_model_len: int | None,
    kv_dtype: str,
    max_batch_tokens: int,
    max_running: int,
) -> Loaded:
    """Runs on the model thread. Every large torch operation (loading, the KV allocation,
    each step) happens on this one thread: with a second thread also running OpenMP
    regions, libgomp sees more threads than cores, stops spinning between kernels and a
    decode step gets ~45% slower on a 2-core machine (measured)."""
    module = model if isinstance(model, torch.nn.Module) else model()
    config: ModelConfig = module.config
    stored = resolve_kv_dtype(kv_dtype, module.dtype, has_quantized_weights(module))
    budget = kv_cache_mb * 2**20
    windows = kept_windows(module)
    n_windowed = sum(w is not None for w in windows)
    if n_windowed == config.num_layers:  # every layer windowed: one pool (KVCache)
        n_windowed = 0
    full = KVCache.bytes_per_block(config, block_size, stored, config.num_layers - n_windowed)
    local = KVCache.bytes_per_block(config, block_size, stored, n_windowed)
    window_blocks = 0
    if n_windowed:
        # windowed layers in a pool of their own: between steps a sequence holds at most the
        # blocks its window spans there, and a step adds its positions. The pool gets what
        # every running sequence could hold at once (or, if smaller, the share a pool for all
        # layers would give them) and the full-context layers the rest of the budget.
        widest = max(w for w in windows if w is not None)
        spans = -(-(widest - 1) // block_size) + 2
        most = max_running * spans + -(-max_batch_tokens // block_size)
        window_blocks = max(2, min(int(budget // (full + local)), most))
    num_blocks = max(2, int((budget - window_blocks * local) // full))
    kv = KVCache(config, num_blocks, block_size, stored, module.device, windows, window_blocks)
    context = min(max_model_len or module.max_positions, module.max_positions)
    return Loaded(module, kv, context, (num_blocks * full + window_blocks * local) / 2**20)


def kept_windows(module: torch.nn.Module) -> list[int | None]:
    """Each layer's sliding window, for the cache to keep windowed layers apart (the fused
    kernel and the eager layers both read the window pool)."""
    layers = getattr(module, "layers", None)
    if layers is None:
        return []
    specs = [getattr(getattr(layer, "attention", None), "spec", None) for layer in layers]
    return [None if spec is None else spec.window for spec in specs]
