from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

from tokenwire.engine.concepts import FORMAT, ConceptSet, build_concept


def make_set(names=("a", "b"), layers=(0, 3, 5), hidden=8, seed=0) -> ConceptSet:
    g = torch.Generator().manual_seed(seed)
    return ConceptSet(list(names), list(layers), torch.randn(len(layers), len(names), hidden, generator=g))


def test_save_load_round_trip(tmp_path):
    cs = make_set()
    p = tmp_path / "c.safetensors"
    cs.save(p)
    back = ConceptSet.load(p, hidden_size=8, num_layers=5)
    assert back.names == ["a", "b"] and back.layers == [0, 3, 5]
    assert back.vectors.dtype == torch.float32 and torch.equal(back.vectors, cs.vectors)


def test_load_validation_against_model(tmp_path):
    p = tmp_path / "c.safetensors"
    make_set().save(p)
    with pytest.raises(ValueError, match="hidden size 8"):
        ConceptSet.load(p, hidden_size=16)
    with pytest.raises(ValueError, match="layer 5 out of range"):
        ConceptSet.load(p, num_layers=4)
    with pytest.raises(FileNotFoundError):
        ConceptSet.load(tmp_path / "missing.safetensors")


def _write(p, tensors, meta):
    save_file(tensors, str(p), metadata=meta)


@pytest.mark.parametrize(
    ("tensors", "meta", "needle"),
    [
        ({"vectors": torch.zeros(2, 1, 4)}, {"format": FORMAT, "names": '["x"]'}, "missing tensor"),
        (
            {"vectors": torch.zeros(2, 1, 4), "layers": torch.tensor([0, 1])},
            {"format": "other", "names": '["x"]'},
            "format",
        ),
        ({"vectors": torch.zeros(2, 1, 4), "layers": torch.tensor([0, 1])}, {"format": FORMAT}, "names"),
        (
            {"vectors": torch.zeros(2, 1, 4), "layers": torch.tensor([0, 1])},
            {"format": FORMAT, "names": '{"x": 1}'},
            "list of strings",
        ),
        (
            {"vectors": torch.zeros(2, 1, 4), "layers": torch.tensor([0, 1], dtype=torch.int32)},
            {"format": FORMAT, "names": '["x"]'},
            "int64",
        ),
        (
            {"vectors": torch.zeros(3, 1, 4), "layers": torch.tensor([0, 1])},
            {"format": FORMAT, "names": '["x"]'},
            "3 layer rows",
        ),
        (
            {"vectors": torch.zeros(2, 2, 4), "layers": torch.tensor([0, 1])},
            {"format": FORMAT, "names": '["x"]'},
            "2 concept columns",
        ),
        (
            {"vectors": torch.zeros(2, 1, 4), "layers": torch.tensor([1, 1])},
            {"format": FORMAT, "names": '["x"]'},
            "duplicate layers",
        ),
        (
            {"vectors": torch.zeros(2, 1, 4), "layers": torch.tensor([-1, 1])},
            {"format": FORMAT, "names": '["x"]'},
            ">= 0",
        ),
        (
            {"vectors": torch.zeros(2, 4), "layers": torch.tensor([0, 1])},
            {"format": FORMAT, "names": '["x"]'},
            "3-D",
        ),
    ],
)
def test_load_rejects_bad_files(tmp_path, tensors, meta, needle):
    p = tmp_path / "bad.safetensors"
    _write(p, tensors, meta)
    with pytest.raises(ValueError, match=needle):
        ConceptSet.load(p)


def test_load_rejects_garbage(tmp_path):
    p = tmp_path / "junk.safetensors"
    p.write_bytes(b"not a safetensors file at all")
    with pytest.raises(ValueError, match="safetensors"):
        ConceptSet.load(p)


