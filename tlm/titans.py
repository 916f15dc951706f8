"""Titans neural long-term memory (LMM), the memory branch of the MAG mixer (design doc §4.3).

Each of ``H`` memory heads owns a small MLP ``M`` whose weights are the recurrent state (per sample, per head,
reset at sequence start). For every token t:

    q_t, k_t, v_t = SiLU(causal_depthwise_conv(x W_{Q,K,V}))      per head; q_t, k_t L2-normalised
    θ_t = θ_max·σ(x w_θ + b_θ)    η_t = σ(x w_η + b_η)    α_t = σ(x w_α + b_α)    per head, per token
    ℓ_t(M) = ‖M(k_t) − v_t‖²                                       sum over features, no ½ factor
    S_t = η_t S_{t−1} − θ_t ∇ℓ_t(M_{t'})                           t' = start of t's chunk (see below)
    M_t = (1 − α_t) M_{t−1} + S_t
    y_t = M_t(q_t)                                                 read AFTER the write of token t

Chunks are absolute: chunk c covers positions [c·b, (c+1)·b) counted from the sequence start, and every
gradient inside a chunk is taken at the chunk-start weights M_{t'}. With b = 1 this is the exact per-token
recurrence (gradient at M_{t−1}).

Chunked parallel form (``memory_scan``). Inside a chunk segment with local tokens i = 1..C, starting from
the state (S_s, M_s) at the segment start and with every gradient u_j taken at M_{t'}:

    S_i = P_i S_s − Σ_{j≤i} θ_j (P_i/P_j) u_j                      P_i = Π_{m≤i} η_m
    M_i = β_i M_s + c_i S_s − Σ_{j≤i} G[i,j] u_j                   β_i = Π_{m≤i} (1 − α_m)
    c_i = Σ_{m≤i} (β_i/β_m) P_m      G[i,j] = θ_j Σ_{j≤m≤i} (β_i/β_m)(P_m/P_j), i.e. G = T_β T_P diag(θ)

with T_β[i,m] = β_i/β_m and T_P[m,j] = P_m/P_j (lower triangular), all exp of log-space segment sums of
log η and log(1 − α) (never a raw cumprod, never a ratio of two products). For one token the loss gradient
w.r.t. layer l's weight is an outer product, u_j^l = g_j^l (z_j^l)ᵀ (backprop signal ⊗ layer input), computed
in closed form for the whole chunk at once. Hence the per-token weights M_i are never materialised: reading
layer l of M_i at input y_i is

    M_i^l y_i = β_i (M_s^l y_i) + c_i (S_s^l y_i) − Σ_j G[i,j] (z_j^l · y_i) g_j^l

(one (C×C) "attention" matmul per layer, the dual form of TTT). This is exactly the function obtained by
materialising M_i per token, but a chunk costs O(B·H·(C·|W| + C²·(o+n))) time and O(B·H·(|W| + C·(C+o+n)))
memory instead of O(B·H·C²·|W|) and O(B·H·C·|W|). The state at the end of a segment is formed explicitly
with one (o×C)(C×n) matmul per layer. Chunks run in a
Python loop (sequential by nature); tokens inside a chunk never do. The outer model backpropagates through
all of this with ordinary autograd (the inner gradients are closed-form, so there is no double backward).

Conventions [ours] (keep the model, the reference and the tests consistent):
  * loss ‖M(k) − v‖² summed over the d_m features, no ½  ⇒  linear memory: ∇_W ℓ = 2 (W k − v) kᵀ;
  * read after write at token t (y_t = M_t(q_t)); both orders are causal;
  * gates per head and per token; bias inits b_θ = 0 (θ = θ_max/2 = 0.05), b_η = 0 (η = 0.5), b_α = −4
    (α ≈ 0.018, memory half-life ≈ 38 tokens); gate weights N(0, 0.02);
  * optional surprise clip: if ``surprise_clip`` is set, θ_j is scaled by min(1, clip/‖u_j‖) where ‖u_j‖ is
    the Frobenius norm of token j's gradient over all memory layers of its head (off by default);
  * compute dtype float32 for everything after the q/k/v projections (float64 stays float64, for gradchecks);
    autocast is disabled inside; the output is cast back to x.dtype; the state stays in the compute dtype.

Axis legend (shapes in comments):
  B batch   N tokens in this call   H memory heads (H_m)   D head width d_m   K conv kernel
  C tokens in a chunk segment (≤ b)   P = |W| flat memory size per head   (o, n) out/in width of one layer
  i, j, m token indices inside a segment

Only torch + stdlib: this file is shipped as transformers remote code.
"""

