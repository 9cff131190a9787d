"""Tiny random-weight Qwen2-VL / Qwen2.5-VL models saved as Hugging Face directories, and test images.

The tokenizer is SmolLM2's with the Qwen2-VL vision tokens added (ids 49152..49155), so the tiny
models can be driven by text through every protocol. Image pixel bounds are small (56x56 to
28*28*64 pixels: 4 to 64 pad tokens per image) to keep the tests fast.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    PretrainedConfig,
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
)

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 49152, 49153, 49154, 49155
VL_VOCAB = 49160
MIN_PIXELS, MAX_PIXELS = 56 * 56, 28 * 28 * 64

_TEXT = dict(
    vocab_size=VL_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=1024,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 10000.0},
)
_IDS = dict(
    image_token_id=IMAGE_PAD,
    video_token_id=VIDEO_PAD,
    vision_start_token_id=VISION_START,
    vision_end_token_id=VISION_END,
    bos_token_id=1,
    eos_token_id=2,
)


def tiny_config(variant: str) -> PretrainedConfig:
    text = dict(_TEXT, bos_token_id=1, eos_token_id=2)
    if variant == "qwen2_vl":
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2, spatial_merge_size=2)
        cfg: PretrainedConfig = Qwen2VLConfig(text_config=text, vision_config=vision, **_IDS)
    elif variant == "qwen2_5_vl":
        # window 56 px = 2x2 merged tokens: images of 3+ merged tokens a side get several windows
        vision = dict(depth=4, hidden_size=32, intermediate_size=48, num_heads=2, out_hidden_size=64,
                      window_size=56, fullatt_block_indexes=[1, 3], spatial_merge_size=2)  # fmt: skip
        cfg = Qwen2_5_VLConfig(text_config=text, vision_config=vision, **_IDS)
    else:
        raise ValueError(variant)
    cfg.architectures = [type(cfg).__name__.replace("Config", "ForConditionalGeneration")]
    return cfg


def hf_vl_model(variant: str, seed: int = 1234) -> torch.nn.Module:
    torch.manual_seed(seed)
    cls = Qwen2VLForConditionalGeneration if variant == "qwen2_vl" else Qwen2_5_VLForConditionalGeneration
    model = cls(tiny_config(variant)).to(torch.float32).eval()
    with torch.no_grad():  # default init leaves norms at 1 and biases at 0: make them count
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_vl_model(model: torch.nn.Module, directory: Path, tokenizer_dir: Path) -> Path:
    """An HF model directory: config.json + safetensors + tokenizer + preprocessor_config.json."""
    directory.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(directory, safe_serialization=True)
    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    tok.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    assert tok.convert_tokens_to_ids(VISION_TOKENS) == [VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD]
    tok.save_pretrained(directory)
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "Qwen2VLImageProcessor",
                "min_pixels": MIN_PIXELS,
                "max_pixels": MAX_PIXELS,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
            }
        )
    )
    return directory


def png(width: int, height: int, seed: int = 0, fmt: str = "PNG") -> bytes:
    """A random-pixel image of the given size, encoded."""
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format=fmt)
    return buf.getvalue()


def image_block(num_pads: int) -> list[int]:
    return [VISION_START, *[IMAGE_PAD] * num_pads, VISION_END]
