"""One POST /v1/run: instantiate the controller, generate every fork, stream AICI run objects.

Each fork is one engine request on its own session, constrained by an AiciConstraint. When
the controller forks (num_forks > 1) the request stops, the session is forked (KV shared) once
per clone and every fork resumes; a suspended fork waits a moment and resumes.

Admission comes first: the run's session is reserved (--max-sessions), the controller
instantiated and the first fork's request admitted by the engine (--max-queued, the KV budget,
the context) before `initial-run` is yielded, so a server answering over HTTP can still refuse
the run with a complete error response. Everything a run creates (engine sessions, the
Coordinator's sequences) is owned by the run and released when it ends, on every path.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import (
    BacktrackEvent,
    FinishEvent,
    GenerateOptions,
    Origin,
    RequestHandle,
    SamplingParams,
    TokenEvent,
    require_int,
    require_number,
    require_seed,
    stream_events,
)
from tokenwire.protocols.aici.client import AiciClient, AiciError
from tokenwire.protocols.aici.codec import FrameError
from tokenwire.protocols.aici.engine_bridge import AiciConstraint, Coordinator, SeqOutcome, SeqState

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

BACKTRACK_MARK = "↩"
SUSPEND_WAIT_S = 0.002
# a fork that keeps waiting (others a step behind, or suspended) backs off to this: a wait that
# lasts (another fork queued in the engine) must not become a loop of 2 ms engine requests
MAX_SUSPEND_WAIT_S = 0.05
INSTANTIATE_TIMEOUT_S = 60.0

__all__ = ["RunRequest", "failed_run", "run_events", "steps_limit"]


def steps_limit(max_tokens: int) -> int:
    """Steps one fork may take in all (tokens sampled or forced, and backtracks) whatever it
    backtracks: twice max_tokens. The engine counts max_tokens net of backtracking, so a
    controller that backtracked every token it made ran for good (2**31 - 1 each step under
    max_tokens 3: 2,636 events in 30 s); undoing its output buys a fork max_tokens more, no more."""
    return 2 * max_tokens


@dataclass
class RunRequest:
    controller: str
    controller_arg: str
    prompt: str | list[int] = ""
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None

    @classmethod
    def from_json(cls, body: Any) -> RunRequest:
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        ctrl = body.get("controller")
        if not isinstance(ctrl, str) or not ctrl:
            raise ValueError("'controller' (module id or tag) is required")
        arg = body.get("controller_arg", "")
        arg = arg if isinstance(arg, str) else json.dumps(arg)
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, (str, list)):
            raise ValueError("'prompt' must be text or a list of token ids")
        # every field is checked here, before the run creates anything, in the engine's one
        # place for numbers (InvalidValueError is a ValueError: HTTP 400 naming the field); a
        # top_p that was not a number answered 500
        max_tokens = require_int(body.get("max_tokens", 256), "max_tokens", 1)
        temperature = require_number(body.get("temperature", 0.0), "temperature", 0.0)
        top_p = require_number(body.get("top_p", 1.0), "top_p", 0.0, 1.0)
        seed = body.get("seed")
        seed = None if seed is None else require_seed(seed)
        return cls(ctrl, arg, prompt, max_tokens, temperature, top_p, seed)


@dataclass
class _Usage:
    sampled: int = 0
    ff: int = 0

    def json(self) -> dict[str, int]:
        return {"sampled_tokens": self.sampled, "ff_tokens": self.ff, "cost": 2 * self.sampled + self.ff}


@dataclass
class _Run:
    engine: EngineAPI
    coord: Coordinator
    req: RunRequest
    usage: _Usage = field(default_factory=_Usage)
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    next_index: int = 1
    live: int = 0
    # sequence id -> its engine session: what this run holds until the fork holding it ends
    owned: dict[int, str] = field(default_factory=dict)
    tasks: set[asyncio.Task[None]] = field(default_factory=set)

    def options(self, constraint: AiciConstraint, generated: int) -> GenerateOptions:
        req = self.req
        constraint.step_limit = steps_limit(req.max_tokens)
        return GenerateOptions(
            max_tokens=max(1, req.max_tokens - generated),
            sampling=SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed),
            constraint=constraint,
            origin=Origin("aici", "run"),
        )

    def release(self, seq_id: int) -> None:
        """Close the sequence's session (cancelling its request) and free it in the runtime.
        Idempotent: a fork's own `finally` and the run's end may both call it."""
        session = self.owned.pop(seq_id, None)
        if session is not None:
            self.engine.close_session(session)
        self.coord.free(seq_id)

    def release_all(self) -> None:
        # a fork task cancelled before it ever ran never enters its own `finally`: without this
        # its sequence stayed in the Coordinator holding results, and every later round waited
        for seq_id in list(self.owned):
            self.release(seq_id)


def _fork_json(
    index: int, text: str, entries: list[dict[str, Any]], finish: str | None, error: str = ""
) -> dict:
    errors = [e["error"] for e in entries if e.get("error")]
    return {
        "index": index,
        "text": text,
        "logs": "".join(e.get("logs") or "" for e in entries),
        "storage": [op for e in entries for op in e.get("storage") or []],
        "error": "\n".join([*errors, *([error] if error and error not in errors else [])]),
        "finish_reason": finish,
    }


def failed_run(message: str) -> dict[str, Any]:
    """A run object ending the run: fork 0 failed with `message` (AICI's error form in a stream)."""
    return {"object": "run", "forks": [_fork_json(0, "", [], "fail", message)]}


async def run_events(
    engine: EngineAPI, client: AiciClient, coord: Coordinator, req: RunRequest, *, raise_refusal: bool = False
) -> AsyncIterator[dict]:
    """The run's objects. With `raise_refusal` a run the engine does not admit (CapacityError,
    KVBudgetError, ... any EngineError) or whose request does not fit the runtime's channel
    (FrameError) raises from the first `__anext__`, before `initial-run`, leaving nothing
    behind; without it the refusal is a failed fork after `initial-run` (for callers whose
    response has already started)."""
    req_id = f"run-{uuid.uuid4()}"
    initial = {"object": "initial-run", "id": req_id, "created": int(time.time()), "model": engine.name}
    run = _Run(engine, coord, req)
    try:
        started = await _admit(run, client, req_id)
    except (EngineError, FrameError) as e:
        if raise_refusal:
            raise
        yield initial
        yield {**failed_run(f"{type(e).__name__}: {e}"), "usage": run.usage.json()}
        return
    if isinstance(started, dict):  # the controller failed to instantiate: AICI's failed fork
        yield initial
        yield {"object": "run", "forks": [started], "usage": run.usage.json()}
        return
    state, session, admitted, first = started
    try:  # from here the run holds a session and a sequence: released however it ends
        yield initial
        run.live = 1
        run.tasks.add(asyncio.create_task(_fork_task(run, 0, state, session, [], first, admitted)))
        while run.live:
            item = await run.queue.get()
            if item is None:
                run.live -= 1
                continue
            yield {"object": "run", "forks": [item], "usage": run.usage.json()}
    finally:
        for t in run.tasks:
            t.cancel()
        run.release_all()


async def _admit(
    run: _Run, client: AiciClient, req_id: str
) -> tuple[SeqState, str, tuple[AiciConstraint, RequestHandle], list[dict[str, Any]]] | dict[str, Any]:
    """Reserve the session, instantiate, admit the first request: (state, session, its
    constraint and handle, early entries), or the failed fork of a controller that did not
    instantiate. Raises the engine's refusal with nothing left behind."""
    engine, coord, req = run.engine, run.coord, run.req
    # the session first: a run refused at --max-sessions costs no controller in the runtime
    session = engine.create_session((), ttl_s=None)
    try:
        inst = await _instantiate(client, coord, req_id, req)
    except AiciError as e:
        engine.close_session(session)
        return _fork_json(0, "", [], "fail", str(e))
    except BaseException:
        engine.close_session(session)
        raise
    if inst.get("error"):
        engine.close_session(session)
        return _fork_json(0, "", [inst], "fail")
    prompt = list((inst.get("result") or {}).get("prompt") or [])
    tok = engine.tokenizer
    if not prompt:  # the engine needs one token to start from
        prompt = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_ids[0]]
    state = coord.new_seq(req_id)
    run.owned[state.seq_id] = session
    constraint = AiciConstraint(coord, state)
    try:
        handle = engine.generate(session, append=prompt, options=run.options(constraint, 0))
    except BaseException:
        # refused (the queue, the KV budget, the context): the session closes and the
        # Coordinator has the runtime drop the controller it instantiated
        run.release(state.seq_id)
        raise
    run.usage.ff += len(prompt)
    first = [inst] if inst.get("logs") or inst.get("storage") else []
    return state, session, (constraint, handle), first


