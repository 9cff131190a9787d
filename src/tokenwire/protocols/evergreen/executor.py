"""Actions on the engine: GENERATE, SCORE, TOKENIZE, DETOKENIZE, COUNT_TOKENS.

GENERATE prefills while its input still streams: every time the input grows, the settled
prefix of its token sequence (content.py) is appended to the action's engine session with a
prefill-only request (max_tokens=0); once the input is complete the rest is appended and
generation starts. Output tokens stream out as fragments of the output leaf node.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Protocol

import grpc

from tokenwire.engine.api import EngineAPI
from tokenwire.engine.errors import (
    ContextOverflowError,
    EngineClosedError,
    EngineError,
    KVBudgetError,
    SessionBusyError,
    SessionNotFoundError,
)
from tokenwire.engine.grammar import GrammarConstraint
from tokenwire.engine.request import (
    BacktrackEvent,
    FinishEvent,
    GenerateOptions,
    InvalidValueError,
    Origin,
    SamplingParams,
    TokenEvent,
    require_int,
    stream_events,
)
from tokenwire.logs import access_log
from tokenwire.protocols.evergreen.actions import ActionSpec
from tokenwire.protocols.evergreen.content import Prompt, PromptBuilder, count_plain, plain_text
from tokenwire.protocols.evergreen.core import ActionState, SessionCore
from tokenwire.protocols.evergreen.engine_sessions import EngineSessions, Lease
from tokenwire.protocols.evergreen.errors import SessionAbort, invalid
from tokenwire.protocols.evergreen.flatten import Flattened
from tokenwire.protocols.evergreen.gen import evergreen_pb2 as pb
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb
from tokenwire.protocols.evergreen.nodes import DEFAULT_MAX_TOKENS

TEXT_OUTPUTS = ("response", "text")


class ActionHost(Protocol):
    """What the session runner gives the executor."""

    core: SessionCore
    engine: EngineAPI
    pool: EngineSessions
    builder: PromptBuilder
    version: int
    default_max_tokens: int

    def send(self, fragments: list[pb.NodeFragment]) -> None: ...
    async def wait_change(self, version: int, waiting_for: str = "") -> None: ...
    async def input(self, action: ActionState, name: str | None = None) -> Flattened: ...
    def read_text(self, uri: str) -> str: ...
    def measure(self, uri: str) -> int: ...


def engine_abort(label: str, exc: EngineError) -> SessionAbort:
    if isinstance(exc, ContextOverflowError):
        code = grpc.StatusCode.OUT_OF_RANGE
    elif isinstance(exc, KVBudgetError):
        code = grpc.StatusCode.RESOURCE_EXHAUSTED
    elif isinstance(exc, EngineClosedError):
        code = grpc.StatusCode.UNAVAILABLE
    elif isinstance(exc, SessionNotFoundError | SessionBusyError):
        code = grpc.StatusCode.INTERNAL
    else:
        code = grpc.StatusCode.INVALID_ARGUMENT
    return SessionAbort(code, f"action {label}: {exc}")


def generate_options(
    spec: ActionSpec, engine: EngineAPI, default_max_tokens: int = DEFAULT_MAX_TOKENS
) -> GenerateOptions:
    config = spec.config(twpb.GenerateConfig) or twpb.GenerateConfig()
    assert isinstance(config, twpb.GenerateConfig)
    max_tokens = config.max_tokens if config.HasField("max_tokens") else default_max_tokens
    if max_tokens <= 0:
        raise invalid(f"action {spec.label}: GenerateConfig.max_tokens must be > 0, got {max_tokens}")
    options = GenerateOptions(
        max_tokens=max_tokens,
        sampling=SamplingParams(
            temperature=config.temperature if config.HasField("temperature") else 1.0,
            top_p=config.top_p if config.HasField("top_p") else 1.0,
            top_k=config.top_k if config.HasField("top_k") else 0,
            seed=config.seed if config.HasField("seed") else None,
        ),
        stop=list(config.stop),
        ignore_eos=config.ignore_eos,
        logprobs=config.logprobs,
        top_logprobs=config.top_logprobs,
        priority=2,  # interactive
        origin=Origin("evergreen", "GENERATE"),
    )
    constraint = spec.config(twpb.ConstraintConfig)
    if constraint is not None:
        assert isinstance(constraint, twpb.ConstraintConfig)

        hf, width = engine.tokenizer.hf, engine.logits_size
        which = constraint.WhichOneof("grammar")
        try:
            if which == "regex":
                options.constraint = GrammarConstraint.regex(hf, width, constraint.regex)
            elif which == "json_schema":
                options.constraint = GrammarConstraint.json_schema(hf, width, constraint.json_schema)
            elif which == "lark":
                options.constraint = GrammarConstraint.lark(hf, width, constraint.lark)
            else:
                raise ValueError("ConstraintConfig sets no grammar (regex, json_schema or lark)")
        except ValueError as exc:
            raise invalid(f"action {spec.label}: ConstraintConfig: {exc}") from exc
    try:
        options.validate()
    except EngineError as exc:
        raise invalid(f"action {spec.label}: GenerateConfig: {exc}") from exc
    return options


async def _complete_input(host: ActionHost, action: ActionState, name: str | None = None) -> Flattened:
    while True:
        version = host.version
        flat = await host.input(action, name)
        if flat.complete:
            return flat
        await host.wait_change(version, f"action {action.spec.label}: input node {flat.waiting_for!r}")


async def run_action(host: ActionHost, action: ActionState) -> None:
    """Run one action to its end; failures go to core.fail (abort or error chunk)."""
    spec = action.spec
    try:
        if spec.name == "GENERATE":
            await _generate(host, action)
        elif spec.name == "SCORE":
            await _score(host, action)
        else:
            await _logged_token_tool(host, action)
        host.send(host.core.finish(action))
    except SessionAbort as exc:
        host.send(host.core.fail(action, exc))
    except EngineError as exc:
        host.send(host.core.fail(action, engine_abort(spec.label, exc)))


async def _logged_token_tool(host: ActionHost, action: ActionState) -> None:
    """TOKENIZE/COUNT_TOKENS/DETOKENIZE never reach the engine's request hook: their access-log
    line is written here (GENERATE and SCORE get theirs from the engine, by their Origin)."""
    started = time.monotonic()
    outcome = "error"
    try:
        await _token_tool(host, action)
        outcome = "ok"
    except asyncio.CancelledError:
        outcome = "cancelled"
        raise
    finally:
        access_log("evergreen", action.spec.name, outcome, duration_s=time.monotonic() - started)


async def _generate(host: ActionHost, action: ActionState) -> None:
    spec = action.spec
    options = generate_options(spec, host.engine, host.default_max_tokens)
    lease: Lease | None = None
    try:
        prompt: Prompt
        while True:
            version = host.version
            flat = await host.input(action)
            prompt = host.builder.build(flat, host.read_text, host.measure)
            if prompt.complete:
                break
            target = prompt.tokens[: prompt.stable]
            # an image's block is computed with the image attached, once the input is complete
            if target and not prompt.images and (lease is None or lease.tokens != target):
                if lease is None:
                    lease = host.pool.acquire(target)
                await lease.prefill(target)
                continue  # more input may have arrived while prefilling
            await host.wait_change(version, f"action {spec.label}: input node {flat.waiting_for!r}")
        if not prompt.tokens:
            raise invalid(f"action {spec.label}: the input is empty")
        # a reused session may share the text before the first image, never an image block
        text_prefix = prompt.tokens[: prompt.images[0].start] if prompt.images else prompt.tokens
        if lease is None:
            lease = host.pool.acquire(text_prefix)
        handle = lease.start(prompt.tokens, options, prompt.images)
        await _stream_generation(host, action, handle, options)
    except BaseException:
        if lease is not None:
            host.pool.discard(lease)
        raise
    if prompt.images:  # the pool matches kept sessions by tokens only: images stay out of it
        host.pool.discard(lease)
    else:
        host.pool.keep(lease)


async def _stream_generation(host: ActionHost, action: ActionState, handle, options: GenerateOptions) -> None:
    eos = host.engine.eos_ids
    pending_ids: list[int] = []
    logprobs: list[dict] = []
    outputs = [n for n in TEXT_OUTPUTS if n in action.outputs]
    async for event in stream_events(handle):
        if isinstance(event, TokenEvent):
            if event.is_prefill:
                continue
            if event.token_id not in eos or options.ignore_eos:
                pending_ids.append(event.token_id)
            if options.logprobs:
                logprobs.append({"id": event.token_id, "text": event.text, "logprob": event.logprob})
            if event.text:
                data = event.text.encode()
                sent = []
                for name in outputs:
                    fragment = host.core.emit(action, name, data, pending_ids)
                    if fragment is not None:
                        sent.append(fragment)
                pending_ids = []
                host.send(sent)
        elif isinstance(event, BacktrackEvent):
            raise SessionAbort(
                grpc.StatusCode.INTERNAL,
                f"action {action.spec.label}: the constraint backtracked over output already streamed",
            )
        elif isinstance(event, FinishEvent):
            if event.reason == "error":
                # UNAVAILABLE: the --replicas replica running it died (a retry may succeed);
                # INVALID_ARGUMENT: the ConstraintConfig's grammar failed (the client's to fix)
                code = grpc.StatusCode.UNAVAILABLE if event.unavailable else grpc.StatusCode.INTERNAL
                code = grpc.StatusCode.INVALID_ARGUMENT if event.bad_input else code
                raise SessionAbort(code, f"action {action.spec.label}: generation failed: {event.error}")
            if event.reason == "cancelled":
                return
            fragments = [host.core.emit(action, n, b"", pending_ids, final=True) for n in outputs]
            if "logprobs" in action.outputs:
                body = json.dumps({"tokens": logprobs, "finish_reason": event.reason}).encode()
                fragments.append(
                    host.core.emit(action, "logprobs", body, final=True, mimetype="application/json")
                )
            host.send([f for f in fragments if f is not None])


async def _score(host: ActionHost, action: ActionState) -> None:
    spec = action.spec
    context: list[int] = []
    images = []
    if "prompt" in spec.inputs:
        flat = await _complete_input(host, action, "prompt")
        prompt = host.builder.build(flat, host.read_text, host.measure)
        context, images = prompt.tokens, prompt.images
    cont_flat = await _complete_input(host, action, "continuation")
    continuation = host.engine.tokenizer.encode(
        plain_text(cont_flat, host.read_text), add_special_tokens=False
    )
    if not continuation:
        raise invalid(f"action {spec.label}: the continuation is empty")
    tokens = context + continuation
    first = max(len(context), 1)  # the very first token of a sequence has no logprob
    options = GenerateOptions(
        max_tokens=0, logprob_ranges=[(first, len(tokens))], priority=2, origin=Origin("evergreen", "SCORE")
    )
    handle = host.engine.generate(None, tokens, options, images=images)
    scored: list[dict] = []
    async for event in stream_events(handle):
        if isinstance(event, TokenEvent) and event.is_prefill and event.logprob is not None:
            text = host.engine.tokenizer.decode([event.token_id])
            scored.append({"id": event.token_id, "text": text, "logprob": event.logprob})
        elif isinstance(event, FinishEvent) and event.reason == "error":
            raise SessionAbort(
                grpc.StatusCode.INTERNAL, f"action {spec.label}: scoring failed: {event.error}"
            )
    body = {"logprob": sum(s["logprob"] for s in scored), "tokens": scored}
    host.send(_one(host, action, "score", json.dumps(body).encode(), "application/json"))


async def _token_tool(host: ActionHost, action: ActionState) -> None:
    spec = action.spec
    tokenizer = host.engine.tokenizer
    flat = await _complete_input(host, action)
    if spec.name == "COUNT_TOKENS":  # an image counts its whole block (vision models)
        count = count_plain(flat, host.read_text, tokenizer, host.builder.vision)
        host.send(_one(host, action, "count", json.dumps(count).encode(), "application/json"))
        return
    text = plain_text(flat, host.read_text)
    if spec.name == "TOKENIZE":
        ids = tokenizer.encode(text, add_special_tokens=False)
        host.send(_one(host, action, "tokens", json.dumps(ids).encode(), "application/json"))
    elif spec.name == "DETOKENIZE":
        try:
            ids = json.loads(text)
        except (ValueError, RecursionError) as exc:  # incl. nesting 5k+ deep (reliability-findings)
            reason = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
            raise invalid(f"action {spec.label}: input is not a JSON array of token ids: {reason}") from None
        vocab = host.engine.vocab_size
        if not isinstance(ids, list):
            raise invalid(f"action {spec.label}: input must be a JSON array of token ids in [0, {vocab})")
        try:  # the engine's rule: a token id is an integer (true/false are not) in the vocabulary
            for i, token in enumerate(ids):
                require_int(token, "input", 0, vocab - 1, what=f"token id [{i}]")
        except InvalidValueError as exc:
            raise invalid(f"action {spec.label}: input must be a JSON array of token ids: {exc}") from None
        host.send(_one(host, action, "text", tokenizer.decode(ids).encode(), "text/plain", ids))
    else:  # pragma: no cover - validate() admits no other names
        raise invalid(f"action {spec.label}: not runnable")


def _one(
    host: ActionHost, action: ActionState, name: str, body: bytes, mimetype: str, ids: list[int] | None = None
) -> list[pb.NodeFragment]:
    fragment = host.core.emit(action, name, body, ids or (), final=True, mimetype=mimetype)
    return [fragment] if fragment is not None else []
