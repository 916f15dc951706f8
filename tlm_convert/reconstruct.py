"""Two refinements of a pruned layer's fit on the calibration tokens (method knobs, off by default).

**Token weights** (``token_weighting``): the refit's least squares Σ_n w_n ‖a_n D′ᵀ − y_n‖² weighs every
calibration token n by w_n instead of 1.

* ``none``: w = 1 (the plain refit, bit for bit);
* ``sink``: w = 0 at position 0 (the attention-sink token, whose residual stream is orders of magnitude larger
  than the others' and dominates the squared error, while the next norm divides its error away), else 1;
* ``inv_norm``: ``sink``, and w_n = 1 / mean(z_n²) elsewhere, z_n the layer's input stream at the MLP: the error
  relative to the stream it is added to, which is what the next RMSNorm sees.

**Layer reconstruction** (``reconstruct_epochs``): after the refit, a few epochs of Adam train the pruned MLP's
gate, up and down projections (every neuron it keeps) to reproduce the refit's target on the cached calibration
batches, y = the source layer's MLP output (local) or h_src − z (residual), under the same token weights. Local:
one MLP at a time, no backward through the rest of the model. Deterministic for a given seed and thread count.
"""

from __future__ import annotations

import torch
from torch import nn

from .options import TOKEN_WEIGHTINGS


def token_weights(kind: str, mixed: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """Per batch, the weight of each calibration token (B, S) fp32 from the MLP inputs z (B, S, d); None for
    ``none`` (uniform)."""
    if kind not in TOKEN_WEIGHTINGS:
        raise ValueError(f"token_weighting={kind!r}: expected one of {', '.join(TOKEN_WEIGHTINGS)}")
    if kind == "none":
        return None
    out = []
    for z in mixed:
        if kind == "sink":
            w = torch.ones(z.shape[:2], dtype=torch.float32, device=z.device)
        else:
            w = 1.0 / z.float().pow(2).mean(-1).clamp(min=1e-12)
        w[:, 0] = 0.0
        out.append(w)
    return out


def reconstruct_mlp(layer, mixed: list[torch.Tensor], targets: list[torch.Tensor],
                    weights: list[torch.Tensor] | None, epochs: int, lr: float, seed: int = 0,
                    on_epoch=None) -> list[float]:
    """Train ``layer.mlp``'s projections with Adam so that mlp(norm(z_b)) ≈ targets[b] on every batch b
    (z_b: (B, S, d) MLP inputs; targets (B, S, d)), ``epochs`` passes over the batches in a seeded order.
    Returns the weighted relative error Σw‖e‖²/Σw‖y‖² before training and after each epoch. ``on_epoch()``: called
    after every epoch (a time budget, which may stop the run)."""
    mlp, norm = layer.mlp, layer.post_attention_layernorm
    params = [p for m in mlp.children() if isinstance(m, nn.Linear) for p in m.parameters()]
    flags = [p.requires_grad for p in params]
    with torch.no_grad():
        inputs = [norm(z) for z in mixed]  # (B, S, d): the norm is not trained
    weights = weights or [torch.ones(z.shape[:2], dtype=torch.float32, device=z.device) for z in mixed]
    scale = float(sum((w[..., None] * y.float().pow(2)).sum() for w, y in zip(weights, targets)))
    history = [_error(mlp, inputs, targets, weights) / scale]
    generator = torch.Generator().manual_seed(seed)
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.Adam(params, lr=lr)
    try:
        with torch.enable_grad():
            for _ in range(epochs):
                for b in torch.randperm(len(inputs), generator=generator).tolist():
                    w = weights[b]
                    loss = (w[..., None] * (mlp(inputs[b]) - targets[b]).pow(2)).sum() / w.sum().clamp(min=1e-12)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                history.append(_error(mlp, inputs, targets, weights) / scale)
                if on_epoch is not None:
                    on_epoch()
    finally:
        for p, flag in zip(params, flags):
            p.requires_grad_(flag)
            p.grad = None
    return history


@torch.no_grad()
def _error(mlp, inputs, targets, weights) -> float:
    return float(sum((w[..., None] * (mlp(x) - y).pow(2)).sum() for x, y, w in zip(inputs, targets, weights)))


__all__ = ["TOKEN_WEIGHTINGS", "token_weights", "reconstruct_mlp"]
