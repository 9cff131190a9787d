"""Building an Engine from command-line style settings (model spec, dtype, device, budget)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from tokenwire.engine.concepts import ConceptSet
from tokenwire.engine.draft import check_same_vocabulary
from tokenwire.engine.engine import Engine
from tokenwire.engine.kv_cache import KVCache, check_kv_dtype, resolve_kv_dtype
from tokenwire.engine.persistence import SessionPersistence
from tokenwire.engine.threads import apply_threads
from tokenwire.model.config import ModelConfig
from tokenwire.model.families import build_model
from tokenwire.model.gguf_weights import GgufWeights
from tokenwire.model.images import ImagePreprocessor
from tokenwire.model.kernels import load_kernels
from tokenwire.model.layers.decoder import DecoderModel
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.loader import (
    ModelSource,
    cache_key,
    default_cache_dir,
    default_model_path,
    load_weights,
    resolve_model,
)
from tokenwire.model.quant import Q4_1, Q8_0
from tokenwire.model.weight_arena import return_freed_memory
from tokenwire.progress import StartupProgress

log = logging.getLogger("tokenwire")

DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16, "bfloat16": torch.bfloat16}
# auto: a GGUF's own quantisation on the CPU (fp32 activations), else --dtype; gguf: the file's
# blocks as they are; int8 / int4: quantise fp32 weights at load to Q8_0 / Q4_1 blocks
WEIGHTS = ("auto", "gguf", "fp32", "bf16", "int8", "int4")


@dataclass
class EngineSettings:
    model: str | None = None
    model_name: str | None = None
    cache_dir: Path | None = None
    dtype: str = "fp32"
    device: str = "auto"
    kv_cache_mb: float | None = None
    max_model_len: int | None = None
    max_num_seqs: int = 1  # full-length sequences the default KV budget holds
    max_batch_tokens: int = 512
    session_ttl_s: float = 1800.0
    max_sessions: int | None = None  # --max-sessions (None: no cap)
    max_queued: int | None = None  # --max-queued (None: no cap)
    concepts: Path | None = None
    progress: bool = True
    threads: int | None = None
    weights: str = "auto"  # WEIGHTS: auto | gguf | fp32 | bf16 | int8 | int4
    kv_dtype: str = "auto"  # KV_DTYPES (engine/kv_cache.py): how the KV cache stores its values
    speculate: str = "ngram"  # SPECULATE (engine/speculation.py): prompt lookup, a draft model, off
    draft_model: str | None = None  # --draft-model: guesses from this model (engine/draft.py)
    compile: bool = True  # fused decode kernels for quantised weights (--no-compile: eager only)
    state_dir: Path | None = None  # --state-dir: sessions persist there (None: RAM only, --no-persist)
    state_max_gb: float | None = None  # --state-max-gb: the KV block files' budget (None: unbounded)


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def free_memory_mb(device: torch.device) -> float | None:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return free / 2**20
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def default_kv_cache_mb(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int, max_num_seqs: int
) -> float:
    """Room for `max_num_seqs` sequences of `max_model_len` tokens in the model's dtype (shorter
    ones share it), capped at half the free GPU memory or a quarter of the free RAM (the model and
    the rest of the process need the others). The MiB are what they were before --kv-dtype: an
    fp16 cache holds twice those tokens in them, a q8 one 3.8 times."""
    model_kv = resolve_kv_dtype("auto", dtype, quantized=False)  # the model dtype's KV type
    wanted = max_num_seqs * max_model_len * KVCache.bytes_per_block(config, 1, model_kv) / 2**20
    free = free_memory_mb(device)
    if free is None:
        return wanted
    return max(1.0, min(wanted, free * (0.5 if device.type == "cuda" else 0.25)))


def resolve_weights(settings: EngineSettings, source: ModelSource, device: torch.device) -> str:
    """The weight format to run: what `auto` means for this model and device, and a clear error
    for combinations that cannot run."""
    weights = settings.weights
    if weights not in WEIGHTS:
        raise ValueError(f"unknown --weights {weights!r}: use one of {', '.join(WEIGHTS)}")
    is_gguf = source.gguf is not None
    if weights == "auto":
        quantized = is_gguf and device.type == "cpu" and settings.dtype in ("fp32", "float32")
        return "gguf" if quantized else ("bf16" if DTYPES[settings.dtype] == torch.bfloat16 else "fp32")
    if weights in ("gguf", "int8", "int4"):
        if device.type != "cpu":
            raise ValueError(f"--weights {weights} runs on the CPU only; use fp32 or bf16 on {device}")
        if weights == "gguf" and not is_gguf:
            raise ValueError(
                f"--weights gguf needs a GGUF model; {source.source} is not one (try int8 or int4)"
            )
    return weights


QUANTIZED_WEIGHTS = ("gguf", "int8", "int4")


def _with_kernels(settings: EngineSettings, weights: str) -> str:
    """Build or load the CPU kernels quantised weights run on (model/kernels). Where they cannot
    be built (no C++ compiler), `auto` falls back to fp32 with a warning; an explicit format fails."""
    try:
        load_kernels()
    except Exception as e:  # the compiler's or ninja's failure, whatever its type
        if settings.weights != "auto":
            raise ValueError(
                f"--weights {weights} needs tokenwire's CPU kernels, which failed to build: {e}"
            ) from e
        log.warning("CPU kernels unavailable (%s): running fp32 weights instead of the GGUF's blocks", e)
        return "fp32"
    return weights


def load_model(
    source: ModelSource,
    weights: str,
    device: torch.device,
    max_len: int | None,
    *,
    stream_layers: bool = False,
) -> DecoderModel:
    """`stream_layers` (fp32 and bf16): each layer's weights read as it runs (families.build_model)."""
    positions = min(max_len or source.config.max_position_embeddings, source.config.max_position_embeddings)
    if source.config.vision is not None and weights not in ("fp32", "bf16"):
        raise ValueError(
            f"--weights {weights} is not available for {source.config.architecture}: use fp32 or bf16"
        )
    if weights == "gguf":
        assert source.gguf is not None
        blocks = GgufWeights(source.gguf, source.config)  # read tensor by tensor into place
        model = build_model(source.config, blocks, blocks.qtypes, max_positions=positions)
        return_freed_memory()
        return model
    # float weights: a GGUF's dequantised (the only fp32 copy of one, made because asked for)
    if source.gguf is not None:
        state: Mapping[str, torch.Tensor] = GgufWeights(source.gguf, source.config, dense=True)
    else:
        state = load_weights(source.model_dir)
    if weights in ("int8", "int4"):
        qtype = Q8_0 if weights == "int8" else Q4_1
        tensors, qtypes = quantize_state(state, qtype)
        return build_model(source.config, tensors, qtypes, max_positions=positions)
    model = build_model(
        source.config, state, dtype=DTYPES[weights], device=device, max_positions=positions,
        stream_layers=stream_layers,
    )  # fmt: skip
    if source.config.vision is not None:  # Qwen2-VL: the image preprocessor of its directory
        model.images = ImagePreprocessor.from_dir(source.model_dir)
    return model


