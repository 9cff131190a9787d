"""The sans-IO core with plain values: Generate plans, image ranges, fork checks, conversions."""

from __future__ import annotations

import grpc
import pytest
import torch

from tokenwire.engine import errors
from tokenwire.engine.admission import Limits
from tokenwire.engine.request import FinishEvent, TokenEvent
from tokenwire.protocols.salience import core
from tokenwire.protocols.salience.gen import salience_pb2 as pb
from tokenwire.protocols.salience.images import (
    ImageBlock,
    VisionTokens,
    blocks_after_truncate,
    check_attachments,
)
from tokenwire.protocols.salience.status import SalienceStatus, status_for

LIMITS = core.ModelLimits(name="m", engine=Limits(100, max_model_len=64, kv_blocks=8, kv_block_size=16))
VISION = VisionTokens(start=90, pad=91, end=92)


def plan(tokens=(1, 2, 3), held=(), limits=LIMITS, **fields):
    for name in ("logprobs_ranges", "readout_ranges"):
        if name in fields:
            fields[name] = [pb.PositionRange(start=s, end=e) for s, e in fields[name]]
    if "images" in fields:
        fields["images"] = [
            pb.ImageAttachment(bytes=b"img", mime="image/png", pad_range_start=s, pad_range_end=e)
            for s, e in fields["images"]
        ]
    request = pb.GenerateRequest(session_id="s", **fields)
    return core.plan_generate(request, list(tokens), list(held), limits)


def refused(code, **kw) -> str:
    with pytest.raises(SalienceStatus) as err:
        plan(**kw)
    assert err.value.code == code
    return err.value.message


def test_offset_rules():
    p = plan(offset=3, append_tokens=[4], max_tokens=2)
    assert p.truncate_to is None and p.append == [4] and p.prompt_len == 4
    p = plan(offset=1, truncating=True, append_tokens=[7])
    assert p.truncate_to == 1 and p.prompt_len == 2
    assert plan(offset=3, truncating=True, max_tokens=1).truncate_to is None  # nothing to rewind
    fp = grpc.StatusCode.FAILED_PRECONDITION
    assert "offset 1 does not match the session length 3" in refused(fp, offset=1)
    assert "length 3" in refused(fp, offset=4)
    assert "length 3" in refused(fp, offset=4, truncating=True)


def test_noop_generate_is_recognised():
    assert plan(offset=3).options is None
    assert plan(offset=2, truncating=True).options is None  # rewind only
    assert plan(offset=3, max_tokens=1).options is not None
    assert plan(offset=3, logprobs_ranges=[(0, 3)]).options is not None
    assert plan(offset=3, append_tokens=[5]).options is not None  # prefill without events


def test_limits_and_ids():
    ia, re = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "append_tokens[1] = 100" in refused(ia, offset=3, append_tokens=[5, 100])
    assert "stop_token_ids[0] = 250" in refused(ia, offset=3, max_tokens=1, stop_token_ids=[250])
    assert "65 tokens exceed" in refused(re, offset=3, append_tokens=[1] * 62)
    small = core.ModelLimits(name="m", engine=Limits(100, max_model_len=64, kv_blocks=2, kv_block_size=16))
    assert "KV cache budget" in refused(re, limits=small, offset=3, append_tokens=[1] * 40)
    assert "start 4 > end 2" in refused(ia, offset=3, max_tokens=1, readout_ranges=[(4, 2)])
    assert "concept" in refused(grpc.StatusCode.FAILED_PRECONDITION, offset=3, readout_ranges=[(0, 1)])
    assert "priority" in refused(ia, offset=3, max_tokens=1, priority=-1)
    assert "temperature" in refused(ia, offset=3, max_tokens=1, temperature=-0.5)
    assert "top_p" in refused(ia, offset=3, max_tokens=1, top_p=1.01)


