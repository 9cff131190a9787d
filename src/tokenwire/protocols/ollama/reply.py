"""The engine's events -> Ollama's response objects (sans-IO: the clock is passed in).

A streamed reply is one JSON object a line (NDJSON): each batch of text as
`{"model", "created_at", "message": {"role": "assistant", "content"}, "done": false}` (generate:
`"response"`), then a last line with `"done": true`, `done_reason` and the counts and durations
in nanoseconds (total, load: planning the request, prompt_eval: up to the first generated token,
eval: from there to the end). generate's last line also carries `context`, the conversation's
tokens, which a later request sends back to continue it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from tokenwire.engine.request import Event, FinishEvent, TokenEvent
from tokenwire.protocols.ollama.core import Request
from tokenwire.protocols.openai import chat
from tokenwire.protocols.openai.output import ChoiceOutput

Clock = Callable[[], int]  # nanoseconds, monotonic


def created_at(ns: int | None = None) -> str:
    """Ollama's RFC 3339 timestamp in UTC, e.g. 2026-11-27T21:00:00.123456Z."""
    moment = datetime.fromtimestamp((time.time_ns() if ns is None else ns) / 1e9, UTC)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _logprobs(entries: list[Any]) -> list[dict[str, Any]]:
    return [
        {
            "token": e["token"],
            "logprob": e["logprob"],
            "bytes": e["bytes"],
            "top_logprobs": e["top_logprobs"],
        }
        for e in entries
    ]


def tool_calls(request: Request, text: str) -> list[dict[str, Any]]:
    """The tool calls in a finished chat output (the OpenAI side's parser), as Ollama writes
    them: `{"function": {"name", "arguments": {...}}}`."""
    if request.tool_mode == "none":
        return []
    calls = chat.parse_tool_calls(request.tool_mode, None, text, request.tool_names)
    out = []
    for call in calls:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = {}
        out.append({"function": {"name": call["function"]["name"], "arguments": arguments}})
    return out


class Reply:
    """One request's reply, built as its events arrive."""

    def __init__(
        self, request: Request, clock: Clock = time.perf_counter_ns, started: int | None = None
    ) -> None:
        self.request = request
        self.clock = clock
        self.started = clock() if started is None else started  # the request arrived
        self.submitted = self.started  # planned: the engine starts
        self.first: int | None = None  # the first generated token
        self.finished: int | None = None
        self.tail = ""  # the text the finish released (held back for a stop string until then)
        self.output: ChoiceOutput | None = request.plan.outputs[0] if request.plan is not None else None

    def submit(self) -> None:
        self.submitted = self.clock()

    def _line(self, text: str, done: bool) -> dict[str, Any]:
        line: dict[str, Any] = {"model": self.request.model, "created_at": created_at()}
        if self.request.kind == "chat":
            line["message"] = {"role": "assistant", "content": text}
        else:
            line["response"] = text
        line["done"] = done
        return line

    def feed(self, event: Event) -> dict[str, Any] | None:
        """One event in; the stream line it releases, if any (the last line is `final()`)."""
        assert self.output is not None
        if isinstance(event, TokenEvent) and not event.is_prefill and self.first is None:
            self.first = self.clock()
        if isinstance(event, FinishEvent):
            self.finished = self.clock()
        delta = self.output.feed(event)
        if isinstance(event, FinishEvent):
            self.tail = delta.text
            return None  # the rest goes in the last line
        if self.request.tool_mode != "none":
            return None  # tool calls are known only at the end: the whole text goes last
        if not delta.text and not delta.logprobs:
            return None
        line = self._line(delta.text, False)
        if delta.logprobs:
            line["logprobs"] = _logprobs(delta.logprobs)
        return line

    def final(self) -> dict[str, Any]:
        """The last line (streaming; `text` is what the stream has not sent yet) or the whole
        reply (not streaming)."""
        out = self.output
        if out is None:  # nothing to generate: Ollama's answer to a load (or an unload)
            line = self._line("", True)
            unload = self.request.keep_alive in (0, "0", "0s")
            line["done_reason"] = "unload" if unload else "load"
            return line
        assert out.finish is not None
        streamed = self.request.stream and self.request.tool_mode == "none"
        rest = self.tail if streamed else out.generated
        calls = tool_calls(self.request, out.generated) if self.request.kind == "chat" else []
        line = self._line("" if calls else rest, True)
        if calls:
            line["message"]["tool_calls"] = calls
        if out.logprobs and not streamed:
            line["logprobs"] = _logprobs(out.logprobs)
        line["done_reason"] = out.finish_reason
        if self.request.kind == "generate":
            line["context"] = [*self.request.prompt, *out.token_ids]
        end = self.finished if self.finished is not None else self.clock()
        first = self.first if self.first is not None else end
        line.update(
            total_duration=end - self.started,
            load_duration=self.submitted - self.started,
            prompt_eval_count=out.finish.prompt_tokens,
            prompt_eval_duration=first - self.submitted,
            eval_count=out.finish.completion_tokens,
            eval_duration=end - first,
        )
        return line