from __future__ import annotations

import logging
import math
from typing import NamedTuple

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from .padding import needs_rows, run_rows

logger = logging.getLogger(__name__)

Shapes = list[tuple[int, int]]  # per memory layer: (out, in)


# ----------------------------------------------------------------------------------------------------------
# Memory MLP helpers (weights kept flat in the state: (..., P))
# ----------------------------------------------------------------------------------------------------------


def memory_shapes(head_dim: int, depth: int, expansion: int) -> Shapes:
    """(out, in) of each memory layer: depth 1 -> [(D, D)]; depth L >= 2 -> [(E, D), (E, E)*(L-2), (D, E)]."""
    if depth < 1:
        raise ValueError(f"memory depth must be >= 1, got {depth}")
    if depth == 1:
        return [(head_dim, head_dim)]
    hidden = expansion * head_dim
    return [(hidden, head_dim)] + [(hidden, hidden)] * (depth - 2) + [(head_dim, hidden)]


def split_weights(flat: Tensor, shapes: Shapes) -> list[Tensor]:
    """(..., P) -> [(..., o, n)] views, one per memory layer."""
    sizes = [o * n for o, n in shapes]
    parts = torch.split(flat, sizes, dim=-1)
    return [p.reshape(*flat.shape[:-1], o, n) for p, (o, n) in zip(parts, shapes)]


def join_weights(mats: list[Tensor]) -> Tensor:
    """[(..., o, n)] -> (..., P)."""
    return torch.cat([m.flatten(-2) for m in mats], dim=-1)


def mlp_apply(mats: list[Tensor], x: Tensor) -> Tensor:
    """M(x) with per-token weights: mats [(..., o, n)], x (..., D) -> (..., D). Used by the reference loop."""
    for idx, w in enumerate(mats):
        x = torch.einsum("...on,...n->...o", w, x)
        if idx < len(mats) - 1:
            x = F.silu(x)
    return x


def loss_grad_factors(mats: list[Tensor], k: Tensor, v: Tensor) -> list[tuple[Tensor, Tensor]]:
    """Closed-form per-token gradient of ℓ = ‖M(k) − v‖² at shared weights, in outer-product form.

    mats: [(B,H,o,n)] shared by the C tokens;  k, v: (B,H,C,D).
    Returns [(g_l (B,H,C,o), z_l (B,H,C,n))] per layer, with ∇_{W_l} ℓ_j = g_l[j] z_l[j]ᵀ.
    """
    inputs, gates = [], []  # layer inputs z_l; SiLU slopes of the hidden layers
    z = k
    for idx, w in enumerate(mats):
        inputs.append(z)
        h = z @ w.transpose(-1, -2)  # (B,H,C,o)
        if idx < len(mats) - 1:
            s = torch.sigmoid(h)
            z = h * s  # SiLU(h)
            gates.append(torch.lerp(s, s.new_ones(()), z))  # SiLU'(h) = σ(h) + SiLU(h)(1 − σ(h))
        else:
            z = h
    g = 2.0 * (z - v)  # (B,H,C,D)  d‖out − v‖²/d out
    factors: list[tuple[Tensor, Tensor]] = [None] * len(mats)  # type: ignore[list-item]
    for idx in range(len(mats) - 1, -1, -1):
        factors[idx] = (g, inputs[idx])
        if idx > 0:
            g = (g @ mats[idx]) * gates[idx - 1]  # (B,H,C,n)
    return factors


