"""Titans mixers: softmax attention and a neural long-term memory (``titans.NeuralMemory``) in parallel.

``titans_variant: "gate"`` (default; the upcycling form)::

    A = attention heads of the normed input x          (B, N, H*Dh)   (sliding window per config.layer_types)
    r = NeuralMemory(x)  (RMS-normalised memory reads)  (B, N, Hm*Dm)
    y = (A ⊙ 2σ(r W_c)) W_o

The attention path and its KV cache stay those of the source model, and ``W_c = 0`` (``memory_gate``, zero at
init) makes the gate exactly 1, so an attention checkpoint upcycles with unchanged logits. The memory can only
rescale attention channels within (0, 2). No persistent memory tokens.

``titans_variant: "mag"`` (the Titans paper's Memory-as-Gate, Behrouz et al. 2025, eq. 26-28)::

    x̃ = [P ∥ x]                                        P: N_p learned persistent tokens (persistent_memory)
    A = SWA*(x̃)                                        attention whose keys start with P's keys and values
                                                        (no RoPE, visible to every query, never cached);
                                                        the window is the layer's (layer_types / sliding_window)
    m = NeuralMemory(x̃) W_m                            the memory reads P first at every sequence start
    y = (RMSNorm_A(A) ⊙ σ(RMSNorm_m(m))) W_o          both branches normalised with learned gains, then gated

The paper's ``⊗`` is "normalise both outputs with learnable vector-valued weights, then a non-linearity"; we read
it as a sigmoid gate of the normalised memory on the normalised attention [ours]. Unlike "gate", the memory sets
every output channel's gate over the full (0, 1) from its own normalised read, and the attention output is
normalised first, so neither branch can dominate by scale. Not function-preserving: for training from scratch.
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .modules import RMSNorm
from .titans import NeuralMemory


class TitansAttention(Attention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.variant = config.titans_variant
        self.memory = NeuralMemory(
            config.hidden_size,
            config.titans_num_heads,
            config.titans_head_dim,
            depth=config.titans_memory_depth,
            expansion=config.titans_memory_expansion,
            chunk_size=config.titans_chunk_size,
            theta_max=config.titans_theta_max,
            conv_kernel=config.titans_conv_kernel,
            norm_eps=config.norm_eps,
            surprise_clip=config.titans_surprise_clip,
        )
        mem_dim, attn_dim = config.titans_num_heads * config.titans_head_dim, self.num_heads * self.head_dim
        if self.variant == "gate":
            self.memory_gate = nn.Linear(mem_dim, attn_dim, bias=False)
            nn.init.zeros_(self.memory_gate.weight)
            self.num_persistent = 0
        else:
            self.memory_proj = nn.Linear(mem_dim, attn_dim, bias=False)
            self.attn_norm = RMSNorm(attn_dim, eps=config.norm_eps)
            self.memory_norm = RMSNorm(attn_dim, eps=config.norm_eps)
            self.num_persistent = config.titans_persistent_tokens
            if self.num_persistent:
                self.persistent_memory = nn.Parameter(torch.zeros(self.num_persistent, config.hidden_size))

    def init_special_weights(self, is_fresh) -> None:
        """Called by the model's init after the generic Linear init: the memory's own init (gate biases,
        identity convs), a closed combine (gate ≡ 1) for "gate" and N(0, initializer_range) persistent tokens for
        "mag", for parameters not loaded from a checkpoint."""
        if is_fresh(self.memory.decay_proj.bias):
            self.memory.reset_parameters()
        if self.variant == "gate" and is_fresh(self.memory_gate.weight):
            self.memory_gate.weight.zero_()
        if self.num_persistent and is_fresh(self.persistent_memory):
            self.persistent_memory.normal_(0.0, self.config.initializer_range)

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, token_mask=None):
        x = hidden_states  # (B, N, d)
        prefix, persistent = None, None
        if self.num_persistent:
            persistent = self.persistent_memory.to(x.dtype).unsqueeze(0).expand(x.shape[0], -1, -1)  # (B, P, d)
            prefix = self._persistent_kv(persistent)
        attn = self.attend(x, position_embeddings, attention_mask, cache, prefix)  # (B, N, H*Dh)
        reads = self._memory_reads(x, persistent, cache, token_mask)  # (B, N, Hm*Dm)
        if self.variant == "gate":
            gate = 2 * torch.sigmoid(self.memory_gate(reads).float())  # (B, N, H*Dh), 1 at init
            return self.o_proj((attn.float() * gate).to(x.dtype))
        gate = torch.sigmoid(self.memory_norm(self.memory_proj(reads)).float())  # (B, N, H*Dh)
        return self.o_proj((self.attn_norm(attn).float() * gate).to(x.dtype))

    def _persistent_kv(self, p):
        """Keys and values of the persistent tokens p (B, P, d): each (B, K, P, Dh), no RoPE."""
        B, P, _ = p.shape
        k = self.k_proj(p).view(B, P, -1, self.head_dim)
        v = self.v_proj(p).view(B, P, -1, self.head_dim)
        if self.config.qk_norm:
            k = self.k_norm(k)
        return k.transpose(1, 2), v.transpose(1, 2)

    def _memory_reads(self, x, persistent, cache, token_mask):
        """Memory reads for x (B, N, d): (B, N, Hm*Dm). A fresh sequence with persistent tokens reads them first."""
        state = cache.layers[self.layer_idx].get("memory") if cache is not None else None
        n_prefix = 0
        if persistent is not None and state is None:
            x = torch.cat([persistent, x], dim=1)  # (B, P + N, d)
            n_prefix = persistent.shape[1]
            if token_mask is not None:
                token_mask = torch.cat([token_mask.new_ones(x.shape[0], n_prefix), token_mask], dim=1)
        reads, state = self.memory(x, state, use_cache=cache is not None, token_mask=token_mask)
        if cache is not None:
            cache.layers[self.layer_idx]["memory"] = state
        return reads[:, n_prefix:]


__all__ = ["TitansAttention"]
