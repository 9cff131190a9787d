"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM2) in plain PyTorch.

The layers work on a *packed* batch: the tokens of every sequence in a step are concatenated
into one [N, hidden] tensor, so the projections and MLP run as single matmuls whatever mix of
prefill chunks and decode tokens the scheduler chose. Only attention needs to know which
token belongs to which sequence; it is delegated to an `AttentionBackend` (paged KV cache for
the engine, plain causal attention for whole-sequence tensor calls).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.model.config import ModelConfig
from tokenwire.model.kernels import ops
from tokenwire.model.quant import QuantLinear


class AttentionBackend(Protocol):
    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [N, H, D], k/v [N, KVH, D] for the packed tokens -> attention output [N, H*D]."""
        ...


@dataclass
class PagedDecode:
    """A decode-only step over the paged KV cache, for the fused decode path: row m of the
    batch is one new token of its own sequence at positions[m]; block_tables[m] lists that
    sequence's KV blocks (padded). k/v are the whole caches [layers, blocks, block_size, kv_heads, D]."""

    k: torch.Tensor
    v: torch.Tensor
    positions: torch.Tensor  # [M] int64
    block_tables: torch.Tensor  # [M, max_blocks] int64


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # llama3 scaling: long wavelengths are divided by `factor`, short ones kept, and the band in
    # between is interpolated smoothly (Llama 3.1 rope_scaling in config.json).
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(nn.Module):
    """Precomputed cos/sin tables in the rotate-half layout Hugging Face checkpoints use.

    rotate_half(x) = cat(-x2, x1) equals roll(x, D/2) with the first half negated, so the
    sign is folded into the sin table and RoPE costs one roll, two multiplies and an add.
    """

    def __init__(self, config: ModelConfig, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(config)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        half = emb.shape[-1] // 2
        sign = torch.cat([-torch.ones(half), torch.ones(half)])
        self.register_buffer("cos", emb.cos(), persistent=False)
        self.register_buffer("sin", emb.sin() * sign, persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[positions].to(dtype)[:, None, :], self.sin[positions].to(dtype)[:, None, :]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    # two multiplies and an add, not addcmul: the fused multiply-add rounds differently from
    # the reference implementation and the difference grows through 30 layers
    return x * cos + torch.roll(x, x.shape[-1] // 2, dims=-1) * signed_sin


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # computed by hand: on CPU this is several times faster than the fused fallback
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class DecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.eps = config.rms_norm_eps
        q_size = config.num_heads * config.head_dim
        kv_size = config.num_kv_heads * config.head_dim
        self.split = (q_size, kv_size, kv_size)
        # q/k/v and gate/up are fused into one matmul each: fewer kernel launches per token.
        self.qkv = nn.Linear(config.hidden_size, q_size + 2 * kv_size, bias=config.attention_bias)
        self.o_proj = nn.Linear(q_size, config.hidden_size, bias=False)
        self.gate_up = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.input_norm = nn.Parameter(torch.ones(config.hidden_size))
        self.post_attention_norm = nn.Parameter(torch.ones(config.hidden_size))

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attention: AttentionBackend
    ) -> torch.Tensor:
        n = x.shape[0]
        h = rms_norm(x, self.input_norm, self.eps)
        qkv = self.qkv(h)
        q_size, kv_size, _ = self.split
        # q and k heads get RoPE in one call
        qk = apply_rope(
            qkv[:, : q_size + kv_size].view(n, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin
        )
        q = qk[:, : self.num_heads]
        k = qk[:, self.num_heads :]
        v = qkv[:, q_size + kv_size :].view(n, self.num_kv_heads, self.head_dim)
        x = x + self.o_proj(attention(self.index, q, k, v))
        h = rms_norm(x, self.post_attention_norm, self.eps)
        gate, up = self.gate_up(h).chunk(2, dim=-1)
        return x + self.down(F.silu(gate).mul_(up))


class LlamaModel(nn.Module):
    def __init__(self, config: ModelConfig, max_positions: int | None = None) -> None:
        super().__init__()
        self.config = config
        self.max_positions = max_positions or config.max_position_embeddings
        self.embed = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_layers))
        self.norm = nn.Parameter(torch.ones(config.hidden_size))
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.rotary = Rotary(config, self.max_positions)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    @property
    def device(self) -> torch.device:
        return self.norm.device

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attention: AttentionBackend | PagedDecode,
        capture_layers: tuple[int, ...] = (),
        capture_index: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """Run the decoder over packed tokens.

        Returns the final normed hidden states [N, hidden] and, for each layer L in
        capture_layers, the residual stream after L blocks (0 = embeddings; the last layer
        after the final norm, as transformers' hidden_states[L]) at capture_index (all
        tokens when None).
        """
        if isinstance(attention, PagedDecode):
            return self._decode_forward(input_ids, attention, capture_layers, capture_index)
        x = self.embed(input_ids)
        cos, sin = self.rotary.tables(positions, x.dtype)
        captured: dict[int, torch.Tensor] = {}

        def capture(layer: int, h: torch.Tensor) -> None:
            if layer in capture_layers:
                captured[layer] = h if capture_index is None else h[capture_index]

        capture(0, x)
        last = len(self.layers)
        for i, layer in enumerate(self.layers):
            x = layer(x, cos, sin, attention)
            if i + 1 < last:
                capture(i + 1, x)
        x = rms_norm(x, self.norm, self.config.rms_norm_eps)
        capture(last, x)  # like transformers' hidden_states[-1]: the final, normed states
        return x, captured

    def _decode_forward(
        self,
        input_ids: torch.Tensor,
        batch: PagedDecode,
        capture_layers: tuple[int, ...],
        capture_index: torch.Tensor | None,
    ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """forward for a decode-only step: the whole stack and the final norm in one kernel call
        (the rotary tables indexed there too), cut where a layer's output is captured."""
        x = self.embed(input_ids).contiguous()
        captured: dict[int, torch.Tensor] = {}

        def capture(layer: int) -> None:
            if layer in capture_layers:  # a copy: the kernel updates x in place
                captured[layer] = (x if capture_index is None else x[capture_index]).clone()

        capture(0)
        last = len(self.layers)
        start = 0
        for end in sorted({i for i in capture_layers if 0 < i < last} | {last}):
            self._decode_stack.run(
                x,
                self.rotary.cos,
                self.rotary.sin,
                batch.k,
                batch.v,
                batch.positions,
                batch.block_tables,
                start,
                end,
                self.norm if end == last else None,
            )
            capture(end)
            start = end
        return x, captured

    @property
    def can_fuse_decode(self) -> bool:
        """Whether decode-only steps may run the stack as one fused kernel (PagedDecode): every
        projection quantised, fp32 on the CPU, and not turned off (`fuse_decode`, --no-compile)."""
        return getattr(self, "fuse_decode", True) and self._fusable

    @functools.cached_property
    def _fusable(self) -> bool:
        # the layers do not change after loading: checked once, not on every step
        return (
            self.device.type == "cpu"
            and self.norm.dtype == torch.float32
            and all(
                isinstance(m, QuantLinear)
                for layer in self.layers
                for m in (layer.qkv, layer.o_proj, layer.gate_up, layer.down)
            )
        )

    @functools.cached_property
    def _decode_stack(self) -> torch.ScriptObject:
        """The fused decode kernel's handle on every layer's weights (built at the first fused step)."""
        ops()  # loads the kernels, which define the class
        cfg = self.config
        stack = torch.classes.tokenwire.DecodeStack(
            cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.rms_norm_eps
        )
        for layer in self.layers:
            stack.add_layer(
                layer.input_norm,
                layer.post_attention_norm,
                layer.qkv.packed,
                layer.qkv.qtype,
                layer.qkv.bias,
                layer.o_proj.packed,
                layer.o_proj.qtype,
                layer.gate_up.packed,
                layer.gate_up.qtype,
                layer.down.packed,
                layer.down.qtype,
            )
        return stack

    def finish_build(self, device: str | torch.device) -> None:
        """After loading and the dtype cast, so the rotary tables stay exact fp32 (cast per call)."""
        self.rotary = Rotary(self.config, self.max_positions).to(device)

    def logits(self, hidden: torch.Tensor, fused_decode: bool = False) -> torch.Tensor:
        """fused_decode: the hidden states came from the fused decode layers (int16 matvecs);
        a quantised lm_head then runs with the same numerics (QuantLinear.decode_rows)."""
        if fused_decode and isinstance(self.lm_head, QuantLinear):
            return self.lm_head.decode_rows(hidden)
        return self.lm_head(hidden).float()

    # ----------------------------------------------------------------- weights
    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load Hugging Face tensor names, fusing q/k/v and gate/up."""
        cfg = self.config

        def take(name: str) -> torch.Tensor:
            if name not in state:
                raise ValueError(f"checkpoint is missing tensor {name!r}")
            return state[name]

        with torch.no_grad():
            self.embed.weight.copy_(take("model.embed_tokens.weight"))
            self.norm.copy_(take("model.norm.weight"))
            head = state.get("lm_head.weight")
            if head is None or cfg.tie_word_embeddings:
                head = take("model.embed_tokens.weight")
            self.lm_head.weight.copy_(head)
            for i, layer in enumerate(self.layers):
                p = f"model.layers.{i}."
                attn = [take(p + f"self_attn.{n}_proj.weight") for n in "qkv"]
                layer.qkv.weight.copy_(torch.cat(attn, dim=0))
                if cfg.attention_bias:
                    layer.qkv.bias.copy_(torch.cat([take(p + f"self_attn.{n}_proj.bias") for n in "qkv"]))
                layer.o_proj.weight.copy_(take(p + "self_attn.o_proj.weight"))
                mlp = [take(p + "mlp.gate_proj.weight"), take(p + "mlp.up_proj.weight")]
                layer.gate_up.weight.copy_(torch.cat(mlp, dim=0))
                layer.down.weight.copy_(take(p + "mlp.down_proj.weight"))
                layer.input_norm.copy_(take(p + "input_layernorm.weight"))
                layer.post_attention_norm.copy_(take(p + "post_attention_layernorm.weight"))


class DenseCausalAttention:
    """Whole-sequence causal attention over a [B, T] batch flattened to B*T packed tokens."""

    def __init__(
        self,
        batch: int,
        seq_len: int,
        key_mask: torch.Tensor | None = None,
        before_layer: Callable[[], None] | None = None,
    ) -> None:
        self.batch = batch
        self.seq_len = seq_len
        # key_mask [B, T] (True = real token) supports right-padded batches.
        self.key_mask = key_mask
        # called as each layer's attention starts: may raise to abandon a long forward
        self.before_layer = before_layer

    def __call__(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.before_layer is not None:
            self.before_layer()
        b, t = self.batch, self.seq_len
        heads, kv_heads, d = q.shape[1], k.shape[1], q.shape[2]
        q4 = q.view(b, t, heads, d).transpose(1, 2)
        k4 = k.view(b, t, kv_heads, d).transpose(1, 2)
        v4 = v.view(b, t, kv_heads, d).transpose(1, 2)
        if kv_heads != heads:
            k4 = k4.repeat_interleave(heads // kv_heads, dim=1)
            v4 = v4.repeat_interleave(heads // kv_heads, dim=1)
        if self.key_mask is None:
            out = F.scaled_dot_product_attention(q4, k4, v4, is_causal=True)
        else:
            causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
            mask = causal[None, None] & self.key_mask[:, None, None, :]
            mask = mask | torch.eye(t, dtype=torch.bool, device=q.device)[None, None]
            out = F.scaled_dot_product_attention(q4, k4, v4, attn_mask=mask)
        return out.transpose(1, 2).reshape(b * t, heads * d)


def build_model(
    config: ModelConfig,
    state: dict[str, torch.Tensor],
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    max_positions: int | None = None,
    model_class: type[LlamaModel] | None = None,
) -> LlamaModel:
    """`model_class`: LlamaModel or a subclass (Qwen2-VL's decoder) built the same way."""
    with torch.device("meta"):
        model = (model_class or LlamaModel)(config, max_positions)
    model = model.to_empty(device=device)
    model.load_hf_state_dict(state)
    model = model.to(dtype)
    model.finish_build(device)
    return model.eval().requires_grad_(False)
