"""The transformers baseline of `tokenwire bench engine`, run in its own process.

A user runs transformers as a plain script: one process, one thread calling generate(). We
do the same, so neither side's OpenMP thread team slows the other (two teams on two cores
make every kernel launch slower, see Engine._start). Prints one JSON object.

    python -m tokenwire.bench.hf_baseline MODEL_DIR PROMPTS_JSON N REPEATS [ftz]
"""

from __future__ import annotations

import json
import re
import statistics
import sys
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tokenwire.model.gguf_weights import GgufWeights
from tokenwire.model.loader import resolve_model


def transformers_model(model_dir: str) -> torch.nn.Module:
    """transformers' model of the directory; for a GGUF's conversion directory (no weights of
    its own), its config with the GGUF's weights dequantised exactly."""
    source = resolve_model(model_dir)
    if source.gguf is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32)
    state = dict(GgufWeights(source.gguf, source.config, dense=True))
    if any(k.endswith(".mlp.experts.gate_up_proj") for k in model.state_dict()):
        state = _fused_experts(state)
    left = model.load_state_dict(state, strict=False)
    if left.unexpected_keys or set(left.missing_keys) - {"lm_head.weight"}:
        raise ValueError(f"{model_dir}: transformers' names differ from the GGUF's: {left}")
    model.tie_weights()  # a tied lm_head: the embedding's table
    return model.eval()


_EXPERT = re.compile(r"(.*\.mlp\.experts\.)(\d+)\.(gate|up|down)_proj\.weight")


def _fused_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Per-expert tensors as transformers >= 5 holds them: gate and up stacked into one
    [experts, 2 x ff, hidden] `gate_up_proj`, the down projections into `down_proj`."""
    out: dict[str, torch.Tensor] = {}
    parts: dict[str, dict[str, dict[int, torch.Tensor]]] = {}
    for key, tensor in state.items():
        m = _EXPERT.fullmatch(key)
        if m is None:
            out[key] = tensor
        else:
            parts.setdefault(m.group(1), {}).setdefault(m.group(3), {})[int(m.group(2))] = tensor
    for prefix, kinds in parts.items():

        def stack(kind: str, kinds: dict = kinds) -> torch.Tensor:
            return torch.stack([kinds[kind][e] for e in sorted(kinds[kind])])

        out[prefix + "gate_up_proj"] = torch.cat([stack("gate"), stack("up")], dim=1)
        out[prefix + "down_proj"] = stack("down")
    return out


def main() -> None:
    model_dir, prompts_file, n, repeats = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    # "ftz": also measure with denormals flushed to zero, as our engine's model thread runs;
    # stock transformers does not, and on this CPU that alone costs it ~40% of its speed.
    if len(sys.argv) > 5 and sys.argv[5] == "ftz":
        torch.set_flush_denormal(True)
    prompts: list[list[int]] = json.loads(open(prompts_file).read())
    torch.set_grad_enabled(False)
    model = transformers_model(model_dir)

    def generate(ids: torch.Tensor, mask: torch.Tensor, tokens: int) -> float:
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=tokens,
            min_new_tokens=tokens,
            do_sample=False,
            pad_token_id=0,
        )
        elapsed = time.perf_counter() - start
        assert out.shape[1] - ids.shape[1] == tokens
        return elapsed

    one = torch.tensor([prompts[0]])
    generate(one, torch.ones_like(one), 4)  # warm-up
    e2e, decode = [], []
    for _ in range(repeats):
        t1 = generate(one, torch.ones_like(one), 1)
        tn = generate(one, torch.ones_like(one), n)
        e2e.append(n / tn)
        decode.append((n - 1) / (tn - t1))
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    batch = [len(prompts) * n / generate(ids, mask, n) for _ in range(repeats)]
    print(
        json.dumps(
            {
                "single_e2e_tok_s": statistics.median(e2e),
                "single_decode_tok_s": statistics.median(decode),
                "streams_tok_s": statistics.median(batch),
            }
        )
    )


if __name__ == "__main__":
    main()
