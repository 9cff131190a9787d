"""Numbers are validated as numbers (a hostile-client probe): NaN or infinity in a GenerateConfig,
a negative seed, true/false as token ids are INVALID_ARGUMENT naming the field (NaN was
INTERNAL), nothing is left behind in the engine, the server serves on; the bearer scheme is
case-insensitive."""

from __future__ import annotations

import argparse
import json

import grpc
import pytest

from tests.protocols.evergreen.conftest import ServerThread, text_of
from tests.protocols.evergreen.helpers import action, leaf, message
from tokenwire.protocols.evergreen.gen import evergreen_service_pb2_grpc as spb_grpc
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb

NAN, INF = float("nan"), float("inf")


def generate_with(config: twpb.GenerateConfig) -> list:
    return [leaf("p", "Hi"), action("GENERATE", {"prompt": "p"}, {"response": "r"}, [config])]


def detokenize(text: str) -> list:
    return [
        leaf("ids", text, mimetype="application/json"),
        action("DETOKENIZE", {"tokens": "ids"}, {"text": "out"}),
    ]


@pytest.mark.parametrize(
    ("items", "words"),
    [
        (generate_with(twpb.GenerateConfig(temperature=NAN, max_tokens=2)), "temperature"),
        (generate_with(twpb.GenerateConfig(temperature=INF, max_tokens=2)), "temperature"),
        (generate_with(twpb.GenerateConfig(top_p=-INF, max_tokens=2)), "top_p"),
        (generate_with(twpb.GenerateConfig(seed=-1, max_tokens=2)), "seed"),
        (generate_with(twpb.GenerateConfig(top_logprobs=-1, logprobs=True, max_tokens=2)), "top_logprobs"),
        (detokenize("[true, false]"), "token id [0]"),
        (detokenize("[1, 2, false]"), "token id [2]"),
        (detokenize("[1.0]"), "token id [0]"),
        (
            [leaf("a", "x"), action("SET_TTL", {"node": "a"}, configs=[twpb.TtlConfig(ttl_seconds=INF)])],
            "ttl",
        ),
    ],
)
def test_bad_numbers_are_invalid_arguments_naming_the_field(conversation, smollm2_engine, items, words):
    sessions = smollm2_engine.stats()["sessions"]
    c = conversation()
    for item in items:
        c.requests.put(message(item))
    error = c.abort_status()
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and words in error.details(), error.details()
    assert smollm2_engine.stats()["sessions"] == sessions  # no engine session left behind
    good = conversation()  # and the server serves on
    ids = smollm2_engine.tokenizer.encode("Hello there", add_special_tokens=False)
    for item in detokenize(json.dumps(ids)):
        good.requests.put(message(item))
    assert text_of(good.read_until_final("out")) == "Hello there"
    assert good.close() == []


@pytest.mark.parametrize("scheme", ["Bearer", "bearer", "BEARER"])
def test_the_bearer_scheme_is_case_insensitive(smollm2_engine, scheme):
    args = argparse.Namespace(auth_token="s3cret", evergreen_max_depth=8, evergreen_max_nodes=50)
    server = ServerThread(smollm2_engine, args)
    try:
        with grpc.insecure_channel(server.target) as channel:
            stub = spb_grpc.EvergreenServiceStub(channel)
            requests = [message(item) for item in detokenize("[19556]")]
            replies = stub.StartSession(
                iter(requests), metadata=[("authorization", f"{scheme} s3cret")], timeout=60
            )
            assert any(f.id == "out" for reply in replies for f in reply.node_fragments)
            refused = stub.StartSession(
                iter(requests), metadata=[("authorization", "Basic s3cret")], timeout=60
            )
            with pytest.raises(grpc.RpcError) as error:
                list(refused)
            assert error.value.code() == grpc.StatusCode.UNAUTHENTICATED
    finally:
        server.stop()
