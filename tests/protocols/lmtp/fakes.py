"""A stand-in engine for the sans-IO core's unit tests: it records calls, events are fed by hand."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.admission import Limits, check_request
from tokenwire.engine.errors import SessionNotFoundError
from tokenwire.engine.request import FinishEvent, FinishReason, GenerateOptions, TokenEvent
from tokenwire.protocols.lmtp.core import LmtpConnection
from tokenwire.protocols.lmtp.streams import Stream


class CharTokenizer:
    """Token id = one byte of UTF-8; enough to exercise text mode with split characters."""

    vocab_size = 300
    eos_token_ids = (2,)
    bos_token_id = 1
    special_token_ids = frozenset({1, 2})
    has_chat_template = False

    class hf:
        name_or_path = "fake/chars"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return ([1] if add_special_tokens else []) + list(text.encode())

    def incremental_decoder(self, skip_special_tokens: bool = False) -> Any:
        import codecs

        class Decoder:
            def __init__(self) -> None:
                self.utf8 = codecs.getincrementaldecoder("utf-8")("replace")

            def feed(self, token: int) -> str:
                return self.utf8.decode(bytes([token]) if token < 256 else b"")

            def flush(self) -> str:
                return self.utf8.decode(b"", final=True)

        return Decoder()


@dataclass
class FakeHandle:
    session: str | None
    append: list[int]
    options: GenerateOptions
    cancelled: bool = False
    queue: dict[int, int] = field(default_factory=dict)  # the engine's: id(handle) -> position

    def cancel(self) -> None:
        self.cancelled = True

    def queue_position(self) -> int | None:
        return self.queue.get(id(self))


@dataclass
class FakeEngine:
    name: str = "fake-model"
    vocab_size: int = 300
    logits_size: int = 300
    max_model_len: int = 64
    eos_ids: set[int] = field(default_factory=lambda: {2})
    tokenizer: CharTokenizer = field(default_factory=CharTokenizer)
    sessions: dict[str, list[int]] = field(default_factory=dict)
    handles: list[FakeHandle] = field(default_factory=list)
    queue: dict[int, int] = field(default_factory=dict)  # id(handle) -> queue position
    checked: list[int] = field(default_factory=list)  # prompt lengths admission saw
    _ids: Any = field(default_factory=lambda: itertools.count(1))

    def check(
        self,
        session: str | None,
        append: list[int],
        options: GenerateOptions | None = None,
        *,
        needs_room: bool = False,
    ) -> int:
        """The real admission rules over this fake's limits."""
        prompt_len = len(self.session_tokens(session) if session is not None else ()) + len(append)
        limits = Limits(self.vocab_size, self.max_model_len, kv_blocks=1000, kv_block_size=16)
        check_request(limits, prompt_len, append, options or GenerateOptions(), needs_room=needs_room)
        self.checked.append(prompt_len)
        return prompt_len

    def generate(self, session: str | None, append: list[int], options: GenerateOptions) -> FakeHandle:
        self.check(session, append, options)
        if session is not None:
            self.sessions[session].extend(append)
        handle = FakeHandle(session, list(append), options, queue=self.queue)
        self.handles.append(handle)
        return handle

    def create_session(self, tokens: list[int] = (), ttl_s: float | None = -1.0) -> str:  # type: ignore[assignment]
        sid = f"s{next(self._ids)}"
        self.sessions[sid] = list(tokens)
        return sid

    def fork_session(self, sid: str, at: int | None = None) -> str:
        child = self.create_session(self.session_tokens(sid))
        return child

    def close_session(self, sid: str) -> bool:
        return self.sessions.pop(sid, None) is not None

    def session_tokens(self, sid: str) -> list[int]:
        if sid not in self.sessions:
            raise SessionNotFoundError(sid)
        return list(self.sessions[sid])

    def has_session(self, sid: str) -> bool:
        return sid in self.sessions


class Harness:
    """An LmtpConnection over a FakeEngine; `watched` holds (handle, stream) in start order."""

    def __init__(self, engine: FakeEngine | None = None, *, ready: bool = True) -> None:
        self.engine = engine or FakeEngine()
        self.watched: list[tuple[FakeHandle, Stream]] = []
        self.conn = LmtpConnection(
            self.engine if ready else None,  # type: ignore[arg-type]
            lambda h, s: self.watched.append((h, s)),  # type: ignore[arg-type,misc]
        )

    def send(self, kind: str, payload: Any) -> list[tuple[str, Any]]:
        import json

        self.conn.feed(f"{kind} {json.dumps(payload)}")
        return self.frames()

    def frames(self) -> list[tuple[str, Any]]:
        import json

        out = []
        for frame in self.conn.take_frames():
            kind, _, body = frame.partition(" ")
            out.append((kind, json.loads(body)))
        return out

    def stream(self, index: int = -1) -> tuple[FakeHandle, Stream]:
        return self.watched[index]

    def token(
        self,
        stream: Stream,
        token: int,
        position: int,
        logprob: float = -0.5,
        top: list[tuple[int, float]] | None = None,
        prefill: bool = False,
        finish: FinishReason | None = None,
    ) -> None:
        """`finish`: the token ends generation, as the engine marks it (eos, stop, length)."""
        event = TokenEvent(token, position, prefill, logprob, top, finish_reason=finish)
        self.conn.on_event(stream, event)

    def finish(
        self,
        stream: Stream,
        reason: FinishReason,
        prompt: int = 0,
        completion: int = 0,
        error: str | None = None,
    ) -> None:
        self.conn.on_event(stream, FinishEvent(reason, prompt, completion, error=error))


def records(frames: list[tuple[str, Any]], kind: str = "TOKEN") -> list[dict[str, Any]]:
    return [r for k, body in frames if k == kind for r in body]
