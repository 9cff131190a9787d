"""Embeddings from the loaded model: `embed(engine, inputs)` for every API that serves them
(OpenAI's /v1/embeddings here, Ollama's /api/embed).

An input (a text, tokenized with the model's special tokens, or a list of token ids) runs
through the model as one dense causal pass; its final normed hidden states are pooled as the
model declares (pooling.py: mean, cls or last) and the vector scaled to unit L2 length, as
OpenAI's are. Inputs are sorted by length and cut into slices of about one engine step's
tokens (SLICE_TOKENS, as GraphPipe's forward), each slice one model call on the engine's model
thread (`model_call`), so the engine's own steps run between slices and a big request never
holds it. Rows of a slice are right-padded: attention is causal, so padding after a row's last
token changes none of its states. A request whose caller went away (its task cancelled) starts
no further slice, and the slice running stops before its next layer.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenwire import metrics
from tokenwire.engine.abandoned_calls import layer_check, new_call_id, slice_result
from tokenwire.engine.errors import InvalidRequestError
from tokenwire.logs import access_log
from tokenwire.model.gguf_header import read_header
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.model.tokenizer import check_text
from tokenwire.protocols.embeddings.pooling import (
    POOLINGS,
    DeclaredPooling,
    Pooling,
    declared_pooling,
    pool,
    shorten,
)

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.engine.engine import Engine
    from tokenwire.engine.request import Origin

# tokens one model call takes (rows are never split): the engine's default --max-batch-tokens
SLICE_TOKENS = 512
# inputs one request may hold (OpenAI's own limit per request)
MAX_INPUTS = 2048
# tokens of all inputs of one request together (OpenAI's own limit per request)
MAX_TOTAL_TOKENS = 300_000

Input = str | Sequence[int]

_declared: dict[tuple[str, str, str], DeclaredPooling] = {}


class EmbeddingInputError(InvalidRequestError):
    """An input the model cannot embed; `param` names it ("input[2]"), `code` the kind."""

    def __init__(self, message: str, param: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.param = param
        self.code = code


@dataclass
class Embeddings:
    vectors: list[list[float]]  # one unit vector per input, in the inputs' order
    prompt_tokens: int  # tokens of all inputs together (OpenAI's usage)
    pooling: Pooling


def pooling_for(engine: EngineAPI) -> DeclaredPooling:
    """The pooling the engine's model declares (pooling.py's order); read once per model."""
    source = getattr(engine, "source", None)  # test doubles of an engine may lack these two
    hf = getattr(getattr(engine, "config", None), "hf", None) or {}
    if source is None:  # a model built in memory (tests): its config alone
        return declared_pooling(hf_config=hf, name=engine.name)
    key = (str(source.source), str(source.model_dir), engine.name)
    if key not in _declared:
        fields = None
        if source.gguf is not None:
            try:
                fields = read_header(source.gguf).fields
            except (OSError, ValueError):  # the file went away since the load: what else it says
                fields = None
        dirs = tuple(dict.fromkeys(d for d in (source.source, source.model_dir) if d.is_dir()))
        _declared[key] = declared_pooling(gguf_fields=fields, model_dirs=dirs, hf_config=hf, name=engine.name)
    return _declared[key]


def tokenize_inputs(
    engine: EngineAPI,
    inputs: Sequence[Input],
    *,
    field: str = "input",
    truncate: bool = False,
    add_special_tokens: bool = True,
) -> list[list[int]]:
    """Each input's token ids, checked: texts through the model's tokenizer (with its special
    tokens), id lists in the vocabulary; none empty, none over max_model_len (cut to it with
    `truncate`), at most MAX_INPUTS of them and MAX_TOTAL_TOKENS together. Errors name the
    input as `field[i]` (just `field` for a single input)."""
    if len(inputs) == 0:
        raise EmbeddingInputError(f"{field} is empty: give at least one text or token list", field)
    if len(inputs) > MAX_INPUTS:
        raise EmbeddingInputError(
            f"{field} holds {len(inputs)} inputs, over the limit of {MAX_INPUTS} per request", field
        )
    vocab, limit = engine.vocab_size, engine.max_model_len
    lists: list[list[int]] = []
    total = 0
    for i, item in enumerate(inputs):
        name = f"{field}[{i}]" if len(inputs) > 1 else field
        if isinstance(item, str):
            check_text(item, name)
            ids = engine.tokenizer.encode(item, add_special_tokens=add_special_tokens)
        else:
            ids = list(item)
            for j, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab:
                    raise EmbeddingInputError(
                        f"{name}[{j}] = {t!r} is not a token id of this model: ids are in [0, {vocab})",
                        name,
                        "invalid_token",
                    )
        if not ids:
            raise EmbeddingInputError(f"{name} is empty: nothing to embed", name)
        if len(ids) > limit:
            if not truncate:
                raise EmbeddingInputError(
                    f"{name} has {len(ids)} tokens, over the model's context length of {limit} "
                    "(max_model_len)",
                    name,
                    "context_length_exceeded",
                )
            ids = ids[:limit]
        total += len(ids)
        if total > MAX_TOTAL_TOKENS:
            raise EmbeddingInputError(
                f"{field} holds over {MAX_TOTAL_TOKENS} tokens together, the limit per request", field
            )
        lists.append(ids)
    return lists


def slices(lengths: Sequence[int], budget: int = SLICE_TOKENS) -> list[list[int]]:
    """Input indices grouped for model calls: sorted by length, each group's padded size
    (rows x longest) within `budget` tokens, or one row alone when it is longer."""
    order = sorted(range(len(lengths)), key=lambda i: lengths[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * lengths[i] <= budget:
            groups[-1].append(i)  # sorted: this row is the group's longest
        else:
            groups.append([i])
    return groups


async def embed(
    engine: EngineAPI,
    inputs: Sequence[Input],
    *,
    pooling: Pooling | None = None,
    dimensions: int | None = None,
    truncate: bool = False,
    field: str = "input",
    origin: Origin | None = None,
) -> list[list[float]]:
    """One unit-length embedding per input (a text or a list of token ids), in order.

    `pooling` overrides the model's own (pooling_for); `dimensions` keeps each vector's first
    values, re-normalised to unit length; `truncate` cuts inputs over max_model_len instead of
    refusing them. Raises EmbeddingInputError (an engine InvalidRequestError, its `param`
    naming `field[i]`) for inputs it cannot embed, EngineClosedError when the server stops.
    `origin` counts the request in /metrics and the access log under its protocol.
    See `embed_counted` for the token count too."""
    result = await embed_counted(
        engine, inputs, pooling=pooling, dimensions=dimensions, truncate=truncate, field=field, origin=origin
    )
    return result.vectors


async def embed_counted(
    engine: EngineAPI,
    inputs: Sequence[Input],
    *,
    pooling: Pooling | None = None,
    dimensions: int | None = None,
    truncate: bool = False,
    field: str = "input",
    origin: Origin | None = None,
) -> Embeddings:
    """`embed`, with the inputs' token count (usage) and the pooling used. Inputs are checked
    before anything runs; a refused request is not counted in /metrics (as a refused chat)."""
    token_lists = tokenize_inputs(engine, inputs, field=field, truncate=truncate)
    prompt_tokens = sum(len(t) for t in token_lists)
    mode = pooling or pooling_for(engine).mode
    if mode not in POOLINGS:
        raise EmbeddingInputError(f"unknown pooling {mode!r}: one of {', '.join(POOLINGS)}", "pooling")
    check_dimensions(dimensions, engine.config.hidden_size)
    started = time.monotonic()
    outcome, error = "error", None
    try:
        pooled = await _run(engine, token_lists, mode)
        vectors = shorten(torch.from_numpy(pooled), dimensions)
        outcome = "stop"
        return Embeddings(vectors.tolist(), prompt_tokens, mode)
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    except Exception as exc:
        error = str(exc)
        raise
    finally:
        if origin is not None:
            _record(origin, outcome, prompt_tokens, time.monotonic() - started, error)


def check_dimensions(dimensions: int | None, hidden_size: int, param: str = "dimensions") -> None:
    if dimensions is None:
        return
    if not isinstance(dimensions, int) or isinstance(dimensions, bool) or not 1 <= dimensions <= hidden_size:
        raise EmbeddingInputError(
            f"{param} = {dimensions!r}: this model's embeddings have {hidden_size} dimensions; "
            f"ask for 1 to {hidden_size}",
            param,
        )


async def _run(engine: EngineAPI, token_lists: list[list[int]], mode: Pooling) -> np.ndarray:
    """The pooled (not yet normalised) [N, H] float32 states, one model call per slice."""
    lengths = [len(t) for t in token_lists]
    out = np.empty((len(token_lists), engine.config.hidden_size), dtype=np.float32)
    call_id = new_call_id()
    for group in slices(lengths):
        width = max(lengths[i] for i in group)
        ids = np.zeros((len(group), width), dtype=np.int64)  # right-padded with id 0
        for row, i in enumerate(group):
            ids[row, : lengths[i]] = token_lists[i]
        rows = np.array([lengths[i] for i in group], dtype=np.int64)
        # by name: under --replicas it runs in a replica's process (EngineAPI.model_call)
        future = engine.model_call(f"{__name__}:embed_forward", ids, rows, mode, call_id)
        out[group] = await slice_result(future, call_id)
    return out


@torch.inference_mode()
def embed_forward(
    engine: Engine, ids: np.ndarray, lengths: np.ndarray, mode: Pooling, call_id: int = 0
) -> Any:
    """Runs on the model thread: one dense causal pass over the right-padded [B, T] batch, its
    final normed states pooled per row (`lengths` [B] real tokens) -> float32 [B, H]."""

    before_layer = layer_check(engine, call_id, "embeddings")
    model = engine.model
    b, t = ids.shape
    device = model.device
    tokens = torch.from_numpy(ids).to(device).reshape(-1)
    positions = torch.arange(t, device=device).repeat(b)
    attention = DenseCausalAttention(b, t, before_layer=before_layer, round_kv=engine.kv.as_stored)
    hidden, _ = model(tokens, positions, attention)
    return pool(hidden.view(b, t, -1), torch.from_numpy(lengths), mode).cpu().numpy()


def _record(origin: Origin, outcome: str, prompt_tokens: int, duration_s: float, error: str | None) -> None:
    """The request in /metrics (requests and prompt tokens per protocol) and the access log."""
    metrics.REQUESTS.labels(origin.protocol, outcome).inc()
    metrics.PROMPT_TOKENS.labels(origin.protocol).inc(prompt_tokens)
    access_log(
        origin.protocol,
        origin.method,
        outcome,
        peer=origin.peer,
        prompt_tokens=prompt_tokens,
        generated_tokens=0,
        duration_s=duration_s,
        error=error,
    )
