"""The outer-optimiser cadence of Hope's ``slow(m)`` continuum-memory levels (design/model.md §4.4).

A level in mode ``slow(m)`` is an ordinary MLP in the forward pass; the outer optimiser steps it only at
optimiser steps 0, m, 2m, …, each time on the mean of the gradients of the steps since its previous step (step 0:
its own gradient). Call ``SlowLevels(model).before_step(optimizer, step)`` after the backward (and after gradient
clipping and, under DDP/FSDP, after the gradient reduction, so every rank holds the same gradients) and right
before ``optimizer.step()``, with ``step`` the number of optimiser steps already taken:

* not due: the gradient is added to ``optimizer.state[p]["slow_grad_sum"]`` and ``p.grad`` set to None, so the
  optimiser skips the parameter entirely (no moment update, no weight decay);
* due: ``p.grad`` becomes the mean of the accumulated gradients and this one, and the sum is reset.

The running sum lives in the optimiser's state, so it is saved and restored with the optimiser's state dict:
resuming mid-cycle continues the same sums. It is only written after the optimiser initialised the parameter's
state at step 0 (AdamW initialises a parameter's state when that state is empty). Nothing happens for models
without slow levels.
"""

from __future__ import annotations

import torch
from torch import nn

KEY = "slow_grad_sum"


class SlowLevels:
    """The slow(m) parameters of a model (any wrapper, e.g. DDP), and the per-step gradient routing."""

    def __init__(self, model: nn.Module):
        self.params: list[tuple[nn.Parameter, int]] = []
        for module in model.modules():
            if hasattr(module, "slow_parameters"):
                self.params.extend(module.slow_parameters())

    def __bool__(self) -> bool:
        return bool(self.params)

    @torch.no_grad()
    def before_step(self, optimizer: torch.optim.Optimizer, step: int) -> None:
        """Route the slow parameters' gradients for optimiser step `step` (0-based); see the module docstring."""
        for p, m in self.params:
            if p.grad is None:
                continue
            state = optimizer.state[p]
            if step % m == 0:
                acc = state.pop(KEY, None)  # None at step 0 (or after an optimiser reset)
                if acc is not None:
                    p.grad.add_(acc).div_(m)
            else:
                if KEY in state:
                    state[KEY].add_(p.grad)
                else:
                    state[KEY] = p.grad.detach().clone()
                p.grad = None


__all__ = ["SlowLevels"]