def gradient_sq_norm(factors: list[tuple[Tensor, Tensor]]) -> Tensor:
    """‖u_j‖² over all layers (Frobenius; ‖g zᵀ‖ = ‖g‖‖z‖): (B,H,C)."""
    return sum((g * g).sum(-1) * (z * z).sum(-1) for g, z in factors)


def clip_scale(sq_norm: Tensor, surprise_clip: float) -> Tensor:
    """min(1, clip/‖u‖) per token; sq_norm = ‖u‖²: (B,H,C) -> (B,H,C)."""
    norm = sq_norm.clamp_min(1e-24).sqrt()
    return (surprise_clip / norm).clamp(max=1.0)


# ----------------------------------------------------------------------------------------------------------
# Within-chunk coefficients (log space)
# ----------------------------------------------------------------------------------------------------------


class SegmentCoefficients(NamedTuple):
    """Gate-only coefficients of one segment (θ is applied later, after the optional surprise clip)."""

    mix: Tensor  # (B,H,C,C) T_β T_P: M_i gets −Σ_j mix[i,j] θ_j u_j  (G = mix · diag(θ))
    mom_mix: Tensor  # (B,H,C,C) T_P = P_i/P_j (j <= i): S_i gets −Σ_j mom_mix[i,j] θ_j u_j
    beta: Tensor  # (B,H,C) β_i: weight of M_0 in M_i
    carry: Tensor  # (B,H,C) c_i: weight of S_0 in M_i
    momentum_decay: Tensor  # (B,H,C) P_i: weight of S_0 in S_i


def _ratio_matrix(log_x: Tensor) -> Tensor:
    """R[i,j] = Π_{j<l<=i} x_l for j <= i (1 on the diagonal), else 0.  log_x: (..., C) -> (..., C, C).

    Segment sums of log x (a masked cumsum, as in Mamba-2's segsum) rather than differences of one cumsum: no
    cancellation, and log x = −inf (x = 0) gives exact zeros instead of NaN from (−inf) − (−inf).
    """
    c = log_x.shape[-1]
    ones = torch.ones(c, c, dtype=torch.bool, device=log_x.device)
    below = log_x[..., :, None].expand(*log_x.shape, c).masked_fill(~ones.tril(-1), 0.0)  # [l,j] = log x_l, l > j
    seg = torch.cumsum(below, dim=-2)  # [i,j] = Σ_{j<l<=i} log x_l
    return torch.exp(seg.masked_fill(~ones.tril(), -math.inf))


def segment_coefficients(log_eta: Tensor, log_keep: Tensor) -> SegmentCoefficients:
    """Coefficients of the within-segment (S, M) recurrence. log_eta = log η, log_keep = log(1 − α): (..., C).

    Any leading axes (e.g. (B,H,chunks)). All products are exp of log-space (segment) sums over <= b tokens:
    ratios such as β_i/β_m never divide two underflowed cumprods.
    """
    t_beta = _ratio_matrix(log_keep)  # (..., C, C)  β_i/β_m
    t_p = _ratio_matrix(log_eta)  # (..., C, C)  P_m/P_j
    p = torch.exp(torch.cumsum(log_eta, dim=-1))  # (..., C)  P_i
    beta = torch.exp(torch.cumsum(log_keep, dim=-1))  # (..., C)  β_i
    carry = (t_beta @ p[..., None]).squeeze(-1)  # c_i = Σ_{m<=i} (β_i/β_m) P_m
    return SegmentCoefficients(t_beta @ t_p, t_p, beta, carry, p)


def _segments(n_tok: int, chunk_pos: int, chunk_size: int) -> list[int]:
    """Lengths of the pieces of [0, n_tok) cut at absolute chunk boundaries, given chunk_pos already used."""
    lengths, t, pos = [], 0, chunk_pos
    while t < n_tok:
        n = min(chunk_size - pos, n_tok - t)
        lengths.append(n)
        t, pos = t + n, (pos + n) % chunk_size
    return lengths


