"""The KV cache in each storage type (--kv-dtype): the fused step's attention against a float64
reference, its arithmetic the same however the work is shared out, and an engine's sessions
(many blocks, a fork, a truncate, prefix-cache hits) giving the same bits as fresh runs."""

from __future__ import annotations

import pytest
import torch

from tests.engine.test_engine_parity import GREEDY, rand_tokens
from tests.tiny_models import hf_model
from tokenwire.engine.engine import Engine
from tokenwire.engine.kv_cache import Q8_BLOCK, KVCache, kv_bytes_per_token
from tokenwire.engine.request import GenerateOptions
from tokenwire.model import kernels
from tokenwire.model.families import build_model, read_config
from tokenwire.model.layers.weights import quantize_state
from tokenwire.model.quant import Q4_1

STORED = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16, "q8": torch.int8}
# |attention - float64 attention over the values as given| for N(0, 1) keys and values and
# scores of about unit spread: the storage's rounding (fp16 2^-11, bf16 2^-8, q8 amax/254 a
# value) averaged over the positions. Measured maxima over these tests: fp32 1.7e-7, fp16 2.9e-4,
# bf16 3.0e-3, q8 6.4e-3.
BOUND_VS_GIVEN = {"fp32": 1e-6, "fp16": 1e-3, "bf16": 1e-2, "q8": 2e-2}
# |attention - float64 attention over the values as stored (dequantised)|: fp32 arithmetic alone
# (measured at most 2.4e-7)
BOUND_VS_STORED = 1e-6


