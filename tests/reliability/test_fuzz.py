"""Fuzzing every network decoder (hypothesis, derandomized so every run is the same): each
input gets a valid answer or the protocol's own error, never an escaping exception; a valid
input is answered afterwards. The inputs and the checks are bench/fuzz_targets.py's (the same
as `tokenwire bench fuzz`, which runs 10^5 cases); here a bounded number per target."""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tokenwire.bench.fuzz_targets import Target, all_targets

SLOW_OK = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.function_scoped_fixture]
STRUCTURED = settings(
    max_examples=150, derandomize=True, deadline=None, database=None, suppress_health_check=SLOW_OK
)
RAW = settings(STRUCTURED, max_examples=100)


@pytest.fixture(scope="module")
def targets(engine: Any) -> dict[str, Target]:
    return {t.name: t for t in all_targets(engine)}


def _check(target: Target, case: Any) -> None:
    assert target.run(case) in ("ok", "refused")


@pytest.mark.parametrize("name", ["lmtp", "graphpipe", "aici", "salience", "evergreen", "openai"])
def test_structured_inputs(targets: dict[str, Target], name: str) -> None:
    """Valid-schema messages with random field values, damaged encodings, deep and cyclic
    Evergreen node graphs, recursion bombs, lone surrogates (fuzz_inputs.py)."""
    target = targets[name]

    @STRUCTURED
    @given(st.randoms(use_true_random=False))
    def check(rng: random.Random) -> None:
        _check(target, target.make(rng))

    check()


# raw bytes (or text) straight into each decoder, in the shape its target takes
_RAW: dict[str, Any] = {
    "lmtp": lambda data: ([], data.decode("utf-8", "replace")),
    "graphpipe": lambda data: data,
    "aici": lambda data: (["main", "side", "frame"][len(data) % 3], data),
    "salience": lambda data: (data, [1, 2, 3]),
    "evergreen": lambda data: [data],
    "openai": lambda data: (["chat", "completion"][len(data) % 2], data),
}


@pytest.mark.parametrize("name", sorted(_RAW))
def test_raw_bytes(targets: dict[str, Target], name: str) -> None:
    target = targets[name]

    @RAW
    @given(st.binary(max_size=512))
    def check(data: bytes) -> None:
        _check(target, _RAW[name](data))

    check()


_VALID: dict[str, Any] = {
    "lmtp": (
        ['HELLO {"stream_id": 0, "extensions": ["text"]}'],
        'MODEL_INFO {"stream_id": 1, "model": "%s"}',
    ),
}


def test_valid_inputs_are_answered_after_fuzzing(targets: dict[str, Target], engine: Any) -> None:
    """The checks can tell an answer from a refusal: known-good inputs are 'ok' (after the
    fuzz above ran on the same module-scoped engine)."""
    import numpy as np

    from tokenwire.protocols.graphpipe.client import build_request
    from tokenwire.protocols.salience.gen import salience_pb2 as spb

    hello, info = _VALID["lmtp"]
    assert targets["lmtp"].run((hello, info % engine.name)) == "ok"
    body = bytes(build_request([np.array([[1, 2, 3]], dtype=np.int64)], None, None, None))
    assert targets["graphpipe"].run(body) == "ok"
    assert targets["aici"].run(("main", b'{"op": "ping"}')) == "ok"
    request = spb.GenerateRequest(session_id="s", append_tokens=[5], offset=3, max_tokens=2)
    assert targets["salience"].run((request.SerializeToString(), [1, 2, 3])) == "ok"
    assert (
        targets["openai"].run(("completion", b'{"model": "%s", "prompt": "Hi"}' % engine.name.encode()))
        == "ok"
    )
    assert targets["evergreen"].run([]) == "ok"
    assert engine.generate(None, [1, 2, 3]).result()[1].reason in ("length", "stop")


def test_what_the_fuzzer_found_stays_fixed(targets: dict[str, Target], engine: Any) -> None:
    """Each failure the fuzzer found, now the protocol's own error naming what was wrong."""
    from tokenwire.protocols.lmtp.core import LmtpConnection

    def lmtp_errors(frame: str) -> list[str]:
        conn = LmtpConnection(engine, lambda handle, stream: None)
        try:
            conn.feed(frame)
            return [out.encode("utf-8").decode() for out in conn.take_frames()]
        finally:
            conn.close()

    deep = "[" * 100_000 + "]" * 100_000
    assert "nested too deeply" in lmtp_errors(f"GENERATE {deep}")[0]
    surrogate = f'GENERATE {{"stream_id": 1, "model": "{engine.name}", "prompt": "\\ud800", "max_tokens": 2}}'
    assert "lone UTF-16 surrogate" in lmtp_errors(surrogate)[0]  # was: the WebSocket closed
    huge = (
        f'GENERATE {{"stream_id": 7, "model": "{engine.name}", "prompt": [1], "max_tokens": 1{"0" * 5000}}}'
    )
    (frame,) = lmtp_errors(huge)  # was: no answer on stream 7 (the JSON did not parse)
    assert frame.startswith("TOKEN ") and '"stream_id":7' in frame and "digits" in frame, frame[:200]
    body = b'{"model": "%s", "prompt": "\\ud800"}' % engine.name.encode()
    assert targets["openai"].run(("completion", body)) == "refused"  # was: TypeError, HTTP 500
    with pytest.raises(Exception, match="lone UTF-16 surrogate"):
        engine.tokenizer.encode("a\ud800")
    for module_id in ("9" * 300, "../../etc/passwd"):  # was: OSError, name too long / outside the store
        side = b'{"op": "set_tags", "$rid": "1", "module_id": "%s", "tags": ["t"]}' % module_id.encode()
        assert targets["aici"].run(("side", side)) == "refused"


def test_structure_aware_targets_answer_every_case_within_its_budget(engine: Any) -> None:
    """Small inputs that imply large work (fuzz_structures.py: shared Evergreen DAGs over
    several messages, nested grammars, oversized token arrays): each answered within its
    budget. On the code before issue 29, evergreen_dag failed 44 of 100 cases (OverBudget in
    flatten.py, budget 1 s) and prompt_size 4 of 100."""
    from tokenwire.bench.fuzz_bench import run_fuzz

    report = run_fuzz(engine, cases=150, seed=3, only=["evergreen_dag", "grammar", "prompt_size"])
    assert report.failures == {}, report.failures
    for name in ("evergreen_dag", "prompt_size"):  # both kinds made: sound inputs and bombs
        outcomes = report.targets[name].outcomes
        assert outcomes["ok"] > 0 and outcomes["refused"] > 0, (name, outcomes)
    assert report.targets["grammar"].outcomes["ok"] > 0


def test_the_budget_cuts_off_a_runaway_case_and_the_run_goes_on() -> None:
    from tokenwire.bench.fuzz_bench import run_targets

    def run(case: int) -> str:
        while case == 0:  # the first case never ends on its own
            pass
        return "ok"

    cases = iter(range(100))
    runaway = Target("runaway", lambda rng: next(cases), run, budget_s=0.2)
    report = run_targets([runaway], cases=3)
    assert report.targets["runaway"].outcomes == {"failed": 1, "ok": 2}, report.targets["runaway"].outcomes
    ((where, info),) = report.failures.items()
    assert where.startswith("runaway: OverBudget"), where
    assert "budget of 0.2 s" in info["message"]
