"""``shrink="fold"``: a shrinking layer's neurons clustered to its new width, each cluster merged into one neuron,
instead of the lowest-scored ones dropped (model folding, Wang et al., ICLR 2025, arXiv 2502.10216, here with the
calibration data at hand).

Feature. What a neuron computes is its pre-activations on the MLP's input x: g·x (and u·x for a gated MLP); merging
neurons perturbs exactly these. With M = E[x xᵀ] over the calibration tokens (x = [x, 1] when the projections have
biases) and M = L Lᵀ, the feature of neuron j is its rows times L: the squared distance of two features is the mean
squared difference of their pre-activations over the calibration tokens (the metric of the neurons' pre-activation
vectors over all N tokens, held in 2 · hidden dimensions). A gated neuron (g, u, d) computes what (g, s·u, d / s)
does for any s ≠ 0, so u enters with unit RMS pre-activation and the sign that makes ⟨g, u⟩_M ≥ 0: neurons that
differ by that symmetry alone have equal features (and merge exactly).

Estimator. scikit-learn's ``KMeans`` with the layer's neuron scores as sample weights: the weighted k-means objective
Σ_j w_j ‖θ_j − θ_c(j)‖² is the importance-weighted pre-activation error the merge makes. It starts from the neurons
the drop would keep (the top-scored: deterministic, no random restarts) and runs at most ``iters`` Lloyd
iterations; with 0 the kept neurons stay as they are and every other neuron joins its nearest one. Agglomerative
clustering takes no sample weights and forms an I × I matrix; k-means costs O(I · K · hidden) an iteration.

Merge. A cluster's gate (and canonical up) rows are the importance-weighted mean of its members', the up row scaled
back to the members' weighted mean RMS (with the sign of the member weighing most), and its down column the sum of
the members' columns in the merged neuron's scale: one neuron now stands in for all the members' outputs. A cluster
of identical neurons (up to the scale symmetry) is thus replaced exactly, and a cluster of one stays as it was. The
layer loop then refits the down projection on the merged neurons' own activations (calibrate), which replaces the
summed columns (they stand with ``refit=False``).
"""

from __future__ import annotations

import logging
import warnings

import torch

from .options import FOLD_ITERS

WEIGHT_FLOOR = 1e-6  # the smallest sample weight, relative to the mean score (a zero-score neuron still clusters)

logger = logging.getLogger(__name__)


def fold_merge(rows: dict[str, torch.Tensor], moment: torch.Tensor, score: torch.Tensor, seeds: list[int],
               iters: int = FOLD_ITERS, seed: int = 0) -> dict[str, torch.Tensor]:
    """The merge matrices of one layer's fold to ``len(seeds)`` neurons.

    rows: the input projections' rows per name, "gate_proj" (gated MLPs only) and "up_proj", each (I, h) (with the
    bias as a last column: (I, h + 1)); moment: Σ x xᵀ of their inputs (h, h) (or (h + 1, h + 1)), any positive
    scale; score: (I,) non-negative importance; seeds: the K neurons the clusters start from (ascending).
    Returns fp64 {"gate_proj": (K, I), "up_proj": (K, I), "down_proj": (I, K)}: the merged rows are M @ rows, the
    merged down projection D @ M_down for the source D (d, I). Deterministic for given inputs."""
    gated = "gate_proj" in rows
    whiten = _whitener(moment.cpu())  # (h', h')
    feats = {name: w.detach().cpu().double() @ whiten for name, w in rows.items()}  # (I, h') each
    up = feats["up_proj"]
    scale = up.norm(dim=1) if gated else torch.ones(len(up), dtype=torch.float64)  # (I,) RMS of u·x
    sign = torch.ones_like(scale)
    if gated:
        sign = torch.where((feats["gate_proj"] * up).sum(1) < 0, -1.0, 1.0).double()
    unit = sign / scale.clamp(min=1e-30) * (scale > 0)  # (I,) u -> unit RMS, canonical sign (0 for a dead up row)
    feature = torch.cat([feats["gate_proj"], up * unit[:, None]] if gated else [up], 1)  # (I, F)
    weight = score.detach().cpu().double().clamp(min=0)
    weight = weight / weight.mean().clamp(min=1e-300) + WEIGHT_FLOOR  # (I,)
    labels = cluster(feature, weight, seeds, iters, seed)  # (I,)
    return merge_matrices(labels, weight, scale, sign, unit, gated, len(seeds), seeds if iters == 0 else None)


