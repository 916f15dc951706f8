"""Softmax attention mixers: Llama-style attention and gated attention (Qiu et al., 2025).

Mixer contract (shared by every mixer in ``mixers.py``)::

    mixer(hidden_states, position_embeddings, attention_mask, cache) -> output
    hidden_states: (B, N, d), already normed by the block;  output: (B, N, d)
    position_embeddings: (cos, sin) each (B, N, Dh), or None without RoPE
    attention_mask: None (plain causal, nothing cached) or bool (B, 1, N, T), True = may attend
    cache: TLMCache or None; a mixer keeps its state in cache.layers[layer_idx]
    token_mask: None (no padding in this call) or bool (B, N), False at pad tokens; stateful mixers keep pads
        out of their state (see ``padding.py``), attention needs only attention_mask

Axis legend: B batch, N new tokens, T keys (past + new), H query heads, K key/value heads, Dh head dim.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from .modules import RMSNorm, apply_rotary


def eager_attention(q, k, v, mask, scale):
    # q: (B, H, N, Dh); k, v: (B, K, T, Dh); mask: None (causal) or bool (B, 1, N, T)
    groups = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(groups, dim=1)  # (B, H, T, Dh)
    v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # (B, H, N, T)
    if mask is None:
        n, t = scores.shape[-2:]
        mask = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n)
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(scores.softmax(-1).to(v.dtype), v)  # (B, H, N, Dh)


def sdpa_attention(q, k, v, mask, scale):
    groups = q.shape[1] // k.shape[1]
    is_causal = mask is None and q.shape[2] > 1
    if mask is None and q.shape[2] == 1:
        mask = None  # one query attends to every cached key
    elif mask is None and q.shape[2] != k.shape[2]:
        n, t = q.shape[2], k.shape[2]
        mask, is_causal = torch.ones(n, t, dtype=torch.bool, device=q.device).tril(t - n), False
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale,
                                          enable_gqa=groups > 1)


ATTENTION_FUNCTIONS = {"sdpa": sdpa_attention, "eager": eager_attention}


def _mask_with_prefix(mask, p, n, t, device):
    """bool (B|1, 1, N, P + T): `p` always-visible prefix keys, then `mask` (None = causal over the last N of T)."""
    if mask is None:
        mask = torch.ones(n, t, dtype=torch.bool, device=device).tril(t - n)[None, None]  # (1, 1, N, T)
    ones = torch.ones(*mask.shape[:-1], p, dtype=torch.bool, device=device)
    return torch.cat([ones, mask], dim=-1)


class Attention(nn.Module):
    """Causal GQA softmax attention with RoPE (or none), optional q/k norm and biases, SDPA or eager."""

    def __init__(self, config, layer_idx: int):
        super().__init__()
        self.config = config
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = config.head_dim
        self.scale = (config.query_pre_attn_scalar or self.head_dim) ** -0.5
        d, hd, kvd = config.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        self.q_proj = nn.Linear(d, hd, bias=config.attention_bias)
        self.k_proj = nn.Linear(d, kvd, bias=config.attention_bias)
        self.v_proj = nn.Linear(d, kvd, bias=config.attention_bias)
        self.o_proj = nn.Linear(hd, d, bias=config.attention_out_bias)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, eps=config.norm_eps, offset=config.norm_offset)
            self.k_norm = RMSNorm(self.head_dim, eps=config.norm_eps, offset=config.norm_offset)

    def attend(self, x, position_embeddings, attention_mask, cache, prefix=None):
        """Per-head attention output before o_proj: (B, N, d) -> (B, N, H*Dh).

        prefix: None or (keys, values), each (B, K, P, Dh): extra keys every query sees (Titans' persistent
        memory), placed before the cached and new keys, never cached, outside any window or padding mask."""
        B, N, _ = x.shape
        q = self.q_proj(x).view(B, N, -1, self.head_dim)  # (B, N, H, Dh)
        k = self.k_proj(x).view(B, N, -1, self.head_dim)  # (B, N, K, Dh)
        v = self.v_proj(x).view(B, N, -1, self.head_dim).transpose(1, 2)  # (B, K, N, Dh)
        if self.config.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)  # (B, H, N, Dh), (B, K, N, Dh)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        if cache is not None:
            k, v = cache.update_kv(self.layer_idx, k, v)  # (B, K, T, Dh)
        if prefix is not None:
            attention_mask = _mask_with_prefix(attention_mask, prefix[0].shape[2], N, k.shape[2], x.device)
            k, v = torch.cat([prefix[0], k], dim=2), torch.cat([prefix[1], v], dim=2)  # (B, K, P + T, Dh)
        impl = ATTENTION_FUNCTIONS.get(self.config._attn_implementation or "sdpa", sdpa_attention)
        dropout_free = impl(q, k, v, attention_mask, self.scale)  # (B, H, N, Dh)
        return dropout_free.transpose(1, 2).reshape(B, N, -1)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, token_mask=None):
        return self.o_proj(self.attend(hidden_states, position_embeddings, attention_mask, cache))


class GatedAttention(Attention):
    """Attention with an elementwise (or headwise) sigmoid gate on the per-head output, before o_proj.

    G = σ(x W_g + b_g) from the same normed input as Q/K/V (gate position G1 of Qiu et al.).
    Upcycling from attention is exact with W_g = 0, b_g = 0 (G ≡ ½) and o_proj doubled.
    """

    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        gate_out = self.num_heads * (self.head_dim if config.gate_type == "elementwise" else 1)
        self.gate_proj = nn.Linear(config.hidden_size, gate_out, bias=True)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, token_mask=None):
        B, N, _ = hidden_states.shape
        attn = self.attend(hidden_states, position_embeddings, attention_mask, cache)  # (B, N, H*Dh)
        gate = torch.sigmoid(self.gate_proj(hidden_states).float())  # (B, N, H*Dh) or (B, N, H)
        attn = attn.view(B, N, self.num_heads, self.head_dim).float() * gate.view(B, N, self.num_heads, -1)
        return self.o_proj(attn.to(hidden_states.dtype).reshape(B, N, -1))


__all__ = ["Attention", "GatedAttention", "ATTENTION_FUNCTIONS"]
