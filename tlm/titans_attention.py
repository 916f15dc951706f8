"""Titans mixer, MAG variant: softmax attention gated by a neural long-term memory, in parallel.

    A = attention heads of the normed input x          (B, N, H*Dh)   (sliding window per config.layer_types)
    r = NeuralMemory(x)  (RMS-normalised memory reads)  (B, N, Hm*Dm)
    y = (A ⊙ 2σ(r W_c)) W_o

Why MAG: the attention path and its KV cache stay those of the source model, memory and attention run in
parallel without segmentation, and ``W_c = 0`` (``memory_gate``, zero at init) makes the gate exactly 1, so an
attention checkpoint upcycles with unchanged logits. Persistent memory tokens are not implemented (N_p = 0).
"""

from __future__ import annotations

import torch
from torch import nn

from .attention import Attention
from .titans import NeuralMemory


class TitansAttention(Attention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
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
        mem_dim = config.titans_num_heads * config.titans_head_dim
        self.memory_gate = nn.Linear(mem_dim, self.num_heads * self.head_dim, bias=False)
        nn.init.zeros_(self.memory_gate.weight)

    def init_special_weights(self, is_fresh) -> None:
        """Called by the model's init after the generic Linear init: the memory's own init (gate biases,
        identity convs) and a closed combine (gate ≡ 1), for parameters not loaded from a checkpoint."""
        if is_fresh(self.memory.decay_proj.bias):
            self.memory.reset_parameters()
        if is_fresh(self.memory_gate.weight):
            self.memory_gate.weight.zero_()

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, token_mask=None):
        attn = self.attend(hidden_states, position_embeddings, attention_mask, cache)  # (B, N, H*Dh)
        state = cache.layers[self.layer_idx].get("memory") if cache is not None else None
        reads, state = self.memory(hidden_states, state, use_cache=cache is not None, token_mask=token_mask)  # (B, N, Hm*Dm)
        if cache is not None:
            cache.layers[self.layer_idx]["memory"] = state
        gate = 2 * torch.sigmoid(self.memory_gate(reads).float())  # (B, N, H*Dh), 1 at init
        return self.o_proj((attn.float() * gate).to(hidden_states.dtype))


__all__ = ["TitansAttention"]
