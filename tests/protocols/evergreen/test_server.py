"""Evergreen on the shared gRPC server, against the default model: aborts as gRPC statuses,
streamed chains, the extension actions, the token tools, refs."""

from __future__ import annotations

import json
import time

import grpc
import pytest

from tests.protocols.evergreen.conftest import check_output_stream, text_of
from tests.protocols.evergreen.helpers import EOT, action, inner, leaf, message
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.protocols.evergreen.core import ERROR_MIMETYPE
from tokenwire.protocols.evergreen.gen import tokenwire_evergreen_pb2 as twpb

GREEDY = twpb.GenerateConfig(temperature=0, max_tokens=8)


def greedy_text(engine, user_text: str, max_tokens: int = 8) -> str:
    prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": user_text}])
    tokens, _ = engine.generate(
        None, prompt, GenerateOptions(max_tokens=max_tokens, sampling=SamplingParams(temperature=0))
    ).result()
    return "".join(t.text for t in tokens)


@pytest.mark.parametrize(
    ("items", "code", "words"),
    [
        (
            [
                leaf("img", "x", mimetype="image/png"),
                action("GENERATE", {"prompt": "img"}, {"response": "r"}),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "'image/png'",
        ),
        (
            [
                leaf("bin", "x", mimetype="application/octet-stream"),
                action("GENERATE", {"prompt": "bin"}, {"response": "r"}),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "unsupported mimetype 'application/octet-stream'",
        ),
        (
            [
                leaf("v", ref="file://../../etc/passwd", mimetype="video/mp4"),
                action("GENERATE", {"prompt": "v"}, {"response": "r"}),
            ],
            grpc.StatusCode.PERMISSION_DENIED,
            "outside the allowed ref roots",
        ),
        (
            [
                leaf("v", ref="https://example.com/a.mp4", mimetype="video/mp4"),
                action("GENERATE", {"prompt": "v"}, {"response": "r"}),
            ],
            grpc.StatusCode.PERMISSION_DENIED,
            "scheme 'https'",
        ),
        (
            [action("GENERATE", {"prompt": "p"}, {"response": "r"}, target="other-model")],
            grpc.StatusCode.NOT_FOUND,
            "target 'other-model'",
        ),
        (
            [leaf("a", "x", seq=0), leaf("a", "y", seq=1, mimetype=None)],
            grpc.StatusCode.INVALID_ARGUMENT,
            "past the node's final seq",
        ),
        ([inner(f"n{i}", f"n{i + 1}") for i in range(10)], grpc.StatusCode.RESOURCE_EXHAUSTED, "max_depth=8"),
        (
            [
                leaf("p", "hi"),
                action("GENERATE", {"prompt": "p"}, {"response": "r"}, [twpb.GenerateConfig(top_p=2)]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "top_p",
        ),
        (
            [
                leaf("p", "hi"),
                action("GENERATE", {"prompt": "p"}, {"response": "r"}, [twpb.ConstraintConfig(regex="(")]),
            ],
            grpc.StatusCode.INVALID_ARGUMENT,
            "ConstraintConfig",
        ),
    ],
)
def test_aborts_are_grpc_statuses_naming_the_rule(conversation, items, code, words):
    c = conversation()
    for item in items:
        c.requests.put(message(item))
    error = c.abort_status()
    assert error.code() == code and words in error.details(), error.details()


def test_input_never_completed_is_failed_precondition(conversation):
    c = conversation()
    c.requests.put(message(action("GENERATE", {"prompt": "p"}, {"response": "r"}), inner("p", "missing")))
    error = c.abort_status()
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION and "'missing'" in error.details()


def test_server_keeps_serving_after_an_abort(conversation, smollm2_engine):
    bad = conversation()
    bad.requests.put(message(inner("a", "a")))
    assert bad.abort_status().code() == grpc.StatusCode.INVALID_ARGUMENT
    good = conversation()
    good.requests.put(message(action("GENERATE", {"t": "p"}, {"text": "r"}, [GREEDY]), leaf("p", "Hi")))
    assert text_of(good.read_until_final("r")) == greedy_text(smollm2_engine, "Hi")
    assert good.close() == []
    assert smollm2_engine.stats()["running"] == 0


def test_duplicates_over_the_wire_are_ignored(conversation, smollm2_engine):
    c = conversation()
    c.requests.put(message(action("GENERATE", {"t": "p"}, {"text": "r"}, [GREEDY])))
    c.requests.put(message(leaf("p", "Name a ", continued=True)))
    c.requests.put(message(leaf("p", "IGNORED ", continued=True)))  # same (id, seq): ignored
    c.requests.put(message(leaf("p", "colour.", seq=1, mimetype=None)))
    c.requests.put(message(leaf("p", "colour.", seq=1, mimetype=None)))  # a retry: no error
    assert text_of(c.read_until_final("r")) == greedy_text(smollm2_engine, "Name a colour.")
    assert c.close() == []


def test_streamed_chain_prefills_while_input_streams(conversation, smollm2_engine):
    words = ("The history of the doughnut is long and full of jam. " * 12).split(" ")
    pieces = [" ".join(words[i : i + 8]) + " " for i in range(0, len(words), 8)]
    c = conversation()
    c.requests.put(message(action("GENERATE", {"text": "prompt"}, {"text": "out"}, [GREEDY])))
    c.requests.put(message(inner("prompt", "body", continued=True)))
    before = smollm2_engine.stats()["computed_tokens"]
    for seq, piece in enumerate(pieces):
        c.requests.put(
            message(leaf("body", piece, seq=seq, continued=True, mimetype="text/plain" if seq == 0 else None))
        )
    # the body is still open (continued) and the prompt root too: nothing can be generated yet,
    # but the available prefix must be prefilled already
    deadline = time.monotonic() + 60
    prompt_so_far = len(smollm2_engine.tokenizer.encode("".join(pieces), add_special_tokens=False))
    while (
        smollm2_engine.stats()["computed_tokens"] - before < prompt_so_far - 4 and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    prefilled = smollm2_engine.stats()["computed_tokens"] - before
    assert prefilled >= prompt_so_far - 4, (prefilled, prompt_so_far)
    c.requests.put(message(leaf("body", "Summarize.", seq=len(pieces), mimetype=None)))
    c.requests.put(message(inner("prompt", "eot", seq=1), leaf("eot", b"", mimetype=EOT)))
    out = c.read_until_final("out")
    total = smollm2_engine.stats()["computed_tokens"] - before
    check_output_stream(out, "out")
    assert text_of(out) == greedy_text(smollm2_engine, "".join(pieces) + "Summarize.")
    full_prompt = (
        len(smollm2_engine.tokenizer.apply_chat_template([{"role": "user", "content": "x"}])) + prompt_so_far
    )
    assert total <= full_prompt + 8 + 12  # the streamed prefix was not computed twice
    assert c.close() == []


def test_chain_output_of_one_action_feeds_the_next(conversation, smollm2_engine):
    c = conversation()
    c.requests.put(
        message(action("GENERATE", {"t": "p1"}, {"text": "r1"}, [GREEDY]), leaf("p1", "Say hello."))
    )
    c.requests.put(
        message(action("GENERATE", {"t": "p2"}, {"text": "r2"}, [GREEDY]), inner("p2", "p1", "r1", "q2"))
    )
    c.requests.put(message(leaf("q2", "Again.")))
    r1 = c.read_until_final("r1")
    r2 = c.read_until_final("r2")
    history = [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": text_of(r1)},
        {"role": "user", "content": "Again."},
    ]
    prompt = smollm2_engine.tokenizer.apply_chat_template(history)
    tokens, _ = smollm2_engine.generate(
        None, prompt, GenerateOptions(max_tokens=8, sampling=SamplingParams(temperature=0))
    ).result()
    assert text_of(r2) == "".join(t.text for t in tokens)
    assert c.close() == []


def test_cancel_stops_an_ongoing_generate(conversation, smollm2_engine):
    c = conversation()
    config = twpb.GenerateConfig(temperature=0, max_tokens=400, ignore_eos=True)
    c.requests.put(
        message(action("GENERATE", {"t": "p"}, {"text": "r"}, [config]), leaf("p", "Count to a thousand."))
    )
    seen = []
    for fragment in c.fragments():
        seen.append(fragment)
        if len(seen) == 3:
            c.requests.put(message(action("CANCEL", {"action": "r"})))
        if not fragment.continued:
            break
    assert 3 <= len(seen) < 100 and not seen[-1].continued
    assert c.close() == []
    assert smollm2_engine.stats()["running"] == 0


def test_drop_then_use_is_not_found_and_drop_keeps_session(conversation):
    c = conversation()
    c.requests.put(message(leaf("a", "x"), leaf("b", "y"), action("DROP", {"node": "a"})))
    c.requests.put(message(action("TOKENIZE", {"text": "b"}, {"tokens": "tb"})))
    assert json.loads(text_of(c.read_until_final("tb")))
    c.requests.put(message(action("TOKENIZE", {"text": "a"}, {"tokens": "ta"})))
    error = c.abort_status()
    assert (
        error.code() == grpc.StatusCode.NOT_FOUND
        and "'a'" in error.details()
        and "dropped" in error.details()
    )


def test_set_ttl_expires(conversation):
    c = conversation()
    c.requests.put(
        message(leaf("a", "x"), action("SET_TTL", {"node": "a"}, configs=[twpb.TtlConfig(ttl_seconds=0.2)]))
    )
    c.requests.put(message(action("COUNT_TOKENS", {"text": "a"}, {"count": "n1"})))
    assert json.loads(text_of(c.read_until_final("n1"))) == 1
    time.sleep(0.6)
    c.requests.put(message(action("COUNT_TOKENS", {"text": "a"}, {"count": "n2"})))
    error = c.abort_status()
    assert error.code() == grpc.StatusCode.NOT_FOUND and "'a'" in error.details()


def test_partial_failures_report_error_chunk_and_session_goes_on(conversation, smollm2_engine):
    c = conversation()
    c.requests.put(
        message(action("SET_SESSION_OPTIONS", configs=[twpb.SessionOptions(partial_failures=True)]))
    )
    c.requests.put(
        message(
            leaf("img", "x", mimetype="image/webp"), action("GENERATE", {"p": "img"}, {"response": "bad"})
        )
    )
    (fragment,) = c.read_until_final("bad")
    assert fragment.chunk_fragment.metadata.mimetype == ERROR_MIMETYPE
    error = twpb.ActionError.FromString(fragment.chunk_fragment.data)
    assert (
        error.code_name == "INVALID_ARGUMENT" and "image/webp" in error.message and error.action == "GENERATE"
    )
    c.requests.put(message(leaf("p", "Hi"), action("GENERATE", {"t": "p"}, {"text": "ok"}, [GREEDY])))
    assert text_of(c.read_until_final("ok")) == greedy_text(smollm2_engine, "Hi")
    assert c.close() == []


def test_token_tools_and_text_refs(conversation, smollm2_engine, ref_root):
    tok = smollm2_engine.tokenizer
    text = (ref_root / "notes.txt").read_text()
    c = conversation()
    c.requests.put(
        message(
            leaf("notes", ref="file://notes.txt"), action("TOKENIZE", {"text": "notes"}, {"tokens": "ids"})
        )
    )
    ids = json.loads(text_of(c.read_until_final("ids")))
    assert ids == tok.encode(text, add_special_tokens=False)
    c.requests.put(
        message(
            leaf("ids_in", json.dumps(ids), mimetype="application/json"),
            action("DETOKENIZE", {"tokens": "ids_in"}, {"text": "back"}),
        )
    )
    assert text_of(c.read_until_final("back")) == text
    c.requests.put(message(action("COUNT_TOKENS", {"text": "notes"}, {"count": "n"})))
    assert json.loads(text_of(c.read_until_final("n"))) == len(ids)
    c.requests.put(
        message(
            leaf("ctx", "What colour is the sky?"),
            leaf("cont", "Blue."),
            action("SCORE", {"prompt": "ctx", "continuation": "cont"}, {"score": "s"}),
        )
    )
    score = json.loads(text_of(c.read_until_final("s")))
    prompt = tok.apply_chat_template([{"role": "user", "content": "What colour is the sky?"}])
    cont = tok.encode("Blue.", add_special_tokens=False)
    events, _ = smollm2_engine.generate(
        None,
        prompt + cont,
        GenerateOptions(max_tokens=0, logprob_ranges=[(len(prompt), len(prompt) + len(cont))]),
    ).result()
    oracle = [e.logprob for e in events if e.is_prefill and e.logprob is not None]
    assert [t["id"] for t in score["tokens"]] == cont
    assert [t["logprob"] for t in score["tokens"]] == pytest.approx(oracle, abs=1e-4)
    assert score["logprob"] == pytest.approx(sum(oracle), abs=1e-3)
    assert c.close() == []


def test_constraint_and_generate_config(conversation):
    c = conversation()
    configs = [
        twpb.GenerateConfig(temperature=0.8, seed=7, max_tokens=20),
        twpb.ConstraintConfig(regex="[0-9]{3}"),
    ]
    c.requests.put(
        message(leaf("p", "Pick a number."), action("GENERATE", {"t": "p"}, {"text": "n"}, configs))
    )
    out = text_of(c.read_until_final("n"))
    assert len(out) == 3 and out.isdigit()
    assert c.close() == []
