"""The sans-IO LMTP core: one object per client connection.

Transports hand it client frames (`feed`) and engine events (`on_events`, delivered through the
`watch` hook they supply) and take the frames it has ready (`take_frames`). It never touches a
socket or an event loop; it calls the thread-safe, non-blocking Engine methods directly.
Records produced together (one engine step's tokens of every stream) leave as one frame.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from tokenwire.engine.errors import EngineError
from tokenwire.engine.request import (
    BacktrackEvent,
    Event,
    FinishEvent,
    GenerateOptions,
    Origin,
    RequestHandle,
)
from tokenwire.protocols.lmtp import info
from tokenwire.protocols.lmtp.codec import FrameError, decode_frame, encode_outbox
from tokenwire.protocols.lmtp.extensions import Buffers, KeptBuffers, ReplayLog
from tokenwire.protocols.lmtp.messages import (
    EXTENSIONS,
    BufferRef,
    PromptItem,
    RequestError,
    StreamId,
    parse_buffer,
    parse_cancel,
    parse_drop,
    parse_generate,
    parse_hello,
    parse_model_info,
    parse_score,
    stream_id_of,
)
from tokenwire.protocols.lmtp.streams import BufferStream, GenerateStream, ScoreStream, Stream

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.lmtp")
Watch = Callable[[RequestHandle, Stream], None]
_EXT_MESSAGES = {"BUFFER": "buffers", "DROP": "buffers", "CANCEL": "retry"}
_STREAM_MESSAGES = ("GENERATE", "SCORE")  # their errors are TOKEN records: they end a stream
# A frame's byte budget, derived from what the model can take: a prompt (plus a SCORE's scored
# part) fits in --max-model-len tokens, a logit_bias has at most one entry per vocabulary id.
# Checked before the JSON is parsed: a frame of 10^7 token ids is refused unread instead of
# becoming lists of 10^7 Python ints (issue 29: RSS rose ~110 MiB and stayed up).
FRAME_BYTES_PER_TOKEN = 64  # JSON bytes one prompt token may take (a long text token, escaped)
FRAME_BYTES_PER_VOCAB_ID = 32  # one logit_bias entry: `"123456": -100.0, `
FRAME_BYTES_BASE = 64 * 1024  # every other field


def frame_budget(engine: EngineAPI) -> int:
    """The most bytes a client frame needs for this model (a transport may cap messages at it)."""
    return (
        FRAME_BYTES_BASE
        + FRAME_BYTES_PER_TOKEN * engine.max_model_len
        + FRAME_BYTES_PER_VOCAB_ID * engine.vocab_size
    )


_STREAM_ID = re.compile(r'"stream_id"\s*:\s*(-?\d{1,18}(?![\d.eE])|"(?:[^"\\]|\\.){0,256}")')


def _stream_id_in(text: str) -> StreamId | None:
    """The stream_id of a frame whose JSON is not parsed, when it can be read: the first match
    in its head, else the last in its tail (clients that put the id after a long prompt, as
    ours does, would otherwise get an error record on no stream and wait forever)."""
    match = _STREAM_ID.search(text[:4096]) or next(reversed(list(_STREAM_ID.finditer(text[-4096:]))), None)
    if match is None:
        return None
    try:
        sid = json.loads(match.group(1))
    except ValueError:
        return None
    if isinstance(sid, str) and not sid.isascii():
        try:
            sid.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate: the error record echoing it could not be sent
            return None
    return sid if isinstance(sid, int | str) else None


class LmtpConnection:
    def __init__(
        self,
        engine: EngineAPI | None,
        watch: Watch,
        *,
        aliases: Iterable[str] = (),
        replay_limit: int = 256,
        peer: str | None = None,
        max_streams: int | None = None,
        owner: str = "",
        kept: KeptBuffers | None = None,
    ) -> None:
        """`owner`: the digest of the token the client presented; `kept`: the server's buffers
        kept past their connections (None: the connection's own only)."""
        self.engine = engine
        self.max_streams = max_streams  # --max-streams-per-connection (None: no cap)
        self.peer = peer  # the client's address, for the access log
        self._watch = watch
        self._aliases = set(aliases)
        self.enabled: set[str] = set()
        self.streams: dict[StreamId, Stream] = {}  # live streams by stream_id
        self.buffers = Buffers(owner, kept)
        self.replay = ReplayLog(replay_limit)
        self._out: list[tuple[str, dict[str, Any]]] = []
        self._parked: list[str] = []  # frames that arrived before the engine was ready
        self.closed = False

    # ------------------------------------------------------------------ transport API
    def feed(self, text: str) -> None:
        """Handle one client frame."""
        if self.closed or self._oversized(text):
            return
        try:
            kind, payload = decode_frame(text)
        except FrameError as exc:
            # the stream it was meant for still gets its answer when its id can be read
            # (reliability-findings: a GENERATE with a 5,000-digit number waited forever)
            sid = _stream_id_in(text)
            stream_kind = sid is not None and text.lstrip().startswith(_STREAM_MESSAGES)
            self._error("TOKEN" if stream_kind else "MSG", sid, str(exc), "bad_frame")
            return
        if self.engine is None and not (kind == "HELLO" and _asks_system(payload)):
            self._parked.append(text)
            return
        handler = self._handlers().get(kind)
        ext = _EXT_MESSAGES.get(kind)
        out_kind = "TOKEN" if kind in _STREAM_MESSAGES else "MSG"
        if handler is None or (ext is not None and ext not in self.enabled):
            hint = f" (extension '{ext}' not negotiated: send HELLO first)" if ext else ""
            self._error(
                out_kind, stream_id_of(payload), f"unknown message type {kind!r}{hint}", "unknown_type"
            )
            return
        try:
            handler(payload)
        except RequestError as exc:
            sid = exc.stream_id if exc.stream_id is not None else stream_id_of(payload)
            self._error(out_kind, sid, exc.message, exc.code, exc.retryable)
        except EngineError as exc:
            code, retryable = info.engine_error_code(exc)
            self._error(out_kind, stream_id_of(payload), str(exc), code, retryable)

    def _oversized(self, text: str) -> bool:
        """Refuses (with the context error record) a frame larger than any request the model
        can take; True when refused."""
        engine = self.engine
        if engine is None:
            return False
        budget = frame_budget(engine)
        if len(text) <= budget:  # characters <= UTF-8 bytes: never refuses a frame within it
            return False
        kind = text[:64].strip().partition(" ")[0]
        sid = _stream_id_in(text)
        message = (
            f"{kind[:40]} frame of {len(text)} characters is larger than any request this model "
            f"can take (--max-model-len {engine.max_model_len}: at most {budget}); refused unread"
        )
        self._error("TOKEN" if kind in _STREAM_MESSAGES else "MSG", sid, message, "context_overflow")
        return True

    def on_events(self, batch: Iterable[tuple[Stream, Event]]) -> None:
        for stream, event in batch:
            self.on_event(stream, event)

    def on_event(self, stream: Stream, event: Event) -> None:
        if stream.finished or self.closed:
            return
        if isinstance(event, FinishEvent):
            records, error = stream.on_finish(event)
            for record in records:
                self._token(stream, record)
            self._end(stream, event, error)
        elif isinstance(event, BacktrackEvent):
            log.warning("LMTP stream %r: unexpected backtrack event", stream.stream_id)
        else:
            for record in stream.on_token(event):
                self._token(stream, record)

    def take_frames(self) -> list[str]:
        """The frames ready to send, in order."""
        out, self._out = self._out, []
        return encode_outbox(out)

    @property
    def has_output(self) -> bool:
        return bool(self._out)

    def set_engine(self, engine: EngineAPI) -> None:
        """The model finished loading: announce it and handle the frames that waited for it."""
        self.engine = engine
        if "system" in self.enabled:
            self._system(None, "ready", model=engine.name)
        parked, self._parked = self._parked, []
        for text in parked:
            self.feed(text)

    def tick(self) -> None:
        """Periodic (system extension): announce queue positions of streams not yet running."""
        if "system" not in self.enabled or self.engine is None:
            return
        for stream in list(self.streams.values()):
            if stream.started or stream.handle is None:
                continue
            position = stream.handle.queue_position()
            if position != stream.queue_position:
                if position is not None:
                    self._system(stream.stream_id, "queued", position=position)
                elif stream.queue_position is not None:
                    self._system(stream.stream_id, "started")
                stream.queue_position = position

    def fail_parked(self, message: str) -> None:
        """The engine never came: answer every frame that waited for it with an error record."""
        parked, self._parked = self._parked, []
        for text in parked:
            try:
                kind, payload = decode_frame(text)
            except FrameError:
                continue
            out_kind = "TOKEN" if kind in _STREAM_MESSAGES else "MSG"
            self._error(out_kind, stream_id_of(payload), message, "shutdown", True)

    def shutdown(self, message: str = "server shutting down") -> None:
        """The server stops: tell the client, end every live stream with an error, release all."""
        if self.closed:
            return
        if "system" in self.enabled:
            self._system(None, "shutdown", message=message)
        for stream in list(self.streams.values()):
            for record in stream.take_held():
                self._token(stream, record)
            kind = "MSG" if isinstance(stream, BufferStream) else "TOKEN"
            self._error(kind, stream.stream_id, message, "shutdown", True, stream)
        self.close()

    def close(self) -> None:
        """The client is gone: cancel its streams and free its sessions. Sends nothing."""
        if self.closed:
            return
        self.closed = True
        streams, self.streams = list(self.streams.values()), {}
        for stream in streams:
            stream.finished = True
            if stream.handle is not None:
                stream.handle.cancel()
        if self.engine is not None:
            for stream in streams:
                if stream.session is not None:
                    self.engine.close_session(stream.session)
        self.buffers.close(self.engine)
        self.replay.clear()

    # ------------------------------------------------------------------ the seed's messages
    def _handlers(self) -> dict[str, Callable[[Any], None]]:
        return {
            "GENERATE": self._generate,
            "SCORE": self._score,
            "MODEL_INFO": self._model_info,
            "HELLO": self._hello,
            "BUFFER": self._buffer_put,
            "DROP": self._buffer_drop,
            "CANCEL": self._cancel,
        }

    def _model_info(self, payload: Any) -> None:
        msg = parse_model_info(payload, self.enabled)
        engine = self._check_model(msg.model)
        self._msg({"stream_id": msg.stream_id, "model_info": info.model_info(engine, msg.data)})

    def _generate(self, payload: Any) -> None:
        msg = parse_generate(payload, self.enabled)
        self._check_model(msg.model)
        fingerprint = _fingerprint("GENERATE", payload)
        if self._resumed(msg.stream_id, fingerprint, msg.resume_from):
            return
        tokens = self._expand(msg.prompt, msg.prompt_is_text, starts=msg.buffer is None)
        stream = GenerateStream(msg.stream_id, fingerprint, save_as=msg.save_as, keep=msg.keep)
        persistent = msg.save_as is not None
        self._start(stream, msg.buffer, tokens, msg.options(), persistent=persistent, generates=True)

    def _score(self, payload: Any) -> None:
        msg = parse_score(payload, self.enabled)
        engine = self._check_model(msg.model)
        fingerprint = _fingerprint("SCORE", payload)
        if self._resumed(msg.stream_id, fingerprint, msg.resume_from):
            return
        prompt = self._expand(msg.prompt, msg.prompt_is_text, starts=msg.buffer is None)
        scored = self._expand([msg.scored], False, False) if isinstance(msg.scored, str) else msg.scored
        base = len(self.buffers.tokens(engine, msg.buffer)) if msg.buffer else 0
        start = base + len(prompt)
        stream = ScoreStream(msg.stream_id, fingerprint, score_start=start, score_end=start + len(scored))
        options = msg.options(stream.score_start, stream.score_end)
        self._start(stream, msg.buffer, prompt + list(scored), options, persistent=False, generates=False)

    # ------------------------------------------------------------------ extensions
    def _hello(self, payload: Any) -> None:
        msg = parse_hello(payload)
        self.enabled = set(msg.extensions) & set(EXTENSIONS)
        self._msg({"stream_id": msg.stream_id, "hello": info.hello(self.engine, self.enabled)})
        if "system" in self.enabled:
            engine = self.engine
            self._system(None, "ready" if engine else "loading", model=engine.name if engine else None)

    def _buffer_put(self, payload: Any) -> None:
        msg = parse_buffer(payload, self.enabled)
        engine = self._engine()
        self._resumed(msg.stream_id, "", 0)  # only refuses a live stream_id
        tokens = self._expand(msg.prompt, msg.prompt_is_text, starts=msg.base is None)
        if tokens:  # computed now, so every later use finds the KV ready
            stream = BufferStream(msg.stream_id, save_as=msg.name, keep=msg.keep, buffer_name=msg.name)
            self._start(stream, msg.base, tokens, GenerateOptions(max_tokens=0, priority=0), True, False)
            return
        base = self.buffers.session(engine, msg.base) if msg.base is not None else None
        session = engine.fork_session(base) if base is not None else engine.create_session(ttl_s=None)
        self.buffers.put(engine, msg.name, session, msg.keep)
        length = len(engine.session_tokens(session))
        self._msg({"stream_id": msg.stream_id, "buffer": {"name": msg.name, "length": length}})

    def _buffer_drop(self, payload: Any) -> None:
        msg = parse_drop(payload, self.enabled)
        if not self.buffers.drop(self._engine(), msg.name):
            raise RequestError(f"DROP: unknown buffer {msg.name!r}", "unknown_buffer", msg.stream_id)
        self._msg({"stream_id": msg.stream_id, "buffer": {"name": msg.name, "dropped": True}})

    def _cancel(self, payload: Any) -> None:
        msg = parse_cancel(payload, self.enabled)
        stream = self.streams.get(msg.stream_id)
        if stream is not None and stream.handle is not None:
            stream.handle.cancel()  # its FinishEvent ends the stream with a "cancelled" error record

    def _resumed(self, sid: StreamId, fingerprint: str, resume_from: int) -> bool:
        """Retry extension: a resent request replays the stream's records from `resume_from` on
        (a stream still running then goes on streaming). Otherwise a live stream_id is refused."""
        retry = "retry" in self.enabled and bool(fingerprint)
        live = self.streams.get(sid)
        if live is not None and not (retry and live.fingerprint == fingerprint):
            raise RequestError(
                f"stream_id {sid!r} is already in use by a live stream", "duplicate_stream", sid
            )
        stream = live or (self.replay.find(sid, fingerprint) if retry else None)
        if stream is None:
            return False
        self._out.extend(("TOKEN", record) for record in ReplayLog.records(stream, resume_from))
        return True

    # ------------------------------------------------------------------ streams
    def _start(
        self,
        stream: Stream,
        buffer: str | None,
        tokens: list[int],
        options: GenerateOptions,
        persistent: bool,
        generates: bool,
    ) -> None:
        engine = self._engine()
        if self.max_streams is not None and len(self.streams) >= self.max_streams:
            raise RequestError(
                f"too many open streams on this connection: {len(self.streams)} "
                f"(--max-streams-per-connection {self.max_streams}); wait for one to end",
                "too_many_streams",
                stream.stream_id,
                retryable=True,
            )
        records = not isinstance(stream, BufferStream)
        if "text" in self.enabled and records:
            # text is for reading: no end-of-turn markup (the token ids stay exact)
            stream.decoder = engine.tokenizer.incremental_decoder(skip_special_tokens=True)
        if "retry" in self.enabled and records:
            stream.sent = []
        base = self.buffers.session(engine, buffer) if buffer is not None else None
        engine.check(base, tokens, options, needs_room=generates)  # before a session is forked or made
        options.origin = Origin("lmtp", type(stream).__name__.removesuffix("Stream").upper(), self.peer)
        if base is not None:
            stream.session = engine.fork_session(base)
        elif persistent:
            stream.session = engine.create_session(ttl_s=None)
        try:
            stream.handle = engine.generate(stream.session, tokens, options)
        except BaseException:
            if stream.session is not None:
                engine.close_session(stream.session)
            raise
        self.replay.forget(stream.stream_id)
        self.streams[stream.stream_id] = stream
        self._watch(stream.handle, stream)

    def _end(self, stream: Stream, event: FinishEvent, error: str | None) -> None:
        if self.streams.get(stream.stream_id) is stream:
            del self.streams[stream.stream_id]
        engine = self._engine()
        if isinstance(stream, BufferStream):
            if error is None:
                record = {"name": stream.buffer_name, "length": event.prompt_tokens}
                self._msg({"stream_id": stream.stream_id, "buffer": record})
            else:
                self._error("MSG", stream.stream_id, f"BUFFER failed: {error}", "engine_error", True)
        elif error is not None:
            code = "cancelled" if event.reason == "cancelled" else "engine_error"
            if event.unavailable:  # --replicas: the replica running it died
                code = "replica_lost"
            self._error("TOKEN", stream.stream_id, error, code, code != "cancelled", stream)
        if stream.session is not None:
            if error is None and stream.save_as is not None:
                self.buffers.put(engine, stream.save_as, stream.session, stream.keep)
            else:
                engine.close_session(stream.session)
        if stream.sent is not None:
            self.replay.add(stream)

    # ------------------------------------------------------------------ helpers
    def _engine(self) -> EngineAPI:
        assert self.engine is not None, "engine not ready"
        return self.engine

    def _check_model(self, model: str) -> EngineAPI:
        engine = self._engine()
        if model != engine.name and model not in self._aliases:
            raise RequestError(
                f"unknown model {model!r}: this server serves {engine.name!r}", "unknown_model"
            )
        return engine

    def _expand(self, items: list[PromptItem], is_text: bool, starts: bool) -> list[int]:
        """Token ids of a prompt: ids as they are, text encoded (the tokenizer's special tokens
        only for a whole-string prompt that starts the sequence), buffers by their tokens."""
        engine = self._engine()
        tokens: list[int] = []
        for item in items:
            if isinstance(item, int):
                tokens.append(item)
            elif isinstance(item, str):
                tokens.extend(engine.tokenizer.encode(item, add_special_tokens=is_text and starts))
            elif isinstance(item, BufferRef):
                tokens.extend(self.buffers.tokens(engine, item.name))
        return tokens

    def _token(self, stream: Stream, record: dict[str, Any]) -> None:
        if stream.sent is not None:  # retry extension: numbered and kept for replay
            record["seq"] = len(stream.sent)
            stream.sent.append(record)
        self._out.append(("TOKEN", record))

    def _msg(self, record: dict[str, Any]) -> None:
        self._out.append(("MSG", record))

    def _system(self, sid: StreamId | None, event: str, **fields: Any) -> None:
        self._msg({"stream_id": sid, "system": {"event": event, **fields}})

    def _error(
        self,
        kind: str,
        sid: StreamId | None,
        message: str,
        code: str,
        retryable: bool = False,
        stream: Stream | None = None,
    ) -> None:
        """An error record: the seed's {stream_id, error}; with the retry extension also a code,
        whether a retry may succeed, and (TOKEN) finish_reason "error"."""
        record: dict[str, Any] = {"stream_id": sid, "error": message}
        if "retry" in self.enabled:
            record.update(code=code, retryable=retryable)
            if kind == "TOKEN":
                record["finish_reason"] = "error"
        if kind == "TOKEN" and stream is not None:
            self._token(stream, record)
        else:
            self._out.append((kind, record))


def _asks_system(payload: Any) -> bool:
    return isinstance(payload, dict) and "system" in (payload.get("extensions") or ())


def _fingerprint(kind: str, payload: dict[str, Any]) -> str:
    body = {k: v for k, v in payload.items() if k != "resume_from"}
    return kind + " " + json.dumps(body, sort_keys=True, default=str)
