"""Ollama's `options` -> the engine's sampling values, through the engine's shared numeric rules
(engine/request.py: no bools for numbers, no NaN or infinities, seeds in 0..2**64-1).

Ollama's own defaults apply when an option is left out (temperature 0.8, top_k 40, top_p 0.9,
num_predict -1: until the context is full). Options about loading the model or the hardware
(num_gpu, num_thread, use_mmap, ...) are accepted and ignored, as they concern how Ollama
itself runs the model; sampling options this engine does not have are refused by name unless
they hold their neutral value; an option Ollama does not know is refused by name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.request import (
    InvalidValueError,
    SamplingParams,
    require_int,
    require_number,
    require_seed,
)
from tokenwire.protocols.ollama.errors import OllamaError, bad_request
from tokenwire.protocols.openai.schemas import MAX_STOP_CHARS

DEFAULT_TEMPERATURE = 0.8
DEFAULT_TOP_K = 40
DEFAULT_TOP_P = 0.9
MAX_STOPS = 16

# how Ollama loads and runs the model: nothing to do with what it generates
IGNORED = frozenset(
    {
        "numa",
        "num_batch",
        "num_gpu",
        "main_gpu",
        "low_vram",
        "f16_kv",
        "logits_all",
        "vocab_only",
        "use_mmap",
        "use_mlock",
        "embedding_only",
        "num_thread",
        "num_keep",
        "repeat_last_n",  # the window of repeat_penalty, which must be neutral here
        "penalize_newline",  # Ollama itself no longer reads it
    }
)
# sampling options the engine does not have: accepted only at their neutral value
NEUTRAL: dict[str, float] = {
    "repeat_penalty": 1.0,
    "typical_p": 1.0,
    "tfs_z": 1.0,
    "min_p": 0.0,
    "mirostat": 0,
    "mirostat_tau": 5.0,
    "mirostat_eta": 0.1,
}
USED = frozenset(
    {
        "temperature",
        "top_p",
        "top_k",
        "seed",
        "num_predict",
        "stop",
        "num_ctx",
        "presence_penalty",
        "frequency_penalty",
    }
)


@dataclass
class Options:
    """What `options` asks of one generation, checked."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    num_predict: int | None = None  # None: until the context is full (Ollama's -1 and -2)
    stop: list[str] = field(default_factory=list)
    num_ctx: int | None = None  # a context smaller than the model's, or None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0


def _checked(name: str, check: Any, value: Any, *args: Any) -> Any:
    try:
        return check(value, f"options.{name}", *args)
    except InvalidValueError as exc:
        raise bad_request(str(exc)) from None


def parse_options(raw: Any) -> Options:
    """`raw`: the request's `options` (None or an object). Raises OllamaError (400)."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise bad_request(f"options must be an object, got {type(raw).__name__}")
    for name, value in raw.items():
        if name in USED or name in IGNORED or value is None:
            continue
        if name in NEUTRAL:
            number = _checked(name, require_number, value)
            if number != NEUTRAL[name]:
                raise bad_request(
                    f"options.{name} is not supported by this server (only its neutral value "
                    f"{NEUTRAL[name]:g}, or leave it out)"
                )
            continue
        raise bad_request(f"options.{name} is not a known option")

    def get(name: str, default: Any) -> Any:
        value = raw.get(name)
        return default if value is None else value

    out = Options()
    temperature = _checked("temperature", require_number, get("temperature", DEFAULT_TEMPERATURE), 0)
    top_k = _checked("top_k", require_int, get("top_k", DEFAULT_TOP_K), 0)
    top_p = _checked("top_p", require_number, get("top_p", DEFAULT_TOP_P), 0, 1)
    if top_p == 0:  # Ollama passes 0 to its sampler as "off"; the engine's range is (0, 1]
        top_p = 1.0
    seed = raw.get("seed")
    if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool) and seed < 0):
        seed = _checked("seed", require_seed, seed)
    elif seed is not None:
        seed = None  # Ollama's -1: a random seed
    out.sampling = SamplingParams(
        temperature=0.0 if top_k == 1 else temperature, top_k=top_k, top_p=top_p, seed=seed
    )
    num_predict = _checked("num_predict", require_int, get("num_predict", -1), -2)
    out.num_predict = None if num_predict < 0 else num_predict
    if "num_ctx" in raw and raw["num_ctx"] is not None:
        out.num_ctx = _checked("num_ctx", require_int, raw["num_ctx"], 1)
    out.stop = _stops(raw.get("stop"))
    out.presence_penalty = _checked("presence_penalty", require_number, get("presence_penalty", 0.0))
    out.frequency_penalty = _checked("frequency_penalty", require_number, get("frequency_penalty", 0.0))
    return out


def _stops(value: Any) -> list[str]:
    """Stop strings; the stop matcher scans a window of the longest one for each of them at
    every token, so their count and length are capped (the length as the OpenAI API's)."""
    if value is None:
        return []
    if isinstance(value, str):
        value = [value]
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request("options.stop must be a list of strings")
    if len(value) > MAX_STOPS or any(len(s) > MAX_STOP_CHARS for s in value):
        raise bad_request(
            f"options.stop takes at most {MAX_STOPS} strings of at most {MAX_STOP_CHARS} characters"
        )
    return [s for s in value if s]


def room(options: Options, prompt_len: int, max_model_len: int) -> int:
    """The tokens this request may generate: num_predict, capped by the context (num_ctx when
    smaller than the model's). A prompt past num_ctx is refused naming it."""
    context = max_model_len if options.num_ctx is None else min(options.num_ctx, max_model_len)
    if options.num_ctx is not None and prompt_len >= context:
        raise OllamaError(
            400,
            f"the prompt is {prompt_len} tokens, which leaves no room to generate in "
            f"options.num_ctx {options.num_ctx}",
        )
    free = max(context - prompt_len, 0)
    return free if options.num_predict is None else min(options.num_predict, free)
