"""The HTTP clients of `tokenwire bench apis`, run in a process of their own.

Each API's stream is read by a plain aiohttp client that parses the API's own framing (SSE,
named SSE events, NDJSON) and takes the token count from the API's own usage fields. They run in
a child process, as a user's client runs outside the server: in the server's process every read
and parse of the client took the GIL from the model thread (a quarter of the per-token cost we
measured there was the client's), which a real client never does. The child imports only
aiohttp and orjson, and answers calls over a pipe: `ClientProcess.call(name, *args)`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import orjson

PROMPT = "Write a long story about a lighthouse keeper, a storm and a lost ship."


class Reading:
    """One streamed answer: its text, token count (from the API's usage), first-token time."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.first = 0.0
        self.text = ""
        self.tokens = 0
        self.seconds = 0.0

    def delta(self, piece: str | None) -> None:
        if piece:
            if not self.text:
                self.first = time.perf_counter() - self.start
            self.text += piece

    def done(self) -> Reading:
        self.seconds = time.perf_counter() - self.start
        return self


async def _sse(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[str | None, Any]]:
    """(event name or None, parsed data) of each server-sent event."""
    event: str | None = None
    async for raw in response.content:
        line = raw.rstrip(b"\r\n")
        if line.startswith(b"event:"):
            event = line[6:].strip().decode()
        elif line.startswith(b"data:"):
            data = line[5:].strip()
            if data == b"[DONE]":
                return
            yield event, orjson.loads(data)
            event = None


async def openai_chat(http: aiohttp.ClientSession, base: str, model: str, tokens: int) -> Reading:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}  # fmt: skip
    r = Reading()
    async with http.post(f"{base}/v1/chat/completions", json=body) as response:
        response.raise_for_status()
        async for _, chunk in _sse(response):
            if chunk.get("usage"):
                r.tokens = chunk["usage"]["completion_tokens"]
            elif chunk.get("choices"):
                r.delta(chunk["choices"][0]["delta"].get("content"))
    return r.done()


async def openai_responses(http: aiohttp.ClientSession, base: str, model: str, tokens: int) -> Reading:
    body = {"model": model, "input": PROMPT, "max_output_tokens": tokens, "temperature": 0,
            "stream": True, "store": False}  # fmt: skip
    r = Reading()
    async with http.post(f"{base}/v1/responses", json=body) as response:
        response.raise_for_status()
        async for _, event in _sse(response):
            if event.get("type") == "response.output_text.delta":
                r.delta(event["delta"])
            elif event.get("type") in ("response.completed", "response.incomplete"):  # incomplete: at the cap
                r.tokens = event["response"]["usage"]["output_tokens"]
    return r.done()


async def anthropic_messages(http: aiohttp.ClientSession, base: str, model: str, tokens: int) -> Reading:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": tokens,
            "temperature": 0, "stream": True}  # fmt: skip
    r = Reading()
    async with http.post(f"{base}/v1/messages", json=body) as response:
        response.raise_for_status()
        async for name, event in _sse(response):
            if name == "content_block_delta" and event["delta"].get("type") == "text_delta":
                r.delta(event["delta"]["text"])
            elif name == "message_delta":
                r.tokens = event["usage"]["output_tokens"]
    return r.done()


async def ollama_chat(http: aiohttp.ClientSession, base: str, model: str, tokens: int) -> Reading:
    body = {"model": model, "messages": [{"role": "user", "content": PROMPT}],
            "options": {"temperature": 0, "num_predict": tokens}}  # fmt: skip
    r = Reading()
    async with http.post(f"{base}/api/chat", json=body) as response:
        response.raise_for_status()
        async for line in response.content:
            if line.strip():
                part = orjson.loads(line)
                r.delta(part.get("message", {}).get("content"))
                if part.get("done"):
                    r.tokens = part["eval_count"]
    return r.done()


APIS: dict[str, Callable[..., Any]] = {
    "openai chat": openai_chat,
    "openai responses": openai_responses,
    "anthropic": anthropic_messages,
    "ollama": ollama_chat,
}


async def responses_first_turn(
    http: aiohttp.ClientSession, base: str, body: dict[str, Any]
) -> dict[str, Any]:
    """A non-streamed Responses turn: (id, the reply's text)."""
    async with http.post(f"{base}/v1/responses", json=body) as response:
        response.raise_for_status()
        turn = await response.json()
    text = "".join(part.get("text", "") for item in turn["output"] for part in item.get("content", []) or [])
    return {"id": turn["id"], "text": text}


async def responses_ttft(http: aiohttp.ClientSession, base: str, body: dict[str, Any]) -> float:
    """Seconds to the first output-text delta of a streamed Responses turn."""
    r = Reading()
    async with http.post(f"{base}/v1/responses", json={**body, "stream": True}) as response:
        response.raise_for_status()
        async for _, event in _sse(response):
            if event.get("type") == "response.output_text.delta":
                r.delta(event["delta"])
                break
    return r.first or time.perf_counter() - r.start


async def responses_delete(http: aiohttp.ClientSession, base: str, response_id: str) -> None:
    async with http.delete(f"{base}/v1/responses/{response_id}") as response:
        response.raise_for_status()


CALLS: dict[str, Callable[..., Any]] = {
    **APIS,
    "responses_first_turn": responses_first_turn,
    "responses_ttft": responses_ttft,
    "responses_delete": responses_delete,
}


def _child(conn: Any) -> None:
    async def serve() -> None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as http:
            while True:
                request = await asyncio.to_thread(conn.recv)
                if request is None:
                    return
                name, args = request
                try:
                    conn.send(("ok", await CALLS[name](http, *args)))
                except Exception as exc:  # the parent raises it
                    conn.send(("error", f"{name}: {type(exc).__name__}: {exc}"))

    asyncio.run(serve())


class ClientProcess:
    """The bench's HTTP clients in a child process; `call` runs one and returns its result."""

    def __init__(self) -> None:
        context = multiprocessing.get_context("spawn")  # not fork: the parent runs model threads
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child, args=(child,), daemon=True, name="bench-apis-client")
        self._process.start()
        child.close()

    async def call(self, name: str, *args: Any) -> Any:
        """Run CALLS[name](http, *args) in the child; the parent's loop keeps serving meanwhile."""
        self._conn.send((name, args))
        status, value = await asyncio.to_thread(self._conn.recv)
        if status == "error":
            raise RuntimeError(value)
        return value

    def close(self) -> None:
        self._conn.send(None)
        self._process.join(timeout=10)
        if self._process.is_alive():
            self._process.kill()
