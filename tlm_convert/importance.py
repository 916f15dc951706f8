"""Neuron importance from calibration activations.

Statistics are accumulated by a forward pre-hook on ``mlp.down_proj``, whose input is the post-gating
activation a = act(g·x) ⊙ (u·x) — exactly what pruning a neuron removes. The hook *adds* every batch into
running sums (fp64), and is removed in ``finally`` even when a batch fails.

Metrics (one score per neuron; compared only within a layer, higher = more important):

==============  ==================================================================================
``activation``  sqrt( Σ_s ( mean_t |a_stj| )² ): mean over each sequence's tokens, L2 across sequences
                (Minitron, arXiv 2407.14679; the post-gating input as in NVIDIA ModelOpt). The default of
                ``--low-memory`` when OBS's I × I matrices exceed its budget, and the profile every report plots.
``obs``         the default of ``--low-memory`` while its matrices fit. Not a per-neuron score: shrinking
                layers remove neurons greedily by their cost *after* least-squares compensation,
                ‖d_j‖² / [G⁻¹]_jj with G = AᵀA the activations' second moments (structured Optimal Brain
                Surgeon, compensate.obs_prune), starting from the least-squares optimum of the refit target;
                the profile uses ``activation``
``wanda_sp``    ‖a_:j‖₂ · ‖d_j‖₂ over all calibration tokens: the Frobenius norm of the neuron's output
``wifv``        Var_n(a_nj) · ‖d_j‖₂² (FLAP, arXiv 2312.11983)
``magnitude``   mean(‖g_j‖², ‖u_j‖², ‖d_j‖²) — weights only (collapses without recovery; ablation)
``random``      U(0, 1) from the seed (ablation floor)
``fisher``      the default (in memory): the diagonal Fisher information of the model's own next-token
                distribution with respect to a mask on each neuron at each position, summed over the
                positions: what removing it costs the whole model's output (KL to the source), not one
                layer's; scored before the layer loop on the source model (tlm_convert.fisher)
``fisher_obs``  OBS's greedy removal with each neuron's local cost weighted by its Fisher *sensitivity*,
                F_j / (Σ a_j² · ‖d_j‖²): the model's output cost per unit of output energy of the neuron, so
                OBS's compensated error is counted in what it does to the whole model (:func:`sensitivity`)
==============  ==================================================================================

``fisher`` is the default (bench/STUDIES.md, "Neuron ranking"); ``obs`` is the best of the per-layer metrics.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

from .options import METRICS, WHOLE_MODEL

OBS_METRICS = frozenset({"obs", "fisher_obs"})  # remove neurons by OBS's greedy compensated cost


class ActivationStats:
    """Running sums over calibration tokens of a (B, S, I) activation; optional Gram matrix AᵀA."""

    def __init__(self, width: int, gram: bool = False, keep: bool = False, block_rows: int | None = None,
                 device: torch.device | str | None = None):
        self.block_rows = block_rows  # the Gram matrix's update in blocks of at most this many columns
        self.kept: list[torch.Tensor] | None = [] if keep else None  # the activations themselves, if asked
        self.tokens = 0
        self.sequences = 0
        f64 = {"dtype": torch.float64, "device": device}  # fp64 sums on the activations' device
        self.sum = torch.zeros(width, **f64)  # Σ a
        self.sumsq = torch.zeros(width, **f64)  # Σ a²
        self.seq_abs_sq = torch.zeros(width, **f64)  # Σ_s (mean_t |a|)²
        self.gram = torch.zeros(width, width, **f64) if gram else None

    @torch.no_grad()
    def update(self, a: torch.Tensor) -> None:
        if self.kept is not None:
            self.kept.append(a)
        a = a.float() if a.dim() == 3 else a.float()[None]  # (B, S, I)
        flat = a.reshape(-1, a.shape[-1])  # (B*S, I)
        self.tokens += flat.shape[0]
        self.sequences += a.shape[0]
        self.sum += flat.sum(0).double()
        self.sumsq += flat.pow(2).sum(0).double()
        self.seq_abs_sq += a.abs().mean(1).double().pow(2).sum(0)
        if self.gram is not None:
            add_gram(self.gram, flat, self.block_rows)

    @property
    def mean(self) -> torch.Tensor:
        return self.sum / max(self.tokens, 1)

    @property
    def variance(self) -> torch.Tensor:
        return (self.sumsq / max(self.tokens, 1) - self.mean.pow(2)).clamp(min=0)


def add_gram(gram: torch.Tensor, flat: torch.Tensor, rows: int | None = None) -> None:
    """gram (I, I) fp64 += flatᵀ flat for activations flat (N, I): fp32 products of column blocks, accumulated in
    fp64. The Gram matrix is symmetric: only the blocks on and above the diagonal are multiplied, each mirrored
    below. Blocks of ``rows`` columns (temporaries of 12·rows² bytes), else a quarter of I."""
    flat = flat.float()
    width = flat.shape[1]
    step = min(rows or width, -(-width // 4))
    for r in range(0, width, step):
        for c in range(r, width, step):
            block = (flat[:, r : r + step].T @ flat[:, c : c + step]).double()  # (step, step)
            gram[r : r + step, c : c + step] += block
            if c != r:
                gram[c : c + step, r : r + step] += block.T


class StopForward(Exception):
    """Raised by a ``stop=True`` statistics hook once it has recorded its input (the rest of the forward, here
    the down projection itself, is not needed)."""


@contextmanager
def activation_stats(down_proj: torch.nn.Module, gram: bool = False, keep: bool = False, columns: int | None = None,
                     stop: bool = False, block_rows: int | None = None, on_batch=None):
    """``with activation_stats(layer.mlp.down_proj) as stats:`` run batches; the hook is always removed.

    ``keep=True`` also keeps each batch's activation tensor in ``stats.kept`` (the converter reuses them);
    ``columns`` records only the first that many neurons (the source ones of a grown layer); ``stop=True`` raises
    :class:`StopForward` after recording, for callers that only want the activations; ``block_rows``: see
    :func:`add_gram`; ``on_batch(a)`` is called with every batch's recorded activations."""
    width = columns or down_proj.in_features
    stats = ActivationStats(width, gram=gram, keep=keep, block_rows=block_rows, device=down_proj.weight.device)

    def hook(_module, args):
        stats.update(args[0].detach()[..., :width])
        if on_batch is not None:
            on_batch(args[0].detach()[..., :width])
        if stop:
            raise StopForward

    handle = down_proj.register_forward_pre_hook(hook)
    try:
        yield stats
    finally:
        handle.remove()


