"""`tokenwire concepts build`: a concept vector per layer from two prompt files.

Each prompt's activations are averaged over its tokens; the concept at layer L is the mean
of the positive prompts minus the mean of the negative ones (unit-normalised, see
engine/concepts.py). Layer L is transformers' hidden_states[L]: 0 = embeddings.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from tokenwire.engine.concepts import ConceptSet, build_concept
from tokenwire.engine.engine import Engine
from tokenwire.engine.factory import EngineSettings, build_engine
from tokenwire.model.layers.attention import DenseCausalAttention


def read_prompts(path: Path) -> list[str]:
    prompts = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    if not prompts:
        raise ValueError(f"{path} has no prompts (one per line)")
    return prompts


def mean_activations(engine: Engine, prompts: list[str], layers: tuple[int, ...]) -> dict[int, torch.Tensor]:
    """layer -> [n_prompts, hidden]: each prompt's activations averaged over its tokens."""

    def run(tokens: list[int]) -> dict[int, torch.Tensor]:
        ids = torch.tensor(tokens, device=engine.model.device)
        positions = torch.arange(len(tokens), device=engine.model.device)
        with torch.inference_mode():
            _, captured = engine.model(ids, positions, DenseCausalAttention(1, len(tokens)), layers)
        return {layer: h.float().mean(0).cpu() for layer, h in captured.items()}

    per_prompt = [
        engine.call_on_model_thread(lambda p=p: run(engine.tokenizer.encode(p))).result() for p in prompts
    ]
    return {layer: torch.stack([acts[layer] for acts in per_prompt]) for layer in layers}


def run_concepts_build(args: argparse.Namespace, settings: EngineSettings) -> int:
    settings.progress = False
    engine = build_engine(settings)
    try:
        n_layers = engine.config.num_layers
        if args.layers:
            layers = tuple(sorted({int(x) for x in args.layers.split(",")}))
        else:
            layers = tuple(range(n_layers + 1))
        bad = [layer for layer in layers if not 0 <= layer <= n_layers]
        if bad:
            raise ValueError(f"layers {bad} out of range: the model has layers 0..{n_layers}")
        positive = mean_activations(engine, read_prompts(args.positive), layers)
        negative = mean_activations(engine, read_prompts(args.negative), layers)
        concept = build_concept(args.name, positive, negative)
        if args.merge:
            concept = ConceptSet.load(
                args.merge, hidden_size=engine.config.hidden_size, num_layers=n_layers
            ).merge(concept)
        args.output.parent.mkdir(parents=True, exist_ok=True)
        concept.save(args.output)
        print(f"wrote {args.output}: concepts {concept.names} over {len(concept.layers)} layers")
        return 0
    finally:
        engine.shutdown()
