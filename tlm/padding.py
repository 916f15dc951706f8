"""Padding for the stateful mixers (Titans' memory, Hope's online levels): pad tokens never reach the state.

A recurrent state (memory weights, fast weights, conv tails, chunk position) must see exactly the row's real
tokens, with chunk boundaries counted from the row's first real token, so that a padded row computes what the row
computes alone. A batched scan cannot skip tokens at different places in different rows, so a call with padding
(``token_mask`` not all True), or whose state already diverged between rows, runs row by row on the real tokens
only (`run_rows`): each row gets its own slice of the state, pad positions get a zero output, and the per-row
states are joined again (`join_rows`): back into one batched state when their non-tensor leaves (chunk
positions, buffer presence) agree, else into ``{"rows": [state_0, …, state_{B−1}]}``, which later calls continue
row by row. Unpadded calls (training, unpadded generation) never take this path.

Only torch and the standard library: this file ships next to checkpoints as transformers remote code.
"""

from __future__ import annotations

from typing import Callable

import torch

from .cache import ROWS, map_tensors

Tensor = torch.Tensor


def needs_rows(token_mask: Tensor | None, state: dict | None) -> bool:
    """True when the call must run row by row: padding in this call, or rows already diverged in the state."""
    if state is not None and ROWS in state:
        return True
    return token_mask is not None and not bool(token_mask.all())


def row_state(state: dict | None, b: int):
    """Row b's state (batch axis kept, size 1) from a batched or a per-row state; None stays None."""
    if state is None:
        return None
    if ROWS in state:
        return state[ROWS][b]
    return map_tensors(state, lambda t: t[b : b + 1])


def join_rows(states: list) -> dict:
    """Per-row states -> one batched state when every non-tensor leaf agrees and shapes allow, else {"rows": …}."""
    try:
        return _join(states)
    except _Diverged:
        return {ROWS: list(states)}


def run_rows(fn: Callable, x: Tensor, token_mask: Tensor | None, state: dict | None, use_cache: bool,
             out_dim: int) -> tuple[Tensor, dict | None]:
    """Run ``fn(x_b, state_b, use_cache) -> (y_b, state_b')`` on each row's real tokens.

    x: (B, N, d); token_mask: (B, N) bool or None (all real). Returns y (B, N, out_dim), zero at pad positions,
    and the joined state (None unless use_cache).
    """
    B, N, _ = x.shape
    keep = torch.ones(B, N, dtype=torch.bool, device=x.device) if token_mask is None else token_mask.bool()
    ys, states = [], []
    for b in range(B):
        y_b, s_b = fn(x[b : b + 1, keep[b]], row_state(state, b), use_cache)  # (1, n_b, out_dim)
        full = y_b.new_zeros(1, N, out_dim)
        full[:, keep[b]] = y_b
        ys.append(full)
        states.append(s_b)
    return torch.cat(ys, 0), (join_rows(states) if use_cache else None)


class _Diverged(Exception):
    pass


def _join(items: list):
    first = items[0]
    if isinstance(first, Tensor):
        if any(not isinstance(t, Tensor) or t.shape[1:] != first.shape[1:] for t in items):
            raise _Diverged
        return torch.cat(items, 0)
    if isinstance(first, dict):
        if ROWS in first or any(not isinstance(d, dict) or d.keys() != first.keys() for d in items):
            raise _Diverged
        return {k: _join([d[k] for d in items]) for k in first}
    if isinstance(first, (list, tuple)):
        if any(type(t) is not type(first) or len(t) != len(first) for t in items):
            raise _Diverged
        return type(first)(_join([t[i] for t in items]) for i in range(len(first)))
    if any(v != first for v in items):  # ints (chunk positions), None (no buffer)
        raise _Diverged
    return first


__all__ = ["needs_rows", "row_state", "join_rows", "run_rows"]