def test_constructor_validates():
    with pytest.raises(ValueError, match="duplicate concept names"):
        ConceptSet(["a", "a"], [0], torch.zeros(1, 2, 4))
    with pytest.raises(ValueError, match="concept columns"):
        ConceptSet(["a"], [0], torch.zeros(1, 2, 4))


def test_build_concept_math():
    pos = {2: torch.tensor([[3.0, 0.0, 1.0], [5.0, 0.0, 1.0]]), 0: torch.tensor([[1.0, 1.0, 0.0]])}
    neg = {0: torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]]), 2: torch.tensor([[0.0, 0.0, 1.0]])}
    cs = build_concept("happy", pos, neg)
    assert cs.names == ["happy"] and cs.layers == [0, 2]
    assert cs.vectors.shape == (2, 1, 3)
    # layer 0: mean diff (0,1,0); layer 2: (4,0,0) -> unit (1,0,0)
    torch.testing.assert_close(cs.vectors[:, 0], torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]]))
    raw = build_concept("happy", pos, neg, normalize=False)
    torch.testing.assert_close(raw.vectors[1, 0], torch.tensor([4.0, 0.0, 0.0]))


def test_build_concept_errors():
    a = torch.ones(2, 3)
    with pytest.raises(ValueError, match="different layers"):
        build_concept("x", {0: a}, {1: a})
    with pytest.raises(ValueError, match="identical"):
        build_concept("x", {0: a}, {0: a})
    with pytest.raises(ValueError, match="hidden sizes differ"):
        build_concept("x", {0: a}, {0: torch.ones(2, 4)})
    with pytest.raises(ValueError, match=r"\[N>=1, hidden\]"):
        build_concept("x", {0: torch.ones(0, 3)}, {0: a})


def test_project_shapes_and_values():
    cs = make_set(hidden=8)
    h = torch.randn(5, 3, 8)
    out = cs.project(h)
    assert out.shape == (5, 3, 2) and out.dtype == torch.float32
    for p in range(5):
        for li in range(3):
            for c in range(2):
                torch.testing.assert_close(out[p, li, c], h[p, li] @ cs.vectors[li, c])
    assert cs.project(h.to(torch.bfloat16)).dtype == torch.float32
    with pytest.raises(ValueError, match=r"\[\.\.\., 3, 8\]"):
        cs.project(torch.randn(5, 2, 8))


def test_stack_layers_matches_hidden_states_convention():
    cs = make_set(layers=(0, 2), hidden=4)
    hidden_states = tuple(torch.full((1, 6, 4), float(i)) for i in range(4))  # embeddings + 3 blocks
    stacked = cs.stack_layers(hidden_states)
    assert stacked.shape == (1, 6, 2, 4)
    assert stacked[0, 0, 0, 0] == 0.0 and stacked[0, 0, 1, 0] == 2.0
    assert cs.project(stacked).shape == (1, 6, 2, 2)


def test_merge():
    a = make_set(names=("a",), seed=1)
    b = make_set(names=("b", "c"), seed=2)
    m = a.merge(b)
    assert m.names == ["a", "b", "c"] and m.vectors.shape == (3, 3, 8)
    assert torch.equal(m.vectors[:, 1:], b.vectors)
    with pytest.raises(ValueError, match="duplicate"):
        m.merge(a)
    with pytest.raises(ValueError, match="different layers"):
        a.merge(make_set(names=("z",), layers=(0, 3)))
    with pytest.raises(ValueError, match="hidden sizes"):
        a.merge(make_set(names=("z",), hidden=4))


def test_names_metadata_is_json(tmp_path):
    p = tmp_path / "c.safetensors"
    make_set(names=("naïve", 'quo"te')).save(p)
    from safetensors import safe_open

    with safe_open(str(p), framework="pt") as f:
        meta = f.metadata()
    assert meta["format"] == FORMAT and json.loads(meta["names"]) == ["naïve", 'quo"te']
    assert ConceptSet.load(p).names == ["naïve", 'quo"te']
