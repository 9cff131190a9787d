"""Salience's sans-IO core: request checks, the Generate plan, and engine event -> message conversion.

Everything here works on plain values (protobuf messages, token lists, the model's limits) and
raises SalienceStatus for a request the service refuses; service.py only moves these values
between grpc.aio and the engine. The order of the Generate checks matters: every check runs
before the session is changed (truncated or appended to), so a refused call leaves it as it was.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import grpc

from tokenwire.engine.admission import Limits, check_request
from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import FinishEvent, GenerateOptions, SamplingParams, TokenEvent
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.images import (
    ImageBlock,
    VisionTokens,
    blocks_after_truncate,
    blocks_for_fork,
    check_attachments,
)
from tokenwire.protocols.salience.status import SalienceStatus, status_for

SERVICE_NAME = "salience.v1.Salience"
READOUT_DTYPE = "float32"  # readouts travel as proto floats
# engine field -> GenerateRequest field, so refusals name what the client sent
PROTO_NAMES = {
    "append": "append_tokens",
    "logprob_ranges": "logprobs_ranges",
    "top_logprobs": "logprob_top_k",
}


@dataclass(frozen=True)
class ModelLimits:
    """What the checks need to know about the loaded model and its engine."""

    name: str
    engine: Limits  # the engine's admission limits (engine.limits)
    vision: VisionTokens | None = None
    pad_count: Callable[[ImageBlock], int] | None = None  # the vision encoder's N per image


@dataclass
class GeneratePlan:
    """What to do for one Generate: rewind, then (unless a no-op) run the engine."""

    truncate_to: int | None  # rewind the session to this length first
    append: list[int]
    options: GenerateOptions | None  # None: nothing to run, only refresh the session's TTL
    prompt_len: int  # session length after the append
    images: list[ImageBlock] = field(default_factory=list)  # the session's blocks afterwards


def _status(code: grpc.StatusCode, message: str) -> SalienceStatus:
    return SalienceStatus(code, message)


def check_model(requested: str, loaded: str) -> None:
    """OpenSession's safety check: empty means whatever is loaded."""
    if requested and requested != loaded:
        raise _status(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"model {requested!r} is not served here: the loaded model is {loaded!r}",
        )


def check_fork(at: int, length: int, images: Sequence[ImageBlock]) -> list[ImageBlock]:
    """ForkSession's checks; returns the image blocks the fork inherits."""
    if at > length:
        raise _status(
            grpc.StatusCode.FAILED_PRECONDITION,
            f"at_position {at} is past the end of the session ({length} tokens)",
        )
    return blocks_for_fork(images, at)


def sampling_from(req: pb.GenerateRequest) -> SamplingParams:
    """The proto's zero defaults: temperature 0 and top_p 0 mean 1.0, top_k 0 means disabled.
    The values are checked by the engine's rules (finite, in range) as sent, before top_k 1
    turns the draw into an argmax (a NaN temperature must not pass as greedy)."""
    sampling = SamplingParams(
        temperature=req.temperature if req.temperature != 0 else 1.0,
        top_k=int(req.top_k),
        top_p=req.top_p if req.top_p != 0 else 1.0,
    )
    try:
        sampling.validate(PROTO_NAMES)
    except EngineError as exc:
        raise status_for(exc) from None
    if req.top_k == 1:
        sampling.temperature = 0.0  # only the best token survives: plain argmax, no draw
    return sampling


def _check_sizes(req: pb.GenerateRequest, offset: int, engine: Limits) -> None:
    """Token arrays counted (O(1) on a protobuf repeated field) before they become Python lists
    and are checked id by id: a 64 MiB message holds ~3*10^7 one-byte ids (issue 29's rule)."""
    count = len(req.append_tokens)
    if offset + count > engine.max_model_len:  # Salience's context error, as the engine's own
        raise _status(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"{offset + count} tokens exceed the model's context ({engine.max_model_len} tokens, "
            f"--max-model-len): append_tokens has {count} ids at offset {offset}",
        )
    if len(req.stop_token_ids) > engine.vocab_size:
        raise _status(
            grpc.StatusCode.INVALID_ARGUMENT,
            f"stop_token_ids has {len(req.stop_token_ids)} ids, more than the vocabulary "
            f"({engine.vocab_size})",
        )


