"""LMTP streams: engine events in, TOKEN records out. One type per kind of stream.

LMTP puts a stream's finish_reason on its last TOKEN record. A GENERATE stream reads it from
the engine (the token that ends generation carries its finish reason); a SCORE stream's last
record is the last scored position. Either last record is held back until the FinishEvent
arrives (the engine emits both in the same step), so that when a client sees the end, the
stream's engine session is already released; every other record goes out at once, so
streaming latency is one engine step. A BUFFER stream sends no TOKEN records: it only fills
an engine session.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tokenwire.engine.request import FinishEvent, RequestHandle, TokenEvent
from tokenwire.model.tokenizer import IncrementalDecoder
from tokenwire.protocols.lmtp.codec import finite
from tokenwire.protocols.lmtp.messages import StreamId

# engine finish reason -> LMTP finish_reason (LMQL reports "stop" for EOS)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}

Record = dict[str, Any]


@dataclass(eq=False)
class Stream:
    """What every stream has: its engine request and the extensions' state."""

    stream_id: StreamId
    fingerprint: str = ""  # the request, canonical (retry extension: same id + same request = retry)
    handle: RequestHandle | None = None
    session: str | None = None  # an engine session this stream owns (a fork of a buffer)
    save_as: str | None = None  # buffer name the session becomes when the stream succeeds
    keep: bool = False  # ... a kept buffer, outliving the connection (extensions.KeptBuffers)
    decoder: IncrementalDecoder | None = None  # text extension
    sent: list[Record] | None = None  # records sent so far (retry extension: replay)
    finished: bool = False
    started: bool = False  # got its first engine event
    queue_position: int | None = None  # last one announced (system extension)

    def on_token(self, event: TokenEvent) -> list[Record]:
        self.started = True
        return []

    def on_finish(self, event: FinishEvent) -> tuple[list[Record], str | None]:
        """Records that end the stream, and an error message when it failed."""
        self.finished = True
        return [], None if event.reason == "length" else (event.error or event.reason)

    def take_held(self) -> list[Record]:
        """Records kept back for the end (sent as they are when the server shuts down)."""
        return []


def _failure(event: FinishEvent) -> str:
    return event.error or ("cancelled" if event.reason == "cancelled" else "generation failed")


@dataclass(eq=False)
class _HoldsLast(Stream):
    held: Record | None = None  # the last record, until the FinishEvent

    def take_held(self) -> list[Record]:
        held, self.held = self.held, None
        return [held] if held is not None else []

    def _out(self, record: Record, last: bool) -> list[Record]:
        out = self.take_held()
        if last:
            self.held = record
        else:
            out.append(record)
        return out

    def _end(self, event: FinishEvent, reason: str) -> tuple[list[Record], str | None]:
        self.finished = True
        held = self.take_held()
        if event.reason not in FINISH_REASONS:
            return held, _failure(event)
        if not held:  # e.g. a constraint's stop, after the last token went out: never leave it open
            return [], f"stream ended ({event.reason}) after its last token was sent"
        held[0]["finish_reason"] = reason
        if self.decoder is not None:
            held[0]["text"] += self.decoder.flush()
        return held, None


@dataclass(eq=False)
class GenerateStream(_HoldsLast):
    def on_token(self, event: TokenEvent) -> list[Record]:
        self.started = True
        token = event.token_id
        logprob = 0.0 if event.logprob is None else finite(event.logprob)
        top: dict[str, float | None] = {str(token): logprob}
        for alt, lp in event.top_logprobs or ():
            if lp != float("-inf"):
                top.setdefault(str(alt), finite(lp))
        record: Record = {
            "token": token,
            "stream_id": self.stream_id,
            "logprob": logprob,
            "finish_reason": None,
            "top_logprobs": top,
        }
        if self.decoder is not None:
            record["text"] = self.decoder.feed(token)
        return self._out(record, last=event.finish_reason is not None)

    def on_finish(self, event: FinishEvent) -> tuple[list[Record], str | None]:
        return self._end(event, FINISH_REASONS.get(event.reason, ""))


@dataclass(eq=False)
class ScoreStream(_HoldsLast):
    score_start: int = 0  # the scored positions [score_start, score_end)
    score_end: int = 0

    def on_token(self, event: TokenEvent) -> list[Record]:
        self.started = True
        record: Record = {
            "token": event.token_id,
            "stream_id": self.stream_id,
            "logprob": 0.0 if event.logprob is None else finite(event.logprob),
            "finish_reason": None,
        }
        if self.decoder is not None:
            record["text"] = self.decoder.feed(event.token_id)
        return self._out(record, last=event.position == self.score_end - 1)

    def on_finish(self, event: FinishEvent) -> tuple[list[Record], str | None]:
        return self._end(event, "stop")  # as LMQL's server ends every SCORE stream


@dataclass(eq=False)
class BufferStream(Stream):
    """BUFFER: computes a named buffer's tokens; answered with a MSG, not TOKEN records."""

    buffer_name: str = ""
