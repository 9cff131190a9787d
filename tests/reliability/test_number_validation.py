"""Numbers are validated as numbers: the engine's one set of numeric rules (engine/request.py),
which every protocol calls and only maps to its own error form (the protocols' own tests:
tests/protocols/*/test_numbers.py and the Salience status tests).

A hostile-client probe found seeds of 2**64 and more giving HTTP 500 and leaving an engine
session behind per request (4,127 after 16 s, then 429 for everyone), NaN temperatures ending
INTERNAL, and JSON's true read as the integer 1. Here: the rules themselves, and the engine
refusing such a request before it creates or appends to any session."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from tokenwire.engine.request import (
    SEED_LIMIT,
    GenerateOptions,
    InvalidValueError,
    SamplingParams,
    choice_seed,
    require_int,
    require_number,
    require_seed,
)

NAN, INF = float("nan"), float("inf")


@pytest.mark.parametrize(
    ("sampling", "field", "words"),
    [
        ({"seed": SEED_LIMIT}, "seed", "0..2**64-1"),
        ({"seed": -1}, "seed", "0..2**64-1"),
        ({"seed": True}, "seed", "must be an integer"),
        ({"seed": 10**5000}, "seed", "an integer of 16610 bits"),  # not echoed: str() would raise
        ({"temperature": NAN}, "temperature", "finite"),
        ({"temperature": INF}, "temperature", "finite"),
        ({"temperature": 10**400}, "temperature", "finite"),  # float() of it overflows
        ({"temperature": True}, "temperature", "must be a number"),
        ({"top_p": NAN}, "top_p", "finite"),
        ({"top_p": -INF}, "top_p", "finite"),
        ({"top_k": True}, "top_k", "must be an integer"),
        ({"top_k": 2.0}, "top_k", "must be an integer"),
        ({"logit_bias": {5: NAN}}, "logit_bias", "logit_bias[5] must be a finite number"),
        ({"logit_bias": {True: 1.0}}, "logit_bias", "key True is not a token id"),
        ({"logit_bias": {5: False}}, "logit_bias", "must be a number"),
    ],
)
def test_sampling_values_must_be_numbers_in_range(sampling: dict, field: str, words: str) -> None:
    with pytest.raises(InvalidValueError) as refused:
        SamplingParams(**sampling).validate()
    assert refused.value.field == field and words in str(refused.value), str(refused.value)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"max_tokens": True}, "max_tokens"),
        ({"priority": False}, "priority"),
        ({"top_logprobs": True}, "top_logprobs"),
        ({"logprob_ranges": [(True, 3)]}, "logprob_ranges"),
        ({"readout_ranges": [(0, 2.5)]}, "readout_ranges"),
    ],
)
def test_generate_options_refuse_booleans_and_non_integers(options: dict, field: str) -> None:
    with pytest.raises(InvalidValueError) as refused:
        GenerateOptions(**options).validate()
    assert refused.value.field == field


def test_a_protocols_names_are_used_in_the_field_and_message() -> None:
    options = GenerateOptions(top_logprobs=True, sampling=SamplingParams(temperature=NAN))
    with pytest.raises(InvalidValueError) as refused:
        options.validate({"top_logprobs": "logprob_top_k"})
    assert refused.value.field == "logprob_top_k" and "logprob_top_k" in str(refused.value)
    with pytest.raises(InvalidValueError) as refused:
        options.sampling.validate({"temperature": "GenerateConfig.temperature"})
    assert refused.value.field == "GenerateConfig.temperature"


def test_the_edges_pass() -> None:
    SamplingParams(temperature=0, top_k=0, top_p=1, seed=0, logit_bias={0: -100}).validate()
    SamplingParams(temperature=2.5, top_p=1e-9, seed=SEED_LIMIT - 1).validate()
    assert require_int(7, "n", 1, 16) == 7 and require_number(3, "t", 0) == 3.0
    assert require_seed(SEED_LIMIT - 1) == SEED_LIMIT - 1


def test_the_choices_seeds_wrap_and_an_invalid_seed_does_not() -> None:
    assert choice_seed(None, 3) is None
    assert [choice_seed(SEED_LIMIT - 2, i) for i in range(4)] == [SEED_LIMIT - 2, SEED_LIMIT - 1, 0, 1]
    with pytest.raises(InvalidValueError):
        choice_seed(SEED_LIMIT, 0)  # 2**64 must not wrap to 0
    with pytest.raises(InvalidValueError):
        choice_seed(-1, 1)


def test_the_engine_refuses_before_a_session_is_created_or_changed(engine: Any) -> None:
    """engine.generate's acceptance (engine.check -> these rules) runs before it makes the
    one-off session or appends to a named one: a refusal leaves no session and no token."""
    sid = engine.create_session([1, 2, 3])
    sessions = engine.stats()["sessions"]
    bad = [
        SamplingParams(seed=SEED_LIMIT),
        SamplingParams(seed=-1),
        SamplingParams(temperature=NAN),
        SamplingParams(top_k=True),  # type: ignore[arg-type]
    ]
    for sampling in bad * 25:
        for target in (None, sid):
            with pytest.raises(InvalidValueError):
                engine.generate(target, [4, 5], GenerateOptions(max_tokens=1, sampling=sampling))
    assert engine.stats()["sessions"] == sessions
    assert engine.session_tokens(sid) == [1, 2, 3]
    _, finish = engine.generate(
        sid, [4], GenerateOptions(max_tokens=1, sampling=SamplingParams(seed=SEED_LIMIT - 1))
    ).result()
    assert finish.reason in ("length", "eos") and engine.session_tokens(sid)[:4] == [1, 2, 3, 4]
    assert engine.close_session(sid)


def test_a_failure_after_acceptance_leaves_nothing(engine: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """What acceptance cannot see (prepare failing: a constraint's start, a generator) must
    still leave no one-off session behind and a named session's tokens as they were."""
    from tokenwire.engine import engine as engine_module

    sid = engine.create_session([1, 2, 3])
    sessions = engine.stats()["sessions"]

    def broken(*_args: Any) -> None:
        raise RuntimeError("prepare failed")

    monkeypatch.setattr(engine_module, "prepare", broken)
    try:
        for target in (None, sid) * 10:
            with pytest.raises(RuntimeError):
                engine.generate(target, [4, 5], GenerateOptions(max_tokens=1))
        assert engine.stats()["sessions"] == sessions and engine.session_tokens(sid) == [1, 2, 3]
    finally:
        monkeypatch.undo()
        for leaked in [s for s in list(engine._sessions) if s != sid]:  # what the engine left
            engine.close_session(leaked)
        engine.close_session(sid)


@pytest.mark.parametrize(
    ("config", "words"), [(b'{"layer": true}', "got True"), (b'{"layer": 1e999}', "got inf")]
)
def test_graphpipe_config_layer_is_an_integer(config: bytes, words: str) -> None:
    from tokenwire.protocols.graphpipe.errors import ErrorCode, GraphPipeError
    from tokenwire.protocols.graphpipe.models.lm_model import LanguageModel

    with pytest.raises(GraphPipeError) as refused:
        LanguageModel.parse_config(SimpleNamespace(num_layers=4), config)  # type: ignore[arg-type]
    assert (
        refused.value.code == ErrorCode.BAD_REQUEST
        and "config layer" in str(refused.value)
        and words in str(refused.value)
    )
