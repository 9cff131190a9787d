"""Each gRPC status code the issue names, with its condition, through the seed-generated client."""

from __future__ import annotations

import time

import grpc
import pytest

from tests.protocols.salience.conftest import ServerThread, openssl_cert
from tests.protocols.salience.helpers import generate


def _code(fn, *args, **kw) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        fn(*args, **kw)
    return err.value.code(), err.value.details()


def test_invalid_argument(stub, pb, smollm2_engine, open_session):
    code, details = _code(stub.OpenSession, pb.OpenSessionRequest(model="gpt-17"))
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert "gpt-17" in details and smollm2_engine.name in details  # names both
    sid = open_session()
    vocab = smollm2_engine.vocab_size
    code, details = _code(generate, stub, pb, session_id=sid, append_tokens=[1, vocab], offset=0)
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert str(vocab) in details and "append_tokens[1]" in details
    code, details = _code(generate, stub, pb, session_id=sid, append_tokens=[1], offset=0, top_p=1.5)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "top_p" in details
    code, details = _code(generate, stub, pb, session_id=sid, append_tokens=[1], offset=0, priority=11)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "priority" in details
    code, details = _code(
        generate, stub, pb, session_id=sid, append_tokens=[1], offset=0, logprobs_ranges=[(3, 1)]
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "logprobs_ranges[0]" in details
    image = pb.ImageAttachment(bytes=b"\x89PNG", mime="image/png", pad_range_start=0, pad_range_end=4)
    code, details = _code(
        generate, stub, pb, session_id=sid, append_tokens=[5, 6, 6, 7], offset=0, images=[image]
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "this model has no vision encoder" in details
    image.pad_range_end = 9  # past the post-append tokens: the range check comes first
    code, details = _code(
        generate, stub, pb, session_id=sid, append_tokens=[5, 6, 6, 7], offset=0, images=[image]
    )
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "outside" in details
    assert smollm2_engine.session_tokens(sid) == []  # every refused call left the session alone


def test_failed_precondition(stub, pb, open_session):
    sid = open_session()
    generate(stub, pb, session_id=sid, append_tokens=[1, 2, 3, 4, 5], offset=0, max_tokens=0)
    code, details = _code(generate, stub, pb, session_id=sid, append_tokens=[6], offset=7)
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "offset 7" in details and "length 5" in details
    code, details = _code(generate, stub, pb, session_id=sid, append_tokens=[6], offset=3)  # no truncating
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "offset 3" in details and "length 5" in details
    code, details = _code(generate, stub, pb, session_id=sid, offset=9, truncating=True)  # can't grow
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "offset 9" in details and "length 5" in details
    code, details = _code(stub.ForkSession, pb.ForkSessionRequest(session_id=sid, at_position=6))
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "6" in details and "5 tokens" in details
    code, details = _code(generate, stub, pb, session_id=sid, offset=5, max_tokens=0, readout_ranges=[(0, 5)])
    assert code == grpc.StatusCode.FAILED_PRECONDITION and "concept" in details
    assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens) == [1, 2, 3, 4, 5]


def test_not_found(stub, pb):
    missing = "0" * 32
    for fn, request in [
        (stub.ForkSession, pb.ForkSessionRequest(session_id=missing, at_position=0)),
        (stub.DumpSession, pb.DumpSessionRequest(session_id=missing)),
        (lambda r: list(stub.Generate(r)), pb.GenerateRequest(session_id=missing, max_tokens=1)),
    ]:
        code, details = _code(fn, request)
        assert code == grpc.StatusCode.NOT_FOUND and missing in details
    stub.CloseSession(pb.CloseSessionRequest(session_id=missing))  # closing stays idempotent


def test_a_session_opened_with_one_token_is_not_found_with_another(stub, pb, smollm2_engine):
    """Per-key sessions (as the OpenAI API's): the bearer token a session was opened with owns
    it; another token, or none, gets the NOT_FOUND of an unknown id (docs/sessions.md)."""
    a, b = [("authorization", "Bearer key-a")], [("authorization", "Bearer key-b")]
    sid = stub.OpenSession(pb.OpenSessionRequest(), metadata=a).session_id
    list(
        stub.Generate(
            pb.GenerateRequest(session_id=sid, append_tokens=[1, 2, 3], offset=0, max_tokens=0), metadata=a
        )
    )
    for metadata in (b, None):
        for fn, request in [
            (stub.ForkSession, pb.ForkSessionRequest(session_id=sid, at_position=1)),
            (stub.DumpSession, pb.DumpSessionRequest(session_id=sid)),
            (lambda r, **kw: list(stub.Generate(r, **kw)), pb.GenerateRequest(session_id=sid, max_tokens=1)),
        ]:
            code, details = _code(fn, request, metadata=metadata)
            assert code == grpc.StatusCode.NOT_FOUND and sid in details
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=metadata)  # a no-op for them
    assert list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid), metadata=a).tokens) == [1, 2, 3]
    child = stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=2), metadata=a).session_id
    code, _ = _code(stub.DumpSession, pb.DumpSessionRequest(session_id=child), metadata=b)
    assert code == grpc.StatusCode.NOT_FOUND  # a fork belongs to its parent's owner
    for owned in (child, sid):
        stub.CloseSession(pb.CloseSessionRequest(session_id=owned), metadata=a)
    assert not smollm2_engine.has_session(sid)