def plan_generate(
    req: pb.GenerateRequest,
    session_tokens: Sequence[int],
    session_images: Sequence[ImageBlock],
    limits: ModelLimits,
) -> GeneratePlan:
    """Check a Generate against the session and the model; raise SalienceStatus or return the plan."""
    length = len(session_tokens)
    offset = req.offset
    truncate_to = None
    if offset != length:
        if offset < length and req.truncating:
            truncate_to = offset
        else:
            hint = " (set truncating=true to rewind)" if offset < length else ""
            raise _status(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"offset {offset} does not match the session length {length}{hint}",
            )
    _check_sizes(req, offset, limits.engine)
    kept = blocks_after_truncate(session_images, offset) if truncate_to is not None else list(session_images)
    append = list(req.append_tokens)
    prompt_len = offset + len(append)
    logprob_ranges = [(int(r.start), int(r.end)) for r in req.logprobs_ranges]
    readout_ranges = [(int(r.start), int(r.end)) for r in req.readout_ranges]
    options = GenerateOptions(
        max_tokens=int(req.max_tokens),
        sampling=sampling_from(req),
        stop_token_ids=[int(t) for t in req.stop_token_ids],
        logprob_ranges=logprob_ranges,
        top_logprobs=int(req.logprob_top_k),
        logprob_mode="raw",
        readout_ranges=readout_ranges,
        priority=int(req.priority),
    )
    # the proto's no-op Generate (only refreshes the session's TTL, after any rewind) runs nothing
    noop = not append and req.max_tokens == 0 and not logprob_ranges and not readout_ranges and not req.images
    try:
        if noop:
            options.validate(PROTO_NAMES)
        else:
            check_request(limits.engine, prompt_len, append, options, names=PROTO_NAMES)
    except EngineError as exc:
        raise status_for(exc) from None
    images = kept
    if req.images:
        attached = [ImageBlock(i.pad_range_start, i.pad_range_end, i.mime, i.bytes) for i in req.images]
        tokens_after = [*session_tokens[:offset], *append]
        images = kept + check_attachments(attached, tokens_after, kept, limits.vision, limits.pad_count)
        images.sort(key=lambda b: b.start)
    return GeneratePlan(truncate_to, append, None if noop else options, prompt_len, images)


def image_blocks_header(blocks: Sequence[ImageBlock]) -> str:
    """DumpSession's `salience-image-blocks` trailing metadata: `start-end:mime` per block."""
    return ",".join(f"{b.start}-{b.end}:{b.mime}" for b in blocks)


def token_message(event: TokenEvent) -> pb.GenerateEvent:
    """An engine TokenEvent as a GenerateEvent. Position 0 of a session has no logprob (nothing
    precedes it), so has_sampled_logprob stays false there even when covered."""
    token = pb.Token(id=event.token_id, position=event.position, is_prefill=event.is_prefill)
    if event.logprob is not None:
        token.sampled_logprob = event.logprob
        token.has_sampled_logprob = True
        if event.top_logprobs:
            token.logprobs.extend(pb.TokenLogprob(id=i, logprob=lp) for i, lp in event.top_logprobs)
    if event.readout is not None:
        token.readout.extend(event.readout.reshape(-1).tolist())  # [n_layers][n_concepts], row-major
    return pb.GenerateEvent(token=token)


_FINISH = {
    "eos": pb.GenerateDone.FINISH_REASON_EOS,
    "length": pb.GenerateDone.FINISH_REASON_LENGTH,
    "cancelled": pb.GenerateDone.FINISH_REASON_CANCELLED,
}


def finish_reason(event: FinishEvent) -> int:
    """Engine finish -> proto FinishReason. A stop token id counts as EOS (the proto's "emitted
    EOS / stop token"); a stop string (or a constraint's stop) is STOP_STRING."""
    if event.reason == "stop":
        if isinstance(event.stop_detail, int):
            return pb.GenerateDone.FINISH_REASON_EOS
        return pb.GenerateDone.FINISH_REASON_STOP_STRING
    return _FINISH.get(event.reason, pb.GenerateDone.FINISH_REASON_UNSPECIFIED)


def done_message(prompt_tokens: int, completion_tokens: int, reason: int) -> pb.GenerateEvent:
    return pb.GenerateEvent(
        done=pb.GenerateDone(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            finish_reason=reason,  # type: ignore[arg-type]
        )
    )


def finish_message(event: FinishEvent) -> pb.GenerateEvent:
    return done_message(event.prompt_tokens, event.completion_tokens, finish_reason(event))


def manifest(concepts: object | None, hidden_size: int) -> pb.ReadoutManifest:
    """The readout manifest: the concept set's names and layers, or empty lists without one."""
    if concepts is None:
        return pb.ReadoutManifest(hidden_size=hidden_size, dtype=READOUT_DTYPE)
    return pb.ReadoutManifest(
        concepts=list(concepts.names),  # type: ignore[attr-defined]
        layers=list(concepts.layers),  # type: ignore[attr-defined]
        hidden_size=hidden_size,
        dtype=READOUT_DTYPE,
    )
