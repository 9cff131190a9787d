"""A GGUF's weights are read from the file into their place: quantised tensors keep the file's
blocks (each projection part in its own type), nothing is widened to fp32 unless asked, a type the
kernels do not run is refused by name, and a load's memory is the file's size, not a multiple."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.model.conftest import TinyGGUF
from tokenwire.engine.factory import load_model
from tokenwire.model.gguf import unpermute_rope_rows
from tokenwire.model.gguf_weights import GgufWeights, UnsupportedWeightTypeError
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.model.loader import resolve_model
from tokenwire.model.quant import QuantEmbedding, QuantLinear, StackedQuantLinear, split_rows
from tokenwire.model.weight_types import BY_NAME

CPU = torch.device("cpu")
# q, k Q8_0 beside a Q4_0 v and gate/up in two types: stacked projections, as K-quant mixes make
MIXED = {
    "self_attn.q_proj": "Q8_0",
    "self_attn.k_proj": "Q8_0",
    "self_attn.v_proj": "Q4_0",
    "self_attn.o_proj": "Q4_1",
    "mlp.gate_proj": "Q4_1",
    "mlp.up_proj": "Q8_0",
    "mlp.down_proj": "Q8_0",
    "model.embed_tokens": "Q8_0",
    "lm_head": "Q4_0",
}


def test_quantised_tensors_keep_the_files_blocks(
    tiny_gguf: TinyGGUF, tmp_path: Path, fp32_activations: None
) -> None:
    import gguf

    path, expected = tiny_gguf("llama", quantize=MIXED)
    source = resolve_model(path, cache_dir=tmp_path / "cache")
    assert not list(source.model_dir.glob("*.safetensors"))  # the cache holds no weights at all
    model = load_model(source, "gguf", CPU, None)
    attention, mlp = model.layers[0].attention, model.layers[0].mlp
    assert isinstance(attention.qkv, StackedQuantLinear) and isinstance(mlp.gate_up, StackedQuantLinear)
    assert [p.qtype for p in attention.qkv.parts] == [BY_NAME["Q8_0"].gguf_id, BY_NAME["Q4_0"].gguf_id]
    assert isinstance(model.embed, QuantEmbedding) and isinstance(model.lm_head, QuantLinear)
    floats = [n for n, p in model.named_parameters() if p.dim() == 2]
    assert floats == []  # every matrix stays in blocks: no fp32 copy of any
    assert model.fusion_blocker is None  # stacked parts fuse, each in its own type

    by_name = {t.name: t for t in gguf.GGUFReader(path).tensors}
    q = BY_NAME["Q8_0"]  # q's rows: the file's bytes, un-permuted, split (and laid out) for the kernels
    rows = unpermute_rope_rows(np.array(by_name["blk.0.attn_q.weight"].data), 2)
    q_part = attention.qkv.parts[0].packed[:128]
    assert torch.equal(q_part, split_rows(torch.from_numpy(rows.copy()), q.gguf_id))
    # the model computes with the file's exact values: fp32 weights of the same file agree (with
    # fp32 activations: the exact comparison; int16 ones are bounded in test_quant.py)
    dense = load_model(source, "fp32", CPU, None)
    for name, value in expected.items():
        assert name in GgufWeights(path, source.config, dense=True)
        np.testing.assert_array_equal(GgufWeights(path, source.config, dense=True)[name].numpy(), value)
    ids = torch.tensor([1, 5, 256, 7, 9, 100])
    with torch.inference_mode():
        a, _ = model(ids, torch.arange(6), DenseCausalAttention(1, 6))
        b, _ = dense(ids, torch.arange(6), DenseCausalAttention(1, 6))
    # the same exact products summed in another order (blocks vs GEMM): ~1e-7 of the scale
    assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_a_type_the_kernels_do_not_run_is_refused_by_name(tiny_gguf: TinyGGUF, tmp_path: Path) -> None:
    path, expected = tiny_gguf("llama", quantize={"mlp.down_proj": "MXFP4"})
    source = resolve_model(path, cache_dir=tmp_path / "cache")
    refused = r"blk\.0\.ffn_down\.weight is MXFP4.*--weights fp32"
    with pytest.raises(UnsupportedWeightTypeError, match=refused):
        load_model(source, "gguf", CPU, None)
    dense = load_model(source, "fp32", CPU, None)  # asked for: dequantised with gguf's reference
    down = expected["model.layers.0.mlp.down_proj.weight"]
    np.testing.assert_array_equal(dense.layers[0].mlp.down.weight.numpy(), down)


_PEAK_SCRIPT = """
import json, sys, torch
from pathlib import Path
from tokenwire.engine.factory import load_model
from tokenwire.model.loader import resolve_model
from tokenwire.model.kernels import load_kernels
load_kernels()
source = resolve_model(None, cache_dir=Path(sys.argv[1]))
def status(key):
    line = next(l for l in open("/proc/self/status") if l.startswith(key + ":"))
    return int(line.split()[1]) * 1024
