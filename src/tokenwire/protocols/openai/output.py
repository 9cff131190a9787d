"""One choice's output: engine events -> the text, logprobs and readouts OpenAI clients see.

The engine ends a generation with the token that completes a stop string and includes that
token; OpenAI's output ends before the stop string. So text that could still become a stop
string is held back while streaming (the engine's own StopStringMatcher says how much is safe),
and the final text is cut where the stop string begins. The EOS token ends the output without
appearing in it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tokenwire.engine.request import BacktrackEvent, Event, FinishEvent, TokenEvent
from tokenwire.engine.stop import StopStringMatcher
from tokenwire.model.tokenizer import Tokenizer

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


def token_text(tokenizer: Tokenizer, token_id: int) -> tuple[str, list[int]]:
    """A token as OpenAI's logprobs show it: its text (bytes that are not whole UTF-8 shown as
    \\xNN escapes) and its raw bytes."""
    raw = tokenizer.token_bytes(token_id)
    return raw.decode("utf-8", errors="backslashreplace"), list(raw)


@dataclass
class Delta:
    """What one batch of events adds to a choice (streaming)."""

    text: str = ""
    logprobs: list[Any] = field(default_factory=list)  # chat entries or (token, lp, top, offset)
    readouts: list[dict[str, Any]] = field(default_factory=list)


class ChoiceOutput:
    def __init__(
        self,
        index: int,
        tokenizer: Tokenizer,
        eos_ids: frozenset[int],
        *,
        stops: list[str],
        ignore_eos: bool,
        legacy_logprobs: bool,
        echo_from: int | None = None,
        echo_text: str = "",
    ) -> None:
        self.index = index
        self.tokenizer = tokenizer
        self.eos_ids = frozenset() if ignore_eos else eos_ids
        self.matcher = StopStringMatcher(stops) if stops else None
        self.legacy = legacy_logprobs
        self.echo_from = echo_from  # prompt positions >= this are echoed (completions)
        self.echo_text = echo_text  # the prompt as text, sent first
        self.echo_pending = bool(echo_text)
        self.generated = ""  # all generated text (stop string included until the finish)
        self.sent = 0  # characters of `generated` already released
        self.offset = 0  # legacy text_offset of the next token
        self.logprobs: list[Any] = []
        self.readouts: list[dict[str, Any]] = []
        self.token_ids: list[int] = []
        self.finish: FinishEvent | None = None
        self.cached_tokens = 0

    # ------------------------------------------------------------------ events
    def feed(self, event: Event) -> Delta:
        delta = Delta()
        if self.echo_pending:
            delta.text, self.echo_pending = self.echo_text, False
        if isinstance(event, TokenEvent):
            self._token(event, delta)
        elif isinstance(event, FinishEvent):
            self.finish = event
            end = len(self.generated)
            if self.matcher is not None and event.reason == "stop" and self.matcher.done:
                end = self.matcher.match_start or 0
            self.generated = self.generated[:end]
            delta.text += self.generated[self.sent :]
            self.sent = len(self.generated)
        elif isinstance(event, BacktrackEvent):  # no OpenAI constraint backtracks; keep text honest
            raise RuntimeError("unexpected backtrack in an OpenAI request")
        return delta

    def _token(self, event: TokenEvent, delta: Delta) -> None:
        if event.is_prefill:
            if self.echo_from is None or event.position < self.echo_from:
                return
            self._record(event, token_text(self.tokenizer, event.token_id)[0], delta)
            return
        self.token_ids.append(event.token_id)
        if event.token_id in self.eos_ids:
            return  # the end of the output, not part of it
        self._record(event, event.text, delta)
        self.generated += event.text
        if self.matcher is not None:
            self.matcher.feed(event.text)
            safe = min(self.matcher.safe_len, len(self.generated))
        else:
            safe = len(self.generated)
        if safe > self.sent:
            delta.text += self.generated[self.sent : safe]
            self.sent = safe

    def _record(self, event: TokenEvent, text: str, delta: Delta) -> None:
        if event.readout is not None:
            entry = {"position": event.position, "token": event.token_id, "values": event.readout.tolist()}
            self.readouts.append(entry)
            delta.readouts.append(entry)
        if event.logprob is None and not (self.legacy and event.is_prefill):
            return
        if self.legacy:
            tok = token_text(self.tokenizer, event.token_id)[0]
            top = (
                {token_text(self.tokenizer, t)[0]: lp for t, lp in event.top_logprobs}
                if event.top_logprobs is not None
                else None
            )
            entry: Any = (tok, event.logprob, top, self.offset)
            self.offset += len(text)
        else:
            tok, raw = token_text(self.tokenizer, event.token_id)
            entry = {
                "token": tok,
                "logprob": event.logprob,
                "bytes": raw,
                "top_logprobs": [
                    dict(zip(("token", "bytes"), token_text(self.tokenizer, t), strict=True), logprob=lp)
                    for t, lp in (event.top_logprobs or [])
                ],
            }
        self.logprobs.append(entry)
        delta.logprobs.append(entry)

    # ------------------------------------------------------------------ results
    @property
    def text(self) -> str:
        return self.echo_text + self.generated

    @property
    def finish_reason(self) -> str:
        assert self.finish is not None
        return FINISH_REASONS.get(self.finish.reason, "stop")


def legacy_logprobs(entries: list[Any]) -> dict[str, Any]:
    """The completions API's logprobs object from (token, logprob, top, text_offset) entries."""
    return {
        "tokens": [e[0] for e in entries],
        "token_logprobs": [e[1] for e in entries],
        "top_logprobs": [e[2] for e in entries],
        "text_offset": [e[3] for e in entries],
    }
