"""The teacher's top-k next-token log-probabilities of each training block, computed the first time the block is
seen and reused on every later epoch (``distill.teacher_topk``): a heal that passes over its text more than once
runs the teacher's forward pass once per block, not once per step.

Blocks are keyed by their token ids, so the cache follows the data order of any epoch, rank or resume. It lives in
memory: ``len(blocks) * (seq_len - 1) * k * 8`` bytes (int32 indices + fp32 log-probabilities); a resumed run
recomputes what it needs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import torch


class TeacherTopCache:
    """``top(ids, compute)`` -> (indices, log-probabilities), each (B, S - 1, k), for the rows of ``ids`` (B, S);
    ``compute(ids)`` gives those of rows not seen before (the teacher's forward pass + losses.teacher_topk)."""

    def __init__(self) -> None:
        self._rows: dict[bytes, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hits = self.misses = 0

    def __len__(self) -> int:
        return len(self._rows)

    @staticmethod
    def _key(row: torch.Tensor) -> bytes:
        return hashlib.blake2b(row.cpu().numpy().tobytes(), digest_size=16).digest()

    def top(self, ids: torch.Tensor, compute: Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]):
        keys = [self._key(row) for row in ids]
        missing = {key: i for i, key in reversed(list(enumerate(keys))) if key not in self._rows}  # key -> row
        self.misses += len(missing)
        self.hits += len(keys) - len(missing)
        if missing:
            idx, logp = compute(ids[list(missing.values())])  # (M, S - 1, k) each
            for j, key in enumerate(missing):
                self._rows[key] = (idx[j].clone(), logp[j].clone())
        rows = [self._rows[key] for key in keys]
        return torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows])


__all__ = ["TeacherTopCache"]
