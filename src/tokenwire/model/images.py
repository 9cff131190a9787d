"""Images for vision models: decode (Pillow), preprocess (the model's own transformers processor), hash.

The processor is transformers' `Qwen2VLImageProcessorPil` configured from the model directory's
preprocessor_config.json: it resizes to the pixel bounds (multiples of patch * merge), normalises
and flattens the image into patches. Nothing of that is re-implemented here. An image's identity
is the hash of its bytes: the same bytes give the same pixels, hence the same embeddings.
"""

from __future__ import annotations

import hashlib
import io
import json
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

# what Salience / Evergreen / OpenAI may send, and the Pillow format each must decode as
IMAGE_MIMES = {"image/png": "PNG", "image/jpeg": "JPEG", "image/jpg": "JPEG", "image/webp": "WEBP"}
_PROCESSOR_KEYS = ("min_pixels", "max_pixels", "patch_size", "temporal_patch_size", "merge_size",
                   "image_mean", "image_std", "size")  # fmt: skip


class ImageError(ValueError):
    """The bytes are not an image this server accepts (wrong mime, corrupt or undecodable data)."""


def image_digest(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


@dataclass(frozen=True)
class PreparedImage:
    digest: bytes  # content hash of the encoded bytes
    pixel_values: torch.Tensor  # [t*h*w, C*T*P*P] patches in the vision tower's order
    grid_thw: tuple[int, int, int]  # patch grid before merging
    merge_size: int

    @property
    def merged_grid(self) -> tuple[int, int]:
        return self.grid_thw[1] // self.merge_size, self.grid_thw[2] // self.merge_size

    @property
    def num_tokens(self) -> int:
        """How many <|image_pad|> tokens stand for this image."""
        t, h, w = self.grid_thw
        return t * h * w // self.merge_size**2


def check_mime(mime: str | None) -> str | None:
    if mime is None:
        return None
    mime = mime.strip().lower()
    if mime not in IMAGE_MIMES:
        raise ImageError(
            f"mime type {mime!r} is not an image type: use one of image/png, image/jpeg, image/webp"
        )
    return mime


def decode_image(data: bytes, mime: str | None = None) -> Any:
    """A PIL RGB image from PNG / JPEG / WebP bytes; ImageError names what is wrong."""
    # local: Pillow loads for an image, not for every engine (engine/vision.py imports this module)
    from PIL import Image, UnidentifiedImageError

    mime = check_mime(mime)
    if not data:
        raise ImageError("image data is empty")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise ImageError(f"image data cannot be decoded ({e})") from None
    formats = {v for v in IMAGE_MIMES.values()}
    if image.format not in formats:
        raise ImageError(f"image format {image.format} is not accepted: send PNG, JPEG or WebP")
    if mime is not None and image.format != IMAGE_MIMES[mime]:
        raise ImageError(f"image data is {image.format}, not the declared {mime}")
    return image.convert("RGB")


class ImagePreprocessor:
    """The model's image processor plus a small cache of prepared images by content hash."""

    def __init__(self, settings: dict[str, Any] | None = None, cache_size: int = 64) -> None:
        # local: transformers' image processor takes seconds to import; only vision models make one
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

        kwargs = {k: v for k, v in (settings or {}).items() if k in _PROCESSOR_KEYS}
        self.processor = Qwen2VLImageProcessorPil(**kwargs)
        self.merge_size = int(self.processor.merge_size)
        # by (content hash, declared mime): a hit must have passed the same mime check
        self._cache: dict[tuple[bytes, str | None], PreparedImage] = {}
        self._cache_size = cache_size
        self._lock = threading.Lock()  # callers' threads (protocol handlers) share the cache

    @classmethod
    def from_dir(cls, model_dir: Path | None) -> ImagePreprocessor:
        path = Path(model_dir) / "preprocessor_config.json" if model_dir is not None else None
        settings = json.loads(path.read_text()) if path is not None and path.is_file() else {}
        return cls(settings)

    def prepare(self, data: bytes, mime: str | None = None) -> PreparedImage:
        digest = image_digest(data)
        key = (digest, check_mime(mime))
        with self._lock:
            cached = self._cache.get(key)
        if cached is not None:
            return cached
        image = decode_image(data, mime)
        try:
            out = self.processor(images=[image], return_tensors="pt")
        except ValueError as e:  # e.g. an aspect ratio over 200
            raise ImageError(f"image cannot be preprocessed: {e}") from None
        grid = tuple(int(x) for x in out["image_grid_thw"][0])
        prepared = PreparedImage(digest, out["pixel_values"].float(), grid, self.merge_size)  # type: ignore[arg-type]
        with self._lock:
            while self._cache and len(self._cache) >= self._cache_size:
                self._cache.pop(next(iter(self._cache)))
            if self._cache_size > 0:
                self._cache[key] = prepared
        return prepared
