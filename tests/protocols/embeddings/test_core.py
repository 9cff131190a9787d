"""The sans-IO parts with plain values: the declared pooling, the pooling math, `dimensions`,
base64, the request's forms and its errors, the tokenizer endpoints' bodies."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tokenwire.protocols.embeddings import wire
from tokenwire.protocols.embeddings.core import Embeddings, slices
from tokenwire.protocols.embeddings.pooling import declared_pooling, normalize, pool, shorten
from tokenwire.protocols.openai.errors import OpenAIError
from tokenwire.protocols.tokenizer_api import core as tok_api


# ---------------------------------------------------------------------------- the declared pooling
@pytest.mark.parametrize(
    ("value", "mode", "declared"),
    [(1, "mean", None), (2, "cls", None), (3, "last", None), (0, "mean", "none"), (4, "mean", "rank")],
)
def test_a_gguf_pooling_type(value: int, mode: str, declared: str | None) -> None:
    fields = {"general.architecture": "qwen3", "qwen3.pooling_type": value}
    found = declared_pooling(gguf_fields=fields)
    assert (found.mode, found.source, found.declared) == (mode, "gguf", declared)


def test_a_gguf_files_header_is_read(tmp_path: Path) -> None:
    import gguf

    from tokenwire.model.gguf_header import read_header

    path = str(tmp_path / "e.gguf")
    writer = gguf.GGUFWriter(path, "qwen3")
    writer.add_pooling_type(gguf.PoolingType.CLS)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert declared_pooling(gguf_fields=read_header(path).fields).mode == "cls"


def test_a_sentence_transformers_directory(tmp_path: Path) -> None:
    (tmp_path / "1_Pooling").mkdir()
    config = {
        "pooling_mode_mean_tokens": False,
        "pooling_mode_cls_token": True,
        "pooling_mode_lasttoken": False,
    }
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps(config))
    found = declared_pooling(gguf_fields={"general.architecture": "llama"}, model_dirs=(tmp_path,))
    assert (found.mode, found.source) == ("cls", "sentence-transformers")


def test_a_served_directory_declares_its_pooling(tiny_model_dir: Path, tmp_path: Path) -> None:
    """pooling_for reads the files of the engine's ModelSource (resolve_model, as serve loads)."""
    import shutil
    from types import SimpleNamespace

    from tokenwire.model.loader import resolve_model
    from tokenwire.protocols.embeddings.core import pooling_for

    model = tmp_path / "st-model"
    shutil.copytree(tiny_model_dir, model)
    (model / "1_Pooling").mkdir()
    (model / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
    source = resolve_model(model)
    engine = SimpleNamespace(source=source, config=source.config, name=source.name)
    assert pooling_for(engine).mode == "last"  # type: ignore[arg-type]
    bare = resolve_model(tiny_model_dir)
    engine = SimpleNamespace(source=bare, config=bare.config, name=bare.name)
    assert pooling_for(engine).mode == "mean"  # type: ignore[arg-type]


def test_qwen3_embedding_pools_last_and_the_rest_mean() -> None:
    qwen3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3"}
    assert declared_pooling(hf_config=qwen3, name="Qwen3-Embedding-0.6B").mode == "last"
    assert declared_pooling(hf_config={"architectures": ["Qwen3Model"]}).mode == "last"
    assert declared_pooling(hf_config=qwen3, name="Qwen3-0.6B").mode == "mean"
    llama = {"architectures": ["LlamaForCausalLM"]}
    assert declared_pooling(hf_config=llama, name="x-embedding") == declared_pooling()
    assert declared_pooling().source == "default"


# ---------------------------------------------------------------------------- the math
def test_pool_ignores_the_padding() -> None:
    hidden = torch.randn(2, 4, 3)
    lengths = torch.tensor([4, 2])
    mean = pool(hidden, lengths, "mean")
    torch.testing.assert_close(mean[0], hidden[0].mean(0))
    torch.testing.assert_close(mean[1], hidden[1, :2].mean(0))
    torch.testing.assert_close(pool(hidden, lengths, "cls"), hidden[:, 0])
    torch.testing.assert_close(pool(hidden, lengths, "last"), torch.stack([hidden[0, 3], hidden[1, 1]]))


def test_dimensions_keep_the_first_values_at_unit_length() -> None:
    vectors = torch.randn(3, 8)
    short = shorten(vectors, 5)
    assert short.shape == (3, 5)
    torch.testing.assert_close(short.norm(dim=1), torch.ones(3))
    torch.testing.assert_close(short, vectors[:, :5] / vectors[:, :5].norm(dim=1, keepdim=True))
    torch.testing.assert_close(shorten(vectors, None), normalize(vectors))


def test_slices_hold_about_one_step_each() -> None:
    lengths = [3, 600, 100, 5, 200, 100]
    groups = slices(lengths, budget=512)
    assert sorted(i for g in groups for i in g) == list(range(6))
    for group in groups:
        assert len(group) == 1 or len(group) * max(lengths[i] for i in group) <= 512


# ---------------------------------------------------------------------------- the request
def _plan(body: Any) -> wire.EmbeddingPlan:
    return wire.parse_request(body, model_name="m", hidden_size=8)


def test_the_four_input_forms() -> None:
    assert _plan({"input": "a"}).inputs == ["a"]
    assert _plan({"input": ["a", "b"]}).inputs == ["a", "b"]
    assert _plan({"input": [1, 2, 3]}).inputs == [[1, 2, 3]]
    assert _plan({"input": [[1, 2], [3]], "model": "m"}).inputs == [[1, 2], [3]]
    plan = _plan({"input": "a", "encoding_format": "base64", "dimensions": 4, "user": "u"})
    assert (plan.encoding_format, plan.dimensions) == ("base64", 4)


@pytest.mark.parametrize(
    ("body", "param", "status"),
    [
        ({"input": []}, "input", 400),
        ({}, "input", 400),
        ({"input": 5}, "input", 400),
        ({"input": ["a", 3]}, "input[1]", 400),
        ({"input": [[1, True]]}, "input[0][1]", 400),
        ({"input": [1, True]}, "input[1]", 400),
        ({"input": [True]}, "input[0]", 400),
        ({"input": "a", "dimensions": 9}, "dimensions", 400),
        ({"input": "a", "dimensions": True}, "dimensions", 400),
        ({"input": "a", "encoding_format": "int8"}, "encoding_format", 400),
        ({"input": "a", "temperature": 1}, "temperature", 400),
        ({"input": "a", "model": "other"}, "model", 404),
        ([], "body", 400),
    ],
)
def test_a_bad_request_names_its_field(body: Any, param: str, status: int) -> None:
    with pytest.raises(OpenAIError) as caught:
        _plan(body)
    assert (caught.value.status, caught.value.param) == (status, param)


def test_base64_decodes_to_the_floats() -> None:
    vectors = normalize(torch.randn(2, 8)).tolist()
    result = Embeddings(vectors, 7, "mean")
    floats = wire.response(result, _plan({"input": ["a", "b"]}), "m")
    b64 = wire.response(result, _plan({"input": ["a", "b"], "encoding_format": "base64"}), "m")
    assert floats["usage"] == {"prompt_tokens": 7, "total_tokens": 7} and floats["model"] == "m"
    for f, b in zip(floats["data"], b64["data"], strict=True):
        assert isinstance(b["embedding"], str) and f["index"] == b["index"]
        assert wire.decode_base64(b["embedding"]) == f["embedding"]


# ---------------------------------------------------------------------------- the tokenizer endpoints
def test_tokenize_both_forms(smollm2_source: Any) -> None:
    tok = smollm2_source.tokenizer
    ids = tok.encode("Hello world", add_special_tokens=False)
    assert tok_api.tokenize({"content": "Hello world"}, tok, model_name="m", max_model_len=9) == {
        "tokens": ids
    }
    vllm = tok_api.tokenize({"prompt": "Hello world", "model": "m"}, tok, model_name="m", max_model_len=9)
    assert vllm == {
        "count": len(tok.encode("Hello world")),
        "max_model_len": 9,
        "tokens": tok.encode("Hello world"),
    }
    pieces = tok_api.tokenize(
        {"content": "Hello world", "with_pieces": True}, tok, model_name="m", max_model_len=9
    )
    assert [p["id"] for p in pieces["tokens"]] == ids
    assert "".join(p["piece"] for p in pieces["tokens"]) == "Hello world"
    # a piece that is part of a character comes as its bytes
    split = tok_api.tokenize({"content": "🦙", "with_pieces": True}, tok, model_name="m", max_model_len=9)
    assert b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode()
                    for p in split["tokens"]) == "🦙".encode()  # fmt: skip


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"tokens": [1, 49152]}, "tokens[1]"),
        ({"tokens": [1, True]}, "tokens[1]"),
        ({"tokens": [-1]}, "tokens[0]"),
        ({"tokens": "1 2"}, "tokens"),
        ({}, "tokens"),
    ],
)
def test_detokenize_refuses_bad_ids(smollm2_source: Any, body: Any, param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        tok_api.detokenize(body, smollm2_source.tokenizer, model_name="m")
    assert (caught.value.status, caught.value.param) == (400, param)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"content": 3}, "content"),
        ({"content": "a", "add_special": 1}, "add_special"),
        ({"content": "a", "prompt": "b"}, "prompt"),
        ({}, "content"),
        ({"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ],
)
def test_tokenize_refuses_bad_bodies(smollm2_source: Any, body: Any, param: str) -> None:
    with pytest.raises(OpenAIError) as caught:
        tok_api.tokenize(body, smollm2_source.tokenizer, model_name="m", max_model_len=9)
    assert (caught.value.status, caught.value.param) == (400, param)


def test_apply_template_is_the_tokenizers_rendering(smollm2_source: Any) -> None:
    tok = smollm2_source.tokenizer
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    got = tok_api.apply_template({"messages": messages}, tok, model_name="m")
    assert got == {"prompt": tok.chat_prompt(messages)}
    chat = tok_api.tokenize({"messages": messages}, tok, model_name="m", max_model_len=9)
    assert chat["tokens"] == tok.apply_chat_template(messages)
