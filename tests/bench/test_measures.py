"""The engine bench's decode measures (bench/measures.py) on the shipped model: with `speculate`
off a request runs one token a step whatever the engine's --speculate, as the baselines it is
compared with do (engine_bench.py's docstring has the measurement that made it so)."""

from __future__ import annotations

from collections.abc import Callable

from tokenwire.bench.measures import ours_single, ours_streams
from tokenwire.engine.engine import Engine

TOKENS = 24


def _steps(engine: Engine, measure: Callable[[], float]) -> int:
    before = engine.stats()["steps"]
    measure()
    return int(engine.stats()["steps"] - before)


def test_the_decode_measures_take_one_token_a_step_with_speculation_off(smollm2_engine: Engine) -> None:
    engine = smollm2_engine
    looping = engine.tokenizer.encode(" one two three four five" * 40)  # prompt lookup finds it
    with_lookup = _steps(engine, lambda: ours_single(engine, looping, TOKENS))
    one_a_step = _steps(engine, lambda: ours_single(engine, looping, TOKENS, speculate=False))
    # the prompt in one step (under the 512-token batch), then a step per token after the first
    assert one_a_step == 1 + (TOKENS - 1)
    assert with_lookup < one_a_step  # the engine's own default keeps guesses on this text
    streams = _steps(engine, lambda: ours_streams(engine, [looping, looping[1:]], TOKENS, speculate=False))
    assert streams == 1 + (TOKENS - 1)  # both prompts in one step, then both rows in every step
