"""Least-squares refit of a pruned layer's down projection on calibration activations.

With A (N×I) the layer's activations, G = AᵀA, kept set K and source down projection D (d×I), choose D′ (d×|K|)
minimising ‖A_K D′ᵀ − A Dᵀ‖² + λ‖D′‖²:

    D′ᵀ = (G_KK + λI)⁻¹ G_K: Dᵀ          λ = damp · mean(diag G_KK)   (GPTQ / SparseGPT-style damping)

i.e. the kept columns plus the part of the pruned neurons' output that the kept neurons predict linearly.
Solved in fp64 by Cholesky. The refit only ever applies to layers that shrink. ``DAMP`` = 1e-3 is the damping
measured best on SmolLM2-135M.
"""

from __future__ import annotations

import torch

from .options import DAMP


def refit_down_proj(gram: torch.Tensor, down: torch.Tensor, keep: list[int], damp: float = DAMP,
                    cross: torch.Tensor | None = None, overwrite: bool = False,
                    block_rows: int | None = None, in_place: bool = False) -> torch.Tensor:
    """gram: (I, I) fp64; down: (d, I); keep: kept neuron indices, ascending -> new down projection (d, |K|).

    ``cross`` (I, d) = Aᵀ Y replaces the target A Dᵀ by another target Y (e.g. the residual target).
    ``overwrite=True`` builds G_KK inside ``gram``'s own storage (which it destroys) instead of copying it out;
    ``block_rows``: the right-hand side G_K: Dᵀ formed that many kept rows at a time; ``in_place``: see
    :func:`refit_kept`."""
    idx = torch.tensor(keep, dtype=torch.long, device=gram.device)
    if cross is not None:
        rhs = cross[idx]  # (K, d)
        del cross  # the caller's (I, d) sum goes as soon as its kept rows are copied, when no one else holds it
    elif block_rows is None:
        rhs = gram[idx] @ down.double().T
    else:
        down_t = down.double().T  # (I, d)
        rhs = torch.cat([gram[idx[s : s + block_rows]] @ down_t for s in range(0, len(idx), block_rows)])
        del down_t
    g_kk = _kept_block_in_place(gram, idx, block_rows) if overwrite else gram[idx][:, idx]
    return refit_kept(g_kk, rhs, damp, overwrite=True, in_place=in_place).to(down.dtype)


def _kept_block_in_place(gram: torch.Tensor, idx: torch.Tensor, rows: int | None) -> torch.Tensor:
    """G_KK compacted into the first K·K entries of ``gram``'s storage (a contiguous (I, I) matrix), ``rows`` kept
    rows at a time: kept row r = idx[r] >= r goes to offset r·K, which ends at (r+1)·K <= idx[r+1]·I, so no row is
    overwritten before it has been read (idx ascending)."""
    k, flat = len(idx), gram.view(-1)
    rows = rows or k
    for s in range(0, k, rows):
        block = gram[idx[s : s + rows]][:, idx]  # (b, K), a copy
        flat[s * k : (s + block.shape[0]) * k] = block.reshape(-1)
    return flat[: k * k].view(k, k)


def refit_kept(g_kk: torch.Tensor, rhs: torch.Tensor, damp: float = DAMP, overwrite: bool = False,
               in_place: bool = False) -> torch.Tensor:
    """Solve (G_KK + λI) Xᵀ = A_Kᵀ Y for the kept neurons: g_kk (K, K), rhs (K, d), fp64 -> X (d, K) fp64.

    ``overwrite=True`` adds λI to ``g_kk`` in place (no K × K copy; the caller's matrix is then the damped one);
    ``in_place=True`` also factors and solves inside ``g_kk``'s storage (LAPACK through scipy: no K × K factor
    beside it; the same solution up to rounding)."""
    lam = damp * g_kk.diagonal().mean().clamp(min=1e-12)
    system = g_kk if overwrite or in_place else g_kk.clone()
    system.diagonal().add_(lam)  # = g_kk + λI, entry for entry
    if in_place and system.device.type == "cpu":  # LAPACK through scipy: host memory only
        return _solve_in_place(system, rhs)
    chol, info = torch.linalg.cholesky_ex(system)
    if int(info) != 0:  # not positive definite even with damping: fall back to a least-squares solve
        solution = torch.linalg.lstsq(system, rhs).solution
    else:
        solution = torch.cholesky_solve(rhs, chol)  # (K, d)
    return solution.T.contiguous()