async def _instantiate(
    client: AiciClient, coord: Coordinator, req_id: str, req: RunRequest
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    fut = await loop.run_in_executor(
        None,
        lambda: client.side_future(
            "instantiate",
            req_id=req_id,
            prompt=req.prompt,
            module_id=req.controller,
            module_arg=req.controller_arg,
        ),
    )
    # shielded: cancelling the wait must not cancel `fut`, or the reply arriving later would
    # find it cancelled and the runtime's controller would never be dropped
    try:
        reply = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), INSTANTIATE_TIMEOUT_S)
    except BaseException as e:
        # the run is gone (client left, server stopping, timeout) but the runtime may still
        # create the controller: once it has, the Coordinator has it dropped
        fut.add_done_callback(lambda f: _drop_if_instantiated(coord, req_id, f))
        if isinstance(e, TimeoutError):
            raise AiciError(
                f"the AICI runtime did not answer 'instantiate' within {INSTANTIATE_TIMEOUT_S:g} s"
            ) from None
        raise
    if reply.get("type") != "ok":
        raise AiciError(str(reply.get("error") or reply))
    return reply.get("data") or {}


def _drop_if_instantiated(coord: Coordinator, req_id: str, fut: Any) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return
    reply = fut.result()
    if reply.get("type") == "ok" and not (reply.get("data") or {}).get("error"):
        coord.drop_instance(req_id)


