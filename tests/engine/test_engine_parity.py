"""The paged, batched engine computes what transformers computes, whatever shares its batch."""

from __future__ import annotations

import pytest
import torch

from tests.tiny_models import hf_model, ours_from_hf
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams

GREEDY = SamplingParams(temperature=0.0)


def make_engine(arch: str, tokenizer, **kw) -> tuple[Engine, torch.nn.Module]:
    hf = hf_model(arch)
    engine = Engine(
        ours_from_hf(hf), tokenizer, name=f"tiny-{arch}", kv_cache_mb=kw.pop("kv_cache_mb", 16), **kw
    )
    return engine, hf


def prompt_logprobs(
    engine: Engine, tokens: list[int], session: str | None = None, append=None
) -> torch.Tensor:
    """Logprob of every prompt token (position >= 1) as the engine reports it."""
    length = len(tokens)
    opts = GenerateOptions(max_tokens=0, logprob_ranges=[(1, length)], logprobs=True)
    events, finish = engine.generate(session, tokens if append is None else append, opts).result()
    assert finish.reason == "length", finish
    return torch.tensor([e.logprob for e in events])


def hf_prompt_logprobs(hf, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logp = torch.log_softmax(hf(torch.tensor([tokens])).logits[0].float(), -1)
    return logp[torch.arange(len(tokens) - 1), torch.tensor(tokens[1:])]


def rand_tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 49152, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# Phi-3's LongRoPE takes its long factors for a server whose context passes the original one
# (16 tokens in the tiny config), where transformers takes them for a sequence that long: every
# sequence here is longer, so both use the long factors throughout
@pytest.fixture(
    scope="module",
    params=[
        "llama3", "qwen2", "smollm2", "qwen3", "smollm3", "gemma3", "phi3", "mixtral", "qwen3_moe", "olmoe",
    ],
)  # fmt: skip
def engine_hf(request, tokenizer):
    engine, hf = make_engine(request.param, tokenizer, max_batch_tokens=64)
    yield engine, hf
    engine.shutdown()


def test_prompt_logprobs_match_transformers(engine_hf) -> None:
    engine, hf = engine_hf
    tokens = rand_tokens(150, 1)  # longer than one 64-token step: chunked prefill
    got = prompt_logprobs(engine, tokens)
    assert (got - hf_prompt_logprobs(hf, tokens)).abs().max() <= 1e-4


def test_greedy_64_tokens_match_transformers(engine_hf) -> None:
    engine, hf = engine_hf
    prompt = rand_tokens(20, 2)
    events, finish = engine.generate(
        None, prompt, GenerateOptions(max_tokens=64, sampling=GREEDY, ignore_eos=True)
    ).result()
    ours = [e.token_id for e in events]
    with torch.inference_mode():
        out = hf.generate(
            torch.tensor([prompt]), max_new_tokens=64, min_new_tokens=64, do_sample=False, pad_token_id=0
        )
    assert ours == out[0, len(prompt) :].tolist()
    assert finish.reason == "length" and finish.completion_tokens == 64


def test_outputs_do_not_depend_on_batch_neighbours(engine_hf) -> None:
    engine, _ = engine_hf
    prompt = rand_tokens(30, 3)
    opts = lambda: GenerateOptions(max_tokens=12, sampling=GREEDY, ignore_eos=True, logprobs=True)  # noqa: E731
    alone = engine.generate(None, prompt, opts()).result()[0]
    neighbours = [engine.generate(None, rand_tokens(10 + 7 * i, 10 + i), opts()) for i in range(5)]
    mixed = engine.generate(None, prompt, opts())
    more = [engine.generate(None, rand_tokens(40, 20 + i), opts()) for i in range(3)]
    together = mixed.result()[0]
    for h in neighbours + more:
        h.result()
    assert [e.token_id for e in alone] == [e.token_id for e in together]
    for a, b in zip(alone, together, strict=True):
        assert abs(a.logprob - b.logprob) <= 1e-4


def test_prefix_cache_hit_gives_same_logits(engine_hf) -> None:
    engine, hf = engine_hf
    tokens = rand_tokens(100, 4)
    first = prompt_logprobs(engine, tokens)
    hits_before = engine.kv.allocator.hits
    # a second request sharing the first 80 tokens reuses their blocks
    tokens2 = tokens[:80] + rand_tokens(30, 5)
    engine.generate(None, tokens2, GenerateOptions(max_tokens=1, sampling=GREEDY)).result()
    assert engine.kv.allocator.hits - hits_before >= 80 // engine.kv.block_size
    # and the scored run of a cached prompt equals the uncached one and transformers
    again = prompt_logprobs(engine, tokens)
    assert (first - again).abs().max() <= 1e-5
    assert (again - hf_prompt_logprobs(hf, tokens)).abs().max() <= 1e-4


def test_session_turns_fork_and_truncate_match_recompute(engine_hf) -> None:
    engine, hf = engine_hf
    tokens = rand_tokens(90, 6)
    sid = engine.create_session()
    engine.generate(sid, tokens[:50], GenerateOptions(max_tokens=0)).result()
    # turn 2 appends; logprobs over the new part must equal a full recompute
    opts = GenerateOptions(max_tokens=0, logprob_ranges=[(50, 90)])
    events, _ = engine.generate(sid, tokens[50:], opts).result()
    expected = hf_prompt_logprobs(hf, tokens)
    assert [e.position for e in events] == list(range(50, 90))
    assert (torch.tensor([e.logprob for e in events]) - expected[49:]).abs().max() <= 1e-4
    # fork at 37 (inside a block): shares the blocks, continues differently
    child = engine.fork_session(sid, 37)
    assert engine.session_tokens(child) == tokens[:37]
    tail = rand_tokens(20, 7)
    events, _ = engine.generate(
        child, tail, GenerateOptions(max_tokens=0, logprob_ranges=[(37, 57)])
    ).result()
    assert (
        torch.tensor([e.logprob for e in events]) - hf_prompt_logprobs(hf, tokens[:37] + tail)[36:]
    ).abs().max() <= 1e-4
    # the parent is untouched by the child's writes (copy-on-write of the shared block)
    parent = prompt_logprobs(engine, tokens, session=None)
    assert (parent - expected).abs().max() <= 1e-4
    events, _ = engine.generate(sid, [], GenerateOptions(max_tokens=0, logprob_ranges=[(1, 90)])).result()
    assert (torch.tensor([e.logprob for e in events]) - expected).abs().max() <= 1e-4
    # truncate to 45 then append something else
    engine.truncate_session(sid, 45)
    events, _ = engine.generate(sid, tail, GenerateOptions(max_tokens=0, logprob_ranges=[(45, 65)])).result()
    assert (
        torch.tensor([e.logprob for e in events]) - hf_prompt_logprobs(hf, tokens[:45] + tail)[44:]
    ).abs().max() <= 1e-4
    engine.close_session(sid)
    engine.close_session(child)