Path("/proc/self/clear_refs").write_text("5")  # the peak RSS restarts from here
before = status("VmRSS")
model = load_model(source, "gguf", torch.device("cpu"), None)
print(json.dumps({"before": before, "peak": status("VmHWM"), "file": source.gguf.stat().st_size}))
"""


def test_loading_a_gguf_costs_its_size_in_memory(smollm2_source, tmp_path: Path) -> None:
    """A fresh process loads the shipped GGUF: the load's peak RSS grows by the file's size plus
    less than 80 MiB (measured 57: the tensor being read, the largest a 30 MiB embedding table,
    the rotary tables, the float norms), never by an fp32 copy (4-8x the file) or a second copy
    of the blocks (before this loader: 195 MiB for this 94 MiB file)."""
    out = subprocess.run(
        [sys.executable, "-c", _PEAK_SCRIPT, str(tmp_path / "cache")],
        capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    m = json.loads(out.stdout.strip().splitlines()[-1])
    grown = m["peak"] - m["before"]
    assert grown <= m["file"] + (80 << 20), f"RSS grew {grown >> 20} MiB for a {m['file'] >> 20} MiB file"


_START_SCRIPT = """
import json, sys
from pathlib import Path
from tokenwire.engine.factory import EngineSettings, build_engine
engine = build_engine(EngineSettings(kv_cache_mb=64, cache_dir=Path(sys.argv[1]), progress=False))
line = next(l for l in open("/proc/self/status") if l.startswith("VmHWM:"))
heavy = [m for m in ("torch._dynamo", "transformers.models.auto.tokenization_auto") if m in sys.modules]
print(json.dumps({"peak": int(line.split()[1]) * 1024, "file": engine.source.gguf.stat().st_size,
                  "kv": engine.kv_cache_mb * 2**20, "heavy": heavy}))
engine.shutdown()
"""


def test_a_whole_start_peaks_under_the_file_the_kv_cache_and_300_mib(smollm2_source, tmp_path: Path) -> None:
    """A fresh process starts the engine on the shipped GGUF (interpreter, torch, tokenizer,
    weights, a 64 MiB KV cache, warm-up), first with its conversion (a new cache), then warm:
    each peak RSS stays within the file + the KV cache + 300 MiB. Warm, it measured 440 of 458
    MiB; 512 before, when the meta-device init imported torch._dynamo, AutoTokenizer every
    model's registry (the conversion still does), and glibc kept the read buffers."""
    for start in ("first", "warm"):
        out = subprocess.run(
            [sys.executable, "-c", _START_SCRIPT, str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=300, check=True,
        )  # fmt: skip
        m = json.loads(out.stdout.strip().splitlines()[-1])
        limit = m["file"] + m["kv"] + (300 << 20)
        assert m["peak"] <= limit, f"{start} start: peak RSS {m['peak'] >> 20} MiB over {limit // 2**20:.0f}"
    assert m["heavy"] == []


def test_meta_modules_skip_their_init_and_real_ones_keep_it() -> None:
    from torch import nn

    from tokenwire.model.layers.weights import meta_init_skipped

    with meta_init_skipped():
        real = nn.Linear(64, 64)
        meta = nn.Linear(64, 64, device="meta")
    assert meta.weight.is_meta
    assert 0 < float(real.weight.detach().abs().max()) <= 1 / 8  # kaiming-uniform's bound, 1 / sqrt(64)
    assert nn.init.normal_.__module__ == "torch.nn.init"  # restored


TINY_K_QUANT = Path(__file__).parent.parent / "data" / "tiny-llama-Q4_K_M.gguf"  # make_tiny_kquant.py
# int16 activations against fp32 ones on that model: the logits' largest gap over their largest
# magnitude (measured 2.1e-4 through its 4 random layers; each activation is rounded to 1/65534
# of its block's largest value)
# the tiled types' int8 activations (a scale per 32; kernels/tiles.h): seen 2.7e-2 of the scale
# on this tiny random file (int16 activations had stayed under 1e-3)
INTEGER_LOGIT_RTOL = 6e-2


def test_a_k_quant_mix_written_by_llama_cpp_runs_as_its_blocks(tmp_path: Path) -> None:
    """llama.cpp's Q4_K_M recipe on a tiny random Llama: Q4_K, and Q6_K for v and down in the
    last layers and for the output. Every tensor stays in its type (v beside q/k: a stacked
    projection), resident like the file, and the logits are the fp32 model's of the same values:
    to 1e-5 of their scale with fp32 activations, to INTEGER_LOGIT_RTOL with the integer ones."""
    from tokenwire.model.kernels import ops
    from tokenwire.model.quant import resident_bytes

    source = resolve_model(TINY_K_QUANT, cache_dir=tmp_path / "cache")
    model = load_model(source, "gguf", CPU, None)
    q4_k, q6_k = BY_NAME["Q4_K"].gguf_id, BY_NAME["Q6_K"].gguf_id
    first, last = model.layers[0].attention.qkv, model.layers[3].attention.qkv
    assert isinstance(first, QuantLinear) and first.qtype == q4_k
    assert isinstance(last, StackedQuantLinear) and [p.qtype for p in last.parts] == [q4_k, q6_k]
    assert model.layers[3].mlp.down.qtype == q6_k and model.lm_head.qtype == q6_k
    assert model.fusion_blocker is None
    assert resident_bytes(model) <= 1.05 * TINY_K_QUANT.stat().st_size
    dense = load_model(source, "fp32", CPU, None)
    ids = torch.tensor([257, 104, 105, 32, 116, 104, 101, 114, 101, 33])
    with torch.inference_mode():
        exact = dense.logits(dense(ids, torch.arange(10), DenseCausalAttention(1, 10))[0])
        int16 = model.logits(model(ids, torch.arange(10), DenseCausalAttention(1, 10))[0])
        ops().set_int16_activations(False)
        try:
            fp32 = model.logits(model(ids, torch.arange(10), DenseCausalAttention(1, 10))[0])
        finally:
            ops().set_int16_activations(True)
    scale = exact.abs().max()
    assert (fp32 - exact).abs().max() <= 1e-5 * scale
    assert (int16 - exact).abs().max() <= INTEGER_LOGIT_RTOL * scale
