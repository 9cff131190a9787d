"""The long-context measures as users meet them: the same request through the OpenAI API.

A real OpenAI server (protocols/openai/transport.py's OpenAIServer, uvicorn on 127.0.0.1, a
free port) runs in this process on its own thread and event loop, over the very engine the
in-process measure uses (its prefix cache holds the context, as it holds it for the in-process
request). The client runs in a process of its own (bench/api_clients.py's ClientProcess, the
one `bench apis` uses), as a user's client does: one streamed /v1/completions request with the
prompt as token ids, greedy, EOS suppressed by logit_bias, the usage asked for in the last
chunk. Decode tok/s as ours_single counts it: the tokens after the first over the time from the
first streamed token to the last.

Why not a client on a thread of this process (as before, issue 45): its reads and JSON parses
take the GIL from the model thread at every token, a cost no real client puts on the server.
"""

from __future__ import annotations

import asyncio
import threading
from types import TracebackType

from tokenwire.bench.api_clients import ClientProcess
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
        self._client: ClientProcess | None = None

    def __enter__(self) -> ServedEngine:
        self._thread.start()
        server = OpenAIServer(self.engine, "127.0.0.1", 0)
        self._server = asyncio.run_coroutine_threadsafe(server.start(), self._loop).result(timeout=60)
        self.port = self._server.port  # the one uvicorn bound for port 0
        self._client = ClientProcess()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._client is not None:
            self._client.close()
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
            "stream_options": {"include_usage": True},
            "logit_bias": {str(t): -100 for t in sorted(self.engine.eos_ids)},
        }
        assert self._client is not None, "use `with ServedEngine(engine) as served:`"
        try:
            return float(self._client.request("completions_decode", f"http://127.0.0.1:{self.port}", body))
        except RuntimeError as exc:
            raise RuntimeError(f"served long decode: {exc}") from None
