"""The thick client library (tokenwire.evergreen) and the `tokenwire evergreen` CLI against the
live server on the default model."""

from __future__ import annotations

import argparse
import asyncio
import io
import sys

import pytest

from tests.protocols.evergreen.test_server import greedy_text
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.evergreen import Chat, EvergreenError, EvergreenSession, GenerateConfig
from tokenwire.protocols.evergreen import client, plugin

GREEDY = GenerateConfig(temperature=0, max_tokens=8)


def run(coro, timeout: float = 120):
    return asyncio.run(asyncio.wait_for(coro, timeout))


def test_generate_streams_text_and_chat_reuses_turn_1(evergreen_server, smollm2_engine):
    async def main():
        async with await EvergreenSession.connect(evergreen_server.target) as session:
            chat = Chat(session)
            pieces = [text async for text in chat.say("Name a fruit.", GREEDY)]
            before = smollm2_engine.stats()["computed_tokens"]
            second = await chat.say("Another one.", GREEDY).text()
            return pieces, second, smollm2_engine.stats()["computed_tokens"] - before

    pieces, second, computed = run(main())
    first = "".join(pieces)
    assert len(pieces) > 1 and first == greedy_text(smollm2_engine, "Name a fruit.")
    history = [
        {"role": "user", "content": "Name a fruit."},
        {"role": "assistant", "content": first},
        {"role": "user", "content": "Another one."},
    ]
    tok = smollm2_engine.tokenizer
    prompt = tok.apply_chat_template(history)
    tokens, _ = smollm2_engine.generate(
        None, prompt, GenerateOptions(max_tokens=8, sampling=SamplingParams(temperature=0))
    ).result()
    assert second == "".join(t.text for t in tokens)
    new = (
        len(prompt)
        - len(tok.apply_chat_template(history[:1]))
        - len(tok.encode(first, add_special_tokens=False))
    )
    assert computed <= new + 1 + 8 + 2  # turn 2: its new tokens and its own output only


def test_large_payloads_are_split_and_files_and_refs_work(
    evergreen_server, smollm2_engine, ref_root, tmp_path
):
    big = "doughnut " * 20_000  # 180 kB: several fragments
    note = tmp_path / "note.txt"
    note.write_text("A note from a file.")

    async def main():
        async with await EvergreenSession.connect(evergreen_server.target) as session:
            ids = await session.tokenize(big)
            from_file = await session.tokenize(session.file(note))
            from_ref = await session.tokenize(session.file(ref_root / "notes.txt", as_ref=True))
            count = await session.count_tokens("hello world")
            back = await session.detokenize(ids[:5])
            score = await session.score("Say yes.", "Yes")
            return ids, from_file, from_ref, count, back, score

    ids, from_file, from_ref, count, back, score = run(main())
    tok = smollm2_engine.tokenizer
    assert ids == tok.encode(big, add_special_tokens=False)
    assert from_file == tok.encode("A note from a file.", add_special_tokens=False)
    assert from_ref == tok.encode((ref_root / "notes.txt").read_text(), add_special_tokens=False)
    assert count == len(tok.encode("hello world", add_special_tokens=False))
    assert back == tok.decode(ids[:5])
    assert score["tokens"] and score["logprob"] < 0


def test_split_into_fragments(evergreen_server):
    async def main():
        session = await EvergreenSession.connect(evergreen_server.target)
        node = session.data(b"x" * (client.FRAGMENT_BYTES * 2 + 5), "text/plain")
        sent = []
        while not session._outbox.empty():
            sent += list(session._outbox.get_nowait().node_fragments)
        await session.close()
        return node, sent

    node, sent = run(main())
    assert [(f.id, f.seq, f.continued) for f in sent] == [
        (node.id, 0, True),
        (node.id, 1, True),
        (node.id, 2, False),
    ]
    assert sent[0].chunk_fragment.metadata.mimetype == "text/plain" and not sent[1].chunk_fragment.HasField(
        "metadata"
    )


def test_errors_surface_as_evergreen_error(evergreen_server):
    async def partial():
        async with await EvergreenSession.connect(evergreen_server.target) as session:
            session.set_options(partial_failures=True)
            bad = session.generate(session.data(b"\x89PNG", "image/png"), GREEDY)
            with pytest.raises(EvergreenError) as info:
                await bad.text()
            ok = await session.generate("Hi", GREEDY).text()
            return info.value, ok

    error, ok = run(partial())
    assert error.code == "INVALID_ARGUMENT" and "image/png" in error.details and ok

    async def aborted():
        async with await EvergreenSession.connect(evergreen_server.target) as session:
            out = session.generate("Hi", GREEDY, target="no-such-model")
            with pytest.raises(EvergreenError) as info:
                await out.text()
            return info.value

    error = run(aborted())
    assert error.code == "NOT_FOUND" and "no-such-model" in error.details, error.details


def test_cancel_from_the_client(evergreen_server):
    async def main():
        async with await EvergreenSession.connect(evergreen_server.target) as session:
            out = session.generate("Count.", GenerateConfig(temperature=0, max_tokens=300, ignore_eos=True))
            async for _ in out:
                session.cancel(out)
                break
            return await out.text()

    text = run(main())
    assert text and len(text) < 300 * 4


def test_cli_multi_turn_chat(evergreen_server, smollm2_engine, monkeypatch, capsys):
    parser = argparse.ArgumentParser()
    plugin.register_cli(parser.add_subparsers())
    args = parser.parse_args(
        [
            "evergreen",
            "Name a fruit.",
            "--chat",
            "--url",
            evergreen_server.target,
            "--temperature",
            "0",
            "--max-tokens",
            "8",
        ]
    )
    monkeypatch.setattr(sys, "stdin", io.StringIO("Another one.\n"))
    assert args.handler(args) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == greedy_text(smollm2_engine, "Name a fruit.")
    assert len(lines) == 2 and lines[1]


def test_generate_stop_strings_and_logprobs_output_match_the_engine(evergreen_server, smollm2_engine):
    user = "List five fruits, one per line."
    prompt = smollm2_engine.tokenizer.apply_chat_template([{"role": "user", "content": user}])
    free = "".join(
        t.text
        for t in smollm2_engine.generate(
            None, prompt, GenerateOptions(max_tokens=24, sampling=SamplingParams(temperature=0))
        ).result()[0]
    )
    stop = free[len(free) // 2 : len(free) // 2 + 3]  # a piece from the middle of the free answer
    assert stop.strip(), free
    tokens, finish = smollm2_engine.generate(
        None,
        prompt,
        GenerateOptions(max_tokens=24, stop=[stop], logprobs=True, sampling=SamplingParams(temperature=0)),
    ).result()
    assert finish.reason == "stop"

    async def main():
        async with await EvergreenSession.connect(evergreen_server.target) as session:
            config = GenerateConfig(temperature=0, max_tokens=24, stop=[stop], logprobs=True)
            node = session.text(user)
            outs = session.action("GENERATE", {"prompt": node}, ["response", "logprobs"], [config])
            return await outs["response"].text(), await outs["logprobs"].json()

    text, logprobs = run(main())
    assert text == "".join(t.text for t in tokens) and stop in text and len(text) < len(free)
    assert logprobs["finish_reason"] == "stop"
    assert [r["id"] for r in logprobs["tokens"]] == [t.token_id for t in tokens]
    assert logprobs["tokens"][0]["logprob"] == pytest.approx(tokens[0].logprob, abs=1e-4)
    assert all(r["logprob"] <= 0 for r in logprobs["tokens"])
