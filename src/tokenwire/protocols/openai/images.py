"""`image_url` content parts of chat messages, for vision models.

Only `data:` URLs are read (the server has no network): `data:image/png;base64,...`. Each image
becomes its vision block in the message text (`<|vision_start|>` + N x `<|image_pad|>` +
`<|vision_end|>`, N = the model's encoder count for that image), and after the template is
tokenized the blocks are found again in order and the images attached to their positions. A
block the client typed itself (the special tokens as text) makes the count disagree: a 400.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tokenwire.engine.api import EngineAPI
from tokenwire.engine.errors import InvalidRequestError
from tokenwire.engine.vision import ImageBlock, ImageInput
from tokenwire.protocols.openai.errors import bad_request


@dataclass(frozen=True)
class ChatVision:
    """The loaded vision model's image block (its tokens and pad count per image), and those
    tokens as the chat template's text."""

    block: ImageBlock
    start_text: str = "<|vision_start|>"
    pad_text: str = "<|image_pad|>"
    end_text: str = "<|vision_end|>"


@dataclass(frozen=True)
class ChatImage:
    data: bytes
    mime: str
    num_tokens: int
    param: str  # where it came from: messages.i.content.j


def vision_of(engine: EngineAPI) -> ChatVision | None:
    block = engine.image_block()
    return None if block is None else ChatVision(block)


def read_image_part(part: Any, vision: ChatVision, param: str) -> tuple[str, ChatImage]:
    """An image_url part -> (its block as text, the image); 400 naming what is wrong."""
    url = (part.image_url or {}).get("url") if isinstance(part.image_url, dict) else None
    if not isinstance(url, str) or not url:
        raise bad_request("image_url part needs image_url.url (a data: URL)", f"{param}.image_url.url")
    if not url.startswith("data:"):
        raise bad_request(
            "image_url.url must be a data: URL (data:image/png;base64,...): this server does not "
            "fetch remote images",
            f"{param}.image_url.url",
        )
    header, sep, payload = url[len("data:") :].partition(",")
    mime, *flags = header.split(";")
    if not sep or "base64" not in flags:
        raise bad_request(
            "image_url data: URL must be base64-encoded (data:<mime>;base64,<data>)", f"{param}.image_url.url"
        )
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("image_url data: URL holds invalid base64", f"{param}.image_url.url") from None
    try:
        n = vision.block.count(data, mime or None)
    except InvalidRequestError as exc:
        raise bad_request(f"image_url: {exc}", f"{param}.image_url.url") from None
    text = vision.start_text + vision.pad_text * n + vision.end_text
    return text, ChatImage(data, mime, n, param)


def place_images(
    tokens: Sequence[int], images: Sequence[ChatImage], vision: ChatVision, offset: int
) -> list[ImageInput]:
    """Find each image's block in the tokenized prompt, in order; `offset`: the session's length
    before these tokens (blocks are attached at absolute positions)."""
    start_id, pad_id, end_id = vision.block.start, vision.block.pad, vision.block.end
    blocks = [i for i, t in enumerate(tokens) if t == start_id]
    if len(blocks) != len(images):
        raise bad_request(
            f"the prompt holds {len(blocks)} vision blocks for {len(images)} images (is a vision "
            "token written as text in a message?)",
            "messages",
        )
    placed = []
    for start, image in zip(blocks, images, strict=True):
        end = start + image.num_tokens + 2
        run = tokens[start + 1 : end - 1]
        if end > len(tokens) or tokens[end - 1] != end_id or any(t != pad_id for t in run):
            raise bad_request(f"the vision block of {image.param} is not intact in the prompt", "messages")
        placed.append(ImageInput(offset + start, offset + end, image.data, image.mime or None))
    return placed
