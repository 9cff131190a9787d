"""LMTP's kept buffers outlive their connection and the process (issue 44): a buffer stored with
`"keep": true` (BUFFER, or GENERATE's save_as) is found by name by a later connection presenting
the same token, after a restart on the same --state-dir too, with the same next-token logprobs
bit for bit (the reference is the same request before the restart; the engine's arithmetic is
batch-invariant) and its KV read back from disk; another token never sees it."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.state_server import StateServer
from tokenwire.protocols.lmtp.client import Client, LmtpError

PROMPT = [(i * 7919) % 40000 + 100 for i in range(300)]  # 18 full blocks of 16, and a tail
NEXT = [504, 3457, 28]


async def _connect(server: StateServer, token: str) -> Client:
    return await Client.connect(f"ws://127.0.0.1:{server.lmtp}/", extensions=["buffers"], auth_token=token)


async def _from(client: Client, buffer: str) -> list[dict[str, Any]]:
    return await client.generate_all([], buffer=buffer, max_tokens=4, top_logprobs=3)


async def _unknown(client: Client, buffer: str) -> None:
    with pytest.raises(LmtpError) as err:
        await _from(client, buffer)
    assert "unknown buffer" in str(err.value)


async def _before(server: StateServer) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    async with await _connect(server, "key-a") as a:
        assert (await a.buffer("doc", PROMPT, keep=True))["length"] == len(PROMPT)
        await a.buffer("scratch", PROMPT[:20])  # the connection's own: goes with it
        await a.generate_all(NEXT, buffer="doc", save_as="chat", keep=True, max_tokens=3)
    async with await _connect(server, "key-a") as a:  # a new connection, the same token
        reference = await _from(a, "doc")
        chat = await _from(a, "chat")
        await _unknown(a, "scratch")
    async with await _connect(server, "key-b") as b:
        await _unknown(b, "doc")
    return reference, chat


async def _after(server: StateServer, reference: list[dict[str, Any]], chat: list[dict[str, Any]]) -> None:
    async with await _connect(server, "key-b") as b:
        await _unknown(b, "doc")
        with pytest.raises(LmtpError):
            await b.drop("doc")  # not b's to drop
    async with await _connect(server, "key-a") as a:
        assert await _from(a, "doc") == reference  # same tokens, same logprobs, bit for bit
        assert await _from(a, "chat") == chat
        await a.drop("doc")
        await _unknown(a, "doc")


def test_a_kept_lmtp_buffer_survives_its_connection_and_a_restart(tmp_path: Path) -> None:
    with StateServer(tmp_path) as server:
        reference, chat = asyncio.run(_before(server))
        server.stop()
    with StateServer(tmp_path) as server:
        asyncio.run(_after(server, reference, chat))
        assert server.metric("tokenwire_kv_disk_reads_total") >= len(PROMPT) // 16
        server.stop()