def _log_conversion(settings: EngineSettings) -> None:
    """Say so when the model's first start converts its GGUF's tokenizer and config (seconds:
    transformers' tokenizer conversion; the weights are read from the file at every load)."""
    try:
        path = Path(settings.model) if settings.model is not None else default_model_path()
        if path.suffix.lower() != ".gguf" or not path.is_file():
            return
        cache = settings.cache_dir if settings.cache_dir is not None else default_cache_dir()
        if (cache / cache_key(path) / "tokenwire_source.json").is_file():
            return
    except OSError:
        return  # resolve_model reports what is wrong with the path
    log.info(
        "reading the tokenizer and config of %s (%.0f MiB GGUF) into %s: first start only",
        path, path.stat().st_size / 2**20, cache,
    )  # fmt: skip


def build_engine(settings: EngineSettings) -> Engine:
    if settings.dtype not in DTYPES:
        raise ValueError(f"unknown dtype {settings.dtype!r}: use fp32 or bf16")
    apply_threads(settings.threads)
    device = pick_device(settings.device)
    with StartupProgress(
        ["model files", "load + warm-up"], enabled=None if settings.progress else False
    ) as bar:
        return _build_engine(settings, device, bar)


def _draft_engine(settings: EngineSettings, device: torch.device) -> Engine | None:
    """The draft model's engine for --draft-model (implies --speculate draft), or None."""
    if settings.draft_model is None:
        if settings.speculate == "draft":
            raise ValueError("--speculate draft needs --draft-model PATH")
        return None
    if settings.speculate == "off":
        raise ValueError("--draft-model guesses tokens: it cannot go with --speculate off")
    draft = replace(settings, model=settings.draft_model, model_name=None, draft_model=None, speculate="off",
                    kv_cache_mb=None, concepts=None, state_dir=None)  # fmt: skip
    log.info("loading the draft model %s", settings.draft_model)
    with StartupProgress(["model files", "load + warm-up"], enabled=False) as quiet:  # the bar is ours
        return _build_engine(draft, device, quiet)


