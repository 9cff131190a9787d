"""A streamed response's server-sent events, from the engine's deltas (sans-IO).

The order is OpenAI's: `response.created`, `response.in_progress`; for text an assistant
message (`response.output_item.added`, `response.content_part.added`, one
`response.output_text.delta` per engine batch, then `response.output_text.done`,
`response.content_part.done`, `response.output_item.done`); for a function call
`response.output_item.added`, `response.function_call_arguments.delta` (as generated when
tool_choice names the function: the output is its arguments; otherwise the whole arguments once
they parse, as chat's tool-call parsing runs on the finished output) and `.done`,
`response.output_item.done`; then `response.completed` (`response.incomplete` when
max_output_tokens cut it). Every event has a `sequence_number`, counting from 0.
"""

from __future__ import annotations

from typing import Any

import orjson

from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.responses.core import Turn, call_item, finish, response_object


def sse(event: dict[str, Any]) -> bytes:
    return b"event: " + event["type"].encode() + b"\ndata: " + orjson.dumps(event) + b"\n\n"


class EventStream:
    def __init__(self, turn: Turn) -> None:
        self.turn = turn
        self.sequence = 0
        self.opened = False  # the first output item (message or named call) has been added
        self.live = turn.plan.tool_mode == "none"  # message text streams as it comes
        self.named = turn.plan.tool_mode == "named"  # so do a named function's arguments

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        event = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event

    def _ids(self, output_index: int = 0) -> dict[str, Any]:
        return {"item_id": self.turn.message_id, "output_index": output_index, "content_index": 0}

    def start(self) -> list[dict[str, Any]]:
        shell = response_object(self.turn, with_output=False)
        return [
            self._event("response.created", response=shell),
            self._event("response.in_progress", response=shell),
        ]

    def _open(self) -> list[dict[str, Any]]:
        self.opened = True
        item = {
            "id": self.turn.message_id,
            "type": "message",
            "role": "assistant",
            "status": "in_progress",
            "content": [],
        }
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return [
            self._event("response.output_item.added", output_index=0, item=item),
            self._event("response.content_part.added", **self._ids(), part=part),
        ]

    def text(self, delta: str) -> list[dict[str, Any]]:
        """Events for text the engine produced: message text, or a named function's arguments
        (other tool output is parsed when it is finished, so it goes out at the end)."""
        if not delta:
            return []
        if self.named:
            events = [] if self.opened else self._open_call()
            ids = {"item_id": self.turn.call_item_id, "output_index": 0}
            events.append(self._event("response.function_call_arguments.delta", **ids, delta=delta))
            return events
        if not self.live:
            return []
        events = [] if self.opened else self._open()
        events.append(self._event("response.output_text.delta", **self._ids(), delta=delta, logprobs=[]))
        return events

    def _open_call(self) -> list[dict[str, Any]]:
        self.opened = True
        item = call_item(self.turn, "", "in_progress")
        return [self._event("response.output_item.added", output_index=0, item=item)]

    def end(self) -> list[dict[str, Any]]:
        """The closing events once the output is finished."""
        events: list[dict[str, Any]] = []
        for index, item in enumerate(finish(self.turn)):
            if item["type"] == "message":
                text = item["content"][0]["text"]
                if not self.opened:
                    events += self._open()
                    if text:
                        delta = self._event(
                            "response.output_text.delta", **self._ids(), delta=text, logprobs=[]
                        )
                        events.append(delta)
                events += [
                    self._event("response.output_text.done", **self._ids(), text=text, logprobs=[]),
                    self._event("response.content_part.done", **self._ids(), part=item["content"][0]),
                    self._event("response.output_item.done", output_index=index, item=item),
                ]
                continue
            ids = {"item_id": item["id"], "output_index": index}
            if not (self.named and self.opened):
                added = {**item, "arguments": "", "status": "in_progress"}
                events.append(self._event("response.output_item.added", output_index=index, item=added))
                if item["arguments"]:
                    events.append(
                        self._event("response.function_call_arguments.delta", **ids, delta=item["arguments"])
                    )
            events += [
                self._event("response.function_call_arguments.done", **ids, arguments=item["arguments"]),
                self._event("response.output_item.done", output_index=index, item=item),
            ]
        kind = "response.incomplete" if self.turn.status == "incomplete" else "response.completed"
        events.append(self._event(kind, response=response_object(self.turn)))
        return events

    def failed(self, exc: OpenAIError) -> list[dict[str, Any]]:
        """A failure after the first event: OpenAI's `error` event, then `response.failed`."""
        self.turn.status = "failed"
        error = self._event("error", code=exc.code, message=exc.message, param=exc.param)
        shell = response_object(self.turn, with_output=False)
        shell["error"] = {
            "code": "server_error" if exc.status >= 500 else "invalid_prompt",
            "message": exc.message,
        }
        return [error, self._event("response.failed", response=shell)]
