"""`tokenwire bench vision`: our Qwen2-VL against transformers' modules, and image-session reuse.

Random weights, fp32, CPU, one 448x448 image (1024 patches -> 256 image tokens), all in one run
with the rounds interleaved (a load change on a shared machine hits both sides alike), medians:

* vision tower: ours `model.visual(patches)` vs transformers' `model.visual(patches, grid_thw)`;
* image prefill: the decoder over 16 text + the 258-token image block + 16 text with the image
  embeddings in place (embedding, scatter, M-RoPE, layers, final norm, last-row logits): ours vs
  transformers' language_model + lm_head on the same inputs;
* second turn: 8 new tokens on a session holding the image (a fork of it, so each round starts
  from the same state) vs re-prefilling the whole conversation with the prefix cache off, once
  with the image's embeddings cached and once from the pixels (the tower runs again).

Shapes: `tiny` (the tests' size) and `2b` = Qwen2-VL-2B's widths (vision 1280 wide, 16 heads,
merger to 1536; decoder 1536 wide, 12 heads / 2 KV heads, 8960 MLP, 151936 vocabulary) with
fewer layers than the real 32 + 28 (--vision-layers, --text-layers): per-layer time is what is
compared, and 2 shared CPU cores cannot run the full depth several times per round.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from PIL import Image

from tokenwire.engine.engine import Engine
from tokenwire.engine.request import GenerateOptions, SamplingParams
from tokenwire.engine.vision import ImageInput
from tokenwire.model.families import build_model, read_config
from tokenwire.model.families.qwen2_vl import mrope_positions
from tokenwire.model.images import ImagePreprocessor
from tokenwire.model.layers.attention import DenseCausalAttention
from tokenwire.model.loader import resolve_model
from tokenwire.model.tokenizer import Tokenizer

VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def _configs(name: str, vision_layers: int, text_layers: int, vocab: int) -> Any:
    # local: transformers' Qwen2-VL classes take seconds to import; `bench --help` loads this module
    from transformers import Qwen2VLConfig

    ids = dict(vision_start_token_id=vocab, vision_end_token_id=vocab + 1, image_token_id=vocab + 2,
               video_token_id=vocab + 3)  # fmt: skip
    if name == "tiny":
        text = dict(
            vocab_size=vocab + 8,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [2, 3, 3], "rope_theta": 1e4},
        )
        vision = dict(depth=2, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2)  # fmt: skip
    else:
        text = dict(
            vocab_size=151936,
            hidden_size=1536,
            intermediate_size=8960,
            num_hidden_layers=text_layers,
            num_attention_heads=12,
            num_key_value_heads=2,
            rope_parameters={"rope_type": "default", "mrope_section": [16, 24, 24], "rope_theta": 1e6},
        )
        vision = dict(depth=vision_layers, embed_dim=1280, hidden_size=1536, num_heads=16, mlp_ratio=4)
    cfg = Qwen2VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True, **ids)
    cfg.architectures = ["Qwen2VLForConditionalGeneration"]
    return cfg


def _tokenizer() -> Any:
    # local: transformers takes seconds to import (see _configs)
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(resolve_model(None).model_dir)
    hf.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    return Tokenizer(hf)


def _image(size: int) -> bytes:
    g = torch.Generator().manual_seed(0)
    pixels = torch.randint(0, 256, (size, size, 3), generator=g, dtype=torch.uint8).numpy()
    buf = io.BytesIO()
    Image.fromarray(pixels, "RGB").save(buf, format="PNG")
    return buf.getvalue()


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    with torch.inference_mode():
        fn()
    return time.perf_counter() - start


def _pair(name: str, args: argparse.Namespace, vocab: int) -> tuple[Any, Any]:
    # local: transformers' Qwen2-VL model (see _configs)
    from transformers import Qwen2VLForConditionalGeneration

    torch.manual_seed(0)
    cfg = _configs(name, args.vision_layers, args.text_layers, vocab)
    hf = Qwen2VLForConditionalGeneration(cfg).eval().requires_grad_(False)
    ours = build_model(read_config(cfg.to_dict()), hf.state_dict())
    ours.images = ImagePreprocessor()  # transformers' defaults: 448x448 stays 448x448
    return hf, ours


def _bench_shapes(name: str, args: argparse.Namespace, tokenizer: Any) -> dict[str, Any]:
    vocab = len(tokenizer.hf) - len(VISION_TOKENS)
    hf, ours = _pair(name, args, vocab)
    v = ours.config.vision
    data = _image(args.size)
    image = ours.images.prepare(data)
    pv, grid = image.pixel_values, image.grid_thw
    grid_t = torch.tensor([grid])
    n = image.num_tokens
    g = torch.Generator().manual_seed(1)
    text = torch.randint(100, vocab, (32,), generator=g).tolist()
    ids = [*text[:16], v.vision_start_token_id, *[v.image_token_id] * n, v.vision_end_token_id, *text[16:]]
    t_ids = torch.tensor(ids)
    positions = torch.arange(len(ids))
    pos3 = mrope_positions(positions, [(17, *image.merged_grid)])
    rows = torch.arange(17, 17 + n)
    with torch.inference_mode():
        embeds = ours.visual(pv, grid)

    def ours_prefill() -> None:
        hidden, _ = ours(t_ids, positions, DenseCausalAttention(1, len(ids)), mrope=pos3, image_rows=rows,
                         image_embeds=embeds)  # fmt: skip
        ours.logits(hidden[-1:])

    lm = hf.model.language_model
    mask = (t_ids == v.image_token_id)[None, :, None]

    def hf_prefill() -> None:
        x = lm.embed_tokens(t_ids[None]).masked_scatter(mask, embeds)
        out = lm(inputs_embeds=x, position_ids=pos3[:, None, :], use_cache=False).last_hidden_state
        hf.lm_head(out[:, -1:])

    cases = {
        "tower_ours": lambda: ours.visual(pv, grid),
        "tower_hf": lambda: hf.model.visual(pv, grid_thw=grid_t),
        "prefill_ours": ours_prefill,
        "prefill_hf": hf_prefill,
    }
    for fn in cases.values():  # warm-up: first-call costs out of the medians
        _timed(fn)
    runs = {k: [] for k in cases}
    for r in range(args.repeats):
        # A B B A: odd rounds run transformers first, so neither side always follows the other
        for key, fn in list(cases.items())[:: 1 if r % 2 == 0 else -1]:
            runs[key].append(_timed(fn))
    result: dict[str, Any] = {k: statistics.median(r) for k, r in runs.items()}
    result.update(image_tokens=n, prompt_tokens=len(ids))

    engine = Engine(ours, tokenizer, name=f"random-qwen2-vl-{name}", kv_cache_mb=64, max_batch_tokens=1024)
    try:
        greedy = GenerateOptions(max_tokens=1, sampling=SamplingParams(temperature=0), ignore_eos=True)
        attach = [ImageInput(16, 16 + n + 2, data)]
        base = engine.create_session()
        first, _ = engine.generate(base, ids, greedy, images=attach).result()
        turn2 = [first[0].token_id, *text[:8]]
        whole = [*ids, *turn2]
        fresh = GenerateOptions(max_tokens=1, sampling=SamplingParams(temperature=0), ignore_eos=True,
                                use_prefix_cache=False)  # fmt: skip

        def reuse() -> None:
            engine.generate(engine.fork_session(base), turn2, greedy).result()

        def reprefill() -> None:
            engine.generate(None, whole, fresh, images=attach).result()

        def cold() -> None:
            assert engine.vision is not None
            engine.vision.clear()
            engine.generate(None, whole, fresh, images=attach).result()

        turns = {"turn2_reuse": reuse, "turn2_reprefill": reprefill, "turn2_reprefill_cold": cold}
        for fn in turns.values():
            _timed(fn)
        t_runs = {k: [] for k in turns}
        for r in range(args.repeats):
            for key, fn in list(turns.items())[:: 1 if r % 2 == 0 else -1]:
                t_runs[key].append(_timed(fn))
        result.update({k: statistics.median(r) for k, r in t_runs.items()})
    finally:
        engine.shutdown()
    return result


def run_vision_bench(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    tokenizer = _tokenizer()
    shapes = ["tiny", "2b"] if args.shapes == "both" else [args.shapes]
    results = {name: _bench_shapes(name, args, tokenizer) for name in shapes}
    out = {
        "size": args.size,
        "repeats": args.repeats,
        "vision_layers_2b": args.vision_layers,
        "text_layers_2b": args.text_layers,
        "threads": torch.get_num_threads(),
        "results": results,
    }
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"tokenwire bench vision — random weights, fp32, CPU ({out['threads']} threads), one {args.size}x"
          f"{args.size} image, median of {args.repeats} interleaved rounds")  # fmt: skip
    print(f"{'shapes':<6}{'measure':<36}{'tokenwire':>12}{'baseline':>12}{'speed-up':>10}")
    for name, r in results.items():
        rows = [
            ("vision tower (vs transformers)", r["tower_ours"], r["tower_hf"]),
            (f"image prefill {r['prompt_tokens']} tok (vs transformers)", r["prefill_ours"], r["prefill_hf"]),
            ("turn 2 reuse (vs re-prefill, cached emb.)", r["turn2_reuse"], r["turn2_reprefill"]),
            ("turn 2 reuse (vs re-prefill + tower)", r["turn2_reuse"], r["turn2_reprefill_cold"]),
        ]
        for label, ours_s, base_s in rows:
            print(
                f"{name:<6}{label:<36}{ours_s * 1e3:>9.1f} ms{base_s * 1e3:>9.1f} ms{base_s / ours_s:>9.2f}x"
            )
    print(f"2b = Qwen2-VL-2B widths with {args.vision_layers} vision + {args.text_layers} decoder layers "
          "(the real model: 32 + 28); speed-up = baseline / tokenwire.")  # fmt: skip
    return 0


def register(bench_sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = bench_sub.add_parser("vision", help="Qwen2-VL: vision tower and image prefill vs transformers, reuse")
    p.add_argument("--json", action="store_true")
    p.add_argument("--shapes", choices=("tiny", "2b", "both"), default="both")
    p.add_argument("--size", type=int, default=448, help="image side in pixels")
    p.add_argument("--vision-layers", type=int, default=4, help="vision blocks of the 2b shapes (real: 32)")
    p.add_argument("--text-layers", type=int, default=2, help="decoder layers of the 2b shapes (real: 28)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=None)
    p.set_defaults(handler=run_vision_bench)
