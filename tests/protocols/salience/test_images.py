"""Salience images end to end on a tiny random Qwen2-VL, through the client generated from the seed's
proto: a correct attach generates what the engine generates, every mismatch gets the seed's status."""

from __future__ import annotations

import grpc
import pytest

from tests.protocols.salience.conftest import ServerThread
from tests.protocols.salience.helpers import generate
from tests.vision_models import IMAGE_PAD, hf_vl_model, image_block, png, save_vl_model
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.engine.vision import ImageInput

IMG = png(84, 56, seed=31)  # 6 pads
OTHER = png(56, 56, seed=32)  # 4 pads


@pytest.fixture(scope="module")
def vl_engine(tmp_path_factory, smollm2_source):
    directory = save_vl_model(
        hf_vl_model("qwen2_vl"), tmp_path_factory.mktemp("vl"), smollm2_source.model_dir
    )
    engine = build_engine(EngineSettings(model=str(directory), progress=False, kv_cache_mb=16))
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def vl_stub(vl_engine, seed_proto):
    server = ServerThread(vl_engine)
    channel = grpc.insecure_channel(server.target)
    yield seed_proto[1].SalienceStub(channel)
    channel.close()
    server.stop()


def _open(stub, pb) -> str:
    return stub.OpenSession(pb.OpenSessionRequest(model="")).session_id


def _attach(pb, data: bytes, start: int, end: int, mime: str = "image/png"):
    return pb.ImageAttachment(bytes=data, mime=mime, pad_range_start=start, pad_range_end=end)


def _refused(stub, pb, sid, append, images, code, message, offset=0, **fields):
    with pytest.raises(grpc.RpcError) as err:
        generate(
            stub,
            pb,
            session_id=sid,
            offset=offset,
            append_tokens=append,
            images=images,
            max_tokens=1,
            **fields,
        )
    assert err.value.code() == code, err.value.details()
    assert message in err.value.details()


def test_a_correct_attach_generates_what_the_engine_does(vl_stub, vl_engine, pb):
    n = vl_engine.image_tokens(IMG)
    assert n == 6
    prompt = [500, 501, *image_block(n), 502, 503]
    sid = _open(vl_stub, pb)
    tokens, done = generate(
        vl_stub, pb, session_id=sid, offset=0, append_tokens=prompt, max_tokens=6, top_k=1,
        images=[_attach(pb, IMG, 2, 2 + n + 2)], logprobs_ranges=[(3, 5)],
    )  # fmt: skip
    assert done.completion_tokens == 6 and done.prompt_tokens == len(prompt)
    generated = [t.id for t in tokens if not t.is_prefill]
    opts = GenerateOptions(max_tokens=6, sampling=SamplingParams(temperature=0), ignore_eos=True)
    expected, _ = vl_engine.generate(None, prompt, opts, images=[ImageInput(2, 2 + n + 2, IMG)]).result()
    assert generated == [e.token_id for e in expected][: len(generated)]
    # logprobs at image positions: the pad tokens' (tiny) probabilities after image embeddings
    scored = [t for t in tokens if t.is_prefill]
    assert [t.position for t in scored] == [3, 4] and all(
        t.id == IMAGE_PAD and t.has_sampled_logprob for t in scored
    )
    # DumpSession: the tokens verbatim, the image block in the trailing metadata
    response, call = vl_stub.DumpSession.with_call(pb.DumpSessionRequest(session_id=sid))
    assert list(response.tokens)[: len(prompt)] == prompt
    assert dict(call.trailing_metadata())["salience-image-blocks"] == f"2-{2 + n + 2}:image/png"


def test_every_image_mismatch_gets_its_status(vl_stub, vl_engine, pb):
    n = vl_engine.image_tokens(IMG)
    block = image_block(n)
    sid = _open(vl_stub, pb)
    bad = grpc.StatusCode.INVALID_ARGUMENT
    # wrong pad count: a run one pad short of what the encoder produces
    short = image_block(n - 1)
    _refused(vl_stub, pb, sid, [7, *short], [_attach(pb, IMG, 1, 1 + len(short))], bad, f"produces {n}")
    # the declared range is not on the pad run (shifted by one)
    _refused(
        vl_stub,
        pb,
        sid,
        [7, *block, 8],
        [_attach(pb, IMG, 2, 2 + n + 2)],
        bad,
        "must start with vision_start",
    )
    # two images whose ranges overlap
    two = [_attach(pb, IMG, 1, 1 + n + 2), _attach(pb, IMG, 3, 3 + n + 2)]
    _refused(vl_stub, pb, sid, [7, *block, *block], two, bad, "overlap")
    # a mime type that is not an image, and bytes that are no image
    _refused(
        vl_stub,
        pb,
        sid,
        [7, *block],
        [_attach(pb, IMG, 1, 1 + n + 2, "text/plain")],
        bad,
        "not an image type",
    )
    corrupt = IMG[:40] + b"\x00" * 30
    _refused(vl_stub, pb, sid, [7, *block], [_attach(pb, corrupt, 1, 1 + n + 2)], bad, "cannot be decoded")
    # nothing was appended by the refused calls
    assert list(vl_stub.DumpSession(pb.DumpSessionRequest(session_id=sid)).tokens) == []


def test_fork_and_rewind_inside_an_image_block_are_refused(vl_stub, vl_engine, pb):
    n = vl_engine.image_tokens(OTHER)
    prompt = [9, *image_block(n), 10]
    sid = _open(vl_stub, pb)
    generate(
        vl_stub,
        pb,
        session_id=sid,
        offset=0,
        append_tokens=prompt,
        max_tokens=0,
        images=[_attach(pb, OTHER, 1, n + 3)],
    )
    with pytest.raises(grpc.RpcError) as err:
        vl_stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=3))
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "inside the image block" in err.value.details()
    _refused(
        vl_stub,
        pb,
        sid,
        [],
        [],
        grpc.StatusCode.FAILED_PRECONDITION,
        "split the image block",
        offset=2,
        truncating=True,
    )
    # at a block boundary the fork inherits the image and generates from it
    child = vl_stub.ForkSession(pb.ForkSessionRequest(session_id=sid, at_position=n + 3)).session_id
    assert len(vl_engine.session_images(child)) == 1
    _, done = generate(vl_stub, pb, session_id=child, offset=n + 3, append_tokens=[11], max_tokens=2, top_k=1)
    assert done.completion_tokens == 2
