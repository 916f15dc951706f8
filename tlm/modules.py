"""Small shared building blocks: norms and rotary position embeddings.

Axis legend: B batch, N new tokens, T keys (past + new), H query heads, K key/value heads, Dh head dim.
"""

from __future__ import annotations

import math

import torch
from torch import nn


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32. ``offset=True`` is Gemma's zero-centred form, x̂·(1 + w), with w initialised at 0."""

    def __init__(self, dim: int, eps: float = 1e-6, offset: bool = False):
        super().__init__()
        self.eps = eps
        self.offset = offset
        self.weight = nn.Parameter(torch.zeros(dim) if offset else torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.offset:  # Gemma multiplies in fp32, then casts
            return (h * (1.0 + self.weight.float())).to(x.dtype)
        return self.weight * h.to(x.dtype)  # Llama casts, then multiplies

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, offset={self.offset}"


def build_norm(config, dim: int | None = None) -> nn.Module:
    """The block norm the config asks for: RMSNorm (optionally (1+w)) or LayerNorm with bias (GPT-2)."""
    dim = dim or config.hidden_size
    if config.norm_type == "layernorm":
        return nn.LayerNorm(dim, eps=config.norm_eps)
    return RMSNorm(dim, eps=config.norm_eps, offset=config.norm_offset)


# ------------------------------------------------------------------------------------------------ rotary


def rope_inv_freq(params: dict, head_dim: int) -> torch.Tensor:
    """Inverse frequencies (Dh/2,) for rope_type default, linear or llama3 (Llama 3.1 long-context scaling)."""
    theta = float(params["rope_theta"])
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    rope_type = params.get("rope_type", "default")
    if rope_type == "linear":
        return inv_freq / float(params["factor"])
    if rope_type == "llama3":
        return _llama3_scale(inv_freq, params)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, p: dict) -> torch.Tensor:
    factor, low, high = float(p["factor"]), float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)  # long wavelengths: divide
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions; rotate-half pairing (channel i with i + Dh/2), as in transformers."""

    def __init__(self, params: dict, head_dim: int):
        super().__init__()
        self.params, self.head_dim = dict(params), head_dim
        self.register_buffer("inv_freq", rope_inv_freq(params, head_dim), persistent=False)

    def reset_inv_freq(self) -> None:
        """Recompute the (non-persistent) table, e.g. after transformers built the model on the meta device."""
        self.inv_freq = rope_inv_freq(self.params, self.head_dim).to(self.inv_freq.device)

    @torch.no_grad()
    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # position_ids: (B, N) -> cos, sin: (B, N, Dh) in x.dtype
        freqs = position_ids[..., None].float() * self.inv_freq.float().to(x.device)  # (B, N, Dh/2)
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: (B, heads, N, Dh); cos, sin: (B, N, Dh)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


__all__ = ["RMSNorm", "build_norm", "RotaryEmbedding", "apply_rotary", "rope_inv_freq"]
