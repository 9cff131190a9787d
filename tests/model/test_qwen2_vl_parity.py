"""Our Qwen2-VL / Qwen2.5-VL (loaded from an HF directory) against transformers' models with the
same random weights: vision embeddings and logits to 1e-4 (fp32), greedy continuations equal."""

from __future__ import annotations

import pytest
import torch

from tests.vision_models import IMAGE_PAD, hf_vl_model, image_block, png, save_vl_model
from tokenwire.engine.factory import load_model
from tokenwire.model.families.qwen2_vl import mrope_positions
from tokenwire.model.images import ImagePreprocessor
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.model.loader import resolve_model

TOL = 1e-4


@pytest.fixture(scope="module", params=["qwen2_vl", "qwen2_5_vl"])
def pair(request, tmp_path_factory, smollm2_source):
    hf = hf_vl_model(request.param)
    directory = save_vl_model(hf, tmp_path_factory.mktemp(request.param), smollm2_source.model_dir)
    source = resolve_model(directory)
    ours = load_model(source, "fp32", torch.device("cpu"), None)
    return hf, ours


def _text(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(100, 40000, (n,), generator=g).tolist()


def _prompt(images: ImagePreprocessor, layout: list[object]) -> tuple[list[int], list]:
    """layout: ints (that many text tokens) and image bytes; returns ids and the prepared images."""
    ids: list[int] = []
    prepared = []
    for i, part in enumerate(layout):
        if isinstance(part, int):
            ids += _text(part, seed=i)
        else:
            image = images.prepare(part)
            prepared.append(image)
            ids += image_block(image.num_tokens)
    return ids, prepared


def _ours_logits(model, ids: list[int], prepared, embeds=None, last_only: bool = False) -> torch.Tensor:
    positions = torch.arange(len(ids))
    pads = [i for i, t in enumerate(ids) if t == IMAGE_PAD]
    placements, k = [], 0
    for image in prepared:
        placements.append((pads[k], *image.merged_grid))
        k += image.num_tokens
    if embeds is None:
        embeds = [model.visual(image.pixel_values, image.grid_thw) for image in prepared]
    with torch.inference_mode():
        hidden, _ = model(
            torch.tensor(ids),
            positions,
            DenseCausalAttention(1, len(ids)),
            mrope=mrope_positions(positions, placements),
            image_rows=torch.tensor(pads, dtype=torch.long),
            image_embeds=torch.cat(embeds) if embeds else None,
        )
        return model.logits(hidden[-1:] if last_only else hidden)


def _hf_inputs(ids: list[int], prepared) -> dict[str, torch.Tensor]:
    t = torch.tensor([ids])
    inputs = {"input_ids": t, "attention_mask": torch.ones_like(t)}
    if prepared:
        inputs["pixel_values"] = torch.cat([p.pixel_values for p in prepared])
        inputs["image_grid_thw"] = torch.tensor([p.grid_thw for p in prepared])
        inputs["mm_token_type_ids"] = (t == IMAGE_PAD).int()
    return inputs


LAYOUTS = {
    "text only": [23],
    "one image": [png(56, 56, seed=1), 7],
    "two images of different sizes": [4, png(140, 84, seed=2), 5, png(56, 112, seed=3), 6],
    "image in the middle of text": [9, png(112, 84, seed=4), 12],
}


@pytest.mark.parametrize("case", list(LAYOUTS))
def test_logits_match_transformers(pair, case):
    hf, ours = pair
    ids, prepared = _prompt(ours.images, LAYOUTS[case])
    with torch.inference_mode():
        expected = hf(**_hf_inputs(ids, prepared)).logits[0].float()
    got = _ours_logits(ours, ids, prepared)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() <= TOL


def test_vision_embeddings_match_transformers(pair):
    hf, ours = pair
    for data in (png(56, 56, seed=5), png(140, 84, seed=6), png(84, 196, seed=7)):
        image = ours.images.prepare(data)
        with torch.inference_mode():
            expected = hf.model.visual(
                image.pixel_values, grid_thw=torch.tensor([image.grid_thw])
            ).pooler_output
            got = ours.visual(image.pixel_values, image.grid_thw)
        assert got.shape == (image.num_tokens, 64)
        assert (got - expected).abs().max().item() <= TOL


def test_greedy_continuation_matches_generate(pair):
    hf, ours = pair
    ids, prepared = _prompt(ours.images, [5, png(140, 84, seed=8), 6])
    with torch.inference_mode():
        out = hf.generate(**_hf_inputs(ids, prepared), max_new_tokens=32, min_new_tokens=32, do_sample=False)
    expected = out[0, len(ids) :].tolist()
    seq = list(ids)
    with torch.inference_mode():
        embeds = [ours.visual(image.pixel_values, image.grid_thw) for image in prepared]
    for _ in range(32):  # the whole sequence again each time: no KV cache in this reference loop
        seq.append(int(_ours_logits(ours, seq, prepared, embeds, last_only=True)[-1].argmax()))
    assert seq[len(ids) :] == expected