def _all_coefficients(log_eta: Tensor, log_keep: Tensor, lengths: list[int], chunk_size: int) -> list:
    """SegmentCoefficients per segment; the run of full chunks is computed in one batched call."""
    eta_parts = torch.split(log_eta, lengths, dim=-1)
    keep_parts = torch.split(log_keep, lengths, dim=-1)
    full = [i for i, n in enumerate(lengths) if n == chunk_size]  # consecutive by construction
    out: list = [None] * len(lengths)
    if len(full) > 1:
        a, b = full[0], full[-1] + 1
        lo, hi = sum(lengths[:a]), sum(lengths[:b])
        eta = log_eta[..., lo:hi].unflatten(-1, (b - a, chunk_size))  # (B,H,chunks,C)
        keep = log_keep[..., lo:hi].unflatten(-1, (b - a, chunk_size))
        fields = [f.unbind(2) for f in segment_coefficients(eta, keep)]  # each: chunks × (B,H,...)
        for c, idx in enumerate(range(a, b)):
            out[idx] = SegmentCoefficients(*(f[c] for f in fields))
    for idx in range(len(lengths)):
        if out[idx] is None:
            out[idx] = segment_coefficients(eta_parts[idx], keep_parts[idx])
    return out


# ----------------------------------------------------------------------------------------------------------
# Chunked scan
# ----------------------------------------------------------------------------------------------------------


