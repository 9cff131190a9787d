"""tokenwire.lmtp.Client: an async LMTP client (WebSocket, or a `tokenwire lmtp --stdio` child).

    async with await Client.connect("ws://127.0.0.1:8080/", extensions=["text"]) as client:
        print(await client.complete("The capital of France is", max_tokens=8))

With no extensions and a known model it speaks exactly the seed's protocol, so it also works
against `lmql serve-model`; otherwise it opens with HELLO to learn the model and turn the
extensions on.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import ssl
from collections.abc import AsyncIterator, Iterable, Sequence
from typing import Any, Protocol

import aiohttp

from tokenwire.protocols.lmtp.codec import EXTENSIONS, StreamId

log = logging.getLogger("tokenwire.lmtp.client")
MAX_MESSAGE_BYTES = 64 * 2**20


class LmtpError(Exception):
    """An error record from the server (or a lost connection / timeout on the client side)."""

    def __init__(
        self,
        message: str,
        *,
        stream_id: StreamId | None = None,
        code: str | None = None,
        retryable: bool = False,
    ) -> None:
        super().__init__(message)
        self.stream_id = stream_id
        self.code = code
        self.retryable = retryable


class Transport(Protocol):
    async def send(self, text: str) -> None: ...
    async def recv(self) -> str | None: ...  # None: the connection is closed
    async def close(self) -> None: ...


class WebSocketTransport:
    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse) -> None:
        self.session, self.ws = session, ws

    @classmethod
    async def open(
        cls,
        url: str,
        timeout: float = 10.0,
        *,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> WebSocketTransport:
        session = aiohttp.ClientSession()
        try:
            ws = await session.ws_connect(
                url,
                headers={"Authorization": f"Bearer {auth_token}"} if auth_token else None,
                ssl=ssl_context if ssl_context is not None else True,
                max_msg_size=MAX_MESSAGE_BYTES,
                timeout=aiohttp.ClientWSTimeout(ws_receive=None, ws_close=timeout),
            )
        except BaseException:
            await session.close()
            raise
        return cls(session, ws)

    async def send(self, text: str) -> None:
        await self.ws.send_str(text)

    async def recv(self) -> str | None:
        while True:
            msg = await self.ws.receive()
            if msg.type == aiohttp.WSMsgType.TEXT:
                return str(msg.data)
            if msg.type in (
                aiohttp.WSMsgType.CLOSE,
                aiohttp.WSMsgType.CLOSING,
                aiohttp.WSMsgType.CLOSED,
                aiohttp.WSMsgType.ERROR,
            ):
                return None

    async def close(self) -> None:
        await self.ws.close()
        await self.session.close()


class ProcessTransport:
    """Frames as lines over a child process's stdin/stdout (`tokenwire lmtp --stdio`)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    @classmethod
    async def spawn(cls, argv: Sequence[str], env: dict[str, str] | None = None) -> ProcessTransport:
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            limit=MAX_MESSAGE_BYTES,
            env=env,
        )
        return cls(proc)

    async def send(self, text: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(text.encode() + b"\n")
        await self.proc.stdin.drain()

    async def recv(self) -> str | None:
        assert self.proc.stdout is not None
        line = await self.proc.stdout.readline()
        return line.decode("utf-8", "replace").rstrip("\r\n") if line else None

    async def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.is_closing():
            self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 10)
        except TimeoutError:
            self.proc.terminate()
            await self.proc.wait()


