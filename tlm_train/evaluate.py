"""Perplexity with strided windows (the sliding-window evaluation of transformers' perplexity guide).

The token stream is read in windows of ``window`` tokens starting every ``stride`` tokens; each window scores only
the tokens no earlier window scored (the last ``stride`` of them, all of them in the first window), each predicted
from up to ``window - 1`` tokens of context. ``stride == window`` is plain non-overlapping blocks; a smaller stride
gives every scored token more context (a lower, more faithful perplexity) at window/stride times the compute.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tlm_convert.perplexity import nll_sum


@dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int


def windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position within the window) for a stream of n tokens."""
    spans, prev_end, begin = [], 0, 0
    while True:
        end = min(begin + window, n)
        first = max(prev_end - begin, 1)  # position 0 of a window has nothing to predict it
        if end - begin >= 2 and first < end - begin:
            spans.append((begin, end, first))
        prev_end = end
        if end == n:
            return spans
        begin += stride


@torch.no_grad()
def strided_perplexity(model, ids: torch.Tensor, window: int, stride: int | None = None,
                       batch_size: int = 8) -> Perplexity:
    """Perplexity of ``model`` (a TLMForCausalLM) on the 1-D token stream ``ids`` (see the module doc); the logits
    are formed in chunks (tlm_convert.perplexity.nll_sum)."""
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if window < 2:
        raise ValueError(f"window must be >= 2 tokens, got {window}")
    ids = ids.long().flatten()
    spans = windows(len(ids), window, stride)
    if not spans:
        raise ValueError(f"{len(ids)} tokens: too few to score; give at least 2")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    by_length: dict[int, list] = {}
    for span in spans:  # windows of equal length batch together (only the last one can be shorter)
        by_length.setdefault(span[1] - span[0], []).append(span)
    for length, group in by_length.items():
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            batch = torch.stack([ids[b:e] for b, e, _ in chunk]).to(device)  # (B, length)
            hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state  # (B, length, d)
            for row, (_, _, first) in enumerate(chunk):  # targets at positions first..length-1
                part, n = nll_sum(model.lm_head, hidden[row : row + 1], batch[row : row + 1], first)
                total, count = total + part, count + n
    mean = total / count
    return Perplexity(math.exp(mean), mean, count, len(spans))


__all__ = ["strided_perplexity", "Perplexity", "windows"]
