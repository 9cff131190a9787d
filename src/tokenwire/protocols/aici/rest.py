"""AICI's REST API on aiohttp, and `tokenwire serve --aici` (runtime + REST on --aici-port).

POST /v1/controllers        raw Wasm body -> {module_id, wasm_size, compiled_size, time}
GET  /v1/controllers/tags   -> {tags: [...]}
POST /v1/controllers/tags   {module_id, tags} -> {tags: [...]}
POST /v1/run                {controller, controller_arg, prompt?, max_tokens?, temperature?, ...}
                            -> text/event-stream: initial-run, run objects, `data: [DONE]`
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import socket
import ssl
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from tokenwire.engine.api import RemoteAiciRuns
from tokenwire.engine.errors import CapacityError, EngineClosedError, EngineError
from tokenwire.logs import access_log
from tokenwire.protocols.aici.client import AiciClient, AiciError
from tokenwire.protocols.aici.codec import FrameError
from tokenwire.protocols.aici.engine_bridge import Coordinator
from tokenwire.protocols.aici.run import RunRequest, failed_run, run_events
from tokenwire.protocols.aici.supervisor import RuntimeSupervisor
from tokenwire.protocols.http_site import start_site
from tokenwire.protocols.security import aiohttp_auth, auth_token, ssl_context
from tokenwire.protocols.serving import SHUTDOWN_MESSAGE, Stopper

if TYPE_CHECKING:
    from tokenwire.engine.api import EngineAPI

log = logging.getLogger("tokenwire.aici")
# The REST body cap (an upload's Wasm, a run). An upload goes to the runtime base64-encoded
# (4/3 of its size) in one side-channel frame of 32 MiB (AiciClient's json_mb): 16 MiB of Wasm
# is ~21.3 MiB there. The old 64 MiB cap let 60 MB through to a FrameError (a 500).
MAX_WASM_BYTES = 16 * 2**20
RETRY_AFTER_S = 1  # what a run refused at a capacity cap is told
CLIENT_CLOSED_REQUEST = 499  # nginx's status for a request whose client went before the answer

__all__ = ["AiciServer", "start_on"]


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> web.Response:
    return web.json_response({"error": message}, status=status, headers=headers)


def _too_large(what: str, size: int | None, limit: int) -> web.Response:
    got = f"{size} bytes" if size is not None else "more"
    return _error(413, f"{what} of {got} is over the limit of {limit} bytes (MAX_WASM_BYTES, docs/limits.md)")


def _refusal(exc: EngineError | FrameError) -> web.Response:
    """A run the engine did not admit, answered before its response started: 429 for a full
    capacity cap (the message names the flag), 503 when the engine stops, 413 when it does not
    fit the runtime's channel, else 400 (the KV budget or the context cannot ever hold it)."""
    if isinstance(exc, CapacityError):
        return _error(429, str(exc), {"Retry-After": str(RETRY_AFTER_S)})
    if isinstance(exc, EngineClosedError):
        return _error(503, str(exc))
    if isinstance(exc, FrameError):
        return _error(413, f"the run does not fit the AICI runtime's channel: {exc}")
    return _error(400, f"{type(exc).__name__}: {exc}")


