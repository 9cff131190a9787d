"""Our session-tracking clients (sync and async), the CLI chat, the generated code and discovery."""

from __future__ import annotations

import asyncio
import io
import sys
from contextlib import aclosing

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from tests.protocols.salience.helpers import chat, engine_greedy
from tokenwire.protocols import protogen
from tokenwire.protocols.salience.client_session import GenerateParams, SessionView
from tokenwire.salience import AsyncClient, Client, SalienceError


def test_session_view_builds_deltas_and_tracks_tokens():
    view = SessionView("s", 100)
    req = view.request([1, 2, 3], GenerateParams(max_tokens=2, logprobs_ranges=[(0, 9)]))
    assert (list(req.append_tokens), req.offset, req.truncating) == ([1, 2, 3], 0, False)
    assert [(r.start, r.end) for r in req.logprobs_ranges] == [(0, 9)]
    from tokenwire.protocols.salience.gen import salience_pb2 as pb

    view.on_event(pb.GenerateEvent(token=pb.Token(id=1, position=0, is_prefill=True)))
    view.on_event(pb.GenerateEvent(token=pb.Token(id=8, position=3)))
    view.on_event(pb.GenerateEvent(done=pb.GenerateDone(completion_tokens=1)))
    assert view.tokens == [1, 2, 3, 8] and view.last_done.completion_tokens == 1
    view.truncate(2)
    req = view.request([5], GenerateParams())
    assert (req.offset, req.truncating) == (2, True)
    view.on_error(SalienceError(grpc.StatusCode.INVALID_ARGUMENT, "refused"))  # nothing changed
    assert view.tokens == [1, 2] and view.rewound and not view.needs_resync
    view.request([5], GenerateParams())
    view.on_cancel()  # the server may hold more than we saw
    assert view.needs_resync


def test_sync_client_tracks_truncate_fork_and_verify(salience_server, smollm2_engine):
    # a prompt whose greedy top-2 logits stay >= 0.39 apart for these 4 tokens: "Say hello." has
    # a 7e-4 near-tie at its second token, within the int16 decode path's noise (a prefix-cache
    # hit that recomputes the last prompt token by itself flips it)
    prompt = chat(smollm2_engine, "Greet me.")
    with Client(salience_server.target) as client:
        assert client.manifest().hidden_size == smollm2_engine.config.hidden_size
        session = client.open()
        got = [t.id for t in session.generate(prompt, max_tokens=4, top_k=1)]
        assert got == engine_greedy(smollm2_engine, prompt, 4)[0]
        assert session.tokens == prompt + got and session.verify()
        session.truncate(len(prompt))  # rewind locally; the next call carries truncating=true
        _, done = session.complete([], max_tokens=2, top_k=1)
        assert done.prompt_tokens == len(prompt) and session.tokens[len(prompt) :] == got[:2]
        assert session.verify()
        branch = session.fork(len(prompt) - 1)
        assert branch.tokens == prompt[:-1] and branch.verify()
        branch.complete([prompt[-1]], max_tokens=1, top_k=1)
        assert branch.verify() and branch.tokens[-1] == got[0]
        session.refresh()  # the no-op Generate
        branch.close()
        session.close()
        try:
            session.dump()
            raise AssertionError("closed session still answers")
        except SalienceError as exc:
            assert exc.code == grpc.StatusCode.NOT_FOUND


def test_async_client_resyncs_after_cancel(salience_server, smollm2_engine):
    prompt = chat(smollm2_engine, "Count to fifty.")

    async def scenario() -> None:
        async with AsyncClient(salience_server.target) as client:
            session = await client.open(smollm2_engine.name)
            seen = 0
            async with aclosing(session.generate(prompt, max_tokens=200, top_k=1)) as stream:
                async for _token in stream:
                    seen += 1
                    if seen == 3:
                        break  # aclosing closes the generator: the call is cancelled
            assert session.view.needs_resync
            for _ in range(200):
                if not smollm2_engine.session_busy(session.id):
                    break
                await asyncio.sleep(0.02)
            tokens, _ = await session.complete([], max_tokens=1, top_k=1)  # resyncs first
            assert len(tokens) == 1 and await session.verify()
            assert session.tokens[: len(prompt)] == prompt and len(session.tokens) >= len(prompt) + 4
            await session.close()

    asyncio.run(asyncio.wait_for(scenario(), 120))


def test_cli_chat_shows_logprobs(salience_server, smollm2_engine, monkeypatch, capsys):
    from tokenwire.cli import main

    monkeypatch.setattr(sys, "stdin", io.StringIO("Hello!\nAnd again?\n"))
    before = smollm2_engine.stats()["sessions"]
    rc = main(["salience", "--url", salience_server.target, "--max-tokens", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert out.count("model> ") == 2 and out.count("(4 tokens") + out.count("(3 tokens") >= 1
    assert "[-" in out or "[0.00]" in out  # per-token logprobs
    assert smollm2_engine.stats()["sessions"] == before  # the chat closed its session


def test_health_and_reflection_list_the_service(salience_server):
    with grpc.insecure_channel(salience_server.target) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        reply = health.Check(health_pb2.HealthCheckRequest(service="salience.v1.Salience"))
        assert reply.status == health_pb2.HealthCheckResponse.SERVING
        reflect = reflection_pb2_grpc.ServerReflectionStub(channel)
        ask = reflection_pb2.ServerReflectionRequest(list_services="")
        answers = list(reflect.ServerReflectionInfo(iter([ask])))
        names = {s.name for s in answers[0].list_services_response.service}
        assert "salience.v1.Salience" in names and "grpc.health.v1.Health" in names
        answers = list(
            reflect.ServerReflectionInfo(
                iter([reflection_pb2.ServerReflectionRequest(file_containing_symbol="salience.v1.Salience")])
            )
        )
        assert answers[0].file_descriptor_response.file_descriptor_proto  # grpcurl can describe it


def test_committed_generated_code_is_fresh(tmp_path):
    proto_dir = protogen.PROTOCOLS_DIR / "salience" / "proto"
    committed = protogen.PROTOCOLS_DIR / "salience" / "gen"
    written = protogen.generate(proto_dir, tmp_path)
    assert {p.name for p in written} == {"salience_pb2.py", "salience_pb2.pyi", "salience_pb2_grpc.py"}
    for path in written:
        stale = f"{path.name} is stale: run make proto"
        assert (committed / path.name).read_text() == path.read_text(), stale