def _cache(kv: str, blocks: int, bs: int, kv_heads: int, d: int, rows: torch.Tensor, slots: torch.Tensor):
    """One layer's cache holding `rows` [n, kv_heads, d] at `slots`, stored by the kernel."""
    cache = torch.zeros(blocks, bs, kv_heads, d, dtype=STORED[kv])
    scales = torch.zeros(blocks, bs, kv_heads, d // Q8_BLOCK, dtype=torch.float16) if kv == "q8" else None
    kernels.ops().kv_store(cache, scales, slots, rows)
    return cache, scales


def _stored(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
    """The cache's values as the kernel reads them, in float64."""
    if scales is None:
        return cache.double()
    return (scales.float().repeat_interleave(Q8_BLOCK, -1) * cache.float()).double()


def _reference(q, keys, values, positions, tables, bs, window, scale) -> torch.Tensor:
    """float64 softmax attention of each row over its sequence's positions [from, pos]; keys and
    values [slots, kv_heads, d]."""
    out = []
    rep = q.shape[1] // keys.shape[1]
    for m, p in enumerate(positions.tolist()):
        first = max(0, p + 1 - window) if window else 0
        t = torch.arange(first, p + 1)
        slots = tables[m, t // bs] * bs + t % bs
        k = keys[slots].repeat_interleave(rep, 1)  # [T, heads, d]
        v = values[slots].repeat_interleave(rep, 1)
        w = torch.softmax(torch.einsum("hd,thd->ht", q[m].double(), k) * scale, -1)
        out.append(torch.einsum("ht,thd->hd", w, v).reshape(-1))
    return torch.stack(out)


# heads a KV head: 3, 2, 3, 4 (llama-1b's: one group of 4 on AVX2), 5 (groups of 3 and 2) and
# gemma3-1b's 4 of 256 values (AVX-512: one head at a time), and one (AVX2: a group of 1)
SHAPES = [(6, 2, 64), (4, 2, 128), (3, 1, 32), (8, 2, 64), (5, 1, 32), (4, 1, 256), (2, 2, 32)]


@pytest.mark.parametrize("kv", list(STORED))
@pytest.mark.parametrize("heads,kv_heads,d", SHAPES)
def test_attention_over_many_blocks_matches_float64(kv: str, heads: int, kv_heads: int, d: int) -> None:
    torch.manual_seed(heads * d)
    bs, blocks = 16, 180
    # three sequences scattered over shuffled blocks: 1,900 positions (8 chunks of 256), 700, 37
    order = torch.randperm(blocks)
    lengths = [1900, 700, 37]
    tables = torch.zeros(len(lengths), 120, dtype=torch.long)
    used = 0
    for i, n in enumerate(lengths):
        need = -(-n // bs)
        tables[i, :need] = order[used : used + need]
        used += need
    slots = torch.cat(
        [tables[i, t // bs] * bs + t % bs for i, n in enumerate(lengths) for t in [torch.arange(n)]]
    )
    keys_given = torch.randn(len(slots), kv_heads, d)
    values_given = torch.randn(len(slots), kv_heads, d)
    k, ks = _cache(kv, blocks, bs, kv_heads, d, keys_given, slots)
    v, vs = _cache(kv, blocks, bs, kv_heads, d, values_given, slots)
    given_k = torch.zeros(blocks * bs, kv_heads, d, dtype=torch.float64)
    given_v = torch.zeros_like(given_k)
    given_k[slots], given_v[slots] = keys_given.double(), values_given.double()
    q = torch.randn(len(lengths), heads, d)
    positions = torch.tensor([n - 1 for n in lengths])
    scale = d**-0.5
    for window in (0, 300):
        got = kernels.ops().paged_attention(q, k, v, ks, vs, positions, tables, window, scale)
        flat = (-1, kv_heads, d)
        stored = _reference(
            q, _stored(k, ks).view(flat), _stored(v, vs).view(flat), positions, tables, bs, window, scale
        )
        given = _reference(q, given_k, given_v, positions, tables, bs, window, scale)
        assert (got.double() - stored).abs().max() <= BOUND_VS_STORED
        assert (got.double() - given).abs().max() <= BOUND_VS_GIVEN[kv]
        # the same bits whether each row's chunks run in one task or are shared out, and
        # whether the row runs alone
        for split in (0, 1):
            again = kernels.ops().paged_attention(q, k, v, ks, vs, positions, tables, window, scale, split)
            assert torch.equal(again, got)
        alone = kernels.ops().paged_attention(q[:1], k, v, ks, vs, positions[:1], tables[:1], window, scale)
        assert torch.equal(alone, got[:1])


@pytest.mark.parametrize(
    "kv,heads,kv_heads,d",
    [
        (kv, *shape)
        for kv in STORED
        for shape in [(9, 3, 64), (6, 2, 16), (3, 1, 32), (8, 2, 64), (16, 2, 32), (4, 1, 256), (2, 2, 64)]
        if kv != "q8" or shape[2] % Q8_BLOCK == 0  # q8 needs a head size that is a multiple of 32
    ],
)
def test_rows_of_one_sequence_read_together_give_each_row_its_bits_alone(
    kv: str, heads: int, kv_heads: int, d: int
) -> None:
    """A decode row and its guesses (issue 45), and 20 and 70 rows of a prefill chunk (groups of
    16, or up to 64 where the chunk is converted: two groups either way): rows of one sequence
    share each chunk's read of the cache (kernels/paged_attention.h; on AVX2 a chunk converted to
    fp32 once for them); each row's output is the bits it gets alone (read from the cache as it
    is), and matches float64."""
    torch.manual_seed(heads + d)
    bs, blocks = 16, 160
    table = torch.randperm(blocks)[:140]
    n = 2100  # positions stored: rows end past 8 chunks of 256, the last chunk partly
    slots = table[torch.arange(n) // bs] * bs + torch.arange(n) % bs
    keys_given, values_given = torch.randn(n, kv_heads, d), torch.randn(n, kv_heads, d)
    k, ks = _cache(kv, blocks, bs, kv_heads, d, keys_given, slots)
    v, vs = _cache(kv, blocks, bs, kv_heads, d, values_given, slots)
    scale = d**-0.5
    flat = (-1, kv_heads, d)
    keys, values = _stored(k, ks).view(flat), _stored(v, vs).view(flat)
    for first, rows in ((2047, 5), (2060, 20), (1990, 70)):  # 5 and 70 across a chunk boundary (2048)
        q = torch.randn(rows, heads, d)
        positions = torch.arange(first, first + rows)
        tables = table.repeat(rows, 1).contiguous()
        for window in (0, 300):
            got = kernels.ops().paged_attention(q, k, v, ks, vs, positions, tables, window, scale)
            stored = _reference(q, keys, values, positions, tables, bs, window, scale)
            assert (got.double() - stored).abs().max() <= BOUND_VS_STORED
            for split in (0, 1):
                together = kernels.ops().paged_attention(
                    q, k, v, ks, vs, positions, tables, window, scale, split
                )
                assert torch.equal(together, got)
            # every row of the short cases; of 70, each group's first and last rows and two inside
            for m in range(rows) if rows <= 20 else (0, 1, 15, 16, 31, 32, 40, 63, 64, 69):
                alone = kernels.ops().paged_attention(
                    q[m : m + 1], k, v, ks, vs, positions[m : m + 1], tables[m : m + 1], window, scale
                )
                assert torch.equal(alone, got[m : m + 1])


@pytest.mark.parametrize("kv", ["fp16", "bf16"])
def test_the_kernel_stores_what_torch_rounds_to(kv: str) -> None:
    """The eager path writes its cache with torch's .to(), the fused step with the kernel: the
    same bits, so either may read what the other wrote."""
    rows = torch.randn(64, 2, 64) * torch.logspace(-6, 4, 64)[:, None, None]
    cache, _ = _cache(kv, 4, 16, 2, 64, rows, torch.arange(64))
    assert torch.equal(cache.view(64, 2, 64), rows.to(STORED[kv]))


@pytest.mark.parametrize("kv", list(STORED))
def test_as_stored_rounds_as_the_cache_stores(kv: str) -> None:
    """A dense pass without the cache (GraphPipe) rounds its keys and values with as_stored:
    the values the engine's cache would give back, bit for bit."""
    from tokenwire.engine.kv_cache import as_stored

    rows = torch.randn(32, 2, 64) * torch.logspace(-3, 3, 32)[:, None, None]
    cache, scales = _cache(kv, 2, 16, 2, 64, rows, torch.arange(32))
    assert torch.equal(as_stored(rows, kv), _stored(cache, scales).float().view(32, 2, 64))


def test_q8_rows_are_int8_with_a_scale_per_32() -> None:
    rows = torch.randn(16, 1, 64) * 3
    cache, scales = _cache("q8", 1, 16, 1, 64, rows, torch.arange(16))
    assert scales is not None
    amax = rows.view(16, 2, 32).abs().amax(-1)
    assert torch.equal(scales.view(16, 2), (amax / 127).to(torch.float16))
    assert cache.abs().max() == 127
    back = _stored(cache, scales).view(16, 64).float()
    assert (back - rows.view(16, 64)).abs().max() <= (amax / 127).max() * 0.51


def _tiny_quantised() -> torch.nn.Module:
    hf = hf_model("llama_d128")  # head size 128: every type, q8's blocks of 32 included
    tensors, qtypes = quantize_state(dict(hf.state_dict()), Q4_1)
    return build_model(read_config(hf.config.to_dict()), tensors, qtypes)


@pytest.fixture(scope="module")
def quantised() -> torch.nn.Module:
    return _tiny_quantised()


def _events(engine: Engine, session: str | None, tokens: list[int], n: int = 8, cache: bool = True):
    opts = GenerateOptions(
        max_tokens=n, ignore_eos=True, sampling=GREEDY, logprobs=True, use_prefix_cache=cache
    )
    events, _ = engine.generate(session, tokens, opts).result()
    return [(e.token_id, e.logprob) for e in events]


def _check_attention_over_the_engines_cache(engine: Engine, sid: str) -> None:
    """A query at a session's last position over its blocks in the engine's cache (every layer):
    the kernel's attention against float64 over the rows as stored."""
    kv, config = engine.kv, engine.model.config
    session = engine._sessions[sid]
    n = len(session.tokens) - 1  # the last token's KV is written by the next step
    table = torch.tensor([session.block_table[: -(-n // kv.block_size)]])
    q = torch.randn(1, config.num_heads, config.head_dim, generator=torch.Generator().manual_seed(n))
    positions, scale = torch.tensor([n - 1]), config.head_dim**-0.5
    flat = (-1, config.num_kv_heads, config.head_dim)
    for layer in range(config.num_layers):
        scales = (None, None) if kv.k_scale is None else (kv.k_scale[layer], kv.v_scale[layer])
        got = kernels.ops().paged_attention(q, kv.k[layer], kv.v[layer], *scales, positions, table, 0, scale)
        keys, values = (x.reshape(flat) for x in kv.read(layer, slice(None), torch.float64))
        want = _reference(q, keys, values, positions, table, kv.block_size, 0, scale)
        assert (got.double() - want).abs().max() <= BOUND_VS_STORED


@pytest.mark.parametrize("kv", ["fp32", "fp16", "bf16", "q8"])
def test_sessions_fork_truncate_and_prefix_hits_give_fresh_runs_bits(quantised, tokenizer, kv: str) -> None:
    """A session over many blocks, forked mid-block, truncated and continued, and a prompt whose
    KV comes from the prefix cache: each continuation is bit for bit the run that computes the
    same tokens from scratch, with the cache in `kv`."""
    engine = Engine(quantised, tokenizer, name="tiny", kv_cache_mb=32, kv_dtype=kv)
    assert engine.kv.kv_dtype == kv and engine.kv.k.dtype == STORED[kv]
    try:
        prompt = rand_tokens(300, 5)  # 19 blocks of 16
        sid = engine.create_session()
        first = _events(engine, sid, prompt)
        assert first == _events(engine, None, prompt, cache=False)
        history = engine.session_tokens(sid)
        child = engine.fork_session(sid, at=250)  # mid-block: the shared block is copied
        more = rand_tokens(20, 6)
        assert _events(engine, child, more) == _events(engine, None, history[:250] + more, cache=False)
        _check_attention_over_the_engines_cache(engine, child)
        engine.truncate_session(sid, 123)
        assert _events(engine, sid, more) == _events(engine, None, history[:123] + more, cache=False)
        _check_attention_over_the_engines_cache(engine, sid)
        hits = engine.stats()["prefix_cache_hits"]
        assert _events(engine, None, history[:250] + more) == _events(
            engine, None, history[:250] + more, cache=False
        )
        assert engine.stats()["prefix_cache_hits"] > hits
    finally:
        engine.shutdown()


def test_the_budget_in_tokens_doubles_with_fp16(quantised, tokenizer) -> None:
    from tokenwire.metrics import EngineCollector

    tokens = {}
    for kv in ("fp32", "fp16", "q8"):
        engine = Engine(quantised, tokenizer, name="tiny", kv_cache_mb=8, kv_dtype=kv)
        try:
            tokens[kv] = engine.stats()["kv_tokens_total"]
            gauges = {m.name: m for m in EngineCollector(engine).collect()}  # type: ignore[arg-type]
            sample = gauges["tokenwire_kv_cache_tokens"].samples[0]
            assert sample.labels == {"kv_dtype": kv} and sample.value == tokens[kv]
            stored = gauges["tokenwire_kv_cache_bytes"].samples[0].value
            assert stored == tokens[kv] * kv_bytes_per_token(quantised.config, kv) <= 8 * 2**20
        finally:
            engine.shutdown()
    assert tokens["fp16"] == 2 * tokens["fp32"]
    assert tokens["q8"] >= 3.7 * tokens["fp32"]
    assert KVCache.bytes_per_block(quantised.config, 16, "q8") == 16 * 2 * 2 * 128 * (1 + 2 / 32)


def test_auto_is_fp16_for_quantised_weights_and_the_model_dtype_else(tokenizer) -> None:
    from tests.tiny_models import ours_from_hf

    quantised = Engine(_tiny_quantised(), tokenizer, name="q", kv_cache_mb=4)
    fp32 = Engine(ours_from_hf(hf_model("llama_d128")), tokenizer, name="f", kv_cache_mb=4)
    try:
        assert quantised.kv.kv_dtype == "fp16" and fp32.kv.kv_dtype == "fp32"
    finally:
        quantised.shutdown()
        fp32.shutdown()


def test_a_bad_kv_dtype_is_refused_by_name(tokenizer) -> None:
    from tests.tiny_models import ours_from_hf

    with pytest.raises(ValueError, match="unknown --kv-dtype 'int3'"):
        Engine(ours_from_hf(hf_model("llama_d128")), tokenizer, name="f", kv_cache_mb=4, kv_dtype="int3")
    with pytest.raises(ValueError, match="multiple of 32; this model's is 16"):
        Engine(ours_from_hf(hf_model("smollm2")), tokenizer, name="f", kv_cache_mb=4, kv_dtype="q8")


# |logprob - transformers'| of an fp32 model's eager path (SDPA over the cache read back in fp32)
# with each KV type, over 150 prompt tokens. Measured: fp32 9.5e-7, fp16 1.3e-4, bf16 1.3e-3,
# q8 3.0e-3 (fp32 keeps the parity rule's 1e-4).
EAGER_LOGPROB_BOUND = {"fp32": 1e-4, "fp16": 1e-3, "bf16": 1e-2, "q8": 1e-2}


@pytest.mark.parametrize("kv", list(STORED))
def test_the_eager_path_reads_every_kv_type(tokenizer, kv: str) -> None:
    from tests.engine.test_engine_parity import hf_prompt_logprobs, prompt_logprobs
    from tests.tiny_models import ours_from_hf

    hf = hf_model("llama_d128")
    engine = Engine(ours_from_hf(hf), tokenizer, name="f", kv_cache_mb=8, kv_dtype=kv, max_batch_tokens=64)
    assert not engine.model.can_fuse_decode  # fp32 weights: the eager layers and PagedAttention
    try:
        tokens = rand_tokens(150, 1)  # three prefill chunks reading the cache back
        got = prompt_logprobs(engine, tokens)
        assert (got - hf_prompt_logprobs(hf, tokens)).abs().max() <= EAGER_LOGPROB_BOUND[kv]
    finally:
        engine.shutdown()
