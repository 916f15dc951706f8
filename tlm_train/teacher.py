"""The frozen teacher of a distillation, stored as its forward pass reads it.

Under bf16 autocast every ``nn.Linear`` casts its weight (and bias) to bf16 at each call, so a teacher whose
projections are *stored* in bf16 computes the same outputs bit for bit, with half their memory and without the
casts. :func:`store_for_autocast` does that to the teacher's nn.Linear layers whose parameters no other kind of module
uses (a head tied to the embedding stays as it is: the embedding's lookup is not autocast), then checks it: the
teacher's logits on a probe block, under autocast, before and after; any difference (a module that reads a projection's
weight in another dtype) restores the original weights.
"""

from __future__ import annotations

import torch
from torch import nn

PROBE_TOKENS = 16


def _castable(model: nn.Module) -> list[nn.Linear]:
    """The nn.Linear layers of ``model`` whose parameters belong to no other module (no tied weight)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    return [m for m in model.modules() if type(m) is nn.Linear  # a subclass may use its weight otherwise
            and all(owners[id(p)] == 1 and p.dtype != torch.float64 for p in m.parameters(recurse=False))]


@torch.no_grad()
def store_for_autocast(teacher: nn.Module, dtype: torch.dtype, device: torch.device | str) -> int:
    """Store the castable nn.Linear parameters of the frozen ``teacher`` (on ``device``) in ``dtype``, the autocast
    dtype its forward passes run under, when that leaves its logits unchanged bit for bit; the bytes saved (0 when
    nothing was cast or the check failed and the weights were restored)."""
    device = torch.device(device)
    layers = [m for m in _castable(teacher) if m.weight.dtype != dtype]
    if not layers:
        return 0
    vocab = teacher.get_output_embeddings().weight.shape[0]
    probe = (torch.arange(PROBE_TOKENS, device=device) * 7919 % vocab).unsqueeze(0)  # any ids: outputs are compared

    def logits() -> torch.Tensor:
        with torch.autocast(device.type, dtype=dtype):
            return teacher(input_ids=probe, use_cache=False).logits.float()

    before = logits()
    originals = {m: {n: p.data for n, p in m.named_parameters(recurse=False)} for m in layers}
    saved = 0
    for m in layers:
        for p in m.parameters(recurse=False):
            saved += p.numel() * (p.element_size() - torch.finfo(dtype).bits // 8)
            p.data = p.data.to(dtype)
    if torch.equal(logits(), before):
        return saved
    for m, params in originals.items():  # a module reads a projection outside autocast's cast: keep the originals
        for n, p in m.named_parameters(recurse=False):
            p.data = params[n]
    return 0


__all__ = ["store_for_autocast"]
