"""The engine's language model as a GraphPipe tensor model.

input `input_ids` int64 [B, T] (whole sequences, no KV cache) ->
  `logits` float32 [B, T, V], `next_token_logprobs` float32 [B, V] (log-softmax at the last
  position), `hidden_states` float32 [B, T, H] of the layer chosen by the request's config
  JSON {"layer": L} (0 = embeddings, num_layers = final normed states, negative counts from the
  end; default -1), `embedding` float32 [B, H] (final normed hidden state mean-pooled over T).

The forward is a dense causal pass on the engine's model thread, so it never runs beside the
engine's own steps (two OpenMP teams on the same cores slow both). It runs in slices of rows of
about one engine step's tokens (SLICE_TOKENS), one model call each, so the engine's steps run
between slices: a [16, 2048] request held the engine for 289 CPU-seconds in one call while a
2-token chat waited 270 s. A call whose callers went away (the client hung up) is cancelled:
no further slice starts, and the slice running stops before its next layer.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tokenwire.engine.abandoned_calls import layer_check, new_call_id, slice_result
from tokenwire.engine.request import InvalidValueError, require_int
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.protocols.graphpipe.codec import IOMetadata
from tokenwire.protocols.graphpipe.errors import ErrorCode, GraphPipeError
from tokenwire.protocols.graphpipe.models.base import TensorModel
from tokenwire.protocols.graphpipe.types import Type

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI
    from tokenwire.engine.engine import Engine

INPUT = "input_ids"
# a request that would make more than this many output bytes is refused before it runs
MAX_OUTPUT_BYTES = 1 << 30
# tokens a slice of rows holds (a row is never split: one row of T tokens is one slice when
# T is larger): the engine's default --max-batch-tokens, so a slice costs about one step
SLICE_TOKENS = 512


class LanguageModel(TensorModel):
    def __init__(self, engine: EngineAPI) -> None:
        self.engine = engine
        self.name = engine.name
        cfg = engine.config
        self.num_layers = cfg.num_layers
        self.hidden = cfg.hidden_size
        self.vocab = engine.logits_size
        self.description = (
            f"{engine.name} as tensors: input_ids int64 [B, T] -> logits, next_token_logprobs, "
            f'hidden_states (config {{"layer": L}}, 0..{self.num_layers}, default -1), embedding'
        )
        self.inputs = [IOMetadata(INPUT, Type.Int64, [-1, -1], f"token ids in [0, {engine.vocab_size})")]
        self.outputs = [
            IOMetadata("logits", Type.Float32, [-1, -1, self.vocab], "next-token logits at every position"),
            IOMetadata(
                "next_token_logprobs", Type.Float32, [-1, self.vocab], "log-softmax at the last position"
            ),
            IOMetadata(
                "hidden_states", Type.Float32, [-1, -1, self.hidden], 'residual stream of config "layer"'
            ),
            IOMetadata("embedding", Type.Float32, [-1, self.hidden], "final hidden state mean-pooled over T"),
        ]
        self.default_inputs = [INPUT]
        self.default_outputs = ["next_token_logprobs"]
        self.stackable = True

    def parse_config(self, config: bytes) -> int:
        """The hidden_states layer, normalised to 0..num_layers."""
        if not config.strip():
            return self.num_layers
        try:
            parsed = json.loads(config)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise GraphPipeError(ErrorCode.BAD_REQUEST, f"config is not JSON: {exc}") from exc
        if not isinstance(parsed, dict) or set(parsed) - {"layer"}:
            raise GraphPipeError(ErrorCode.BAD_REQUEST, 'config must be a JSON object like {"layer": 3}')
        layer = parsed.get("layer", -1)
        n = self.num_layers
        try:  # the engine's rule: an integer (true/false are not), here in -(n+1)..n
            layer = require_int(layer, "config layer", -(n + 1), n)
        except InvalidValueError as exc:
            raise GraphPipeError(
                ErrorCode.BAD_REQUEST, f"{exc} (0..{n}, or -{n + 1}..-1 from the end)"
            ) from None
        return layer % (n + 1)

    def check_values(self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any) -> None:
        ids = inputs[INPUT]
        b, t = ids.shape
        if b == 0 or t == 0:
            raise GraphPipeError(
                ErrorCode.WRONG_SHAPE, f"input {INPUT!r} has shape [{b}, {t}]; B and T must be >= 1"
            )
        if t > self.engine.max_model_len:
            raise GraphPipeError(
                ErrorCode.WRONG_SHAPE,
                f"input {INPUT!r} has T={t} tokens, over max_model_len {self.engine.max_model_len}",
            )
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.engine.vocab_size:
            bad = lo if lo < 0 else hi
            raise GraphPipeError(
                ErrorCode.BAD_REQUEST,
                f"input {INPUT!r} holds token id {bad}, outside [0, {self.engine.vocab_size})",
            )
        per_row = {
            "logits": t * self.vocab,
            "next_token_logprobs": self.vocab,
            "hidden_states": t * self.hidden,
        }
        size = 4 * b * sum(per_row.get(o, self.hidden) for o in outputs)
        if size > MAX_OUTPUT_BYTES:
            raise GraphPipeError(
                ErrorCode.BAD_REQUEST,
                f"outputs {outputs} would be {size / 2**20:.0f} MiB, over the 1024 MiB limit",
            )

    def start(
        self, inputs: dict[str, np.ndarray], outputs: list[str], config: Any
    ) -> asyncio.Future[list[np.ndarray]]:
        ids = np.array(inputs[INPUT], dtype=np.int64)  # token ids are small: a writable copy for torch
        return asyncio.ensure_future(self._sliced(ids, outputs, config))

    async def _sliced(self, ids: np.ndarray, outputs: list[str], config: Any) -> list[np.ndarray]:
        b, t = ids.shape
        rows = max(1, SLICE_TOKENS // max(t, 1))
        call_id = new_call_id()
        parts: list[list[np.ndarray]] = []
        for lo in range(0, b, rows):
            # by name: under --replicas it runs in a replica's process (EngineAPI.model_call)
            future = self.engine.model_call(
                f"{__name__}:dense_forward", ids[lo : lo + rows], outputs, config, call_id
            )
            parts.append(await slice_result(future, call_id))
        return [np.concatenate(part) for part in zip(*parts, strict=True)]


@torch.inference_mode()
def dense_forward(
    engine: Engine, ids: np.ndarray, outputs: list[str], layer: int, call_id: int = 0
) -> list[np.ndarray]:
    """Runs on the model thread: one dense causal pass over the [B, T] batch."""
    before_layer = layer_check(engine, call_id, "GraphPipe")

    model = engine.model
    b, t = ids.shape
    device = model.device
    tokens = torch.from_numpy(ids).to(device).reshape(-1)
    positions = torch.arange(t, device=device).repeat(b)
    capture = (layer,) if "hidden_states" in outputs else ()
    # a batch can take seconds on a CPU: the forward stops within a layer of shutdown or of its
    # client leaving
    hidden, captured = model(
        tokens,
        positions,
        DenseCausalAttention(b, t, before_layer=before_layer, round_kv=engine.kv.as_stored),
        capture_layers=capture,
    )
    hidden = hidden.view(b, t, -1)
    results: dict[str, torch.Tensor] = {}
    if "logits" in outputs:
        results["logits"] = model.logits(hidden.reshape(b * t, -1)).view(b, t, -1)
    if "next_token_logprobs" in outputs:
        last = results["logits"][:, -1] if "logits" in results else model.logits(hidden[:, -1])
        results["next_token_logprobs"] = torch.log_softmax(last.float(), dim=-1)
    if "hidden_states" in outputs:
        results["hidden_states"] = captured[layer].view(b, t, -1)
    if "embedding" in outputs:
        results["embedding"] = hidden.float().mean(dim=1)
    return [results[o].float().cpu().numpy() for o in outputs]