def test_options_mapping_and_proto_defaults():
    o = plan(
        offset=3, append_tokens=[4, 5], max_tokens=7, logprobs_ranges=[(0, 9)], logprob_top_k=4, priority=9,
        stop_token_ids=[42],
    ).options  # fmt: skip
    assert o is not None and o.max_tokens == 7 and o.priority == 9 and list(o.stop_token_ids) == [42]
    assert o.logprob_ranges == [(0, 9)] and o.top_logprobs == 4 and o.logprob_mode == "raw"
    s = o.sampling
    assert (s.temperature, s.top_p, s.top_k) == (1.0, 1.0, 0)  # zero means 1.0 / 1.0 / disabled
    s = plan(offset=3, max_tokens=1, temperature=0.5, top_p=0.9, top_k=20).options.sampling
    assert (s.temperature, s.top_p, s.top_k) == (0.5, pytest.approx(0.9), 20)
    assert plan(offset=3, max_tokens=1, top_k=1).options.sampling.temperature == 0.0  # top_k 1 = greedy


def test_image_attachment_range_checks():
    toks = [1, 90, 91, 91, 92, 5]
    ok = check_attachments([ImageBlock(1, 5)], toks, [], VISION, lambda img: 2)
    assert ok == [ImageBlock(1, 5)]

    def bad(images, tokens=toks, existing=(), vision=VISION, n=2) -> str:
        with pytest.raises(SalienceStatus) as err:
            check_attachments(images, tokens, list(existing), vision, lambda img: n)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        return err.value.message

    assert "outside the session's post-append tokens [0, 6)" in bad([ImageBlock(3, 8)])
    assert "empty" in bad([ImageBlock(3, 3)])
    assert "shorter" in bad([ImageBlock(1, 3)])
    assert "overlap" in bad([ImageBlock(0, 4), ImageBlock(3, 6)])
    assert "overlap" in bad([ImageBlock(1, 5)], existing=[ImageBlock(0, 3)])
    assert "vision encoder produces 3" in bad([ImageBlock(1, 5)], n=3)  # end - start must be N + 2
    assert "not the image pad token 91" in bad([ImageBlock(1, 5)], tokens=[1, 90, 91, 7, 92, 5])
    assert "vision_start 90" in bad([ImageBlock(0, 4)])
    assert "no vision encoder" in bad([ImageBlock(1, 5)], vision=None)


def test_images_through_the_plan():
    with_vision = core.ModelLimits(name="m", engine=LIMITS.engine, vision=VISION, pad_count=lambda img: 2)
    p = plan(limits=with_vision, offset=3, append_tokens=[90, 91, 91, 92], images=[(3, 7)])
    assert [(b.start, b.end, b.mime, b.data) for b in p.images] == [(3, 7, "image/png", b"img")]
    held = [ImageBlock(3, 7)]
    with pytest.raises(SalienceStatus) as err:  # rewinding into an image block
        plan(tokens=[1, 2, 3, 90, 91, 91, 92], held=held, limits=with_vision, offset=5, truncating=True)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "split the image block" in err.value.message
    p = plan(tokens=[1, 2, 3, 90, 91, 91, 92], held=held, limits=with_vision, offset=3, truncating=True)
    assert p.images == []  # a clean rewind drops the block
    assert blocks_after_truncate(held, 7) == held
    no_vision = "no vision encoder"
    assert no_vision in refused(
        grpc.StatusCode.INVALID_ARGUMENT, offset=3, append_tokens=[90, 91, 92], images=[(3, 6)]
    )


def test_fork_checks():
    held = [ImageBlock(2, 6)]
    assert core.check_fork(6, 8, held) == held
    assert core.check_fork(2, 8, held) == []
    for at, needle in ((9, "past the end"), (4, "inside the image block [2, 6)")):
        with pytest.raises(SalienceStatus) as err:
            core.check_fork(at, 8, held)
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION and needle in err.value.message


def test_check_model():
    core.check_model("", "smol")
    core.check_model("smol", "smol")
    with pytest.raises(SalienceStatus) as err:
        core.check_model("big", "smol")
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "'big'" in err.value.message
    assert "'smol'" in err.value.message