def neuron_scores(metric: str, stats: ActivationStats | None, weights: dict, seed: int = 0,
                  whole_model: torch.Tensor | None = None) -> torch.Tensor:
    """One score per neuron (I,) for a layer; ``weights`` holds that layer's gate/up/down weight tensors;
    ``whole_model``: the layer's scores from a :data:`WHOLE_MODEL` metric's pass before the layer loop."""
    if metric not in METRICS:
        raise ValueError(f"importance={metric!r}: expected one of {', '.join(METRICS)}")
    if metric in WHOLE_MODEL:
        if whole_model is None:
            raise ValueError(f"importance={metric!r} scores the whole model before the layer loop; none were given")
        return whole_model.double()
    metric = "activation" if metric == "obs" else metric
    down = weights["down_proj"].double()  # (d, I)
    col_sq = down.pow(2).sum(0)  # ‖d_j‖²
    if metric == "random":
        return torch.rand(down.shape[1], generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if metric == "magnitude":
        rows = [weights[n].double().pow(2).sum(1) for n in ("gate_proj", "up_proj") if n in weights]
        return torch.stack(rows + [col_sq]).mean(0)
    if stats is None or stats.tokens == 0:
        raise ValueError(f"importance={metric!r} needs calibration activations; none were recorded")
    if metric == "activation":
        return stats.seq_abs_sq.sqrt()
    if metric == "wanda_sp":
        return stats.sumsq.sqrt() * col_sq.sqrt()
    return stats.variance * col_sq  # wifv


def sensitivity(fisher: torch.Tensor, stats: ActivationStats, down: torch.Tensor) -> torch.Tensor:
    """(I,) F_j / (Σ_t a_j² · ‖d_j‖²), divided by its mean: the Fisher score per unit of the neuron's output energy
    (``fisher_obs``'s weights on OBS's costs). ``down``: (d, I)."""
    energy = stats.sumsq * down.double().pow(2).sum(0)  # (I,)
    ratio = fisher.double() / energy.clamp(min=1e-30)
    return ratio / ratio.mean().clamp(min=1e-30)


__all__ = ["METRICS", "WHOLE_MODEL", "OBS_METRICS", "sensitivity", "ActivationStats", "StopForward", "activation_stats", "add_gram", "neuron_scores"]