def test_resource_exhausted_on_context_overflow(stub, pb, smollm2_engine, open_session):
    sid = open_session()
    too_long = [1] * (smollm2_engine.max_model_len + 1)
    code, details = _code(generate, stub, pb, session_id=sid, append_tokens=too_long, offset=0)
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and str(smollm2_engine.max_model_len) in details
    assert smollm2_engine.session_tokens(sid) == []


def test_aborted_while_a_generate_runs(stub, pb, smollm2_engine, open_session):
    sid = open_session()
    request = pb.GenerateRequest(session_id=sid, append_tokens=[1, 2, 3], offset=0, max_tokens=300)
    call = stub.Generate(request)
    next(call)  # the first token: the request is running
    length = len(smollm2_engine.session_tokens(sid))
    code, details = _code(generate, stub, pb, session_id=sid, offset=length, max_tokens=1)
    assert code == grpc.StatusCode.ABORTED and sid in details
    call.cancel()
    deadline = time.monotonic() + 10
    while smollm2_engine.session_busy(sid) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not smollm2_engine.session_busy(sid)


def test_unauthenticated_without_the_bearer_token(smollm2_engine, seed_proto):
    pb, pb_grpc = seed_proto
    server = ServerThread(smollm2_engine, auth_token="s3cret")
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.SalienceStub(channel)
            for metadata in (None, [("authorization", "Bearer wrong")], [("authorization", "s3cret")]):
                code, details = _code(stub.OpenSession, pb.OpenSessionRequest(), metadata=metadata)
                assert code == grpc.StatusCode.UNAUTHENTICATED and "Bearer" in details
            code, _ = _code(lambda: list(stub.Generate(pb.GenerateRequest(session_id="x"))))
            assert code == grpc.StatusCode.UNAUTHENTICATED
            good = [("authorization", "Bearer s3cret")]
            sid = stub.OpenSession(pb.OpenSessionRequest(), metadata=good).session_id
            assert stub.DumpSession(pb.DumpSessionRequest(session_id=sid), metadata=good).tokens == []
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=good)
    finally:
        server.stop()


def test_tls(smollm2_engine, seed_proto, tmp_path):
    pb, pb_grpc = seed_proto
    cert, key = openssl_cert(tmp_path)
    server = ServerThread(smollm2_engine, tls_cert=str(cert), tls_key=str(key))
    try:
        creds = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
        with grpc.secure_channel(server.target, creds) as channel:
            stub = pb_grpc.SalienceStub(channel)
            sid = stub.OpenSession(pb.OpenSessionRequest()).session_id
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
        with grpc.insecure_channel(server.target) as plain:  # plaintext is refused
            code, _ = _code(pb_grpc.SalienceStub(plain).OpenSession, pb.OpenSessionRequest(), timeout=5)
            assert code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        server.stop()


def test_nan_and_infinity_are_refused_and_the_session_is_unchanged(stub, pb, smollm2_engine, open_session):
    sid = open_session()
    generate(stub, pb, session_id=sid, append_tokens=[1, 2, 3], offset=0, max_tokens=0)
    for fields in (
        {"temperature": float("inf")},
        {"temperature": float("nan"), "top_k": 1},
        {"top_p": float("-inf")},
    ):
        code, details = _code(
            generate, stub, pb, session_id=sid, append_tokens=[4], offset=3, max_tokens=1, **fields
        )
        assert code == grpc.StatusCode.INVALID_ARGUMENT and next(iter(fields)) in details, details
        assert smollm2_engine.session_tokens(sid) == [1, 2, 3]
    _, done = generate(stub, pb, session_id=sid, append_tokens=[4], offset=3, max_tokens=1, top_k=1)
    assert done.completion_tokens == 1 and smollm2_engine.session_tokens(sid)[:4] == [1, 2, 3, 4]


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER", "bEaReR"])
def test_the_bearer_scheme_is_case_insensitive(smollm2_engine, seed_proto, scheme):
    """RFC 9110 (11.1): the auth scheme is case-insensitive, on Salience as on every protocol
    (protocols/security.py's one rule)."""
    pb, pb_grpc = seed_proto
    server = ServerThread(smollm2_engine, auth_token="s3cret")
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = pb_grpc.SalienceStub(channel)
            good = [("authorization", f"{scheme} s3cret")]
            sid = stub.OpenSession(pb.OpenSessionRequest(), metadata=good).session_id
            assert stub.DumpSession(pb.DumpSessionRequest(session_id=sid), metadata=good).tokens == []
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), metadata=good)
            code, _ = _code(
                stub.OpenSession, pb.OpenSessionRequest(), metadata=[("authorization", "Basic s3cret")]
            )
            assert code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()