def _solve_in_place(system: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    """``refit_kept``'s solve with LAPACK's Cholesky (dpotrf/dpotrs) in ``system``'s own storage (contiguous,
    DESTROYED): the symmetric system seen column-major, whose lower triangle (row-major: upper) takes the factor."""
    import numpy as np
    from scipy.linalg import lapack

    diagonal = system.diagonal().clone()
    factor, info = lapack.dpotrf(system.numpy().T, lower=1, clean=0, overwrite_a=1)
    if info < 0:
        raise RuntimeError(f"LAPACK dpotrf: illegal argument {-info}")
    if info > 0:  # not positive definite even with damping: least squares, as refit_kept falls back to
        full = torch.tril(system, -1)  # the row-major lower triangle is untouched
        full = full + full.T
        full.diagonal().copy_(diagonal)
        return torch.linalg.lstsq(full, rhs).solution.T.contiguous()
    rhs_t = rhs.T.contiguous()  # (d, K), a view when rhs is one: seen column-major, the (K, d) right-hand side
    del rhs
    x, info = lapack.dpotrs(factor, rhs_t.numpy().T, lower=1, overwrite_b=1)
    if info != 0:
        raise RuntimeError(f"LAPACK dpotrs failed (info {info})")
    return torch.from_numpy(np.asarray(x).T).contiguous()  # (d, K)


__all__ = ["DAMP", "refit_down_proj", "refit_kept", "obs_prune"]


def obs_prune(gram: torch.Tensor, down: torch.Tensor, width: int, damp: float = DAMP,
              weights: torch.Tensor | None = None) -> tuple[list[int], torch.Tensor]:
    """Greedy structured Optimal Brain Surgeon: remove neurons one at a time, always the one whose removal (with
    the optimal least-squares compensation of the others) costs least, ‖d_j‖² / [G⁻¹]_jj, updating the remaining
    columns and G⁻¹ after each removal (as SparseGPT does for weights; ZipLM for structures).

    gram: (I, I) fp64; down: (d, I) -> (kept indices ascending, compensated down projection (d, width)).
    Damping λ·I is added to G as in ``refit_down_proj`` (here it pulls the compensation towards the source
    columns rather than towards zero). ``weights`` (I,): each neuron's cost is multiplied by its weight (how much
    the whole model's output cares about a unit of this layer's output error along the neuron's direction:
    ``importance="fisher_obs"``); None: the plain local cost.

    G⁻¹ is never updated in place: after s removals it is H₀ − Q Qᵀ with one column of Q per removal
    (q = H[:, j] / √H[j, j]), so a step costs O(I·(d + s)) instead of O(I²), and only its diagonal is tracked.
    """
    n = gram.shape[0]
    lam = damp * gram.diagonal().mean().clamp(min=1e-12)
    h0 = torch.linalg.inv(gram + lam * torch.eye(n, dtype=torch.float64, device=gram.device))  # (I, I)
    removals = n - width
    q_t = gram.new_zeros(max(removals, 0), n)  # (removals, I): row s is q of removal s
    diag = h0.diagonal().clone()  # diag(G⁻¹) after the removals so far
    w = down.double().clone()  # (d, I)
    alive = torch.ones(n, dtype=torch.bool, device=gram.device)
    for s in range(removals):
        cost = w.pow(2).sum(0) / diag.clamp(min=1e-30)  # (I,)
        if weights is not None:
            cost *= weights
        cost[~alive] = float("inf")
        j = int(torch.argmin(cost))
        col = h0[j] - q_t[:s].T @ q_t[:s, j]  # (I,) column j of the current G⁻¹ (G⁻¹ is symmetric)
        w.addr_(w[:, j].clone(), col, alpha=-1.0 / float(col[j]))  # compensate every other column; column j -> 0
        q_t[s] = col / col[j].sqrt()
        diag -= q_t[s].pow(2)
        alive[j] = False
    keep = alive.nonzero().flatten().tolist()
    return keep, w[:, alive].to(down.dtype).contiguous()
