"""One LMTP stream: engine events in, TOKEN records out.

LMTP puts a stream's finish_reason on its last TOKEN record, while the engine reports the end
in a FinishEvent after the last TokenEvent. A stream therefore holds back a record it knows to
be the last (EOS, a stop token, max_tokens, the context's end, the last scored position) until
the FinishEvent arrives (the engine emits both in the same step), and sends every other record
at once, so streaming latency is one engine step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.request import FinishEvent, RequestHandle, TokenEvent
from tokenwire.model.tokenizer import IncrementalDecoder
from tokenwire.protocols.lmtp.codec import finite
from tokenwire.protocols.lmtp.messages import StreamId

# engine finish reason -> LMTP finish_reason (LMQL reports "stop" for EOS)
FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length"}


@dataclass
class Stream:
    kind: str  # "generate", "score" or "buffer" (a BUFFER prefill)
    stream_id: StreamId
    fingerprint: str = ""  # the request, canonical (retry extension: same id + same request = retry)
    handle: RequestHandle | None = None
    session: str | None = None  # an engine session this stream owns (a fork of a buffer)
    save_as: str | None = None  # buffer name the session becomes when the stream succeeds
    decoder: IncrementalDecoder | None = None  # text extension
    sent: list[dict[str, Any]] | None = None  # records sent so far (retry extension: replay)
    held: dict[str, Any] | None = None
    finished: bool = False
    started: bool = False  # got its first engine event
    queue_position: int | None = None  # last one announced (system extension)
    buffer_name: str | None = None  # BUFFER: the buffer being filled
    # GENERATE: what makes a token the last one
    prompt_len: int = 0
    max_tokens: int = 0
    max_model_len: int = 0
    eos_ids: frozenset[int] = field(default_factory=frozenset)
    stop_ids: frozenset[int] = field(default_factory=frozenset)
    # SCORE: the scored positions [score_start, score_end)
    score_start: int = 0
    score_end: int = 0

    def on_token(self, event: TokenEvent) -> list[dict[str, Any]]:
        self.started = True
        if self.kind == "generate":
            record = self._generated(event)
            last = self._is_last_generated(event)
        elif self.kind == "score":
            record = {
                "token": event.token_id,
                "stream_id": self.stream_id,
                "logprob": 0.0 if event.logprob is None else finite(event.logprob),
                "finish_reason": None,
            }
            if self.decoder is not None:
                record["text"] = self.decoder.feed(event.token_id)
            last = event.position == self.score_end - 1
        else:
            return []
        out = [self.held] if self.held is not None else []
        self.held = None
        if last:
            self.held = record
        else:
            out.append(record)
        return out

    def _generated(self, event: TokenEvent) -> dict[str, Any]:
        token = event.token_id
        logprob = 0.0 if event.logprob is None else finite(event.logprob)
        top: dict[str, float | None] = {str(token): logprob}
        for alt, lp in event.top_logprobs or ():
            if lp != float("-inf"):
                top.setdefault(str(alt), finite(lp))
        record: dict[str, Any] = {
            "token": token,
            "stream_id": self.stream_id,
            "logprob": logprob,
            "finish_reason": None,
            "top_logprobs": top,
        }
        if self.decoder is not None:
            record["text"] = self.decoder.feed(token)
        return record

    def _is_last_generated(self, event: TokenEvent) -> bool:
        """Mirrors the engine's end-of-generation test (sampling_loop._append)."""
        token = event.token_id
        if token in self.eos_ids or token in self.stop_ids:
            return True
        generated = event.position - self.prompt_len + 1
        return generated >= self.max_tokens or event.position + 1 >= self.max_model_len

    def on_finish(self, event: FinishEvent) -> tuple[list[dict[str, Any]], str | None]:
        """Records that end the stream, and an error message when it failed."""
        self.finished = True
        out: list[dict[str, Any]] = []
        reason = FINISH_REASONS.get(event.reason)
        if reason is not None and self.kind == "score":
            reason = "stop"  # as LMQL's server ends every SCORE stream
        held, self.held = self.held, None
        if held is not None:
            if reason is not None:
                held["finish_reason"] = reason
                if self.decoder is not None:
                    held["text"] += self.decoder.flush()
            out.append(held)
        if self.kind == "buffer":
            return out, None if event.reason == "length" else (event.error or event.reason)
        if reason is None:
            return out, event.error or ("cancelled" if event.reason == "cancelled" else "generation failed")
        if held is None:  # cannot happen for the options the server sets; never leave a stream open
            return out, f"stream ended ({event.reason}) after its last token was sent"
        return out, None
