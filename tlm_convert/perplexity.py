"""Next-token negative log-likelihood with chunked logits: the one perplexity of the conversion report, ``tlm eval``
and the trainer's evaluation.

The logits are formed ``LOGIT_CHUNK`` positions of one sequence at a time from the final (normed) hidden states: a
(batch, seq, vocab) fp32 logit tensor, with its shifted copy and log-softmax, would be several times the size of a
small model's weights.
"""

from __future__ import annotations

import math

import torch
from torch.nn import functional as F

LOGIT_CHUNK = 128  # positions whose logits are formed at a time (128 x vocab fp32)


@torch.no_grad()
def nll_sum(lm_head, hidden: torch.Tensor, ids: torch.Tensor, first: int = 1) -> tuple[float, int]:
    """(Σ −log p(ids[b, t] | ids[b, :t]) over rows b and positions t >= ``first``, number of terms).

    lm_head: hidden (n, d) -> logits (n, V); hidden: (B, S, d) final-normed states of ``ids`` (B, S)."""
    total, length = 0.0, ids.shape[1]
    for b in range(ids.shape[0]):
        for s in range(first - 1, length - 1, LOGIT_CHUNK):
            e = min(s + LOGIT_CHUNK, length - 1)
            logits = lm_head(hidden[b, s:e])  # (positions, V)
            total += float(F.cross_entropy(logits.float(), ids[b, s + 1 : e + 1], reduction="sum"))
            del logits
    return total, ids.shape[0] * max(length - first, 0)


@torch.no_grad()
def perplexity(model, blocks: torch.Tensor, batch_size: int = 8) -> float:
    """exp(mean next-token NLL) of a TLMForCausalLM over non-overlapping blocks (n, S) (each scores S - 1 tokens)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for i in range(0, len(blocks), batch_size):
        batch = blocks[i : i + batch_size].to(device)
        hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state
        part, n = nll_sum(model.lm_head, hidden, batch)
        total, count = total + part, count + n
    return math.exp(total / count)


__all__ = ["LOGIT_CHUNK", "nll_sum", "perplexity"]
