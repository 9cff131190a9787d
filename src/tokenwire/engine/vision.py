"""Images in engine sessions (vision models): attaching them, their embeddings, their step inputs.

An attached image is a block of the session's tokens, `<|vision_start|> + N*<|image_pad|> +
<|vision_end|>` at [start, end), N being what the vision tower makes of the image. Its N pad
positions are one run of KV positions like any other: the step feeds the image's embeddings at
those rows instead of the pad token's, with M-RoPE positions (qwen2_vl.py).

Embeddings are cached by the image's content hash (`EmbeddingCache`), so the tower runs once per
distinct image however many sessions, forks, preemptions or prefix-cache misses need it. The
prefix cache keys a KV block by its tokens *and* the hashes of the images it holds (session.py),
so two images with the same pad run never share blocks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise
from typing import Any

import torch

from tokenwire.engine.errors import InvalidRequestError, PositionError
from tokenwire.model.config import ModelConfig
from tokenwire.model.families.qwen2_vl import mrope_positions
from tokenwire.model.images import ImageError, PreparedImage


@dataclass(frozen=True)
class ImageInput:
    """An image a caller attaches: its encoded bytes and the block [start, end) it stands in
    (absolute positions in the session's tokens after the append)."""

    start: int
    end: int
    data: bytes
    mime: str | None = None


@dataclass(frozen=True)
class SessionImage:
    start: int  # the <|vision_start|> position
    end: int  # one past the <|vision_end|>
    image: PreparedImage

    @property
    def pad_start(self) -> int:
        return self.start + 1

    @property
    def pad_end(self) -> int:
        return self.end - 1

    def splits(self, position: int) -> bool:
        """Whether cutting the session at `position` (keeping [0, position)) would split the block."""
        return self.start < position < self.end


class EmbeddingCache:
    """Vision-tower outputs by image content hash, least recently used evicted past `max_bytes`."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, torch.Tensor] = OrderedDict()
        self._bytes = 0
        self.tower_runs = 0  # images run through the tower (misses)
        self.hits = 0

    def clear(self) -> None:
        """Forget every embedding (benchmarks: a re-prefill that runs the tower again)."""
        self._entries.clear()
        self._bytes = 0

    def get(self, model: Any, image: PreparedImage) -> torch.Tensor:
        """The image's embeddings [N, hidden]; runs the tower on a miss (model thread only)."""
        found = self._entries.get(image.digest)
        if found is not None:
            self._entries.move_to_end(image.digest)
            self.hits += 1
            return found
        with torch.inference_mode():
            embeds = model.visual(image.pixel_values.to(model.device), image.grid_thw)
        self.tower_runs += 1
        self._entries[image.digest] = embeds
        self._bytes += embeds.numel() * embeds.element_size()
        while self._bytes > self.max_bytes and len(self._entries) > 1:
            _, old = self._entries.popitem(last=False)
            self._bytes -= old.numel() * old.element_size()
        return embeds


ImageCounter = Callable[[bytes, str | None], int]  # image bytes, mime (None: sniffed) -> pad count


@dataclass(frozen=True)
class ImageBlock:
    """How a vision model's prompt holds an image: `start` + N x `pad` + `end` token ids, N being
    what `count` says the encoder makes of the image (InvalidRequestError for bytes that are not
    a usable image). What every protocol builds its image blocks from (EngineAPI.image_block)."""

    start: int
    pad: int
    end: int
    count: ImageCounter

    def tokens(self, pads: int) -> list[int]:
        """The block of an image that takes `pads` pad tokens."""
        return [self.start, *[self.pad] * pads, self.end]


def vision_tokens(config: ModelConfig) -> tuple[int, int, int] | None:
    """(vision_start, image_pad, vision_end) ids of a vision model; None for a text-only one."""
    v = config.vision
    return None if v is None else (v.vision_start_token_id, v.image_token_id, v.vision_end_token_id)


def decode_images(model: Any, images: Sequence[ImageInput]) -> list[PreparedImage]:
    """Decode and preprocess attached images (no engine state: callers run it outside the lock);
    InvalidRequestError names the first bad one, or says the model has no vision encoder."""
    if vision_tokens(model.config) is None:
        raise InvalidRequestError("this model has no vision encoder: images are not accepted")
    prepared: list[PreparedImage] = []
    for i, image in enumerate(images):
        try:
            prepared.append(model.images.prepare(image.data, image.mime))
        except ImageError as e:
            raise InvalidRequestError(f"images[{i}]: {e}") from None
    return prepared


def place_images(
    config: Any,
    tokens: Sequence[int],
    existing: Sequence[SessionImage],
    images: Sequence[ImageInput],
    prepared: Sequence[PreparedImage],
) -> list[SessionImage]:
    """Check decoded images against the session's post-append `tokens` and the blocks it holds;
    raises InvalidRequestError naming the first problem. Returns the new blocks (not attached)."""
    ids = vision_tokens(config)
    assert ids is not None
    start_id, pad_id, end_id = ids
    added: list[SessionImage] = []
    for i, (image, ready) in enumerate(zip(images, prepared, strict=True)):
        if not 0 <= image.start < image.end <= len(tokens):
            raise InvalidRequestError(
                f"images[{i}]: block [{image.start}, {image.end}) lies outside the tokens [0, {len(tokens)})"
            )
        n = ready.num_tokens
        block = tokens[image.start : image.end]
        framed = len(block) == n + 2 and block[0] == start_id and block[-1] == end_id
        if not framed or any(t != pad_id for t in block[1:-1]):
            raise InvalidRequestError(
                f"images[{i}]: tokens [{image.start}, {image.end}) must be vision_start {start_id}, "
                f"{n} x image_pad {pad_id} (this image's token count), vision_end {end_id}"
            )
        added.append(SessionImage(image.start, image.end, ready))
    blocks = sorted([*existing, *added], key=lambda b: b.start)
    for a, b in pairwise(blocks):
        if b.start < a.end:
            raise InvalidRequestError(f"image blocks [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap")
    return added


def check_cut(images: Sequence[SessionImage], position: int, what: str) -> None:
    for block in images:
        if block.splits(position):
            raise PositionError(
                f"cannot {what} at {position}: it falls inside the image block [{block.start}, {block.end})"
            )


def block_key(images: Sequence[SessionImage], start: int, end: int) -> bytes:
    """What besides its tokens identifies the KV of positions [start, end): the hashes (and
    places) of the images whose pads lie there."""
    inside = [b for b in images if b.pad_start < end and start < b.pad_end]
    return b"".join(b.start.to_bytes(4, "little") + b.image.digest for b in inside)


def step_inputs(
    model: Any, cache: EmbeddingCache, rows: Sequence[tuple[Any, int, int]]
) -> dict[str, torch.Tensor]:
    """The vision model's extra inputs for a step: M-RoPE positions of every row and the image
    embeddings of the pad rows. `rows`: (session, start, count) per item, in packed order."""
    pos3: list[torch.Tensor] = []
    image_rows: list[torch.Tensor] = []
    embeds: list[torch.Tensor] = []
    base = 0
    for session, start, count in rows:
        positions = torch.arange(start, start + count)
        images: Sequence[SessionImage] = session.images
        placements = [(b.pad_start, *b.image.merged_grid) for b in images]
        pos3.append(mrope_positions(positions, placements))
        for b in images:
            lo, hi = max(b.pad_start, start), min(b.pad_end, start + count)
            if lo >= hi:
                continue
            full = cache.get(model, b.image)
            embeds.append(full[lo - b.pad_start : hi - b.pad_start])
            image_rows.append(torch.arange(base + lo - start, base + hi - start))
        base += count
    out = {"mrope": torch.cat(pos3, dim=1)}
    if embeds:
        out["image_rows"] = torch.cat(image_rows)
        out["image_embeds"] = torch.cat(embeds)
    return out
