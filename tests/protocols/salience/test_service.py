"""Every RPC through a client generated from the seed's proto, against the default model."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from tests.protocols.salience.helpers import chat, engine_greedy, generate
from tokenwire.engine.request import GenerateOptions


def test_open_dump_close_and_manifest(stub, pb, smollm2_engine):
    reply = stub.OpenSession(pb.OpenSessionRequest(model=smollm2_engine.name))
    assert reply.session_id and reply.max_model_len == smollm2_engine.max_model_len
    sid = reply.session_id
    assert smollm2_engine.has_session(sid)
    assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens) == []
    prompt = chat(smollm2_engine, "Name a colour.")
    tokens, done = generate(stub, pb, session_id=sid, append_tokens=prompt, offset=0, max_tokens=0)
    assert tokens == []  # prefill only, no ranges: no Token events
    assert (done.prompt_tokens, done.completion_tokens, done.total_tokens) == (len(prompt), 0, len(prompt))
    assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens) == prompt
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    assert not smollm2_engine.has_session(sid)
    stub.CloseSession(pb.CloseSessionRequest(session_id=sid))  # idempotent
    manifest = stub.GetReadoutManifest(pb.GetReadoutManifestRequest())
    assert list(manifest.concepts) == [] and list(manifest.layers) == []  # no concept file loaded
    assert manifest.hidden_size == smollm2_engine.config.hidden_size


def test_greedy_generate_equals_engine_greedy(stub, pb, smollm2_engine, open_session):
    prompt = chat(smollm2_engine, "What is the capital of France?")
    want_ids, want_lps = engine_greedy(smollm2_engine, prompt, 12, top=3)
    sid = open_session()
    n = len(prompt)
    tokens, done = generate(
        stub, pb, session_id=sid, append_tokens=prompt, offset=0, max_tokens=12, top_k=1,
        logprobs_ranges=[(n, n + 100)], logprob_top_k=3,
    )  # fmt: skip
    assert [t.id for t in tokens] == want_ids
    assert [t.position for t in tokens] == list(range(n, n + len(tokens)))
    assert not any(t.is_prefill for t in tokens)
    assert all(t.has_sampled_logprob and len(t.logprobs) == 3 for t in tokens)
    assert [t.sampled_logprob for t in tokens] == pytest.approx(want_lps, abs=1e-4)
    assert all(t.logprobs[0].id == t.id for t in tokens)  # greedy: the sampled token is the best
    reason = pb.GenerateDone.FINISH_REASON_LENGTH if len(tokens) == 12 else pb.GenerateDone.FINISH_REASON_EOS
    assert done.finish_reason == reason and done.completion_tokens == len(tokens)
    assert done.prompt_tokens == n and done.total_tokens == n + len(tokens)
    assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens) == prompt + want_ids


def test_prefill_only_logprobs_equal_engine_scoring(stub, pb, smollm2_engine, open_session):
    text = smollm2_engine.tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    opts = GenerateOptions(max_tokens=0, logprob_ranges=[(0, len(text))], top_logprobs=2)
    events, _ = smollm2_engine.generate(None, text, opts).result()
    sid = open_session()
    tokens, done = generate(
        stub, pb, session_id=sid, append_tokens=text, offset=0, max_tokens=0,
        logprobs_ranges=[(0, 3), (3, len(text))], logprob_top_k=2,
    )  # fmt: skip
    assert [t.position for t in tokens] == list(range(len(text)))
    assert [t.id for t in tokens] == text and all(t.is_prefill for t in tokens)
    assert not tokens[0].has_sampled_logprob  # nothing precedes position 0
    for token, event in zip(tokens[1:], events[1:], strict=True):
        assert token.has_sampled_logprob
        assert token.sampled_logprob == pytest.approx(event.logprob, abs=1e-5)
        assert [(a.id, pytest.approx(a.logprob, abs=1e-5)) for a in token.logprobs] == event.top_logprobs
    assert done.completion_tokens == 0 and done.finish_reason == pb.GenerateDone.FINISH_REASON_LENGTH
    # only covered positions get events: score two tokens appended to the session
    more = smollm2_engine.tokenizer.encode(" Then it sleeps.", add_special_tokens=False)
    n = len(text)
    tokens, _ = generate(
        stub, pb, session_id=sid, append_tokens=more, offset=n, max_tokens=0, logprobs_ranges=[(n + 1, n + 3)]
    )
    assert [t.position for t in tokens] == [n + 1, n + 2] and [t.id for t in tokens] == more[1:3]
    assert all(t.has_sampled_logprob and len(t.logprobs) == 0 for t in tokens)


def test_truncate_and_append_equals_fresh_session(stub, pb, smollm2_engine, open_session):
    tok = smollm2_engine.tokenizer
    head = chat(smollm2_engine, "Tell me about bees.")
    detour = tok.encode(" Actually, no.", add_special_tokens=False)
    tail = tok.encode(" Bees make honey", add_special_tokens=False)
    a, b = open_session(), open_session()
    generate(stub, pb, session_id=a, append_tokens=head + detour, offset=0, max_tokens=3, top_k=1)
    length = len(stub.DumpSession(pb.DumpSessionRequest(session_id=a)).tokens)
    assert length > len(head + detour)
    fields = dict(max_tokens=6, top_k=1, logprobs_ranges=[(0, 10_000)])
    rewound, done_a = generate(
        stub, pb, session_id=a, append_tokens=tail, offset=len(head), truncating=True, **fields
    )
    fresh, done_b = generate(stub, pb, session_id=b, append_tokens=head + tail, offset=0, **fields)
    assert [(t.id, t.position, t.is_prefill) for t in rewound] == [
        (t.id, t.position, t.is_prefill) for t in fresh
    ]
    want = [t.sampled_logprob for t in fresh]
    assert [t.sampled_logprob for t in rewound] == pytest.approx(want, abs=1e-4)
    assert done_a.prompt_tokens == done_b.prompt_tokens
    assert done_a.completion_tokens == done_b.completion_tokens
    dump = [list(stub.DumpSession(pb.DumpSessionRequest(session_id=s)).tokens) for s in (a, b)]
    assert dump[0] == dump[1]


def test_fork_shares_blocks_and_branches_continue_independently(stub, pb, smollm2_engine, open_session):
    tok = smollm2_engine.tokenizer
    bs = smollm2_engine.kv.block_size
    prompt = chat(smollm2_engine, "Write one sentence about the moon and one about the sun, please.")
    sid = open_session()
    generate(stub, pb, session_id=sid, append_tokens=prompt, offset=0, max_tokens=0)
    at = (len(prompt) // bs) * bs  # a block boundary inside the computed prefix
    assert at >= bs
    before = smollm2_engine.stats()["kv_blocks_available"]
    child = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=at)).session_id
    assert smollm2_engine.stats()["kv_blocks_available"] == before  # no block copied or allocated
    # the child's table is the parent's first blocks, shared by reference
    with smollm2_engine._lock:
        parent_blocks = smollm2_engine._sessions[sid].block_table[: at // bs]
        child_blocks = list(smollm2_engine._sessions[child].block_table)
        assert child_blocks == parent_blocks
        assert all(smollm2_engine.kv.allocator.refcount[b] >= 2 for b in child_blocks)
    assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=child)).tokens) == prompt[:at]
    # each branch continues on its own; each equals the engine's greedy run of its full sequence
    x = tok.encode(" Moon:", add_special_tokens=False)
    y = tok.encode(" Sun:", add_special_tokens=False)
    gx, _ = generate(stub, pb, session_id=child, append_tokens=x, offset=at, max_tokens=5, top_k=1)
    gy, _ = generate(stub, pb, session_id=sid, append_tokens=y, offset=len(prompt), max_tokens=5, top_k=1)
    assert [t.id for t in gx] == engine_greedy(smollm2_engine, prompt[:at] + x, 5)[0]
    assert [t.id for t in gy] == engine_greedy(smollm2_engine, prompt + y, 5)[0]
    parent = list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens)
    assert parent[: len(prompt) + len(y)] == prompt + y
    assert parent[len(prompt) + len(y) :] == [t.id for t in gy]


def test_cancel_mid_stream_frees_the_engine_request(stub, pb, smollm2_engine, open_session):
    sid = open_session()
    prompt = chat(smollm2_engine, "Count from one to one hundred.")
    call = stub.Generate(
        pb.GenerateRequest(
            session_id=sid, append_tokens=prompt, offset=0, max_tokens=400, top_k=1, stop_token_ids=[]
        )
    )
    received = []
    for event in call:
        received.append(event.token.id)
        if len(received) == 3:
            break
    assert smollm2_engine.session_busy(sid)
    call.cancel()
    deadline = time.monotonic() + 10
    while smollm2_engine.session_busy(sid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not smollm2_engine.session_busy(sid)
    assert smollm2_engine.stats()["running"] == 0 and smollm2_engine.stats()["waiting"] == 0
    with pytest.raises(grpc.RpcError) as err:
        next(call)
    assert err.value.code() == grpc.StatusCode.CANCELLED
    # the tokens decoded so far stay in the session (at least those we received)
    kept = list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens)
    assert kept[: len(prompt) + 3] == prompt + received and len(kept) < len(prompt) + 400
    # the session is usable again right away
    _, done = generate(stub, pb, session_id=sid, offset=len(kept), max_tokens=1, top_k=1)
    assert done.completion_tokens == 1


def test_concurrent_sessions_stream_independently(stub, pb, smollm2_engine, open_session):
    prompts = [chat(smollm2_engine, q) for q in ("Why is the sky blue?", "List three fruits.")]
    sessions = [open_session() for _ in prompts]
    results: dict[int, list[tuple[int, float]]] = {0: [], 1: []}
    errors: list[BaseException] = []

    def stream(i: int) -> None:
        try:
            request = pb.GenerateRequest(
                session_id=sessions[i], append_tokens=prompts[i], offset=0, max_tokens=16, top_k=1
            )
            for event in stub.Generate(request):
                if event.HasField("token"):
                    results[i].append((event.token.id, time.monotonic()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=stream, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    for i in (0, 1):
        want = engine_greedy(smollm2_engine, prompts[i], 16)[0]
        assert [tid for tid, _ in results[i]] == want
    # the two streams were in flight at the same time (batched together), not one after the other
    (a0, a1), (b0, b1) = [(r[0][1], r[-1][1]) for r in (results[0], results[1])]
    assert a0 < b1 and b0 < a1


def test_noop_generate_refreshes_ttl_and_idle_sessions_expire(smollm2_engine, seed_proto):
    from tests.protocols.salience.conftest import ServerThread

    pb, pb_grpc = seed_proto
    server = ServerThread(smollm2_engine, session_ttl=1.5)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.SalienceStub(channel)
            kept = stub.OpenSession(pb.OpenSessionRequest()).session_id
            idle = stub.OpenSession(pb.OpenSessionRequest()).session_id
            generate(stub, pb, session_id=kept, append_tokens=[1, 2, 3], offset=0, max_tokens=0)
            end = time.monotonic() + 4.0
            while time.monotonic() < end:
                _, done = generate(stub, pb, session_id=kept, offset=3)  # the no-op Generate
                assert done.prompt_tokens == 3 and done.completion_tokens == 0
                time.sleep(0.4)
            assert not smollm2_engine.has_session(idle)
            with pytest.raises(grpc.RpcError) as err:
                stub.DumpSession(pb.DumpSessionRequest(session_id=idle))
            assert err.value.code() == grpc.StatusCode.NOT_FOUND
            assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=kept)).tokens) == [1, 2, 3]
    finally:
        server.stop()
    assert not smollm2_engine.has_session(kept)  # the server closed its sessions on shutdown
