"""The Qwen2-VL / Qwen2.5-VL vision tower: patch embedding, ViT blocks with 2D RoPE, 2x2 merger.

One image at a time: its flattened patches [n, C*T*P*P] (the image processor's `pixel_values`,
patches already ordered merge-block by merge-block) go in, n / merge**2 embeddings of the
decoder's width come out, one per `<|image_pad|>`. Attention never crosses images, so running
images one by one equals the reference's packed batch, and lets the engine cache each image's
embeddings by content.

Qwen2-VL: LayerNorm, fc1 -> quick_gelu -> fc2, every block full attention, LayerNorm merger.
Qwen2.5-VL: RMSNorm, gated SiLU MLP with biases, windowed attention (windows of
window_size // patch_size // merge merged tokens a side) except in `fullatt_blocks`, RMSNorm merger.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tokenwire.model.qwen2_vl_config import VisionConfig


def _act(name: str, x: torch.Tensor) -> torch.Tensor:
    if name == "quick_gelu":
        return torch.sigmoid(1.702 * x).mul_(x)  # one temporary fewer than x * sigmoid(1.702 x)
    if name == "silu":
        return F.silu(x)
    if name in ("gelu", "gelu_pytorch_tanh"):
        return F.gelu(x, approximate="tanh" if name == "gelu_pytorch_tanh" else "none")
    raise ValueError(f"unsupported vision activation {name!r}")


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


class _Norm(nn.Module):
    """LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL), eps 1e-6 in both."""

    def __init__(self, dim: int, rms: bool) -> None:
        super().__init__()
        self.rms = rms
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None if rms else nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:
            return _rms(x, self.weight)
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, 1e-6)


class VisionBlock(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        rms = cfg.variant == "qwen2_5_vl"
        self.cfg = cfg
        self.norm1 = _Norm(cfg.width, rms)
        self.norm2 = _Norm(cfg.width, rms)
        self.qkv = nn.Linear(cfg.width, 3 * cfg.width)
        self.proj = nn.Linear(cfg.width, cfg.width)
        self.gated = rms
        # Qwen2.5-VL's gate and up projections fused into one matmul (like the decoder's)
        self.fc1 = nn.Linear(cfg.width, (2 if rms else 1) * cfg.mlp_hidden)
        self.fc2 = nn.Linear(cfg.mlp_hidden, cfg.width)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, segments: list[int]
    ) -> torch.Tensor:
        n, heads = x.shape[0], self.cfg.num_heads
        qkv = self.qkv(self.norm1(x)).view(n, 3, heads, -1)
        # q and k rotated in one go: [n, 2, heads, d] against cos/sin [n, 1, 1, d]
        qk = qkv[:, :2]
        qk = qk * cos[:, None] + torch.roll(qk, qk.shape[-1] // 2, dims=-1) * sin[:, None]
        q, k, v = qk[:, 0], qk[:, 1], qkv[:, 2]
        # [1, heads, n, d]: a 4-D batch takes the CPU flash-attention kernel; 3-D inputs fall back
        # to the math path (materialised scores), measured 3-5x slower at 16 heads x 1024 patches.
        # Each segment (the image, or one window) attends only to itself.
        q, k, v = (t.transpose(0, 1)[None] for t in (q, k, v))
        if len(segments) == 1:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = torch.cat(
                [
                    F.scaled_dot_product_attention(qs, ks, vs)
                    for qs, ks, vs in zip(
                        q.split(segments, 2), k.split(segments, 2), v.split(segments, 2), strict=True
                    )
                ],
                dim=2,
            )
        x = x + self.proj(out[0].transpose(0, 1).reshape(n, -1))
        h = self.fc1(self.norm2(x))
        if self.gated:
            gate, up = h.chunk(2, dim=-1)
            h = _act(self.cfg.hidden_act, gate) * up
        else:
            h = _act(self.cfg.hidden_act, h)
        return x + self.fc2(h)


class VisionTower(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # the Conv3d of the reference, whose kernel equals its stride, is one matmul over the
        # already-flattened patches (C, T, P, P order): the weight is stored as [width, patch_dim]
        self.patch_embed = nn.Linear(cfg.patch_dim, cfg.width, bias=False)
        self.blocks = nn.ModuleList(VisionBlock(cfg) for _ in range(cfg.depth))
        merged = cfg.width * cfg.merge_size**2
        self.merger_norm = _Norm(cfg.width, cfg.variant == "qwen2_5_vl")
        self.merger_fc1 = nn.Linear(merged, merged)
        self.merger_fc2 = nn.Linear(merged, cfg.out_hidden)
        self.init_tables()

    def init_tables(self) -> None:
        """The rotary frequencies (a plain CPU tensor: rebuilt after a meta-device construction)."""
        spatial = self.cfg.head_dim // 2
        with torch.device("cpu"):
            self.inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, spatial, 2).float() / spatial))

    def _rope(self, grid_h: int, grid_w: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / signed sin [n, 1, head_dim] for the patches in merge-block order."""
        m = self.cfg.merge_size
        with torch.device("cpu"):
            hpos = torch.arange(grid_h)[:, None].expand(grid_h, grid_w)
            wpos = torch.arange(grid_w)[None, :].expand(grid_h, grid_w)
            order = (grid_h // m, m, grid_w // m, m)
            hpos = hpos.reshape(order).transpose(1, 2).flatten()
            wpos = wpos.reshape(order).transpose(1, 2).flatten()
            inv = self.inv_freq
            freqs = torch.cat([hpos[:, None].float() * inv, wpos[:, None].float() * inv], dim=-1)
            emb = torch.cat([freqs, freqs], dim=-1)
            half = emb.shape[-1] // 2
            sign = torch.cat([-torch.ones(half), torch.ones(half)])
        device, dtype = self.merger_fc1.weight.device, self.merger_fc1.weight.dtype
        cos, sin = emb.cos(), emb.sin() * sign
        return cos[:, None].to(device, dtype), sin[:, None].to(device, dtype)

    def _windows(self, grid_h: int, grid_w: int) -> tuple[torch.Tensor, list[int]]:
        """Qwen2.5-VL: the permutation of merge blocks that makes each window contiguous, and
        the windows' lengths in patches (windows at the right and bottom edges are smaller)."""
        m = self.cfg.merge_size
        side = self.cfg.window_size // m // self.cfg.patch_size
        lh, lw = grid_h // m, grid_w // m
        index = torch.arange(lh * lw).view(lh, lw)
        order: list[torch.Tensor] = []
        lengths: list[int] = []
        for top in range(0, lh, side):
            for left in range(0, lw, side):
                window = index[top : top + side, left : left + side].reshape(-1)
                order.append(window)
                lengths.append(window.numel() * m * m)
        return torch.cat(order), lengths

    def forward(self, pixel_values: torch.Tensor, grid_thw: tuple[int, int, int]) -> torch.Tensor:
        """One image's patches [t*h*w, patch_dim] -> its embeddings [t*h*w / merge**2, out_hidden]."""
        t, h, w = (int(x) for x in grid_thw)
        if t != 1:
            raise ValueError(f"one image per call: grid_thw {grid_thw} has {t} temporal patches")
        cfg = self.cfg
        unit = cfg.merge_size**2
        x = self.patch_embed(pixel_values.to(self.patch_embed.weight.dtype))
        cos, sin = self._rope(h, w)
        n = x.shape[0]
        full = [n]
        window_order = None
        windows = full
        if cfg.variant == "qwen2_5_vl":
            window_order, windows = self._windows(h, w)

            def permute(a: torch.Tensor) -> torch.Tensor:
                return a.view(n // unit, unit, *a.shape[1:])[window_order].reshape(a.shape)

            x, cos, sin = permute(x), permute(cos), permute(sin)
        for i, block in enumerate(self.blocks):
            segments = windows if window_order is not None and i not in cfg.fullatt_blocks else full
            x = block(x, cos, sin, segments)
        x = self.merger_norm(x).view(n // unit, -1)
        x = self.merger_fc2(F.gelu(self.merger_fc1(x)))
        if window_order is not None:
            x = x[torch.argsort(window_order)]
        return x

    def load_hf_state_dict(self, take: dict[str, torch.Tensor], prefix: str) -> None:
        """Copy the tower's tensors (transformers' names under `prefix`, e.g. "model.visual.")."""

        def get(name: str) -> torch.Tensor:
            key = prefix + name
            if key not in take:
                raise ValueError(f"checkpoint is missing tensor {key!r}")
            return take[key]

        with torch.no_grad():
            self.patch_embed.weight.copy_(get("patch_embed.proj.weight").reshape(self.cfg.width, -1))
            for i, block in enumerate(self.blocks):
                p = f"blocks.{i}."
                block.norm1.weight.copy_(get(p + "norm1.weight"))
                block.norm2.weight.copy_(get(p + "norm2.weight"))
                if block.norm1.bias is not None:
                    block.norm1.bias.copy_(get(p + "norm1.bias"))
                    block.norm2.bias.copy_(get(p + "norm2.bias"))
                for name in ("qkv", "proj"):
                    getattr(block, name).weight.copy_(get(p + f"attn.{name}.weight"))
                    getattr(block, name).bias.copy_(get(p + f"attn.{name}.bias"))
                if block.gated:
                    block.fc1.weight.copy_(
                        torch.cat([get(p + "mlp.gate_proj.weight"), get(p + "mlp.up_proj.weight")])
                    )
                    block.fc1.bias.copy_(
                        torch.cat([get(p + "mlp.gate_proj.bias"), get(p + "mlp.up_proj.bias")])
                    )
                    block.fc2.weight.copy_(get(p + "mlp.down_proj.weight"))
                    block.fc2.bias.copy_(get(p + "mlp.down_proj.bias"))
                else:
                    for ours, theirs in (("fc1", "fc1"), ("fc2", "fc2")):
                        getattr(block, ours).weight.copy_(get(p + f"mlp.{theirs}.weight"))
                        getattr(block, ours).bias.copy_(get(p + f"mlp.{theirs}.bias"))
            self.merger_norm.weight.copy_(get("merger.ln_q.weight"))
            if self.merger_norm.bias is not None:
                self.merger_norm.bias.copy_(get("merger.ln_q.bias"))
            self.merger_fc1.weight.copy_(get("merger.mlp.0.weight"))
            self.merger_fc1.bias.copy_(get("merger.mlp.0.bias"))
            self.merger_fc2.weight.copy_(get("merger.mlp.2.weight"))
            self.merger_fc2.bias.copy_(get("merger.mlp.2.bias"))
