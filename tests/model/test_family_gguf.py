"""A Qwen3 GGUF as llama.cpp's converter writes it (gguf-py's tensor-name map and metadata keys,
q/k rows as they are) loads into the model its Hugging Face directory gives: F32 to 1e-4 of
transformers, Q8_0 run as its blocks equal to the same file dequantised."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import quantize as gguf_quantize
from transformers import AutoModelForCausalLM, Qwen3Config

from tests.model.test_llama_parity import dense_logits
from tests.tiny_models import _common
from tokenwire.bench.shapes import copy_shipped_tokenizer
from tokenwire.engine.factory import load_model
from tokenwire.model.loader import resolve_model


def write_gguf(hf: torch.nn.Module, path: Path, quant: str) -> None:
    c = hf.config
    w = gguf.GGUFWriter(str(path), "qwen3")
    assert copy_shipped_tokenizer(w) == c.vocab_size
    lengths = {
        "block_count": c.num_hidden_layers,
        "context_length": c.max_position_embeddings,
        "embedding_length": c.hidden_size,
        "feed_forward_length": c.intermediate_size,
        "attention.head_count": c.num_attention_heads,
        "attention.head_count_kv": c.num_key_value_heads,
        "attention.key_length": c.head_dim,
        "attention.value_length": c.head_dim,
    }
    for key, value in lengths.items():
        w.add_uint32(f"qwen3.{key}", value)
    w.add_float32("qwen3.rope.freq_base", c.rope_parameters["rope_theta"])
    w.add_float32("qwen3.attention.layer_norm_rms_epsilon", c.rms_norm_eps)
    # llama.cpp's own HF -> GGUF tensor names (gguf-py's map, not ours)
    to_gguf = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, c.num_hidden_layers)
    for name, tensor in hf.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        target, data = f"{to_gguf.get_name(stem)}.{kind}", tensor.numpy().astype(np.float32)
        if quant == "Q8_0" and data.ndim == 2:
            q8 = gguf.GGMLQuantizationType.Q8_0
            w.add_tensor(target, gguf_quantize(data, q8), raw_dtype=q8)
        else:
            w.add_tensor(target, data)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("quant", ["F32", "Q8_0"])
def test_qwen3_gguf_loads_like_its_hf_directory(tmp_path: Path, quant: str) -> None:
    torch.manual_seed(5)
    hf = AutoModelForCausalLM.from_config(Qwen3Config(**_common()), dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
    write_gguf(hf, tmp_path / f"tiny-qwen3-{quant}.gguf", quant)
    source = resolve_model(tmp_path / f"tiny-qwen3-{quant}.gguf", cache_dir=tmp_path / "cache")
    assert source.config.architecture == "Qwen3ForCausalLM"
    ids = torch.randint(0, 49152, (1, 60), generator=torch.Generator().manual_seed(6))
    dense = dense_logits(load_model(source, "fp32", torch.device("cpu"), None), ids)
    if quant == "F32":
        with torch.inference_mode():
            assert (dense - hf(ids).logits).abs().max() <= 1e-4
    else:  # the blocks as they are: same values, same math
        quantised = load_model(source, "gguf", torch.device("cpu"), None)
        assert quantised.fusion_blocker is None
        assert (dense_logits(quantised, ids) - dense).abs().max() <= 1e-4