def _build_engine(settings: EngineSettings, device: torch.device, bar: StartupProgress) -> Engine:
    draft = _draft_engine(settings, device)
    try:
        return _build_target(settings, device, bar, draft)
    except BaseException:
        if draft is not None:
            draft.shutdown()
        raise


def _state(settings: EngineSettings) -> SessionPersistence | None:
    if settings.state_dir is None:
        return None
    return SessionPersistence(settings.state_dir, settings.state_max_gb)


def _build_target(
    settings: EngineSettings, device: torch.device, bar: StartupProgress, draft: Engine | None
) -> Engine:
    started = time.monotonic()
    _log_conversion(settings)
    with bar.stage("model files"):  # the GGUF conversion (first start) is inside this one bar
        source = resolve_model(
            settings.model, cache_dir=settings.cache_dir, name=settings.model_name,
        )  # fmt: skip
    if time.monotonic() - started > 1:
        log.info("model files ready in %.1fs", time.monotonic() - started)
    if draft is not None:  # its guesses are our token ids: one vocabulary, checked before loading
        check_same_vocabulary(source.tokenizer, draft.tokenizer, str(settings.draft_model))
    concepts = None
    if settings.concepts is not None:
        concepts = ConceptSet.load(
            settings.concepts, hidden_size=source.config.hidden_size, num_layers=source.config.num_layers
        )
    context = min(settings.max_model_len or source.config.max_position_embeddings,
                  source.config.max_position_embeddings)  # fmt: skip
    kv_mb = settings.kv_cache_mb
    if kv_mb is None:
        kv_mb = default_kv_cache_mb(
            source.config, DTYPES[settings.dtype], device, context, settings.max_num_seqs
        )
    weights = resolve_weights(settings, source, device)
    kv_dtype = resolve_kv_dtype(settings.kv_dtype, DTYPES[settings.dtype], weights in QUANTIZED_WEIGHTS)
    check_kv_dtype(kv_dtype, source.config, device)  # before minutes of loading

    if weights in QUANTIZED_WEIGHTS:
        weights = _with_kernels(settings, weights)

    def make_model() -> DecoderModel:
        model = load_model(source, weights, device, settings.max_model_len)
        model.fuse_decode = settings.compile
        return model

    log.info("loading %s weights from %s, KV cache %.0f MiB", weights, source.model_dir, kv_mb)
    with bar.stage("load + warm-up"):
        engine = Engine(
            make_model,
            source.tokenizer,
            name=source.name,
            kv_cache_mb=kv_mb,
            max_batch_tokens=settings.max_batch_tokens,
            max_model_len=settings.max_model_len,
            session_ttl_s=settings.session_ttl_s,
            concepts=concepts,
            max_sessions=settings.max_sessions,
            max_queued=settings.max_queued,
            source=source,
            weights=weights,
            kv_dtype=settings.kv_dtype,
            speculate="draft" if draft is not None else settings.speculate,
            draft=draft,
            state=_state(settings),
        )
    log.info(
        "model %s (%s) loaded in %.1fs: weights %s, device %s, KV cache %.0f MiB = %d tokens "
        "(%d blocks, %s, %.0f bytes a token), context %d",
        source.name,
        source.config.architecture,
        time.monotonic() - started,
        weights,
        device,
        engine.kv_cache_mb,
        engine.kv.num_blocks * engine.kv.block_size,
        engine.kv.num_blocks,
        engine.kv.kv_dtype,
        engine.kv.bytes_per_token,
        engine.max_model_len,
    )
    pool = engine.kv.window_pool
    if pool is not None:
        log.info(
            "sliding-window layers (window %d) in a pool of their own: %d blocks, %.0f bytes a token; "
            "a sequence holds only the blocks its window reaches",
            engine.kv.window, pool.num_blocks, engine.kv.window_bytes_per_token,
        )  # fmt: skip
    return engine