def _scan_segment(
    q: Tensor, k: Tensor, v: Tensor, theta: Tensor, co: SegmentCoefficients,
    start: Tensor, memory: Tensor, momentum: Tensor, shapes: Shapes, surprise_clip: float | None, need_state: bool,
) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One segment (<= one chunk) of tokens. q, k, v: (B,H,C,D); theta (B,H,C); start/memory/momentum (B,H,P).

    Returns y (B,H,C,D) and the (memory, momentum) after the last token (None when not need_state).
    """
    w_start = split_weights(start, shapes)  # gradient point M_{t'}
    w_mem = split_weights(memory, shapes)  # M_s, the recurrence's starting point
    w_mom = split_weights(momentum, shapes)  # S_s
    factors = loss_grad_factors(w_start, k, v)
    if surprise_clip is not None:
        theta = theta * clip_scale(gradient_sq_norm(factors), surprise_clip)
    mix = co.mix * theta[..., None, :]  # G (B,H,C,C)

    y = q  # (B,H,C,D)
    for idx, ((g, z), wm, ws) in enumerate(zip(factors, w_mem, w_mom)):
        # (B,H,C,o) = β_i M_s y_i + c_i S_s y_i − Σ_j G[i,j] (z_j·y_i) g_j
        scores = mix * (y @ z.transpose(-1, -2))  # (B,H,C,C)
        h = co.beta[..., None] * (y @ wm.transpose(-1, -2)) - scores @ g
        h = torch.addcmul(h, co.carry[..., None], y @ ws.transpose(-1, -2))
        y = F.silu(h) if idx < len(factors) - 1 else h
    if not need_state:
        return y, None, None

    w_last = mix[..., -1, :, None]  # (B,H,C,1)  G[n,j]
    m_last = co.mom_mix[..., -1, :, None] * theta[..., None]  # θ_j P_n/P_j
    beta_n = co.beta[..., -1, None, None]  # (B,H,1,1)
    carry_n = co.carry[..., -1, None, None]
    p_n = co.momentum_decay[..., -1, None, None]
    new_mem, new_mom = [], []
    for (g, z), wm, ws in zip(factors, w_mem, w_mom):
        mem_l = beta_n * wm - (g * w_last).transpose(-1, -2) @ z  # (B,H,o,n)
        new_mem.append(torch.addcmul(mem_l, carry_n, ws))
        new_mom.append(p_n * ws - (g * m_last).transpose(-1, -2) @ z)
    return y, join_weights(new_mem), join_weights(new_mom)


def memory_scan(
    q: Tensor, k: Tensor, v: Tensor, theta: Tensor, log_eta: Tensor, log_keep: Tensor,
    memory_start: Tensor, memory: Tensor, momentum: Tensor, chunk_pos: int, chunk_size: int, shapes: Shapes,
    surprise_clip: float | None = None, need_state: bool = True,
) -> tuple[Tensor, dict | None]:
    """Chunked parallel memory update + read over N tokens that continue a stream at `chunk_pos`.

    q, k, v: (B,H,N,D); theta, log_eta, log_keep = log(1 − α): (B,H,N); memory_start, memory, momentum: (B,H,P).
    chunk_pos: tokens already consumed in the current chunk (0 <= chunk_pos < chunk_size).
    Returns y (B,H,N,D) and {"memory_start", "memory", "momentum", "chunk_pos"} (None unless need_state).
    """
    if not 0 <= chunk_pos < chunk_size:
        raise ValueError(f"chunk_pos {chunk_pos} outside [0, {chunk_size})")
    lengths = _segments(q.shape[2], chunk_pos, chunk_size)
    coeffs = _all_coefficients(log_eta, log_keep, lengths, chunk_size)
    pieces = [torch.split(t, lengths, dim=2) for t in (q, k, v)]  # one SplitBackward instead of N/b slices
    thetas = torch.split(theta, lengths, dim=-1)
    ys = []
    pos = chunk_pos
    start, mem, mom = memory_start, memory, momentum
    for idx, n in enumerate(lengths):
        last = idx == len(lengths) - 1
        y, mem, mom = _scan_segment(
            pieces[0][idx], pieces[1][idx], pieces[2][idx], thetas[idx], coeffs[idx],
            start, mem, mom, shapes, surprise_clip, need_state=need_state or not last,
        )
        ys.append(y)
        pos = (pos + n) % chunk_size
        if pos == 0:
            start = mem  # the next chunk takes its gradients here
    y = torch.cat(ys, dim=2) if ys else q.new_zeros(q.shape)
    if not need_state:
        return y, None
    return y, {"memory_start": start, "memory": mem, "momentum": mom, "chunk_pos": pos}


def memory_reference(
    q: Tensor, k: Tensor, v: Tensor, theta: Tensor, eta: Tensor, alpha: Tensor,
    memory_start: Tensor, memory: Tensor, momentum: Tensor, chunk_pos: int, chunk_size: int, shapes: Shapes,
    surprise_clip: float | None = None,
) -> tuple[Tensor, dict]:
    """Plain token loop over the same equations (tests only). Same arguments as `memory_scan`, but raw gates
    eta = η and alpha = α (B,H,N), direct products (no log space), and the loss gradient from torch.func
    autograd instead of the closed form, with explicitly materialised per-token weights.
    """

    def loss(flat_w: Tensor, k1: Tensor, v1: Tensor) -> Tensor:  # flat_w (P,), k1, v1 (D,)
        return ((mlp_apply(split_weights(flat_w, shapes), k1) - v1) ** 2).sum()

    grad_fn = torch.func.vmap(torch.func.vmap(torch.func.grad(loss)))  # over (B, H)
    start, mem, mom = memory_start, memory, momentum
    ys = []
    for t in range(q.shape[2]):
        if (chunk_pos + t) % chunk_size == 0:
            start = mem
        u = grad_fn(start, k[:, :, t], v[:, :, t])  # (B,H,P)
        th = theta[:, :, t, None]  # (B,H,1)
        if surprise_clip is not None:
            th = th * clip_scale((u * u).sum(-1, keepdim=True), surprise_clip)
        mom = eta[:, :, t, None] * mom - th * u
        mem = (1 - alpha[:, :, t, None]) * mem + mom
        ys.append(mlp_apply(split_weights(mem, shapes), q[:, :, t]))  # (B,H,D)
    pos = (chunk_pos + q.shape[2]) % chunk_size
    if pos == 0:
        start = mem
    y = torch.stack(ys, dim=2) if ys else q.new_zeros(q.shape)
    return y, {"memory_start": start, "memory": mem, "momentum": mom, "chunk_pos": pos}


# ----------------------------------------------------------------------------------------------------------
# Module
# ----------------------------------------------------------------------------------------------------------


class MemoryInputs(NamedTuple):
    q: Tensor  # (B,H,N,D), L2-normalised
    k: Tensor  # (B,H,N,D), L2-normalised
    v: Tensor  # (B,H,N,D)
    theta: Tensor  # (B,H,N)  θ
    log_eta: Tensor  # (B,H,N)  log η
    log_keep: Tensor  # (B,H,N)  log(1 − α)
    conv: tuple[Tensor, Tensor, Tensor]  # new conv tails for q, k, v: (B,K−1,H·D) pre-conv inputs


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


class NeuralMemory(nn.Module):
    """Titans LMM branch: x (B,N,hidden) -> r (B,N,H·D), the RMS-normalised concatenated memory reads.

    State (``use_cache=True``), all tensors in the compute dtype:
      memory_start (B,H,P)  M at the start of the current chunk (gradient point of its remaining tokens)
      memory       (B,H,P)  current M;   momentum (B,H,P) current S
      chunk_pos    int      tokens already consumed in the current chunk (chunks are absolute positions)
      conv         (q, k, v) tails, each (B,K−1,H·D): the last K−1 pre-conv projections (zeros before t=0)
    Flat weight layout P: layer by layer, each (o, n) row-major, in the order of `memory_shapes`.
    The state keeps the autograd graph of the call that made it: detach it between training windows.
    """

    def __init__(
        self, hidden_size: int, num_heads: int, head_dim: int, depth: int = 2, expansion: int = 2,
        chunk_size: int = 16, theta_max: float = 0.1, conv_kernel: int = 4, norm_eps: float = 1e-6,
        surprise_clip: float | None = None,
    ):
        super().__init__()
        if chunk_size < 1 or conv_kernel < 1 or theta_max <= 0:
            raise ValueError("chunk_size and conv_kernel must be >= 1 and theta_max > 0")
        self.hidden_size, self.num_heads, self.head_dim = hidden_size, num_heads, head_dim
        self.depth, self.expansion, self.chunk_size = depth, expansion, chunk_size
        self.theta_max, self.conv_kernel, self.norm_eps = theta_max, conv_kernel, norm_eps
        self.surprise_clip = surprise_clip
        self.shapes = memory_shapes(head_dim, depth, expansion)
        width = num_heads * head_dim

        self.q_proj = nn.Linear(hidden_size, width, bias=False)
        self.k_proj = nn.Linear(hidden_size, width, bias=False)
        self.v_proj = nn.Linear(hidden_size, width, bias=False)
        self.q_conv = nn.Conv1d(width, width, conv_kernel, groups=width, bias=True)
        self.k_conv = nn.Conv1d(width, width, conv_kernel, groups=width, bias=True)
        self.v_conv = nn.Conv1d(width, width, conv_kernel, groups=width, bias=True)
        self.lr_proj = nn.Linear(hidden_size, num_heads, bias=True)  # θ
        self.momentum_proj = nn.Linear(hidden_size, num_heads, bias=True)  # η
        self.decay_proj = nn.Linear(hidden_size, num_heads, bias=True)  # α
        self.memory_init = nn.ParameterList([nn.Parameter(torch.empty(num_heads, o, n)) for o, n in self.shapes])
        self.out_norm = nn.RMSNorm(width, eps=norm_eps)
        self.reset_parameters()
        logger.debug("NeuralMemory: H=%d D=%d depth=%d |W|=%d b=%d", num_heads, head_dim, depth,
                     self.memory_size, chunk_size)

    # Init ------------------------------------------------------------------------------------------------
    LR_BIAS, MOMENTUM_BIAS, DECAY_BIAS, GATE_STD = 0.0, 0.0, -4.0, 0.02

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """Our init; call it from the model's `_init_weights` (a generic Linear init would zero the gate biases).

        q/k/v projections: nn.Linear default. Convs: identity (last tap 1, other taps 0, bias 0), so the conv is
        a no-op at init. Gates: weights N(0, 0.02), biases b_θ = 0 (θ = θ_max/2), b_η = 0 (η = 1/2),
        b_α = −4 (α ≈ 0.018). Memory M_0: N(0, std 1/√fan_in) per layer. Output norm gain 1.
        """
        for proj in (self.q_proj, self.k_proj, self.v_proj):
            proj.reset_parameters()
        for conv in (self.q_conv, self.k_conv, self.v_conv):
            conv.weight.zero_()
            conv.weight[:, 0, -1] = 1.0
            conv.bias.zero_()
        for proj, bias in ((self.lr_proj, self.LR_BIAS), (self.momentum_proj, self.MOMENTUM_BIAS),
                           (self.decay_proj, self.DECAY_BIAS)):
            proj.weight.normal_(0.0, self.GATE_STD)
            proj.bias.fill_(bias)
        for w in self.memory_init:
            w.normal_(0.0, 1.0 / math.sqrt(w.shape[-1]))
        self.out_norm.reset_parameters()

    @property
    def memory_size(self) -> int:
        """P = |W| per head."""
        return sum(o * n for o, n in self.shapes)

    # Pieces ----------------------------------------------------------------------------------------------
    def _conv(self, conv: nn.Conv1d, u: Tensor, tail: Tensor | None) -> tuple[Tensor, Tensor]:
        """Causal depthwise conv. u: (B,N,W) pre-conv, tail: (B,K−1,W) or None -> (B,N,W), new tail (B,K−1,W)."""
        kk = self.conv_kernel - 1
        if tail is None:
            tail = u.new_zeros(u.shape[0], kk, u.shape[2])
        padded = torch.cat([tail.to(u.dtype), u], dim=1)  # (B,K−1+N,W)
        out = F.conv1d(padded.transpose(1, 2), conv.weight.to(u.dtype), conv.bias.to(u.dtype), groups=u.shape[2])
        return out.transpose(1, 2), padded[:, padded.shape[1] - kk:]

    def _heads(self, u: Tensor) -> Tensor:
        """(B,N,H·D) -> (B,H,N,D)."""
        b, n, _ = u.shape
        return u.view(b, n, self.num_heads, self.head_dim).transpose(1, 2)

    def memory_inputs(self, x: Tensor, state: dict | None = None) -> MemoryInputs:
        """q, k, v, gates and new conv tails from x (B,N,hidden). Projections run in the ambient precision
        (autocast applies); everything after is in the compute dtype with autocast off."""
        cdt = _compute_dtype(x.dtype)
        tails = state["conv"] if state is not None else (None, None, None)
        raw = [proj(x) for proj in (self.q_proj, self.k_proj, self.v_proj)]
        with torch.autocast(device_type=x.device.type, enabled=False):
            feats, new_tails = [], []
            for u, conv, tail in zip(raw, (self.q_conv, self.k_conv, self.v_conv), tails):
                out, new_tail = self._conv(conv, u.to(cdt), tail)
                feats.append(self._heads(F.silu(out)))
                new_tails.append(new_tail)
            q = F.normalize(feats[0], dim=-1, eps=self.norm_eps)
            k = F.normalize(feats[1], dim=-1, eps=self.norm_eps)
            xc = x.to(cdt)
            logits = [F.linear(xc, p.weight.to(cdt), p.bias.to(cdt)).transpose(1, 2)  # (B,H,N)
                      for p in (self.lr_proj, self.momentum_proj, self.decay_proj)]
            theta = self.theta_max * torch.sigmoid(logits[0])
            log_eta = F.logsigmoid(logits[1])
            log_keep = F.logsigmoid(-logits[2])  # log(1 − σ(z)) = log σ(−z)
        return MemoryInputs(q, k, feats[2], theta, log_eta, log_keep, tuple(new_tails))

    def initial_state(self, batch_size: int, device: torch.device, dtype: torch.dtype) -> dict:
        """Fresh per-sequence state: M = M_0 (broadcast over the batch), S = 0, chunk_pos 0, zero conv tails."""
        m0 = join_weights([w.to(device=device, dtype=dtype) for w in self.memory_init])  # (H,P)
        m0 = m0.unsqueeze(0).expand(batch_size, -1, -1)  # (B,H,P)
        width = self.num_heads * self.head_dim
        tail = torch.zeros(batch_size, self.conv_kernel - 1, width, device=device, dtype=dtype)
        return {"memory_start": m0, "memory": m0, "momentum": torch.zeros_like(m0), "chunk_pos": 0,
                "conv": (tail, tail, tail)}

    def _readout(self, y: Tensor, dtype: torch.dtype) -> Tensor:
        """(B,H,N,D) -> RMSNorm over H·D with gain out_norm.weight, (B,N,H·D) in `dtype`."""
        b, h, n, d = y.shape
        flat = y.transpose(1, 2).reshape(b, n, h * d)
        r = F.rms_norm(flat, (h * d,), self.out_norm.weight.to(flat.dtype), self.norm_eps)
        return r.to(dtype)

    # Forward ---------------------------------------------------------------------------------------------
    def _run(self, x: Tensor, state: dict | None, use_cache: bool, reference: bool) -> tuple[Tensor, dict | None]:
        cdt = _compute_dtype(x.dtype)
        if x.shape[1] == 0:  # nothing to consume: empty read, state unchanged
            r = x.new_zeros(x.shape[0], 0, self.num_heads * self.head_dim)
            if not use_cache:
                return r, None
            return r, state if state is not None else self.initial_state(x.shape[0], x.device, cdt)
        inp = self.memory_inputs(x, state)
        with torch.autocast(device_type=x.device.type, enabled=False):
            st = state if state is not None else self.initial_state(x.shape[0], x.device, cdt)
            args = (st["memory_start"].to(cdt), st["memory"].to(cdt), st["momentum"].to(cdt), st["chunk_pos"],
                    self.chunk_size, self.shapes, self.surprise_clip)
            if reference:
                y, new = memory_reference(inp.q, inp.k, inp.v, inp.theta, inp.log_eta.exp(),
                                          -torch.expm1(inp.log_keep), *args)
            else:
                y, new = memory_scan(inp.q, inp.k, inp.v, inp.theta, inp.log_eta, inp.log_keep, *args,
                                     need_state=use_cache)
            r = self._readout(y, x.dtype)
        if not use_cache:
            return r, None
        new["conv"] = inp.conv
        return r, new

    def forward(self, x: Tensor, state: dict | None = None, use_cache: bool = False,
                token_mask: Tensor | None = None) -> tuple[Tensor, dict | None]:
        """x: (B,N,hidden), already normed -> r (B,N,H·D), and the new state when use_cache (else None).

        `state` (from a previous call with use_cache=True) continues the same sequences; None starts new ones.
        `token_mask` (B,N) bool, False at pad tokens: pads never update the memory or the conv tails, chunks count
        from each row's first real token, and pad positions read 0 (row by row, see `padding`).
        """
        if needs_rows(token_mask, state):
            run = lambda xb, sb, uc: self._run(xb, sb, uc, reference=False)  # noqa: E731
            return run_rows(run, x, token_mask, state, use_cache, self.num_heads * self.head_dim)
        return self._run(x, state, use_cache, reference=False)

    def reference_forward(self, x: Tensor, state: dict | None = None) -> tuple[Tensor, dict]:
        """Same as forward(use_cache=True) but through the token loop `memory_reference` (tests only; slow)."""
        return self._run(x, state, True, reference=True)


__all__ = [
    "NeuralMemory", "MemoryInputs", "SegmentCoefficients", "memory_scan", "memory_reference",
    "segment_coefficients", "loss_grad_factors", "memory_shapes", "split_weights", "join_weights", "mlp_apply",
]
