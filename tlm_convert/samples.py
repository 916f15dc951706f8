"""Calibration text sampled from the source model itself: ``--calibration-data self``.

A bundled or user sample covers the domains it holds, and the conversion keeps the neurons those domains use, so it
loses most on the domains the sample lacks. The model's own samples
stand for the blend it was trained on, so the default calibration is the bundled mix and such samples in equal
shares.

Samples start from the tokenizer's BOS token (its EOS token where it has no BOS), are drawn at temperature 1 with
no top-k/top-p (the model's own distribution), with the start token and every end-of-sequence id (the tokenizer's
and the generation config's) suppressed so that every sample fills its block,
and are returned without the start token: one (seq_len,) block per sample, as a text block would be. The draw is
seeded (``seed``) and leaves the global random state as it was.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm
from transformers import StoppingCriteria, StoppingCriteriaList

from tlm_io.errors import ConversionError
from tlm_io.text import load_text, text_prefix, token_blocks

from .options import SELF

BATCH = 128  # samples drawn together: more tokens/s than small batches on CPU, for a KV cache that grows with it


def start_token(tokenizer) -> int:
    """The token samples start from: BOS, else EOS; ConversionError when the tokenizer has neither."""
    for token in (tokenizer.bos_token_id, tokenizer.eos_token_id):
        if token is not None:
            return int(token)
    raise ConversionError("--calibration-data self needs a tokenizer with a BOS or EOS token to start samples from; "
                          "pass calibration text instead")


@torch.no_grad()
def sample_blocks(model, tokenizer, n: int, seq_len: int, seed: int = 0, batch_size: int = BATCH,
                  progress: bool = False, budget=None) -> torch.Tensor:
    """(n, seq_len) token ids sampled from ``model`` (a causal LM with ``generate``), ``batch_size`` samples at a
    time; ``progress``: a bar over the sampled tokens on stderr, advanced at every generation step. ``budget``: a
    tlm_train.budget.Budget over the n * seq_len tokens, told at every generation step (it may refuse the rest).
    A sample begins as the tokenizer begins a text (tlm_io.text.text_prefix: Gemma's <bos> stays at position 0, as in
    text blocks); without such a prefix it starts from BOS (else EOS), which is then dropped."""
    start = start_token(tokenizer)
    prefix = text_prefix(tokenizer)  # kept in every block
    lead = list(prefix) or [start]  # what generation starts from
    vocab = getattr(getattr(model, "config", None), "vocab_size", None) or (1 << 62)
    if max(lead) >= vocab:
        raise ConversionError(f"--calibration-data self starts its samples from token {max(lead)} (the tokenizer's "
                              f"BOS or EOS), beyond the model's vocabulary of {vocab}; use the model's own tokenizer or "
                              "pass calibration text")
    suppress = sorted({start, tokenizer.eos_token_id, *_config_eos(model)} - {None})  # no sample ends early
    suppress = [t for t in suppress if 0 <= t < vocab]
    device = next(model.parameters()).device
    out = []
    bar = tqdm(total=n * seq_len, desc="self samples", unit="tok", file=sys.stderr, disable=not progress)
    with bar, torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        for first in range(0, n, batch_size):
            rows = min(batch_size, n - first)
            ids = torch.tensor(lead, dtype=torch.long, device=device).expand(rows, -1)  # (rows, L)
            sampled = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=True,
                                     temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=seq_len - len(prefix),
                                     suppress_tokens=suppress, pad_token_id=start,
                                     stopping_criteria=StoppingCriteriaList([_Advance(bar, budget)]))
            out.append(sampled[:, len(lead) - len(prefix):].cpu())  # (rows, seq_len): the prefix, then samples
    return torch.cat(out)


class _Advance(StoppingCriteria):
    """Never stops; advances ``bar`` (and ``budget``) by one token per row at every generation step."""

    def __init__(self, bar, budget=None):
        self.bar, self.budget = bar, budget

    def __call__(self, input_ids: torch.Tensor, scores, **kwargs) -> torch.Tensor:
        self.bar.update(input_ids.shape[0])
        if self.budget is not None:
            self.budget.tick(input_ids.shape[0])
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def _config_eos(model) -> list:
    """The end-of-sequence ids ``generate`` stops at (the model's generation config; may differ from the
    tokenizer's)."""
    eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


def calibration_blocks(tokenizer, sources: tuple[str, ...], seq_len: int, tokens: int, model=None, seed: int = 0,
                       progress: bool = False, limits=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The calibration blocks of ``sources`` in order, each source an equal share of ``tokens`` (text sources as
    data.token_blocks takes them, evenly spread; ``self`` sampled from ``model``), and the sampled blocks alone
    (None without ``self``): (n, seq_len), (m, seq_len). ``limits``: a tlm_train.budget.Limits for the sampling's
    time (said aloud when long, refused above the limit); a text shorter than its share is said aloud through it."""
    share = tokens // len(sources)
    if share < seq_len:
        raise ConversionError(f"--calibration-tokens {tokens} gives each of the {len(sources)} calibration sources "
                              f"{share} tokens, less than one block of --seq-len {seq_len}; raise it or pass fewer "
                              "sources")
    parts, samples = [], None
    for source in sources:
        if source == SELF:
            n = share // seq_len
            budget = None if limits is None else limits.budget(
                "self samples", n * seq_len, "tokens", "lower --calibration-tokens or calibrate on text")
            samples = sample_blocks(model, tokenizer, n, seq_len, seed, progress=progress, budget=budget)
            parts.append(samples)
        else:
            parts.append(token_blocks(tokenizer, load_text(source), seq_len, share))
            _say_short(parts[-1], share, seq_len, source, limits)
    return torch.cat(parts), samples


def _say_short(blocks: torch.Tensor, share: int, seq_len: int, source: str, limits) -> None:
    """A note (``limits.on_note``) when a text source gave fewer whole blocks than its share asked for."""
    asked = share // seq_len
    if blocks.shape[0] < asked and limits is not None and limits.on_note is not None:
        limits.on_note(f"calibration: {source} has {blocks.numel():,} tokens ({blocks.shape[0]:,} blocks of "
                       f"{seq_len}), fewer than the {asked * seq_len:,} asked of it; the conversion uses all of them "
                       "(add text, or lower --calibration-tokens to silence this)")


def samples_text(tokenizer, samples: torch.Tensor) -> str:
    """The sampled blocks as text: one paragraph per sample, separated by blank lines (without the tokenizer's
    start-of-text prefix, which tokenizing the text puts back at the start of each block)."""
    p = len(text_prefix(tokenizer))
    return "".join(tokenizer.decode(row[p:]) + "\n\n" for row in samples.tolist())


__all__ = ["SELF", "BATCH", "sample_blocks", "start_token", "calibration_blocks", "samples_text"]
