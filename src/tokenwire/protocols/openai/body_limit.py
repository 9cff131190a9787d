"""The OpenAI API's request-body cap (--http-max-body-mb): uvicorn and FastAPI read any body
whole into memory, so without a cap one client's multi-GiB POST takes the server's memory.

Plain ASGI, ahead of the routes: a declared Content-Length over the cap is refused at once
(413, OpenAI's error shape, nothing read); a chunked body is counted as it arrives and refused
as soon as it passes the cap.
"""

from __future__ import annotations

from typing import Any

from tokenwire.protocols.openai.errors import OpenAIError

DEFAULT_MAX_BODY_MB = 64.0  # a full-vocabulary logit_bias, or a long prompt as token ids, is a few MiB


class BodyLimitMiddleware:
    def __init__(self, app: Any, max_bytes: int, respond: Any) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.respond = respond  # OpenAIError -> an ASGI app answering it

    def _error(self) -> OpenAIError:
        return OpenAIError(
            413,
            f"request body over the {self.max_bytes / 2**20:g} MiB limit (--http-max-body-mb)",
            type="invalid_request_error",
            code="request_too_large",
        )

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = next((v for k, v in scope["headers"] if k == b"content-length"), None)
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self.respond(self._error())(scope, receive, send)
            return
        seen = 0
        started = refused = False

        async def counted_receive() -> Any:
            nonlocal seen, refused
            if refused:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes and not started:
                    # answer now; the route sees a client that went away (and answers nobody)
                    refused = True
                    await self.respond(self._error())(scope, receive, send)
                    return {"type": "http.disconnect"}
            return message

        async def tracked_send(message: Any) -> None:
            nonlocal started
            if refused:
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        await self.app(scope, counted_receive, tracked_send)
