"""The four extensions end to end over WebSocket, the stdio transport, and `tokenwire lmtp`."""

from __future__ import annotations

import asyncio
import contextlib
import io
import os
import sys
import threading
from pathlib import Path

import pytest

from tests.protocols.lmtp.conftest import ServerThread, engine_greedy, run
from tokenwire.lmtp import Client, LmtpError

pytestmark = pytest.mark.slow
ALL = ["text", "buffers", "system", "retry"]


def test_text_mode_streams_text_correct_across_split_characters(lmtp_server, lmtp_engine) -> None:
    tok = lmtp_engine.tokenizer
    prompt = "The capital of France is"
    want, _ = engine_greedy(lmtp_engine, tok.encode(prompt), 6)
    scored = " 日本語 🙂 déjà"

    async def go():
        async with await Client.connect(lmtp_server.url, extensions=["text"]) as client:
            assert client.extensions == {"text"} and client.model == lmtp_engine.name
            text = await client.complete(prompt, max_tokens=6)
            records = await client.score_all(prompt, scored)
            return text, records

    text, records = run(go())
    assert text == tok.decode(want)
    split = [r for r in records if r["text"] == ""]
    assert split, "expected characters spread over several byte-level tokens"
    assert "".join(r["text"] for r in records) == scored
    assert [r["token"] for r in records] == tok.encode(scored, add_special_tokens=False)


def test_buffers_reuse_prompt_parts_and_outputs(lmtp_server, lmtp_engine) -> None:
    tok = lmtp_engine.tokenizer
    system = tok.encode("You are a terse assistant. Answer in one word.\n")
    question = tok.encode("Q: Capital of France?\nA:", add_special_tokens=False)
    want, _ = engine_greedy(lmtp_engine, system + question, 4)
    sessions_before = lmtp_engine.stats()["sessions"]

    async def go():
        async with await Client.connect(lmtp_server.url, extensions=["buffers"]) as client:
            assert await client.buffer("sys", system) == {"name": "sys", "length": len(system)}
            first = await client.generate_all(question, buffer="sys", max_tokens=4, save_as="turn")
            again = await client.generate_all([{"buffer": "sys"}, *question], max_tokens=4)
            more = await client.generate_all(
                tok.encode(" And Spain?", add_special_tokens=False), buffer="turn", max_tokens=2
            )
            assert lmtp_engine.stats()["sessions"] == sessions_before + 2  # "sys" and "turn" live as sessions
            await client.drop("sys")
            with pytest.raises(LmtpError, match="unknown buffer"):
                await client.generate_all(question, buffer="sys")
            return first, again, more

    first, again, more = run(go())
    assert [r["token"] for r in first] == want == [r["token"] for r in again]
    turn = system + question + want
    assert [r["token"] for r in more] == engine_greedy(
        lmtp_engine, turn + tok.encode(" And Spain?", add_special_tokens=False), 2
    )[0]
    assert lmtp_engine.stats()["sessions"] == sessions_before  # the connection's buffers went with it


def test_system_messages_announce_ready_and_shutdown(lmtp_engine) -> None:
    server = ServerThread(lmtp_engine)
    stopper = threading.Thread(target=server.stop)
    try:

        async def go():
            client = await Client.connect(server.url, extensions=["system"])
            assert (await client.system.get()) == {"event": "ready", "model": lmtp_engine.name}
            ids = lmtp_engine.tokenizer.encode("Tell me a long story.")
            stream = client.generate(ids, max_tokens=4000, ignore_eos=True)
            await stream.__anext__()
            stopper.start()
            with pytest.raises(LmtpError, match="server shutting down"):
                async for _ in stream:
                    pass
            event = await asyncio.wait_for(client.system.get(), 10)
            await client.close()
            return event

        assert run(go()) == {"event": "shutdown", "message": "server shutting down"}
    finally:
        if stopper.is_alive():
            stopper.join(30)
        elif server.thread.is_alive():
            server.stop()
    assert lmtp_engine.stats()["running"] == 0


def test_retry_resends_a_silent_stream_without_generating_twice(lmtp_engine) -> None:
    calls: list[object] = []

    class Counting:
        def __getattr__(self, name):
            return getattr(lmtp_engine, name)

        def generate(self, *args, **kwargs):
            calls.append(args)
            return lmtp_engine.generate(*args, **kwargs)

    server = ServerThread(Counting())
    ids = lmtp_engine.tokenizer.encode("Once upon a time")
    want, _ = engine_greedy(lmtp_engine, ids, 12)
    try:

        async def go():
            async with await Client.connect(server.url, extensions=["retry"]) as client:
                records = await client.generate_all(ids, max_tokens=12, timeout=0.002, retries=1000)
                return records, [r["seq"] for r in records]

        records, seqs = run(go())
    finally:
        server.stop()
    assert [r["token"] for r in records] == want and seqs == list(range(12))
    assert len(calls) == 1  # every resend was answered from the stream itself


def test_stdio_transport_shares_the_core(lmtp_engine) -> None:
    from tokenwire.protocols.lmtp.stdio import serve_lines

    ids = lmtp_engine.tokenizer.encode("The capital of France is")
    want, _ = engine_greedy(lmtp_engine, ids, 3)

    class Pipe:  # the client's end of an in-memory line transport
        def __init__(self) -> None:
            self.to_server: asyncio.Queue[str | None] = asyncio.Queue()
            self.to_client: asyncio.Queue[str | None] = asyncio.Queue()

        async def send(self, text: str) -> None:
            await self.to_server.put(text)

        async def recv(self) -> str | None:
            return await self.to_client.get()

        async def close(self) -> None:
            await self.to_server.put(None)

    async def go():
        pipe = Pipe()

        async def load():
            await asyncio.sleep(0.05)  # "loading": the client hears about it first
            return lmtp_engine

        server = asyncio.create_task(serve_lines(load(), pipe.to_server.get, pipe.to_client.put))
        client = await Client.over(pipe, extensions=["system", "text"])
        records = await client.generate_all(ids, max_tokens=3)
        await client.close()
        await asyncio.wait_for(server, 10)
        return client.hello, records

    hello, records = run(go())
    assert hello["status"] == "loading" and hello["model"] == lmtp_engine.name
    assert [r["token"] for r in records] == want


def test_tokenwire_lmtp_command_streams_a_completion(lmtp_server, lmtp_engine) -> None:
    from tokenwire.cli import main

    want, _ = engine_greedy(lmtp_engine, lmtp_engine.tokenizer.encode("The capital of France is"), 5)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert main(["lmtp", "--url", lmtp_server.url, "--max-tokens", "5", "The capital of France is"]) == 0
    assert out.getvalue() == lmtp_engine.tokenizer.decode(want) + "\n"


def test_tokenwire_lmtp_stdio_subprocess(lmtp_engine) -> None:
    """The real `tokenwire lmtp --stdio` process (loads the model itself)."""
    root = Path(__file__).resolve().parents[3]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root / "src"), os.environ.get("PYTHONPATH", "")])}
    argv = [sys.executable, "-m", "tokenwire.cli", "lmtp", "--stdio", "--kv-cache-mb", "64"]

    async def go():
        client = await Client.spawn(argv, extensions=["text", "system"], timeout=120, env=env)
        try:
            info = await client.model_info()
            text = await client.complete("The capital of France is", max_tokens=3)
        finally:
            await client.close()
        return info, text

    info, text = run(go(), timeout=180)
    want, _ = engine_greedy(lmtp_engine, lmtp_engine.tokenizer.encode("The capital of France is"), 3)
    assert info["model"] == lmtp_engine.name and text == lmtp_engine.tokenizer.decode(want)