def _whitener(moment: torch.Tensor) -> torch.Tensor:
    """L with M + λI = L Lᵀ (h', h') fp64, M scaled to unit mean diagonal and λ = 1e-6: rows @ L have the
    pre-activation metric (up to one common scale), also where few tokens leave M singular."""
    m = moment.double() / moment.diagonal().double().mean().clamp(min=1e-300)
    m = m + 1e-6 * torch.eye(len(m), dtype=torch.float64)
    return torch.linalg.cholesky(m)


def cluster(feature: torch.Tensor, weight: torch.Tensor, seeds: list[int], iters: int, seed: int) -> torch.Tensor:
    """(I,) the cluster of every row of ``feature`` (I, F): weighted k-means (scikit-learn) from the rows ``seeds``,
    at most ``iters`` Lloyd iterations (0: each row's nearest seed); every cluster non-empty (:func:`fill_empty`)."""
    x, k = feature.numpy(), len(seeds)
    if iters == 0:
        labels = torch.cdist(feature, feature[seeds]).argmin(1)  # (I,)
        labels[seeds] = torch.arange(k)  # a seed stays in its own cluster (ties: duplicates of a seed)
    else:
        from sklearn.cluster import KMeans  # slow to import: only where a fold runs
        from sklearn.exceptions import ConvergenceWarning

        km = KMeans(n_clusters=k, init=x[seeds], n_init=1, max_iter=iters, algorithm="lloyd", random_state=seed)
        with warnings.catch_warnings():  # fewer distinct neurons than clusters: fill_empty splits copies
            warnings.simplefilter("ignore", ConvergenceWarning)
            labels = torch.from_numpy(km.fit(x, sample_weight=weight.numpy()).labels_).long()
    return fill_empty(labels, feature, weight, k)


def fill_empty(labels: torch.Tensor, feature: torch.Tensor, weight: torch.Tensor, k: int) -> torch.Tensor:
    """``labels`` (I,) with every cluster 0..k-1 given a member: each empty one takes the row of a cluster of two or
    more whose weighted squared distance to its centroid is largest (k-means' own relocation rule)."""
    labels = labels.clone()
    counts = torch.bincount(labels, minlength=k)
    for empty in (counts == 0).nonzero().flatten().tolist():
        sums = torch.zeros(k, feature.shape[1], dtype=torch.float64).index_add_(0, labels, feature * weight[:, None])
        mass = torch.zeros(k, dtype=torch.float64).index_add_(0, labels, weight)
        centroid = sums / mass.clamp(min=1e-300)[:, None]  # (k, F)
        cost = weight * (feature - centroid[labels]).pow(2).sum(1)  # (I,)
        cost[counts[labels] < 2] = -1.0
        j = int(cost.argmax())
        counts[labels[j]] -= 1
        labels[j], counts[empty] = empty, 1
    return labels


def merge_matrices(labels, weight, scale, sign, unit, gated: bool, k: int, seeds=None) -> dict[str, torch.Tensor]:
    """The fold's linear maps from the clusters ``labels`` (I,) over 0..k-1: each cluster's rows
    the ``weight``-ed mean of its members' (``seeds`` given: the seed's own rows), the canonical up rows (``unit``
    times the source's) rescaled to the members' mean RMS ``scale`` with the sign of the member weighing most, the
    down columns summed in that scale (a dead member, scale 0, adds nothing)."""
    n = len(labels)
    members = torch.zeros(k, n, dtype=torch.float64)
    members[labels, torch.arange(n)] = 1.0  # (K, I) one-hot membership
    if seeds is not None:
        mean = torch.zeros(k, n, dtype=torch.float64)
        mean[torch.arange(k), torch.as_tensor(seeds)] = 1.0
    else:
        mean = members * weight  # (K, I)
    mean = mean / mean.sum(1, keepdim=True)  # (K, I) rows sum to 1
    size = (mean @ scale) * sign[mean.argmax(1)]  # (K,) the merged neuron's signed up RMS
    size = torch.where(size == 0, torch.ones_like(size), size)  # a dead cluster: its rows 0, the scale moot
    up = mean * unit * size[:, None]  # (K, I)
    down = (members * (sign * scale)).T / size  # (I, K): 1 / unit = sign * scale
    sizes = torch.bincount(labels, minlength=k)
    logger.info("fold: %d neurons -> %d, %d alone, the largest cluster %d%s", n, k, int((sizes == 1).sum()),
                int(sizes.max()), " (seeds kept as they are)" if seeds is not None else "")
    return {**({"gate_proj": mean} if gated else {}), "up_proj": up, "down_proj": down}


__all__ = ["fold_merge", "cluster", "fill_empty", "merge_matrices"]