class AiciServer:
    def __init__(
        self,
        engine: EngineAPI,
        client: AiciClient | None,
        host: str = "127.0.0.1",
        port: int = 4242,
        sock: socket.socket | None = None,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
        make_client: Callable[[], AiciClient] | None = None,
        remote: RemoteAiciRuns | None = None,
    ) -> None:
        self.engine = engine
        # under --replicas (scale/aici.py): runs and uploads go to the replicas' own runtimes
        self.remote = remote
        # restarts a runtime that died (supervisor.py); None: a dead runtime stays dead
        self.supervisor = RuntimeSupervisor(self, make_client) if make_client is not None else None
        self.auth_token = auth_token
        self.ssl_context = ssl_context
        self.client = client
        self.coord = Coordinator.for_engine(client, engine) if client else None
        self.host = host
        self.port = port
        self.sock = sock  # bound before the model loaded (tokenwire serve)
        self._runner: web.AppRunner | None = None
        self._runs: set[asyncio.Task[Any]] = set()  # /v1/run handlers streaming now
        self._shutting_down: str | None = None

    async def start(self) -> AiciServer:
        auth = aiohttp_auth(self.auth_token, "aici", lambda message: _error(401, message))
        middlewares = [_access_middleware] + ([auth] if auth is not None else [])
        app = web.Application(client_max_size=MAX_WASM_BYTES, middlewares=middlewares)
        app.router.add_post("/v1/controllers", self._upload)
        app.router.add_get("/v1/controllers/tags", self._get_tags)
        app.router.add_post("/v1/controllers/tags", self._set_tags)
        app.router.add_post("/v1/run", self._run)
        # a run sends nothing while its prompt is read: a client that left was noticed only at
        # the first event; cancelled at once instead (the run's forks end with it)
        self._runner, self.port = await start_site(
            app, self.host, self.port, self.sock, "--aici-port", self.ssl_context, cancel_on_disconnect=True
        )
        runtime = self.remote.describe() if self.remote is not None else self.client.prefix
        log.info("AICI REST listening on %s/v1/ (runtime %s)", self.url, runtime)
        if self.supervisor is not None:
            self.supervisor.start()
        return self

    @property
    def shutting_down(self) -> bool:
        return self._shutting_down is not None

    @property
    def runs(self) -> set[asyncio.Task[Any]]:
        return self._runs

    @property
    def url(self) -> str:
        return f"{'https' if self.ssl_context else 'http'}://{self.host}:{self.port}"

    async def _upload(self, request: web.Request) -> web.Response:
        if request.content_length is not None and request.content_length > MAX_WASM_BYTES:
            return _too_large("a Wasm upload", request.content_length, MAX_WASM_BYTES)  # unread
        try:
            body = await request.read()
        except web.HTTPRequestEntityTooLarge:  # a chunked body past the cap
            return _too_large("a Wasm upload", None, MAX_WASM_BYTES)
        except ConnectionError:
            return _body_lost(request)
        try:
            data = await self._side("mk_module", binary=base64.b64encode(body).decode())
        except FrameError as e:  # only if the runtime's channels were made smaller than ours
            return _error(413, f"the Wasm upload does not fit the AICI runtime's channel: {e}")
        except AiciError as e:
            return _error(400, str(e))
        return web.json_response(data)

    async def _get_tags(self, request: web.Request) -> web.Response:
        try:
            return web.json_response(await self._side("get_tags"))
        except AiciError as e:
            return _error(503, str(e))

    async def _set_tags(self, request: web.Request) -> web.Response:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        tags = body.get("tags")
        try:
            data = await self._side("set_tags", module_id=body.get("module_id"), tags=tags)
        except AiciError as e:
            return _error(400, str(e))
        return web.json_response(data)

    async def _run(self, request: web.Request) -> web.StreamResponse:
        body = await _json_body(request)
        if isinstance(body, web.Response):
            return body
        try:
            req = RunRequest.from_json(body)
        except ValueError as e:
            return _error(400, str(e))
        if self._shutting_down is not None:
            return _error(503, self._shutting_down)
        if self.supervisor is not None and not await self.supervisor.wait_ready():
            return _error(503, "the AICI runtime died and is restarting; retry shortly")
        events = self._events(req)
        task = asyncio.current_task()
        assert task is not None
        self._runs.add(task)
        resp: web.StreamResponse | None = None
        try:
            # admission (session, queue, KV budget) happens before the first object: a refused
            # run is a whole HTTP error, never a stream cut off after its headers
            try:
                first = await anext(events)
            except (EngineError, FrameError) as e:
                return _refusal(e)
            resp = web.StreamResponse(
                headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
            )
            await resp.prepare(request)
            await resp.write(f"data: {json.dumps(first, ensure_ascii=False)}\n\n".encode())
            async for obj in events:
                await resp.write(f"data: {json.dumps(obj, ensure_ascii=False)}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        except asyncio.CancelledError:
            if self._shutting_down is None:
                raise  # the client went away
            task.uncancel()
            await events.aclose()
            if resp is None:  # stopped while the run was being admitted: nothing sent yet
                return _error(503, self._shutting_down)
            # the server stops: the run ends with AICI's own error form, a failed fork
            await resp.write(f"data: {json.dumps(shutdown_event(self._shutting_down))}\n\n".encode())
            await resp.write(b"data: [DONE]\n\n")
        finally:
            self._runs.discard(task)
            await events.aclose()  # a client that went away: cancel the forks, free everything
        assert resp is not None
        return resp

    def _events(self, req: RunRequest) -> Any:
        if self.remote is not None:
            return self.remote.run(req)
        assert self.client is not None and self.coord is not None
        return run_events(self.engine, self.client, self.coord, req, raise_refusal=True)

    async def _side(self, op: str, **fields: Any) -> dict[str, Any]:
        if self.remote is not None:
            return await self.remote.side(op, **fields)
        assert self.client is not None
        return await self.client.side_async(op, **fields)

    async def shutdown(self, message: str = SHUTDOWN_MESSAGE, wait_s: float = 2.0) -> None:
        """Server stopping: refuse new runs (503) and end the streaming ones with a failed fork
        whose error is `message`, then `[DONE]`."""
        self._shutting_down = message
        runs = list(self._runs)
        for task in runs:
            task.cancel()
        if runs:
            await asyncio.wait(runs, timeout=wait_s)

    async def stop(self) -> None:
        if self.supervisor is not None:
            await self.supervisor.stop()
        await self.shutdown()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.coord is not None:
            self.coord.close()


def shutdown_event(message: str) -> dict[str, Any]:
    return {**failed_run(message), "error": {"message": message, "code": 503}}


@web.middleware
async def _access_middleware(request: web.Request, handler: Any) -> web.StreamResponse:
    """One access-log line for each REST call (uploads, tags, runs incl. their instantiate);
    a run's generations also get the engine's lines (method "run", with tokens and TTFT)."""
    started = time.monotonic()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        access_log(
            "aici",
            f"{request.method} {request.path}",
            "ok" if status < 400 else str(status),
            peer=request.remote,
            duration_s=time.monotonic() - started,
        )


def _body_lost(request: web.Request) -> web.Response:
    """The connection went while the body was arriving: the connection guard answered 408 to a
    stalled body (--body-timeout) and closed it, or the client left. Nobody is there to answer
    and it is no server error: raised out of the handler, aiohttp logged a traceback at ERROR
    per request, a log flood for a client stalling on purpose. The guard has already logged
    the stall (rate-limited); this response is never sent, its status goes to the access line."""
    log.debug(
        "%s %s from %s: connection lost while reading the body", request.method, request.path, request.remote
    )
    return web.Response(status=CLIENT_CLOSED_REQUEST)


async def _json_body(request: web.Request) -> dict[str, Any] | web.Response:
    if request.content_length is not None and request.content_length > MAX_WASM_BYTES:
        return _too_large("a request body", request.content_length, MAX_WASM_BYTES)
    try:
        body = await request.json()
    except web.HTTPRequestEntityTooLarge:
        return _too_large("a request body", None, MAX_WASM_BYTES)
    except ConnectionError:
        return _body_lost(request)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        return _error(400, f"malformed JSON body: {e}")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object")
    return body


def runtime_args_from(args: argparse.Namespace) -> list[str]:
    extra = list(getattr(args, "aici_runtime_arg", []) or [])
    store = getattr(args, "aici_store_dir", None)
    if store is not None:
        extra.append(f"--store-dir={store}")
    return extra


def tokenizer_spec(engine: EngineAPI) -> str:
    """The runtime must tokenize exactly as the engine: point it at the loaded model's files."""
    return str(engine.source.model_dir) if engine.source is not None else "default"


def runtime_spin_ms(requested: float | None, engine: EngineAPI) -> float:
    """--aici-busy-wait-ms, or by default 200 ms when the model runs on a GPU and 0 on the CPU
    (a spinning runtime takes a core the forward needs)."""
    if requested is not None:
        return requested
    return 200.0 if engine.device_type == "cuda" else 0.0


async def start_on(engine: EngineAPI, args: argparse.Namespace, sock: socket.socket) -> Stopper:
    """`tokenwire serve --aici`: start the runtime, then serve the REST API on `sock`."""
    requested_spin = getattr(args, "aici_busy_wait_ms", None)
    remote = engine.remote_aici(runtime_args_from(args), requested_spin)
    if remote is not None:  # --replicas: every replica starts its own runtime on first use
        server = await AiciServer(
            engine, None, args.host, args.aici_port, sock, auth_token(args), ssl_context(args), None, remote
        ).start()
        return server.stop
    loop = asyncio.get_running_loop()
    spin_ms = runtime_spin_ms(requested_spin, engine)

    def make_client() -> AiciClient:
        return AiciClient(
            tokenizer=tokenizer_spec(engine), runtime_args=runtime_args_from(args), busy_wait_ms=spin_ms
        )

    client = await loop.run_in_executor(None, make_client)
    server = await AiciServer(
        engine, client, args.host, args.aici_port, sock, auth_token(args), ssl_context(args), make_client
    ).start()

    async def stop() -> None:
        await server.stop()
        await loop.run_in_executor(None, server.client.close)  # the runtime now (it may have restarted)

    return stop
