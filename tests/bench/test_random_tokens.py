"""The no-model backend: the engine runs unchanged around RandomTokenModel."""

from __future__ import annotations

import asyncio

import torch

from tokenwire.bench.random_tokens import TABLE_ROWS, RandomTokenModel
from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams


def test_greedy_follows_the_table_and_logprobs_are_exact(smollm2_source) -> None:
    model = RandomTokenModel(smollm2_source.config, seed=3)
    assert model.config.num_layers == 1 and model.config.vocab_size == smollm2_source.config.vocab_size
    engine = Engine(model, smollm2_source.tokenizer, name="random", kv_cache_mb=16)
    try:
        prompt = [1, 504, 3458]
        opts = GenerateOptions(
            max_tokens=20,
            ignore_eos=True,
            logprobs=True,
            top_logprobs=1,
            sampling=SamplingParams(temperature=0.0),
        )
        events, finish = engine.generate(None, prompt, opts).result()
    finally:
        engine.shutdown()
    assert finish.reason == "length" and len(events) == 20
    tokens = list(prompt)
    for event in events:
        row = model.table[(tokens[-1] * 31 + len(tokens) - 1) % TABLE_ROWS]
        logp = torch.log_softmax(row, dim=-1)
        assert event.token_id == int(torch.argmax(row))
        assert abs(event.logprob - float(logp[event.token_id])) < 1e-5
        assert event.top_logprobs is not None and event.top_logprobs[0][0] == event.token_id
        tokens.append(event.token_id)


def test_bench_client_counts_echo_tokens() -> None:
    from tokenwire.bench.lmtp_bench import receive_tokens
    from tokenwire.bench.lmtp_bench_servers import _start_echo

    async def scenario() -> tuple[int, float]:
        port, stop = await _start_echo(0)
        try:
            return await receive_tokens(port, "echo", 4, 25, [1, 2])
        finally:
            await stop()

    tokens, seconds = asyncio.run(scenario())
    assert tokens == 4 * 25 and seconds > 0