class Client:
    def __init__(self, transport: Transport, model: str | None = None) -> None:
        self.transport = transport
        self.model = model
        self.extensions: set[str] = set()
        self.hello: dict[str, Any] | None = None
        self.system: asyncio.Queue[dict[str, Any]] = asyncio.Queue()  # system extension events
        self.unrouted: list[dict[str, Any]] = []  # records for no open stream (e.g. bad-frame errors)
        self._ids = itertools.count(1)
        self._streams: dict[StreamId, asyncio.Queue[dict[str, Any] | None]] = {}
        self._futures: dict[StreamId, asyncio.Future[dict[str, Any]]] = {}
        self._ready = asyncio.Event()
        self.closed = False
        self._reader = asyncio.create_task(self._read_loop(), name="lmtp-client-reader")

    # ------------------------------------------------------------------ opening and closing
    @classmethod
    async def connect(
        cls,
        url: str = "ws://127.0.0.1:8080/",
        *,
        model: str | None = None,
        extensions: Iterable[str] = (),
        timeout: float = 10.0,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> Client:
        """`auth_token`: the server's --auth-token; `ssl_context`: trust for a wss:// URL."""
        transport = await WebSocketTransport.open(
            url, timeout, auth_token=auth_token, ssl_context=ssl_context
        )
        client = cls(transport, model)
        return await client._start(extensions, timeout)

    @classmethod
    async def spawn(
        cls,
        argv: Sequence[str],
        *,
        model: str | None = None,
        extensions: Iterable[str] = (),
        timeout: float = 300.0,
        env: dict[str, str] | None = None,
    ) -> Client:
        """Start `argv` (e.g. ["tokenwire", "lmtp", "--stdio"]) and speak LMTP over its stdio."""
        client = cls(await ProcessTransport.spawn(argv, env), model)
        return await client._start(extensions, timeout)

    @classmethod
    async def over(
        cls,
        transport: Transport,
        *,
        model: str | None = None,
        extensions: Iterable[str] = (),
        timeout: float = 10.0,
    ) -> Client:
        return await cls(transport, model)._start(extensions, timeout)

    async def _start(self, extensions: Iterable[str], timeout: float) -> Client:
        wanted = [e for e in extensions if e in EXTENSIONS]
        if not wanted and self.model is not None:
            return self  # the seed's protocol, nothing to negotiate
        try:
            reply = await self.request("HELLO", {"extensions": wanted, "client": "tokenwire"}, timeout)
            self.hello = hello = reply["hello"]
            self.extensions = set(hello.get("extensions", ()))
            if hello.get("status") == "loading":  # the system extension says when it is ready
                while (event := await asyncio.wait_for(self.system.get(), timeout)).get("event") != "ready":
                    pass
                hello["model"] = event.get("model")  # "status" stays as the server said it
        except BaseException:
            await self.close()
            raise
        self.model = self.model or self.hello.get("model")
        return self

    async def close(self) -> None:
        if not self.closed:
            self.closed = True
            await self.transport.close()
        self._reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._reader

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------------ requests
    async def request(
        self, kind: str, payload: dict[str, Any], timeout: float | None = 30.0
    ) -> dict[str, Any]:
        """Send a request answered by one MSG record (MODEL_INFO, HELLO, BUFFER, DROP)."""
        sid = next(self._ids)
        fut: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._futures[sid] = fut
        try:
            await self._send(kind, {"stream_id": sid, **payload})
            record = await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            raise LmtpError(
                f"LMTP {kind} timed out after {timeout} s", stream_id=sid, code="timeout"
            ) from None
        finally:
            self._futures.pop(sid, None)
        _raise_if_error(record)
        return record

    async def model_info(self, *, tokenizer_json: bool = False) -> dict[str, Any]:
        data = {"tokenizer_json": True} if tokenizer_json else {}
        return (await self.request("MODEL_INFO", {"model": self.model, "data": data}))["model_info"]

    def generate(
        self,
        prompt: Any,
        *,
        max_tokens: int = 32,
        temperature: float = 0.0,
        logit_bias: dict[int, float] | None = None,
        top_logprobs: int = 1,
        timeout: float | None = None,
        retries: int = 0,
        **fields: Any,
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream TOKEN records. `prompt`: token ids (or text, with the text extension). Other
        fields (top_p, top_k, seed, priority, stop_token_ids, ignore_eos, buffer, save_as) pass
        through. With `timeout`, a stream that stays silent that long is resent (retry extension,
        up to `retries` times) and resumes where it stopped."""
        payload: dict[str, Any] = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": temperature,
            "top_logprobs": top_logprobs,
            **fields,
        }
        if logit_bias:
            payload["logit_bias"] = {str(k): v for k, v in logit_bias.items()}
        return self._stream("GENERATE", payload, timeout, retries)

    def score(
        self, prompt: Any, scored: Any, *, timeout: float | None = None, retries: int = 0, **fields: Any
    ) -> AsyncIterator[dict[str, Any]]:
        """Stream one record (token, logprob) per scored token."""
        payload = {"model": self.model, "prompt": prompt, "scored": scored, **fields}
        return self._stream("SCORE", payload, timeout, retries)

    async def generate_all(self, prompt: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return [record async for record in self.generate(prompt, **kwargs)]

    async def score_all(self, prompt: Any, scored: Any, **kwargs: Any) -> list[dict[str, Any]]:
        return [record async for record in self.score(prompt, scored, **kwargs)]

    async def complete(self, prompt: Any, **kwargs: Any) -> str:
        """The generated text (text extension)."""
        return "".join([r.get("text", "") async for r in self.generate(prompt, **kwargs)])

    async def buffer(
        self, name: str, prompt: Any = None, *, base: str | None = None, keep: bool = False
    ) -> dict[str, Any]:
        """Store tokens (or text) as a named buffer, computed once (buffers extension); `keep`:
        it outlives the connection (and a restart), for this client's token."""
        payload: dict[str, Any] = {"name": name, "prompt": prompt, **({"keep": True} if keep else {})}
        if base is not None:
            payload["base"] = base
        return (await self.request("BUFFER", payload, timeout=None))["buffer"]

    async def drop(self, name: str) -> None:
        await self.request("DROP", {"name": name})

    # ------------------------------------------------------------------ internals
    async def _stream(
        self, kind: str, payload: dict[str, Any], timeout: float | None, retries: int
    ) -> AsyncIterator[dict[str, Any]]:
        sid = next(self._ids)
        queue: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()
        self._streams[sid] = queue
        payload = {**payload, "stream_id": sid}
        received, ended = 0, False
        try:
            await self._send(kind, payload)
            while True:
                try:
                    record = await asyncio.wait_for(queue.get(), timeout)
                except TimeoutError:
                    if retries <= 0 or "retry" not in self.extensions:
                        raise LmtpError(
                            f"stream {sid} got nothing for {timeout} s",
                            stream_id=sid,
                            code="timeout",
                            retryable=True,
                        ) from None
                    retries -= 1
                    log.info(
                        "LMTP stream %s silent for %s s: resending from record %d", sid, timeout, received
                    )
                    await self._send(kind, {**payload, "resume_from": received})
                    continue
                if record is None:
                    raise LmtpError("connection closed", stream_id=sid, code="closed", retryable=True)
                if record.get("seq", received) < received:
                    continue  # already seen (a replay overlapping records in flight)
                received += 1
                if record.get("error") is not None:
                    ended = True
                    _raise_if_error(record)
                yield record
                if record.get("finish_reason") is not None:
                    ended = True
                    return
        finally:
            self._streams.pop(sid, None)
            if not ended and not self.closed and "retry" in self.extensions:
                with contextlib.suppress(Exception):  # the consumer left early: stop the work
                    await self._send("CANCEL", {"stream_id": sid})

    async def _send(self, kind: str, payload: dict[str, Any]) -> None:
        if self.closed or self._reader.done():
            raise LmtpError("connection closed", code="closed", retryable=True)
        await self.transport.send(f"{kind} {json.dumps(payload)}")

    async def _read_loop(self) -> None:
        try:
            while (text := await self.transport.recv()) is not None:
                try:
                    self._dispatch(text)
                except (ValueError, KeyError, TypeError) as exc:
                    log.warning("LMTP client: cannot handle frame %.200r: %s", text, exc)
        finally:
            for queue in self._streams.values():
                queue.put_nowait(None)
            for fut in self._futures.values():
                if not fut.done():
                    fut.set_exception(LmtpError("connection closed", code="closed", retryable=True))

    def _dispatch(self, text: str) -> None:
        kind, _, body = text.partition(" ")
        records = json.loads(body)
        for record in records:
            sid = record.get("stream_id")
            if kind == "MSG" and "system" in record:
                self.system.put_nowait(
                    {**record["system"], **({"stream_id": sid} if sid is not None else {})}
                )
            elif kind == "MSG" and sid in self._futures:
                fut = self._futures.pop(sid)
                if not fut.done():
                    fut.set_result(record)
            elif sid in self._streams:
                self._streams[sid].put_nowait(record)
            else:
                self.unrouted.append(record)


def _raise_if_error(record: dict[str, Any]) -> None:
    if record.get("error") is not None:
        raise LmtpError(
            str(record["error"]),
            stream_id=record.get("stream_id"),
            code=record.get("code"),
            retryable=bool(record.get("retryable", False)),
        )
