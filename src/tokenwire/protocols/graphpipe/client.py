"""GraphPipe clients: `Client` (blocking, http.client keep-alive) and `AsyncClient` (aiohttp).

Both offer execute(array, input_name=None, output_name=None) -> array (or a list when the
server returns several outputs), execute_multi(inputs, input_names, output_names, config)
-> list of arrays, and metadata() -> MetadataResponse, like Oracle's `graphpipe.remote`.
A non-200 status or an InferResponse with errors raises GraphPipeClientError carrying the
server's error code and message. Returned arrays are read-only views on the response body.
"""

from __future__ import annotations

import http.client
import json
import ssl
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import numpy as np

from tokenwire.protocols.graphpipe.codec import (
    CodecError,
    InferRequest,
    MetadataResponse,
    decode_infer_response,
    decode_metadata_response,
    encode_infer_request,
    encode_metadata_request,
)

HEADERS = {"Content-Type": "application/octet-stream"}


class GraphPipeClientError(Exception):
    def __init__(self, message: str, *, code: int | None = None, status: int = 200) -> None:
        super().__init__(message)
        self.code = code
        self.status = status


def _config_bytes(config: str | bytes | dict[str, Any] | None) -> bytes:
    if config is None:
        return b""
    if isinstance(config, dict):
        return json.dumps(config).encode("utf-8")
    return config.encode("utf-8") if isinstance(config, str) else bytes(config)


def build_request(
    inputs: Sequence[np.ndarray],
    input_names: Sequence[str] | None,
    output_names: Sequence[str] | None,
    config: str | bytes | dict[str, Any] | None,
) -> memoryview:
    return encode_infer_request(
        InferRequest(
            inputs=[np.asarray(a) for a in inputs],
            input_names=list(input_names or []),
            output_names=list(output_names or []),
            config=_config_bytes(config),
        )
    )


def read_outputs(status: int, body: bytes) -> list[np.ndarray]:
    try:
        response = decode_infer_response(body)
    except CodecError as exc:
        if status != 200:
            raise GraphPipeClientError(f"HTTP {status}: {body[:200]!r}", status=status) from None
        raise GraphPipeClientError(f"bad response: {exc}", status=status) from exc
    if response.errors:
        first = response.errors[0]
        raise GraphPipeClientError(first.message, code=first.code, status=status)
    if status != 200:
        raise GraphPipeClientError(f"HTTP {status}", status=status)
    return response.outputs


def read_metadata(status: int, body: bytes) -> MetadataResponse:
    if status != 200:
        read_outputs(status, body)  # raises with the server's error if there is one
    try:
        return decode_metadata_response(body)
    except CodecError as exc:
        raise GraphPipeClientError(f"bad metadata response: {exc}", status=status) from exc


def _single(outputs: list[np.ndarray]) -> np.ndarray | list[np.ndarray]:
    return outputs[0] if len(outputs) == 1 else outputs


class Client:
    """Blocking client over one keep-alive HTTP connection (not thread-safe: one per thread)."""

    def __init__(
        self,
        url: str,
        timeout: float = 120.0,
        *,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ValueError(f"GraphPipe URL must be http(s)://, got {url!r}")
        self.url = url
        self.path = parts.path or "/"
        self.headers = _headers(auth_token)
        host = parts.hostname or "127.0.0.1"
        self._conn: http.client.HTTPConnection = (
            http.client.HTTPSConnection(host, parts.port, timeout=timeout, context=ssl_context)
            if parts.scheme == "https"
            else http.client.HTTPConnection(host, parts.port, timeout=timeout)
        )

    def _post(self, body: bytes | memoryview) -> tuple[int, bytes]:
        for attempt in (0, 1):
            try:
                self._conn.request("POST", self.path, body=body, headers=self.headers)
                response = self._conn.getresponse()
                return response.status, response.read()
            except (http.client.RemoteDisconnected, BrokenPipeError, ConnectionResetError):
                self._conn.close()  # the server dropped an idle keep-alive connection: retry once
                if attempt:
                    raise
        raise AssertionError("unreachable")

    def execute_multi(
        self,
        inputs: Sequence[np.ndarray],
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        config: str | bytes | dict[str, Any] | None = None,
    ) -> list[np.ndarray]:
        return read_outputs(*self._post(build_request(inputs, input_names, output_names, config)))

    def execute(
        self, array: np.ndarray, input_name: str | None = None, output_name: str | None = None
    ) -> np.ndarray | list[np.ndarray]:
        outputs = self.execute_multi(
            [array],
            None if input_name is None else [input_name],
            None if output_name is None else [output_name],
        )
        return _single(outputs)

    def metadata(self) -> MetadataResponse:
        return read_metadata(*self._post(encode_metadata_request()))

    def close(self) -> None:
        self._conn.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class AsyncClient:
    """asyncio client; concurrent calls share one aiohttp connection pool."""

    def __init__(
        self,
        url: str,
        timeout: float = 120.0,
        connections: int = 100,
        *,
        auth_token: str | None = None,
        ssl_context: ssl.SSLContext | None = None,
    ) -> None:
        self.url = url
        self.headers = _headers(auth_token)
        connector = aiohttp.TCPConnector(
            limit=connections, ssl=ssl_context if ssl_context is not None else True
        )
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=timeout), connector=connector
        )

    async def _post(self, body: bytes | memoryview) -> tuple[int, bytes]:
        async with self._session.post(self.url, data=bytes(body), headers=self.headers) as response:
            return response.status, await response.read()

    async def execute_multi(
        self,
        inputs: Sequence[np.ndarray],
        input_names: Sequence[str] | None = None,
        output_names: Sequence[str] | None = None,
        config: str | bytes | dict[str, Any] | None = None,
    ) -> list[np.ndarray]:
        return read_outputs(*await self._post(build_request(inputs, input_names, output_names, config)))

    async def execute(
        self, array: np.ndarray, input_name: str | None = None, output_name: str | None = None
    ) -> np.ndarray | list[np.ndarray]:
        outputs = await self.execute_multi(
            [array],
            None if input_name is None else [input_name],
            None if output_name is None else [output_name],
        )
        return _single(outputs)

    async def metadata(self) -> MetadataResponse:
        return read_metadata(*await self._post(encode_metadata_request()))

    async def close(self) -> None:
        await self._session.close()

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()


def _headers(auth_token: str | None) -> dict[str, str]:
    return {**HEADERS, "Authorization": f"Bearer {auth_token}"} if auth_token else dict(HEADERS)


def execute(
    url: str, array: np.ndarray, input_name: str | None = None, output_name: str | None = None
) -> Any:
    with Client(url) as client:
        return client.execute(array, input_name, output_name)


def execute_multi(
    url: str,
    inputs: Sequence[np.ndarray],
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    config: str | bytes | dict[str, Any] | None = None,
) -> list[np.ndarray]:
    with Client(url) as client:
        return client.execute_multi(inputs, input_names, output_names, config)


def metadata(url: str) -> MetadataResponse:
    with Client(url) as client:
        return client.metadata()