async def _fork_task(
    run: _Run,
    index: int,
    state: SeqState,
    session: str,
    append: list[int],
    early: list[dict[str, Any]],
    admitted: tuple[AiciConstraint, RequestHandle] | None = None,
) -> None:
    """One fork until it finishes; `admitted`: its constraint and first request, already admitted."""
    engine, coord = run.engine, run.coord
    constraint, handle = admitted if admitted is not None else (AiciConstraint(coord, state), None)
    generated = 0
    finish: str | None = None
    error = ""
    wait_s = SUSPEND_WAIT_S
    try:
        while finish is None:
            if handle is None:
                # cleared before the request exists, never after: the engine thread consults the
                # constraint as soon as the request is admitted, and an outcome it set ("wait",
                # "fork", "suspend") cleared here would turn the request's stop into the fork's
                # end (empty text, aici-stop; a fork's clones never started). The first request,
                # admitted in _admit before this task ran, comes with a fresh constraint.
                constraint.outcome = None
                handle = engine.generate(session, append=append, options=run.options(constraint, generated))
            append = []
            async for ev in stream_events(handle):
                text = ""
                if isinstance(ev, TokenEvent) and not ev.is_prefill:
                    generated += 1
                    wait_s = SUSPEND_WAIT_S
                    text = "" if ev.token_id in engine.eos_ids else ev.text or ""
                elif isinstance(ev, BacktrackEvent):
                    generated -= ev.count
                    text = BACKTRACK_MARK * ev.count
                run.usage.sampled += constraint.sampled
                run.usage.ff += constraint.forced
                constraint.sampled = constraint.forced = 0
                if isinstance(ev, FinishEvent):
                    out = constraint.outcome
                    if out is None:
                        finish = "aici-stop" if ev.reason in ("eos", "stop") else ev.reason
                        error = ev.error or ""
                    elif out.kind == "fork":
                        _spawn_clones(run, session, out)
                        append = list(out.ff_tokens)
                    elif out.kind in ("suspend", "wait"):
                        await asyncio.sleep(wait_s)
                        wait_s = min(2 * wait_s, MAX_SUSPEND_WAIT_S)
                    elif out.kind == "length":  # steps_limit
                        finish = "length"
                    else:
                        finish = "aici-stop" if out.kind == "stop" else "fail"
                        error = out.error
                    break
                entries = coord.drain_entries(state.seq_id)
                if text or entries or early:
                    await run.queue.put(_fork_json(index, text, early + entries, None))
                    early = []
            handle = None
    except EngineError as e:
        finish, error = "fail", f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # report, never hang the stream
        finish, error = "fail", f"internal error: {type(e).__name__}: {e}"
    finally:
        entries = coord.drain_entries(state.seq_id)
        run.release(state.seq_id)
        if finish is not None:
            await run.queue.put(_fork_json(index, "", early + entries, finish, error))
        await run.queue.put(None)


def _spawn_clones(run: _Run, parent_session: str, out: SeqOutcome) -> None:
    """A task per clone the controller forked, each on a fork of the parent's session. A fork
    refused (--max-sessions) fails the parent with the engine's message; the clones not
    started are freed, or they would hold their results and stall every later round."""
    for n, clone_id in enumerate(out.clone_ids):
        try:
            child = run.engine.fork_session(parent_session)
        except BaseException:
            for not_started in out.clone_ids[n:]:
                run.coord.free(not_started)
            raise
        run.owned[clone_id] = child
        index, run.next_index = run.next_index, run.next_index + 1
        run.live += 1
        state = run.coord.seqs[clone_id]
        run.tasks.add(asyncio.create_task(_fork_task(run, index, state, child, list(out.ff_tokens), [])))