def test_token_message_conversion():
    readout = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    ev = TokenEvent(7, 12, False, -0.25, [(7, -0.25), (9, -1.5)], readout)
    t = core.token_message(ev).token
    assert (t.id, t.position, t.is_prefill) == (7, 12, False)
    assert t.has_sampled_logprob and t.sampled_logprob == -0.25
    assert [(a.id, a.logprob) for a in t.logprobs] == [(7, -0.25), (9, -1.5)]
    assert list(t.readout) == [1.0, 2.0, 3.0, 4.0, 5.0, 6.0]  # [n_layers][n_concepts] row-major
    bare = core.token_message(TokenEvent(3, 0, True)).token
    assert not bare.has_sampled_logprob and len(bare.logprobs) == 0 and len(bare.readout) == 0


def test_finish_mapping():
    d = pb.GenerateDone
    cases = [
        (FinishEvent("eos", 5, 2), d.FINISH_REASON_EOS),
        (FinishEvent("stop", 5, 2, stop_detail=42), d.FINISH_REASON_EOS),  # stop_token_ids
        (FinishEvent("stop", 5, 2, stop_detail="\n\n"), d.FINISH_REASON_STOP_STRING),
        (FinishEvent("length", 5, 2), d.FINISH_REASON_LENGTH),
        (FinishEvent("cancelled", 5, 2), d.FINISH_REASON_CANCELLED),
    ]
    for event, reason in cases:
        done = core.finish_message(event).done
        assert done.finish_reason == reason
        assert (done.prompt_tokens, done.completion_tokens, done.total_tokens) == (5, 2, 7)


def test_engine_error_status_mapping():
    c = grpc.StatusCode
    assert status_for(errors.SessionNotFoundError("gone")).code == c.NOT_FOUND
    assert status_for(errors.SessionNotFoundError("gone")).message == "gone"
    assert status_for(errors.SessionBusyError("busy")).code == c.ABORTED
    assert status_for(errors.ContextOverflowError("long")).code == c.RESOURCE_EXHAUSTED
    assert status_for(errors.KVBudgetError("kv")).code == c.RESOURCE_EXHAUSTED
    assert status_for(errors.PositionError("pos")).code == c.FAILED_PRECONDITION
    assert status_for(errors.InvalidTokenError("tok")).code == c.INVALID_ARGUMENT
    assert status_for(errors.InvalidRequestError("opt")).code == c.INVALID_ARGUMENT
    assert status_for(errors.EngineClosedError("down")).code == c.UNAVAILABLE
    assert status_for(errors.EngineError("other")).code == c.INTERNAL


def test_manifest_without_concepts():
    m = core.manifest(None, 576)
    assert list(m.concepts) == [] and list(m.layers) == [] and m.hidden_size == 576


def test_token_arrays_are_counted_before_they_are_read(monkeypatch):
    """Issue 29: an append_tokens past the context is refused from its length, before the ids
    become a list and are checked one by one (10^7 ids were read and checked first)."""
    checked = []
    monkeypatch.setattr(core, "check_request", lambda *a, **k: checked.append(a))
    message = refused(grpc.StatusCode.RESOURCE_EXHAUSTED, offset=3, append_tokens=[10**6] * 100_000)
    assert "append_tokens has 100000 ids" in message and "--max-model-len" in message, message
    message = refused(grpc.StatusCode.INVALID_ARGUMENT, offset=3, max_tokens=1, stop_token_ids=[1] * 101)
    assert "stop_token_ids has 101 ids" in message and "vocabulary (100)" in message, message
    assert not checked


@pytest.mark.parametrize(
    ("fields", "name"),
    [
        ({"temperature": float("inf")}, "temperature"),
        ({"temperature": float("-inf")}, "temperature"),
        ({"temperature": float("nan"), "top_k": 1}, "temperature"),  # not passed off as greedy
        ({"temperature": float("inf"), "top_k": 1}, "temperature"),
        ({"top_p": float("nan")}, "top_p"),
        ({"top_p": float("-inf")}, "top_p"),
    ],
)
def test_nan_and_infinity_are_invalid_arguments_naming_the_field(fields, name):
    """The engine's numeric rules (engine/request.py), checked as sent, before top_k 1 makes
    the draw an argmax."""
    message = refused(grpc.StatusCode.INVALID_ARGUMENT, offset=3, max_tokens=1, **fields)
    assert name in message and "finite" in message, message
