"""Building an Engine from command-line style settings (model spec, dtype, device, budget)."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenwire.engine.concepts import ConceptSet
from tokenwire.engine.engine import Engine
from tokenwire.model.llama import LlamaModel, build_model
from tokenwire.model.loader import ModelSource, load_weights, resolve_model

log = logging.getLogger("tokenwire")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}


@dataclass
class EngineSettings:
    model: str | None = None
    model_name: str | None = None
    cache_dir: Path | None = None
    dtype: str = "fp32"
    device: str = "auto"
    kv_cache_mb: float | None = None
    max_model_len: int | None = None
    max_batch_tokens: int = 512
    session_ttl_s: float = 1800.0
    concepts: Path | None = None
    progress: bool = True
    threads: int | None = None


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def default_kv_cache_mb(device: torch.device) -> float:
    """A quarter of the free memory, capped at 4 GiB: room for the model and the rest."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return min(free / 2**20 * 0.5, 16384)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return min(int(line.split()[1]) / 1024 * 0.25, 4096)
    except OSError:
        pass
    return 1024


def load_model(
    source: ModelSource, dtype: torch.dtype, device: torch.device, max_len: int | None
) -> LlamaModel:
    state = load_weights(source.model_dir)
    positions = min(max_len or source.config.max_position_embeddings, source.config.max_position_embeddings)
    return build_model(source.config, state, dtype=dtype, device=device, max_positions=positions)


def build_engine(settings: EngineSettings) -> Engine:
    if settings.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {settings.dtype!r}: use fp32 or bf16")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    device = pick_device(settings.device)
    started = time.monotonic()
    source = resolve_model(
        settings.model, cache_dir=settings.cache_dir, name=settings.model_name, progress=settings.progress
    )
    concepts = None
    if settings.concepts is not None:
        concepts = ConceptSet.load(
            settings.concepts, hidden_size=source.config.hidden_size, num_layers=source.config.num_layers
        )
    kv_mb = settings.kv_cache_mb if settings.kv_cache_mb is not None else default_kv_cache_mb(device)
    engine = Engine(
        lambda: load_model(source, DTYPES[settings.dtype], device, settings.max_model_len),
        source.tokenizer,
        name=source.name,
        kv_cache_mb=kv_mb,
        max_batch_tokens=settings.max_batch_tokens,
        max_model_len=settings.max_model_len,
        session_ttl_s=settings.session_ttl_s,
        concepts=concepts,
    )
    engine.source = source
    log.info(
        "model %s (%s) loaded in %.1fs: dtype %s, device %s, KV cache %.0f MiB (%d blocks), context %d",
        source.name,
        source.config.architecture,
        time.monotonic() - started,
        settings.dtype,
        device,
        engine.kv_cache_mb,
        engine.kv.num_blocks,
        engine.max_model_len,
    )
    return engine
