"""The Responses API's stored responses and LMTP's kept buffers outlive the process (issue 44),
and a Salience session stays its bearer token's, on one server restarted on its --state-dir (one
pair of starts for the three).

- Responses, through the real `openai` package: a `previous_response_id` chain continues after
  the restart with the chain's KV read back from disk (`cached_tokens`), retrieve and
  `input_items` still answer, and another API key still gets 404.
- LMTP: a buffer stored with `"keep": true` (BUFFER, or GENERATE's save_as) is found by name by a
  later connection presenting the same token, before and after the restart, with the same
  next-token logprobs bit for bit; another token never sees it.

"The same as without the restart": the reference is the same request made before the restart
(a stored response stays continuable; a kept buffer is forked, not changed), greedy, and the
engine's arithmetic is batch-invariant, so the results after the restart must be the very same.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import grpc
import pytest

from tests.state_server import MODEL, StateServer
from tokenwire.protocols.lmtp.client import Client, LmtpError
from tokenwire.protocols.salience.client import Client as SalienceClient
from tokenwire.protocols.salience.client import Session as SalienceSession
from tokenwire.protocols.salience.client_session import SalienceError, SessionView

PROMPT = [(i * 7919) % 40000 + 100 for i in range(300)]  # 18 full blocks of 16, and a tail
NEXT = [504, 3457, 28]
FIRST = "Write one long sentence about the history of the city of Paris, its river and its bridges. " * 3


# ---------------------------------------------------------------------- Responses
def _openai(server: StateServer, key: str) -> Any:
    import openai

    base = f"http://127.0.0.1:{server.http}/v1"
    return openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=120)


def _create(client: Any, **fields: Any) -> Any:
    return client.responses.create(**{"model": MODEL, "temperature": 0, "max_output_tokens": 6, **fields})


def _responses_before(server: StateServer) -> tuple[Any, Any]:
    a = _openai(server, "key-a")
    first = _create(a, input=FIRST, instructions="Answer briefly.")
    reference = _create(a, input="And its river?", previous_response_id=first.id)
    return first, reference


def _responses_after(server: StateServer, first: Any, reference: Any) -> None:
    import openai

    a, b = _openai(server, "key-a"), _openai(server, "key-b")
    again = a.responses.retrieve(first.id)  # GET /v1/responses/{id} after the restart
    assert again.id == first.id and again.output_text == first.output_text
    assert [i.content[0].text for i in a.responses.input_items.list(first.id).data] == [FIRST]
    with pytest.raises(openai.NotFoundError):
        b.responses.retrieve(first.id)
    with pytest.raises(openai.NotFoundError):
        _create(b, input="And its river?", previous_response_id=first.id)
    second = _create(a, input="And its river?", previous_response_id=first.id)
    assert second.output_text == reference.output_text
    assert second.usage.input_tokens == reference.usage.input_tokens
    cached = second.usage.input_tokens_details.cached_tokens
    assert cached >= 16 * (first.usage.total_tokens // 16) - 16  # the chain's KV, not recomputed
    third = _create(a, input="Thanks.", previous_response_id=second.id)  # the chain goes on
    assert third.status in ("completed", "incomplete") and third.output_text


# ---------------------------------------------------------------------- LMTP
async def _lmtp(server: StateServer, token: str) -> Client:
    return await Client.connect(f"ws://127.0.0.1:{server.lmtp}/", extensions=["buffers"], auth_token=token)


async def _from(client: Client, buffer: str) -> list[dict[str, Any]]:
    return await client.generate_all([], buffer=buffer, max_tokens=4, top_logprobs=3)


async def _unknown(client: Client, buffer: str) -> None:
    with pytest.raises(LmtpError) as err:
        await _from(client, buffer)
    assert "unknown buffer" in str(err.value)


async def _lmtp_before(server: StateServer) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    async with await _lmtp(server, "key-a") as a:
        assert (await a.buffer("doc", PROMPT, keep=True))["length"] == len(PROMPT)
        await a.buffer("scratch", PROMPT[:20])  # the connection's own: goes with it
        await a.generate_all(NEXT, buffer="doc", save_as="chat", keep=True, max_tokens=3)
    async with await _lmtp(server, "key-a") as a:  # a new connection, the same token
        reference = await _from(a, "doc")
        chat = await _from(a, "chat")
        await _unknown(a, "scratch")
    async with await _lmtp(server, "key-b") as b:
        await _unknown(b, "doc")
    return reference, chat


Records = list[dict[str, Any]]


async def _lmtp_after(server: StateServer, reference: Records, chat: Records) -> None:
    async with await _lmtp(server, "key-b") as b:
        await _unknown(b, "doc")
        with pytest.raises(LmtpError):
            await b.drop("doc")  # not b's to drop
    async with await _lmtp(server, "key-a") as a:
        assert await _from(a, "doc") == reference  # same tokens, same logprobs, bit for bit
        assert await _from(a, "chat") == chat
        await a.drop("doc")
        await _unknown(a, "doc")


# ---------------------------------------------------------------------- Salience
def _salience_dump(server: StateServer, sid: str, token: str) -> list[int]:
    with SalienceClient(f"127.0.0.1:{server.grpc}", auth_token=token) as client:
        return SalienceSession(client, SessionView(sid, 8192)).dump()


def _salience_not_found(server: StateServer, sid: str, token: str) -> None:
    with pytest.raises(SalienceError) as err:
        _salience_dump(server, sid, token)
    assert err.value.code == grpc.StatusCode.NOT_FOUND


def test_stored_responses_kept_lmtp_buffers_and_salience_owners_survive_a_restart(tmp_path: Path) -> None:
    with StateServer(tmp_path) as server:
        first, reference = _responses_before(server)
        buffered, chat = asyncio.run(_lmtp_before(server))
        with SalienceClient(f"127.0.0.1:{server.grpc}", auth_token="key-a") as client:
            session = client.open()
            session.complete(PROMPT[:40], max_tokens=0)
            owned = session.id
        _salience_not_found(server, owned, "key-b")
        server.stop()
    with StateServer(tmp_path) as server:
        assert _salience_dump(server, owned, "key-a") == PROMPT[:40]
        _salience_not_found(server, owned, "key-b")  # the owner's digest persisted
        _responses_after(server, first, reference)
        reads = server.metric("tokenwire_kv_disk_reads_total")
        assert reads > 0 and "disk_kv_tokens=" in server.log  # the chain's KV came from disk
        asyncio.run(_lmtp_after(server, buffered, chat))
        assert server.metric("tokenwire_kv_disk_reads_total") >= reads + len(PROMPT) // 16
        server.stop()
