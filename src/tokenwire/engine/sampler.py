"""Turning one row of logits into a token (and the logprobs callers asked for)."""

from __future__ import annotations

import torch

from tokenwire.engine.constraints import ConstraintStep
from tokenwire.engine.request import SamplingParams


def processed_logits(
    logits: torch.Tensor, params: SamplingParams, step: ConstraintStep | None, vocab_size: int
) -> torch.Tensor:
    """Logits after logit_bias and the constraint's bias and mask (before temperature)."""
    out = logits
    if params.logit_bias:
        ids, values = params.bias_tensors
        out = out.clone().index_add_(0, ids, values.to(out.dtype))
    if logits.shape[0] > vocab_size:
        # padding rows of the embedding matrix are never real tokens
        out = out.clone() if out is logits else out
        out[vocab_size:] = float("-inf")
    if step is not None:
        if step.bias is not None:
            out = out + step.bias[: out.shape[0]].to(out.dtype)
        if step.allowed is not None:
            out = out.masked_fill(~step.allowed[: out.shape[0]], float("-inf"))
    return out


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    """Greedy when temperature is 0; otherwise temperature, top-k, top-p, then a draw.

    A speculated token (engine/speculation.py) is a draft that puts all its mass on one token.
    Rejection sampling keeps it with probability p(guess) and otherwise draws from p without it;
    drawing from p and keeping the guess when the draw is the guess is that same rule, and it
    uses the generator exactly as a step without a guess: a seeded request samples the same
    tokens with and without speculation, whatever was guessed."""
    if params.temperature == 0:
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.dim() == 1:
            # numpy's argmax is vectorised: ~4 us for 49k floats where torch's CPU argmax
            # takes ~85 us; both return the first maximum
            return int(logits.numpy().argmax())
        return int(torch.argmax(logits))
    scores = logits / params.temperature
    if params.top_k > 0 and params.top_k < scores.shape[0]:
        kth = torch.topk(scores, params.top_k).values[-1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=True)
        cumulative = torch.softmax(sorted_scores, dim=-1).cumsum(-1)
        # drop tokens once the mass before them already reaches top_p (always keep the best)
        drop = (cumulative - torch.softmax(sorted_scores, dim=-1)) >= params.top_p
        drop[0] = False
        scores = scores.scatter(0, order[drop], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    return int(torch.multinomial(probs, 1, generator=generator))


def logprobs_of(logits: torch.Tensor, token: int, top: int) -> tuple[float, list[tuple[int, float]] | None]:
    """log-softmax at `token` and the `top` best (max instead of topk for the common top-1)."""
    logp = torch.log_softmax(logits.float(), dim=-1)  # one row stays on one thread (see step.py)
    chosen = float(logp[token])
    if top <= 0:
        return chosen, None
    if top == 1:
        value, index = torch.max(logp, dim=-1)
        return chosen, [(int(index), float(value))]
    values, ids = torch.topk(logp, min(top, logp.shape[0]))
    return chosen, list(zip(ids.tolist(), values.tolist(), strict=True))
