"""Concept readouts over the wire equal a direct computation from the model's hidden states.

A tiny random-weight model with a concept set (the shared real-model engine has none; loading
the real model a second time would cost more than the check gains). transformers' forward pass
with output_hidden_states is the oracle.
"""

from __future__ import annotations

import grpc
import pytest
import torch

from tests.protocols.salience.conftest import ServerThread
from tests.protocols.salience.helpers import generate
from tests.tiny_models import hf_model, ours_from_hf
from tokenwire.engine.concepts import ConceptSet
from tokenwire.engine.engine import Engine


@pytest.fixture(scope="module")
def tiny(smollm2_source):
    hf = hf_model("llama2")
    g = torch.Generator().manual_seed(7)
    concepts = ConceptSet(["joy", "fear", "time"], [0, 2], torch.randn(2, 3, 64, generator=g))
    engine = Engine(ours_from_hf(hf), smollm2_source.tokenizer, name="tiny", kv_cache_mb=8, concepts=concepts)
    server = ServerThread(engine)
    yield hf, engine, concepts, server
    server.stop()
    engine.shutdown()


def test_manifest_lists_the_concept_set(tiny, seed_proto):
    _, _, _, server = tiny
    pb, pb_grpc = seed_proto
    with grpc.insecure_channel(server.target) as channel:
        manifest = pb_grpc.SalienceStub(channel).GetReadoutManifest(pb.GetReadoutManifestRequest())
    assert list(manifest.concepts) == ["joy", "fear", "time"] and list(manifest.layers) == [0, 2]
    assert manifest.hidden_size == 64 and manifest.dtype == "float32"


def test_readouts_equal_projection_of_hidden_states(tiny, seed_proto):
    hf, engine, concepts, server = tiny
    pb, pb_grpc = seed_proto
    prompt = engine.tokenizer.encode("Readouts read the residual stream, layer by layer.")
    n = len(prompt)
    with grpc.insecure_channel(server.target) as channel:
        stub = pb_grpc.SalienceStub(channel)
        sid = stub.OpenSession(pb.OpenSessionRequest(model="tiny")).session_id
        tokens, done = generate(
            stub, pb, session_id=sid, append_tokens=prompt, offset=0, max_tokens=4, top_k=1,
            readout_ranges=[(2, 6), (n - 1, n + 2)],
        )  # fmt: skip
        full = list(stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens)
        stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    with torch.no_grad():
        hidden = hf(torch.tensor([full]), output_hidden_states=True).hidden_states
    expected = concepts.project(concepts.stack_layers([h[0] for h in hidden]))  # [P, layers, concepts]
    covered = [*range(2, 6), n - 1, n, n + 1]
    with_readout = [t for t in tokens if len(t.readout)]
    assert [t.position for t in with_readout] == covered
    assert [t.is_prefill for t in with_readout] == [True] * 5 + [False] * 2
    for t in with_readout:
        got = torch.tensor(list(t.readout)).reshape(2, 3)  # [n_layers][n_concepts], flattened
        torch.testing.assert_close(got, expected[t.position], atol=1e-3, rtol=1e-4)
    assert all(len(t.readout) == 0 for t in tokens if t.position not in covered)
    assert done.completion_tokens == 4
