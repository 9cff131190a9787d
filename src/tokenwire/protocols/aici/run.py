"""One POST /v1/run: instantiate the controller, generate every fork, stream AICI run objects.

Each fork is one engine request on its own session, constrained by an AiciConstraint. When
the controller forks (num_forks > 1) the request stops, the session is forked (KV shared) once
per clone and every fork resumes; a suspended fork waits a moment and resumes.
"""

from __future__ import annotations

import asyncio
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
    SamplingParams,
    TokenEvent,
)
from tokenwire.protocols.aici.client import AiciClient, AiciError
from tokenwire.protocols.aici.engine_bridge import AiciConstraint, Coordinator, SeqState

if TYPE_CHECKING:
    from tokenwire.engine.engine import Engine

BACKTRACK_MARK = "↩"
SUSPEND_WAIT_S = 0.002

__all__ = ["RunRequest", "failed_run", "run_events"]


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
        import json

        arg = arg if isinstance(arg, str) else json.dumps(arg)
        prompt = body.get("prompt") or ""
        if not isinstance(prompt, (str, list)):
            raise ValueError("'prompt' must be text or a list of token ids")
        max_tokens = body.get("max_tokens", 256)
        if not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1:
            raise ValueError("'max_tokens' must be a positive integer")
        temperature = body.get("temperature", 0.0)
        if not isinstance(temperature, (int, float)) or temperature < 0:
            raise ValueError("'temperature' must be a non-negative number")
        seed = body.get("seed")
        if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
            raise ValueError("'seed' must be an integer")
        return cls(ctrl, arg, prompt, max_tokens, float(temperature), float(body.get("top_p", 1.0)), seed)


@dataclass
class _Usage:
    sampled: int = 0
    ff: int = 0

    def json(self) -> dict[str, int]:
        return {"sampled_tokens": self.sampled, "ff_tokens": self.ff, "cost": 2 * self.sampled + self.ff}


@dataclass
class _Run:
    engine: Engine
    coord: Coordinator
    req: RunRequest
    usage: _Usage = field(default_factory=_Usage)
    queue: asyncio.Queue[dict[str, Any] | None] = field(default_factory=asyncio.Queue)
    next_index: int = 1
    live: int = 0


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
    engine: Engine, client: AiciClient, coord: Coordinator, req: RunRequest
) -> AsyncIterator[dict]:
    req_id = f"run-{uuid.uuid4()}"
    yield {"object": "initial-run", "id": req_id, "created": int(time.time()), "model": engine.name}
    run = _Run(engine, coord, req)
    try:
        inst = await client.side_async(
            "instantiate",
            req_id=req_id,
            prompt=req.prompt,
            module_id=req.controller,
            module_arg=req.controller_arg,
        )
    except AiciError as e:
        yield {"object": "run", "forks": [_fork_json(0, "", [], "fail", str(e))], "usage": run.usage.json()}
        return
    if inst.get("error"):
        yield {"object": "run", "forks": [_fork_json(0, "", [inst], "fail")], "usage": run.usage.json()}
        return
    prompt = list((inst.get("result") or {}).get("prompt") or [])
    tok = engine.tokenizer
    if not prompt:  # the engine needs one token to start from
        prompt = [tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_ids[0]]
    run.usage.ff += len(prompt)
    state = coord.new_seq(req_id)
    session = engine.create_session(prompt, ttl_s=None)
    first = [inst] if inst.get("logs") or inst.get("storage") else []
    run.live = 1
    task = asyncio.create_task(_fork_task(run, 0, state, session, [], first))
    tasks = {task}
    try:
        while run.live:
            item = await run.queue.get()
            if item is None:
                run.live -= 1
                continue
            if "spawn" in item:
                tasks.add(item["spawn"])
                continue
            yield {"object": "run", "forks": [item], "usage": run.usage.json()}
    finally:
        for t in tasks:
            t.cancel()


async def _fork_task(
    run: _Run, index: int, state: SeqState, session: str, append: list[int], early: list[dict[str, Any]]
) -> None:
    engine, coord, req = run.engine, run.coord, run.req
    constraint = AiciConstraint(coord, state)
    generated = 0
    finish: str | None = None
    error = ""
    try:
        while finish is None:
            sampling = SamplingParams(temperature=req.temperature, top_p=req.top_p, seed=req.seed)
            opts = GenerateOptions(
                max_tokens=max(1, req.max_tokens - generated),
                sampling=sampling,
                constraint=constraint,
                origin=Origin("aici", "run"),
            )
            constraint.outcome = None
            handle = engine.generate(session, append=append, options=opts)
            append = []
            async for ev in handle:
                text = ""
                if isinstance(ev, TokenEvent) and not ev.is_prefill:
                    generated += 1
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
                        for clone_id in out.clone_ids:
                            child = engine.fork_session(session)
                            i, run.next_index = run.next_index, run.next_index + 1
                            run.live += 1
                            t = asyncio.create_task(
                                _fork_task(run, i, coord.seqs[clone_id], child, list(out.ff_tokens), [])
                            )
                            await run.queue.put({"spawn": t})
                        append = list(out.ff_tokens)
                    elif out.kind in ("suspend", "wait"):
                        await asyncio.sleep(SUSPEND_WAIT_S)
                    else:
                        finish = "aici-stop" if out.kind == "stop" else "fail"
                        error = out.error
                    break
                entries = coord.drain_entries(state.seq_id)
                if text or entries or early:
                    await run.queue.put(_fork_json(index, text, early + entries, None))
                    early = []
    except EngineError as e:
        finish, error = "fail", f"{type(e).__name__}: {e}"
    except asyncio.CancelledError:
        raise
    except Exception as e:  # report, never hang the stream
        finish, error = "fail", f"internal error: {type(e).__name__}: {e}"
    finally:
        entries = coord.drain_entries(state.seq_id)
        coord.free(state.seq_id)
        engine.close_session(session)
        if finish is not None:
            await run.queue.put(_fork_json(index, "", early + entries, finish, error))
        await run.queue.put(None)
