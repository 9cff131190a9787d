"""Image blocks of a session: the `<|vision_start|> + N*<|image_pad|> + <|vision_end|>` runs.

Pure functions over plain values. The server keeps each session's blocks so that truncation and
forks cannot split one (FAILED_PRECONDITION), and checks every newly attached ImageAttachment:
its range lies inside the post-append token list, does not overlap another block, spans exactly
N + 2 tokens (N = what the vision encoder produces for the image) and holds the model's vision
tokens. A model without a vision encoder rejects images after these structural checks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import pairwise

import grpc

from tokenwire.protocols.salience.status import SalienceStatus


@dataclass(frozen=True)
class VisionTokens:
    """The model's special tokens that frame an image's placeholder run."""

    start: int
    pad: int
    end: int


@dataclass(frozen=True)
class ImageBlock:
    """One attached image and the half-open token range [start, end) of its vision block."""

    start: int
    end: int
    mime: str = ""
    data: bytes = b""


def _invalid(message: str) -> SalienceStatus:
    return SalienceStatus(grpc.StatusCode.INVALID_ARGUMENT, message)


def check_attachments(
    attachments: Sequence[ImageBlock],
    tokens_after: Sequence[int],
    existing: Sequence[ImageBlock],
    vision: VisionTokens | None,
    pad_count: Callable[[ImageBlock], int] | None,
) -> list[ImageBlock]:
    """Validate newly attached images against the post-append token list.

    `existing`: the session's blocks that survive this call's truncation. `pad_count(image)`
    gives the vision encoder's feature count N; None when the model has no vision encoder, in
    which case every image is rejected once its range is well formed. Returns the new blocks.
    """
    n = len(tokens_after)
    for i, image in enumerate(attachments):
        if image.end <= image.start:
            raise _invalid(f"images[{i}]: empty pad range [{image.start}, {image.end})")
        if image.end > n:
            raise _invalid(
                f"images[{i}]: pad range [{image.start}, {image.end}) lies outside the session's "
                f"post-append tokens [0, {n})"
            )
        if image.end - image.start < 3:
            raise _invalid(
                f"images[{i}]: pad range [{image.start}, {image.end}) is shorter than "
                "vision_start + 1 pad + vision_end"
            )
    ordered = sorted([*existing, *attachments], key=lambda b: b.start)
    for a, b in pairwise(ordered):
        if b.start < a.end:
            raise _invalid(f"image ranges [{a.start}, {a.end}) and [{b.start}, {b.end}) overlap")
    if vision is None or pad_count is None:
        raise _invalid("this model has no vision encoder: images are not accepted")
    for i, image in enumerate(attachments):
        first, last = tokens_after[image.start], tokens_after[image.end - 1]
        if first != vision.start or last != vision.end:
            raise _invalid(
                f"images[{i}]: range [{image.start}, {image.end}) must start with vision_start "
                f"{vision.start} and end with vision_end {vision.end}, found {first} and {last}"
            )
        for p in range(image.start + 1, image.end - 1):
            if tokens_after[p] != vision.pad:
                raise _invalid(
                    f"images[{i}]: position {p} holds token {tokens_after[p]}, not the image pad "
                    f"token {vision.pad}"
                )
        expected = pad_count(image)
        if image.end - image.start != expected + 2:
            raise _invalid(
                f"images[{i}]: the run has {image.end - image.start - 2} pad tokens but the vision "
                f"encoder produces {expected} for this image (end - start must be {expected + 2})"
            )
    return list(attachments)


def _inside(block: ImageBlock, position: int) -> bool:
    return block.start < position < block.end


def blocks_after_truncate(blocks: Sequence[ImageBlock], length: int) -> list[ImageBlock]:
    """Blocks kept when the session is cut to `length` tokens; cutting through one is an error."""
    for block in blocks:
        if _inside(block, length):
            raise SalienceStatus(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"truncating to {length} would split the image block [{block.start}, {block.end})",
            )
    return [b for b in blocks if b.end <= length]


def blocks_for_fork(blocks: Sequence[ImageBlock], at: int) -> list[ImageBlock]:
    """Blocks a fork at `at` inherits; a fork point inside a block is an error."""
    for block in blocks:
        if _inside(block, at):
            raise SalienceStatus(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"at_position {at} falls inside the image block [{block.start}, {block.end}); "
                "fork at a block boundary",
            )
    return [b for b in blocks if b.end <= at]
