"""Next-token negative log-likelihood with chunked logits: the one perplexity of the conversion report, ``tlm eval``
and the trainer's evaluation.

The logits are formed ``LOGIT_CHUNK`` positions of one sequence at a time from the final (normed) hidden states: a
(batch, seq, vocab) fp32 logit tensor, with its shifted copy and log-softmax, would be several times the size of a
small model's weights.

:func:`perplexity` scores non-overlapping blocks; :func:`strided_perplexity` (``tlm eval``) scores a token stream
with strided windows, the sliding-window evaluation of transformers' perplexity guide: the stream is read in
windows of ``window`` tokens starting every ``stride`` tokens; each window scores only the tokens no earlier window
scored (the last ``stride`` of them, all of them in the first window), each predicted from up to ``window - 1``
tokens of context. ``stride == window`` is plain non-overlapping blocks; a smaller stride gives every scored token
more context (a lower, more faithful perplexity) at window/stride times the compute.

The protocol is a policy of the same computation (:data:`PROTOCOLS`): ``strided`` (``tlm eval``'s default: the
tokenizer's start-of-text tokens before every window, stride seq-len / 2, the last window may be shorter) or ``gptq``
(the GPTQ/Wanda WikiText-2 evaluation the pruning papers report: the documents joined by blank lines, tokenized once
as the tokenizer encodes a text, non-overlapping windows of 2,048 tokens, a shorter tail dropped, the mean NLL over
every scored token).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

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


@dataclass
class Perplexity:
    perplexity: float
    nll: float  # mean negative log-likelihood per scored token (nats)
    tokens: int  # tokens scored
    windows: int


@dataclass(frozen=True)
class Protocol:
    """How a text becomes scored windows: ``seq_len`` (the default window), ``overlap`` (stride seq_len / 2 by
    default, any stride allowed; else the stride is the window), ``window_prefix`` (the start-of-text tokens before
    every window; else once, as the tokenizer encodes the text), ``full_windows`` (a shorter last window is
    dropped), ``max_tokens`` (the default cap of the stream; None: all of it), ``keep_empty`` (a data set's empty
    records are joined too)."""

    name: str
    seq_len: int
    overlap: bool
    window_prefix: bool
    full_windows: bool
    max_tokens: int | None
    keep_empty: bool


PROTOCOLS = {"strided": Protocol("strided", 512, True, True, False, 16384, False),
             "gptq": Protocol("gptq", 2048, False, False, True, None, True)}


def windows(n: int, window: int, stride: int, lead: int = 0, full: bool = False) -> list[tuple[int, int, int]]:
    """(begin, end, first scored position within the window) for a stream of n tokens; ``lead``: tokens put before
    each window (a start-of-text prefix), which predict its position 0, else nothing does; ``full``: only windows
    of ``window`` tokens (a shorter last one is dropped)."""
    if full:
        return [(b, b + window, 0 if lead else 1) for b in range(0, n - window + 1, window)]
    spans, prev_end, begin = [], 0, 0
    least = 0 if lead else 1
    while True:
        end = min(begin + window, n)
        first = max(prev_end - begin, least)
        if end - begin >= 2 - lead and first < end - begin:
            spans.append((begin, end, first))
        prev_end = end
        if end == n:
            return spans
        begin += stride


@torch.no_grad()
def strided_perplexity(model, ids: torch.Tensor, window: int, stride: int | None = None,
                       batch_size: int = 8, prefix: tuple[int, ...] = (), full: bool = False) -> Perplexity:
    """Perplexity of ``model`` (a TLMForCausalLM) on the 1-D token stream ``ids`` (see the module doc); the logits
    are formed in chunks (:func:`nll_sum`). ``prefix``: the tokenizer's start-of-text tokens
    (tlm_io.text.text_prefix), put before every window, which then holds window - len(prefix) tokens of ``ids``
    (``stride`` is capped there); with a prefix, the stream's first token is scored too. ``full``: non-overlapping
    windows of exactly ``window`` tokens, a shorter tail dropped (the ``gptq`` protocol; ``stride`` is ignored)."""
    stride = window if stride is None else stride
    if not 1 <= stride <= window:
        raise ValueError(f"stride must be in [1, window={window}], got {stride}")
    if window < 2 + len(prefix):
        raise ValueError(f"window must be >= {2 + len(prefix)} tokens, got {window}")
    body = window - len(prefix)  # tokens of ids a window holds
    stride = min(stride, body)
    ids = ids.long().flatten()
    lead = torch.tensor(prefix, dtype=torch.long)
    spans = windows(len(ids), body, stride, len(prefix), full)
    if not spans:
        raise ValueError(f"{len(ids)} tokens: too few to score; give at least {body if full else 2}")
    device = next(model.parameters()).device
    total, count = 0.0, 0
    by_length: dict[int, list] = {}
    for span in spans:  # windows of equal length batch together (only the last one can be shorter)
        by_length.setdefault(span[1] - span[0], []).append(span)
    for length, group in by_length.items():
        for i in range(0, len(group), batch_size):
            chunk = group[i : i + batch_size]
            batch = torch.stack([torch.cat([lead, ids[b:e]]) for b, e, _ in chunk]).to(device)  # (B, P + length)
            hidden = model.model(input_ids=batch, use_cache=False).last_hidden_state  # (B, P + length, d)
            for row, (_, _, first) in enumerate(chunk):  # targets at positions P + first .. P + length - 1
                part, n = nll_sum(model.lm_head, hidden[row : row + 1], batch[row : row + 1], first + len(prefix))
                total, count = total + part, count + n
    mean = total / count
    return Perplexity(math.exp(mean), mean, count, len(spans))


__all__ = ["LOGIT_CHUNK", "PROTOCOLS", "Perplexity", "Protocol", "nll_sum", "perplexity", "strided_perplexity",
           "windows"]
