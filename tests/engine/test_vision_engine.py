"""Images in the engine (tiny random Qwen2-VL): embeddings cached by content, image-aware prefix
cache, forks around image blocks, and generation equal to transformers' through paged attention."""

from __future__ import annotations

import pytest
import torch

from tests.vision_models import IMAGE_PAD, hf_vl_model, image_block, png, save_vl_model
from tokenwire.engine.errors import InvalidRequestError, PositionError
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.engine.vision import ImageInput

IMG_X, IMG_Y = png(56, 56, seed=11), png(56, 56, seed=12)  # both 4 pads
IMG_WIDE = png(140, 84, seed=13)  # 15 pads


@pytest.fixture(scope="module")
def vl(tmp_path_factory, smollm2_source):
    hf = hf_vl_model("qwen2_vl")
    directory = save_vl_model(hf, tmp_path_factory.mktemp("vl"), smollm2_source.model_dir)
    # a small step budget: image pad runs are split across prefill chunks
    engine = build_engine(
        EngineSettings(model=str(directory), progress=False, kv_cache_mb=16, max_batch_tokens=8)
    )
    yield hf, engine
    engine.shutdown()


def _text(n: int, seed: int) -> list[int]:
    return torch.randint(100, 40000, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _greedy(n: int, **kw: object) -> GenerateOptions:
    return GenerateOptions(
        max_tokens=n, sampling=SamplingParams(temperature=0), ignore_eos=True, logprobs=True, **kw
    )


def _run(engine, session, append, images=(), n=8, **kw):
    tokens, done = engine.generate(session, append, _greedy(n, **kw), images=images).result()
    assert done.reason == "length", done.error
    return [t.token_id for t in tokens], [t.logprob for t in tokens]


def _with_image(
    prefix: list[int], data: bytes, suffix: list[int], engine
) -> tuple[list[int], list[ImageInput]]:
    n = engine.image_tokens(data)
    ids = [*prefix, *image_block(n), *suffix]
    return ids, [ImageInput(len(prefix), len(prefix) + n + 2, data)]


def test_generation_matches_transformers(vl):
    hf, engine = vl
    ids, images = _with_image(_text(5, 1), IMG_WIDE, _text(7, 2), engine)
    got, _ = _run(engine, None, ids, images, n=16)
    image = engine.model.images.prepare(IMG_WIDE)
    t = torch.tensor([ids])
    with torch.inference_mode():
        out = hf.generate(
            input_ids=t,
            attention_mask=torch.ones_like(t),
            pixel_values=image.pixel_values,
            image_grid_thw=torch.tensor([image.grid_thw]),
            mm_token_type_ids=(t == IMAGE_PAD).int(),
            max_new_tokens=16,
            min_new_tokens=16,
            do_sample=False,
        )
    assert got == out[0, len(ids) :].tolist()


def test_same_image_in_two_sessions_runs_the_tower_once(vl):
    _, engine = vl
    data = png(84, 56, seed=21)
    before = engine.vision.tower_runs
    for seed in (3, 4):  # different text before the image: no prefix-cache help
        ids, images = _with_image(_text(6, seed), data, _text(3, seed + 10), engine)
        _run(engine, engine.create_session(), ids, images, n=2)
    assert engine.vision.tower_runs == before + 1


def test_different_image_with_same_pad_run_never_shares_blocks(vl):
    _, engine = vl
    prefix, suffix = _text(16, 5), _text(42, 6)  # 64 tokens: the image's pads lie in block 1
    ids_x, images_x = _with_image(prefix, IMG_X, suffix, engine)
    ids_y, images_y = _with_image(prefix, IMG_Y, suffix, engine)
    assert ids_x == ids_y  # same tokens, only the pixels differ
    sx = engine.create_session()
    _, lp_x = _run(engine, sx, ids_x, images_x, n=4)
    handle = engine.generate(None, ids_y, _greedy(4), images=images_y)
    tokens, _ = handle.result()
    assert handle.cached_tokens == 16  # only the block before the image
    _, lp_y_fresh = _run(engine, None, ids_y, images_y, n=4, use_prefix_cache=False)
    assert [t.logprob for t in tokens] == pytest.approx(lp_y_fresh, abs=1e-4)
    assert lp_y_fresh != pytest.approx(lp_x, abs=1e-4)  # the images do change the output
    again = engine.generate(None, ids_x, _greedy(4), images=images_x)
    lp_again = [t.logprob for t in again.result()[0]]
    assert again.cached_tokens == 48  # the same image reuses every full block but the last
    assert lp_again == pytest.approx(lp_x, abs=1e-4)


def test_fork_after_and_before_an_image_equals_recomputation(vl):
    _, engine = vl
    prefix, middle, tail = _text(9, 7), _text(5, 8), _text(4, 9)
    ids, images = _with_image(prefix, IMG_WIDE, middle, engine)
    src = engine.create_session()
    _run(engine, src, ids, images, n=3)
    after = images[0].end
    child = engine.fork_session(src, after)
    got_ids, got_lp = _run(engine, child, tail, n=6)
    fresh_ids = [*ids[:after], *tail]
    want_ids, want_lp = _run(engine, None, fresh_ids, images, n=6, use_prefix_cache=False)
    assert got_ids == want_ids
    assert got_lp == pytest.approx(want_lp, abs=1e-4)
    assert [b.start for b in engine.session_images(child)] == [images[0].start]

    before = images[0].start
    child = engine.fork_session(src, before)
    assert engine.session_images(child) == []
    block = ids[before:after]
    got_ids, got_lp = _run(engine, child, [*block, *tail], [ImageInput(before, after, IMG_WIDE)], n=6)
    assert got_ids == want_ids
    assert got_lp == pytest.approx(want_lp, abs=1e-4)


def test_fork_and_truncate_inside_an_image_block_are_refused(vl):
    _, engine = vl
    ids, images = _with_image(_text(3, 10), IMG_X, _text(2, 11), engine)
    sid = engine.create_session()
    _run(engine, sid, ids, images, n=1)
    start, end = images[0].start, images[0].end
    for at in (start + 1, start + 3, end - 1):
        with pytest.raises(PositionError, match="inside the image block"):
            engine.fork_session(sid, at)
        with pytest.raises(PositionError, match="inside the image block"):
            engine.truncate_session(sid, at)
    engine.truncate_session(sid, end)  # a block boundary is fine
    assert len(engine.session_images(sid)) == 1
    engine.truncate_session(sid, start)
    assert engine.session_images(sid) == []


def test_bad_images_are_refused_before_anything_changes(vl):
    _, engine = vl
    sid = engine.create_session()
    ids, images = _with_image(_text(3, 12), IMG_X, [], engine)
    start, end = images[0].start, images[0].end
    cases = {
        "4 x image_pad": [ImageInput(start, end - 1, IMG_X)],  # one pad short of the image's count
        "cannot be decoded": [ImageInput(start, end, b"\x89PNG\r\n\x1a\nnot really")],
        "not an image type": [ImageInput(start, end, IMG_X, "text/plain")],
        "overlap": [ImageInput(start, end, IMG_X), ImageInput(start, end, IMG_Y)],
    }
    for message, bad in cases.items():
        with pytest.raises(InvalidRequestError, match=message):
            engine.generate(sid, ids, _greedy(1), images=bad)
        assert engine.session_tokens(sid) == []


def test_text_only_model_refuses_images(smollm2_engine):
    with pytest.raises(InvalidRequestError, match="no vision encoder"):
        smollm2_engine.generate(None, [1, 2, 3], _greedy(1), images=[ImageInput(0, 3, IMG_X)])


def test_image_prefill_batches_with_text_decode(vl):
    _, engine = vl
    text = _text(6, 13)
    ids, images = _with_image(_text(4, 14), IMG_WIDE, _text(5, 15), engine)
    solo_text = _run(engine, None, text, n=12)
    solo_image = _run(engine, None, ids, images, n=4)
    steps = engine.steps
    # both at once: the image's prefill chunks (8-token step budget) share steps with the decode
    a = engine.generate(None, text, _greedy(12))
    b = engine.generate(None, ids, _greedy(4), images=images)
    got_text, got_image = a.result()[0], b.result()[0]
    assert [t.token_id for t in got_text] == solo_text[0]
    assert [t.token_id for t in got_image] == solo_image[0]
    assert [t.logprob for t in got_image] == pytest.approx(solo_image[1], abs=1e-4)
    one_after_the_other = 12 + -(-len(ids) // 8) + 3  # 12 decodes, then the image's chunks and 3 decodes
    assert engine.steps - steps <= one_after_the_other - 3


def test_qwen2_5_vl_generation_matches_transformers(tmp_path, smollm2_source):
    """The windowed Qwen2.5-VL tower through the engine (two images, one with several windows)."""
    hf = hf_vl_model("qwen2_5_vl")
    directory = save_vl_model(hf, tmp_path / "vl25", smollm2_source.model_dir)
    engine = build_engine(
        EngineSettings(model=str(directory), progress=False, kv_cache_mb=16, max_batch_tokens=8)
    )
    try:
        first, second = png(84, 140, seed=16), png(56, 56, seed=17)
        ids, images = _with_image(_text(3, 18), first, _text(2, 19), engine)
        more, extra = _with_image(ids, second, _text(3, 20), engine)
        got, _ = _run(engine, None, more, [*images, *extra], n=12)
        prepared = [engine.model.images.prepare(first), engine.model.images.prepare(second)]
        t = torch.tensor([more])
        with torch.inference_mode():
            out = hf.generate(
                input_ids=t,
                attention_mask=torch.ones_like(t),
                pixel_values=torch.cat([p.pixel_values for p in prepared]),
                image_grid_thw=torch.tensor([p.grid_thw for p in prepared]),
                mm_token_type_ids=(t == IMAGE_PAD).int(),
                max_new_tokens=12,
                min_new_tokens=12,
                do_sample=False,
            )
        assert got == out[0, len(more) :].tolist()
    finally:
        engine.shutdown()
