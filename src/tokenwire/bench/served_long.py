"""The long-context measures as users meet them: the same request through the OpenAI API.

A real OpenAI server (protocols/openai/transport.py's OpenAIServer, uvicorn on 127.0.0.1, a
free port) runs in this process on its own thread and event loop, over the very engine the
in-process measure uses (its prefix cache holds the context, as it holds it for the in-process
request). The client is the standard library's http.client on the calling thread: one streamed
/v1/completions request with the prompt as token ids, greedy, EOS suppressed by logit_bias, the
usage asked for in the last chunk. Decode tok/s as ours_single counts it: the tokens after the
first over the time from the first streamed token to the last.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
import time
from types import TracebackType

from tokenwire.engine.engine import Engine
from tokenwire.protocols.openai.transport import OpenAIServer


class ServedEngine:
    """`with ServedEngine(engine) as served:` an OpenAI server on 127.0.0.1 over `engine`."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="bench-openai", daemon=True)
        self._server: OpenAIServer | None = None

    def __enter__(self) -> ServedEngine:
        self._thread.start()
        server = OpenAIServer(self.engine, "127.0.0.1", 0)
        self._server = asyncio.run_coroutine_threadsafe(server.start(), self._loop).result(timeout=60)
        self.port = self._server.port  # the one uvicorn bound for port 0
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(), self._loop).result(timeout=30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=30)
        self._loop.close()

    def decode_tok_s(self, prompt: list[int], n: int) -> float:
        """Greedy decode tok/s of one streamed completion of `n` tokens after `prompt`."""
        body = {
            "model": self.engine.name,
            "prompt": prompt,
            "max_tokens": n,
            "temperature": 0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "logit_bias": {str(t): -100 for t in sorted(self.engine.eos_ids)},
        }
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=600)
        try:
            conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
            response = conn.getresponse()
            if response.status != 200:
                raise RuntimeError(f"served long decode: HTTP {response.status}: {response.read()[:300]!r}")
            stamps, tokens = [], 0
            for line in response:
                if not line.startswith(b"data: ") or line.strip() == b"data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    stamps.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
        finally:
            conn.close()
        if tokens < 2 or len(stamps) < 2:
            raise RuntimeError(f"served long decode: {tokens} tokens in {len(stamps)} chunks")
        return (tokens - 1) / (stamps[-1] - stamps[0])
