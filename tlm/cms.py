"""Continuum Memory System (CMS): the MLP replacement of a Hope-attention layer (design/model.md §4.4).

A CMS holds k gated-MLP *levels* that together have exactly the parameters of the plain MLP they replace:
level widths are ``split_level_widths(intermediate_size, shares, multiple_of)``, so the levels hold
``3·d·intermediate_size`` weights and the TLM taper (which sets ``intermediate_size`` per layer) carries over
unchanged. Tensor names are ``levels.{i}.{gate,up,down}_proj.weight`` (and ``norms.{i}.weight`` for chain).

Topologies (``topology``):

* ``"sum"`` ("independent"): ``y = Σ_ℓ MLP_ℓ(x)``. A SwiGLU output is a sum over hidden units, so a sum of
  static levels *is* a plain MLP whose units are partitioned into groups; this is the exact, parameter-neutral
  upcycling path (`ContinuumMemory.from_gated_mlp`).
* ``"chain"`` ("sequential", the paper's CMS, made residual so it trains from scratch and upcycles): a residual
  sub-stream that starts at the CMS input, ``u_0 = x``, ``u_ℓ = u_{ℓ−1} + MLP_ℓ(n_ℓ)`` with ``n_1 = x`` and
  ``n_ℓ = RMSNorm_{ℓ−1}(u_{ℓ−1})``, and ``y = u_k − x = Σ_ℓ MLP_ℓ(n_ℓ)``: each level reads the normalised input
  plus everything the earlier levels wrote, i.e. k pre-norm MLP sub-layers of width ω_ℓ·d_ff. The k−1 learned
  RMSNorm gains (``norms.{ℓ-1}.weight``, initialised to 1) are the only extra parameters: ``(k−1)·d`` per layer,
  not tapered. With zero ``down_proj`` on levels ≥ 2 the chain equals MLP_1 exactly.

  Why the sub-stream starts at x: normalising level 1's *output* (``h_{ℓ+1} = h_ℓ + MLP_{ℓ+1}(RMSNorm(h_ℓ))``), small
  early in training, amplified it and its gradient by 1/rms, and the model trained slowly.

Modes per level (``modes``):

* ``"static"``: an ordinary trained MLP.
* ``"slow(m)"``: a static MLP in the forward pass whose parameters the outer optimiser steps only every m
  optimiser steps, on the gradients accumulated since its last step (`tlm.slow.SlowLevels`, one call in the
  training loop before ``optimizer.step()``); the levels whose chunk exceeds the context in Nested Learning.
* ``"online"``: per-sample *fast weights* (batch axis: samples never share them) that start every sequence at
  the level's trained parameters and are updated in context every ``chunk_size`` tokens. Chunk boundaries are
  absolute positions (multiples of ``chunk_size`` counted from position 0 of the sequence). Tokens of a chunk
  are read with the weights from *before* the chunk, and a chunk's update is applied only once its last token
  has arrived, so outputs never depend on later tokens.

Update rule — ``local`` (a labelled deviation: design §4.4 names the paper-faithful ``teach`` rule, which
needs the LM-loss gradient at the CMS output and a per-chunk forward/backward; ``teach`` is not implemented, see
the README). ``local`` is the Titans-style associative rule with learned projections: after each complete chunk
c, with ``k_t = x_t W_k`` and ``v_t = x_t W_v`` (``local_proj.{j}.{k,v}_proj``, one pair per online level j,
present only when ``inner_lr > 0``: 2·d² parameters each)::

    θ ← θ − clip( η · Σ_{t∈c} ∇_θ ½‖MLP_θ(k_t) − v_t‖² )

The gradient is computed in closed form (`_grad_factors`), batched over the batch axis, in fp32 (autocast
is disabled inside online levels; fp64 inputs stay fp64). It is kept as rank-n factors: the clip norm comes
from n×n Gram matrices and each step is one fused ``baddbmm`` per matrix, so no full gradient is formed. It is
made of ordinary differentiable tensor ops, so outer training backpropagates through every fast-weight
update with plain autograd (second order, no stop-gradient). ``η = inner_lr`` is a fixed float (no learnable
or data-dependent η, so no extra parameters). ``clip``: the per-sample update of a level (gate, up and down
together) is rescaled to Frobenius norm at most ``update_clip`` (default 1.0; ``None`` disables), so online
updates cannot explode however large the reconstruction error is. At ``inner_lr == 0`` an online level is
computed exactly as a static one (same ops, bit-identical) while its state is still tracked.

Cost: an online level runs sequentially over N/C chunks; per chunk it reads (3 matmuls), projects k and v (2),
runs the memory on k (3), forms dh (1) and steps the weights (3 rank-C updates), about 4x a static level's
forward FLOPs, and autograd keeps one set
of per-sample fast weights (B·3·d·w floats) per chunk for the backward.

Cache (``use_cache=True``) — the returned ``state`` is a dict::

    {"fast":   tuple over online levels (in level order) of (gate (B, w, d), up (B, w, d), down (B, d, w)), fp32,
     "buffer": None when pos % chunk_size == 0, else a tuple over online levels of that level's inputs of the
               current partial chunk (B, pos % chunk_size, d), fp32,
     "pos":    int, tokens consumed so far}

The buffer is per online level (not one tensor) because in chain topology each level sees a different input.
Calling forward on ``x[:, :n]`` then on ``x[:, n:]`` with the returned state equals one call on ``x`` (any split,
token-by-token decode included). The final partial chunk stays in the buffer and is applied once it completes;
without ``use_cache`` it is simply dropped (it could only affect later tokens).

Only torch, the standard library and relative imports are used: the file ships next to checkpoints as
transformers remote code.
"""

from __future__ import annotations

import logging
import math
import re
from typing import Callable, Sequence

import torch
from torch import nn

from .mlp import GatedMLP, get_activation
from .padding import needs_rows, run_rows

logger = logging.getLogger(__name__)

Tensor = torch.Tensor
FastWeights = tuple  # (gate (B, w, d), up (B, w, d), down (B, d, w))

MODES = ("static", "online", "slow(m)")
TOPOLOGIES = ("sum", "chain")
_SHARE_TOL = 1e-6
_FLOOR_EPS = 1e-9  # guards floor() against 1/3·39 = 12.999999999999998


# --------------------------------------------------------------------------------------------------------------
# modes and widths


def parse_mode(mode: str) -> tuple[str, int | None]:
    """A level mode -> (kind, m): "static" -> ("static", None), "online" -> ("online", None), "slow(4)" -> ("slow", 4)."""
    if mode in ("static", "online"):
        return mode, None
    match = re.fullmatch(r"slow\((\d+)\)", str(mode).replace(" ", ""))
    if match and int(match.group(1)) >= 1:
        return "slow", int(match.group(1))
    raise ValueError(f"mode {mode!r} is invalid; allowed: 'static', 'online', 'slow(m)' with an integer m >= 1")



def split_level_widths(total: int, shares: Sequence[float], multiple_of: int = 1) -> list[int]:
    """Split a layer's MLP width ``total`` over k levels with shares ``ω`` (Σω = 1).

    Levels 1…k−1 get ``floor(ω_ℓ·total / q)·q`` (q = ``multiple_of``); the last level takes the remainder, so the
    widths sum to ``total`` exactly. Raises ValueError when an argument is invalid or a level would be empty.
    """
    if not isinstance(total, int) or total < 1:
        raise ValueError(f"total = {total!r} is invalid; allowed: an integer >= 1")
    if not isinstance(multiple_of, int) or multiple_of < 1:
        raise ValueError(f"multiple_of = {multiple_of!r} is invalid; allowed: an integer >= 1")
    shares = [float(s) for s in shares]
    if not shares:
        raise ValueError("shares = [] is invalid; allowed: one positive share per level, summing to 1")
    for i, s in enumerate(shares):
        if not s > 0 or not math.isfinite(s):
            raise ValueError(f"shares[{i}] = {s!r} is invalid; allowed: finite values > 0")
    if abs(sum(shares) - 1.0) > _SHARE_TOL:
        raise ValueError(f"shares = {shares!r} sum to {sum(shares)!r}; allowed: shares summing to 1 (tol {_SHARE_TOL})")
    q = multiple_of
    widths = [math.floor(s * total / q + _FLOOR_EPS) * q for s in shares[:-1]]
    widths.append(total - sum(widths))
    for i, w in enumerate(widths):
        if w < 1:
            raise ValueError(
                f"level {i} of shares = {shares!r} gets width {w} from total = {total}, multiple_of = {q}; "
                f"allowed: every level >= 1 (levels 1..k-1 need share·total >= multiple_of)"
            )
    return widths


def cms_num_params(hidden_size: int, intermediate_size: int, num_levels: int, topology: str = "sum",
                   local_projections: int = 0) -> int:
    """Parameters of a ContinuumMemory: ``3·d·intermediate_size``, ``(k−1)·d`` norm gains for chain, and ``2·d²``
    per online level with the local rule's projections (present only when inner_lr > 0)."""
    extra = (num_levels - 1) * hidden_size if topology == "chain" else 0
    return 3 * hidden_size * intermediate_size + extra + 2 * hidden_size * hidden_size * local_projections


# --------------------------------------------------------------------------------------------------------------
# activation derivatives (closed form, differentiable; needed by the closed-form inner gradient)

_SQRT_2 = math.sqrt(2.0)
_INV_SQRT_2PI = 1.0 / math.sqrt(2.0 * math.pi)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _silu_grad(a: Tensor) -> Tensor:
    s = torch.sigmoid(a)
    return s * (1.0 + a * (1.0 - s))


def _gelu_grad(a: Tensor) -> Tensor:
    return 0.5 * (1.0 + torch.erf(a / _SQRT_2)) + a * torch.exp(-0.5 * a * a) * _INV_SQRT_2PI


def _gelu_tanh_grad(a: Tensor) -> Tensor:
    t = torch.tanh(_SQRT_2_OVER_PI * (a + 0.044715 * a.pow(3)))
    return 0.5 * (1.0 + t) + 0.5 * a * (1.0 - t * t) * _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * a * a)


def _relu_grad(a: Tensor) -> Tensor:
    return (a > 0).to(a.dtype)


_ACT_GRADS: dict[str, Callable[[Tensor], Tensor]] = {
    "silu": _silu_grad,
    "swish": _silu_grad,
    "gelu": _gelu_grad,
    "gelu_pytorch_tanh": _gelu_tanh_grad,
    "gelu_new": _gelu_tanh_grad,
    "gelu_fast": _gelu_tanh_grad,
    "relu": _relu_grad,
}


def _autograd_derivative(fn: Callable[[Tensor], Tensor]) -> Callable[[Tensor], Tensor]:
    """Elementwise derivative of an elementwise `fn` by torch.func (works under no_grad and composes with autograd)."""
    grad_of_sum = torch.func.grad(lambda z: fn(z).sum())
    return grad_of_sum


def activation_derivative(name: str) -> Callable[[Tensor], Tensor]:
    """act'(a) for the activation called `name`: closed form when known, else torch.func."""
    if name in _ACT_GRADS:
        return _ACT_GRADS[name]
    return _autograd_derivative(get_activation(name))


# --------------------------------------------------------------------------------------------------------------
# fast-weight kernels (all batched over B, fp32)


def _fast_forward(x: Tensor, fast: FastWeights, act: Callable) -> tuple[Tensor, tuple[Tensor, Tensor, Tensor, Tensor]]:
    """MLP with per-sample weights. x: (B, n, d) -> y: (B, n, d), plus intermediates (a, b, s, h), each (B, n, w)."""
    gate, up, down = fast  # (B, w, d), (B, w, d), (B, d, w)
    a = torch.matmul(x, gate.transpose(1, 2))  # (B, n, w) pre-activation
    b = torch.matmul(x, up.transpose(1, 2))  # (B, n, w)
    s = act(a)  # (B, n, w)
    h = s * b  # (B, n, w)
    y = torch.matmul(h, down.transpose(1, 2))  # (B, n, d)
    return y, (a, b, s, h)


def _grad_factors(
    k: Tensor, err: Tensor, inter: tuple[Tensor, Tensor, Tensor, Tensor], down: Tensor, act_grad: Callable
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor], tuple[Tensor, Tensor]]:
    """Closed-form ∇_θ Σ_t ⟨MLP_θ(k_t), err_t⟩ per sample (err held fixed), as rank-n factor pairs (P, Q), ∇ = Pᵀ Q.

    With err_t = MLP_θ(k_t) − v_t this is ∇_θ Σ_t ½‖MLP_θ(k_t) − v_t‖² (the local rule).
    k, err: (B, n, d); inter: (a, b, s, h) of MLP_θ(k), each (B, n, w); down: (B, d, w).
    ∇gate = (dh ⊙ b ⊙ act'(a))ᵀ k, ∇up = (dh ⊙ s)ᵀ k, ∇down = errᵀ h, where dh = err · down.
    Returns ((P_gate (B, n, w), k), (P_up (B, n, w), k), (err (B, n, d), h (B, n, w))). The full (B, w, d)
    gradients are never formed: the norm is taken from n×n Gram matrices and the step is one baddbmm.
    """
    a, b, s, h = inter
    dh = torch.matmul(err, down)  # (B, n, w)
    return (dh * b * act_grad(a), k), (dh * s, k), (err, h)


def _outer_sq_norm(p: Tensor, q: Tensor) -> Tensor:
    """‖pᵀ q‖_F² per sample from Grams: Σ_ij (p pᵀ)_ij (q qᵀ)_ij. p: (B, n, w), q: (B, n, d) -> (B,)."""
    gram_p = torch.matmul(p, p.transpose(1, 2))  # (B, n, n)
    gram_q = torch.matmul(q, q.transpose(1, 2))  # (B, n, n)
    return (gram_p * gram_q).sum(dim=(1, 2)).clamp_min(0.0)


def _step_coefficient(factors, lr: float, clip: float | None) -> Tensor | float:
    """Per-sample step size: lr, times clip/‖lr·∇‖ where the joint norm (gate, up, down) exceeds `clip`.

    Returns a float (no clip) or (B,) tensor. The unclipped branch is exactly lr; the clamp inside rsqrt keeps
    the backward finite when the gradient is 0.
    """
    if clip is None:
        return lr
    sq = lr * lr * sum(_outer_sq_norm(p, q) for p, q in factors)  # (B,) ‖lr·∇‖²
    limit = clip * clip
    scale = torch.where(sq > limit, clip * torch.rsqrt(sq.clamp_min(limit)), torch.ones_like(sq))  # (B,)
    return lr * scale


def _apply_step(fast: FastWeights, factors, coef: Tensor | float) -> FastWeights:
    """θ ← θ − coef · Pᵀ Q for each of (gate, up, down), one fused baddbmm per matrix."""
    out = []
    for w, (p, q) in zip(fast, factors):
        p = p * (coef if isinstance(coef, float) else coef[:, None, None])  # (B, n, ·), scaled factor is small
        out.append(torch.baddbmm(w, p.transpose(1, 2), q, alpha=-1.0))  # (B, rows, cols)
    return tuple(out)


def _segment_sizes(T: int, m: int, chunk_size: int) -> list[int]:
    """Lengths that cut T tokens at absolute chunk boundaries, given m tokens already in the current chunk."""
    sizes, left = [], T
    first = chunk_size - m
    while left > 0:
        n = min(left, first)
        sizes.append(n)
        left -= n
        first = chunk_size
    return sizes


def online_level_forward(
    x: Tensor,
    fast: FastWeights,
    buffer: Tensor | None,
    chunk_size: int,
    lr: float,
    clip: float | None,
    act: Callable,
    act_grad: Callable,
    proj: tuple[Tensor, Tensor] | None = None,
) -> tuple[Tensor, FastWeights, Tensor | None]:
    """Run one online level over x, chunk by chunk (local rule).

    x: (B, T, d) fp32, the level's input for the next T tokens; fast: the current fast weights (weights from
    before the current chunk); buffer: (B, m, d) inputs of the current partial chunk already consumed
    (m = pos % chunk_size) or None; proj: the local rule's (W_k, W_v), each (d, d), needed when lr > 0.
    Returns y (B, T, d), the new fast weights and the new buffer. Every segment is read with the pre-chunk
    weights; a chunk's update, from k = chunk W_kᵀ and v = chunk W_vᵀ, is applied once the chunk completes.
    """
    if lr > 0 and proj is None:
        raise ValueError("proj = None is invalid with lr > 0; allowed: the local rule's (W_k, W_v)")
    B, T, d = x.shape
    m = 0 if buffer is None else buffer.shape[1]
    outs = []
    for seg in x.split(_segment_sizes(T, m, chunk_size), dim=1):  # split: its backward is one cat, not N²
        n = seg.shape[1]
        outs.append(_fast_forward(seg, fast, act)[0])  # (B, n, d), read with the pre-chunk weights
        chunk = seg if buffer is None else torch.cat([buffer, seg], dim=1)  # (B, m + n, d)
        if m + n == chunk_size:
            if lr > 0:
                k, v = torch.matmul(chunk, proj[0].t()), torch.matmul(chunk, proj[1].t())  # (B, C, d)
                yk, inter = _fast_forward(k, fast, act)
                factors = _grad_factors(k, yk - v, inter, fast[2], act_grad)
                fast = _apply_step(fast, factors, _step_coefficient(factors, lr, clip))
            buffer, m = None, 0
        else:
            buffer, m = chunk, m + n
    y = torch.cat(outs, dim=1) if outs else x.new_zeros(B, 0, d)
    return y, fast, buffer


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Online levels run in fp32 (fp64 stays fp64, e.g. for gradient checks)."""
    return torch.promote_types(dtype, torch.float32)


def _roll_buffer(buffer: Tensor | None, x: Tensor, pos: int, chunk_size: int) -> Tensor | None:
    """Partial-chunk buffer after consuming x (B, T, d) at position pos, without running any update."""
    new_m = (pos + x.shape[1]) % chunk_size
    if new_m == 0:
        return None
    full = x if buffer is None else torch.cat([buffer, x], dim=1)
    return full[:, -new_m:]


# --------------------------------------------------------------------------------------------------------------
# module


class _KeyValue(nn.Module):
    """The local rule's projections k = x W_kᵀ, v = x W_vᵀ (no biases)."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.k_proj = nn.Linear(hidden_size, hidden_size, bias=False)
        self.v_proj = nn.Linear(hidden_size, hidden_size, bias=False)


class _RMSNorm(nn.Module):
    """Llama-style RMSNorm with a learned gain (initialised to 1); x: (..., d) -> (..., d), computed in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _check_config(shares, modes, topology, chunk_size, inner_lr, update_clip) -> None:
    if len(modes) != len(shares):
        raise ValueError(
            f"modes = {tuple(modes)!r} has {len(modes)} entries but shares = {tuple(shares)!r} has {len(shares)}; "
            f"allowed: one mode per level"
        )
    for i, m in enumerate(modes):
        try:
            parse_mode(m)
        except ValueError:
            raise ValueError(f"modes[{i}] = {m!r} is invalid; allowed: {', '.join(map(repr, MODES))}") from None
    if topology not in TOPOLOGIES:
        raise ValueError(f"topology = {topology!r} is invalid; allowed: {', '.join(map(repr, TOPOLOGIES))}")
    if not isinstance(chunk_size, int) or isinstance(chunk_size, bool) or chunk_size < 1:
        raise ValueError(f"chunk_size = {chunk_size!r} is invalid; allowed: an integer >= 1")
    if not (isinstance(inner_lr, (int, float)) and math.isfinite(inner_lr) and inner_lr >= 0):
        raise ValueError(f"inner_lr = {inner_lr!r} is invalid; allowed: a finite float >= 0")
    if update_clip is not None and not (isinstance(update_clip, (int, float)) and update_clip > 0):
        raise ValueError(f"update_clip = {update_clip!r} is invalid; allowed: a float > 0 or None")


class ContinuumMemory(nn.Module):
    """k gated-MLP levels replacing a block MLP; x: (B, N, hidden) (already normed) -> (B, N, hidden).

    See the module docstring for topology, modes, the ``local`` online update and the cache format.
    """

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        shares: Sequence[float] = (1 / 3, 1 / 3, 1 / 3),
        modes: Sequence[str] = ("online", "static", "static"),
        topology: str = "sum",
        chunk_size: int = 16,
        inner_lr: float = 0.0,
        hidden_act: str = "silu",
        multiple_of: int = 1,
        norm_eps: float = 1e-6,
        update_clip: float | None = 1.0,
    ):
        super().__init__()
        if not isinstance(hidden_size, int) or hidden_size < 1:
            raise ValueError(f"hidden_size = {hidden_size!r} is invalid; allowed: an integer >= 1")
        shares, modes = tuple(float(s) for s in shares), tuple(modes)
        _check_config(shares, modes, topology, chunk_size, inner_lr, update_clip)
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.widths = split_level_widths(intermediate_size, shares, multiple_of)
        self.shares, self.modes, self.topology = shares, modes, topology
        self.chunk_size, self.inner_lr = chunk_size, float(inner_lr)
        self.update_clip = None if update_clip is None else float(update_clip)
        self.hidden_act = hidden_act
        self.act_fn = get_activation(hidden_act)
        self.act_grad = activation_derivative(hidden_act)
        self.levels = nn.ModuleList(GatedMLP(hidden_size, w, hidden_act, bias=False) for w in self.widths)
        n_norms = len(self.widths) - 1 if topology == "chain" else 0
        self.norms = nn.ModuleList(_RMSNorm(hidden_size, norm_eps) for _ in range(n_norms))
        kinds = [parse_mode(m) for m in modes]
        self.online_levels = tuple(i for i, (kind, _) in enumerate(kinds) if kind == "online")
        self.slow_every = {i: every for i, (kind, every) in enumerate(kinds) if kind == "slow"}  # level -> m
        if self.inner_lr > 0:  # the local rule's key/value projections, one pair per online level
            self.local_proj = nn.ModuleList(_KeyValue(hidden_size) for _ in self.online_levels)
        logger.debug(
            "ContinuumMemory d=%d widths=%s modes=%s topology=%s C=%d eta=%g",
            hidden_size, self.widths, modes, topology, chunk_size, self.inner_lr,
        )

    # -- upcycling -------------------------------------------------------------------------------------------

    @classmethod
    def from_gated_mlp(
        cls, mlp: GatedMLP, unit_order: Sequence[int] | Tensor | None = None, **kwargs
    ) -> "ContinuumMemory":
        """Sum-topology CMS that reproduces `mlp` exactly (design §4.4 upcycling): its hidden units, taken in
        `unit_order` (a permutation; default 0..w−1), are split into consecutive groups, level 1 first, with the
        widths of `split_level_widths`. `kwargs` go to the constructor (topology must be "sum")."""
        if kwargs.setdefault("topology", "sum") != "sum":
            raise ValueError(f"topology = {kwargs['topology']!r} is invalid for from_gated_mlp; allowed: 'sum'")
        if mlp.gate_proj.bias is not None:
            raise ValueError("mlp has biases; allowed: a bias-free GatedMLP")
        d, w = mlp.gate_proj.in_features, mlp.intermediate_size
        order = torch.arange(w) if unit_order is None else torch.as_tensor(unit_order, dtype=torch.long)
        if order.shape != (w,) or not torch.equal(order.sort().values, torch.arange(w)):
            raise ValueError(f"unit_order is invalid; allowed: a permutation of range({w})")
        cms = cls(d, w, **kwargs).to(device=mlp.gate_proj.weight.device, dtype=mlp.gate_proj.weight.dtype)
        start = 0
        with torch.no_grad():
            for level, width in zip(cms.levels, cms.widths):
                idx = order[start : start + width].to(mlp.gate_proj.weight.device)
                level.gate_proj.weight.copy_(mlp.gate_proj.weight[idx])
                level.up_proj.weight.copy_(mlp.up_proj.weight[idx])
                level.down_proj.weight.copy_(mlp.down_proj.weight[:, idx])
                start += width
        return cms

    # -- state ---------------------------------------------------------------------------------------------

    def initial_fast_weights(self, batch_size: int, dtype: torch.dtype = torch.float32) -> tuple[FastWeights, ...]:
        """Fast weights at the start of a sequence: each online level's parameters in `dtype`, expanded to (B, ...)."""
        out = []
        for i in self.online_levels:
            lvl = self.levels[i]
            out.append(tuple(
                p.to(dtype).unsqueeze(0).expand(batch_size, -1, -1)
                for p in (lvl.gate_proj.weight, lvl.up_proj.weight, lvl.down_proj.weight)
            ))
        return tuple(out)

    def _unpack_state(self, state: dict | None, batch_size: int, dtype: torch.dtype):
        """(pos, fast per online level, buffer per online level or None) from `state`, validated."""
        if state is None:
            return 0, self.initial_fast_weights(batch_size, _compute_dtype(dtype)), None
        pos, fast, buffer = int(state["pos"]), tuple(state["fast"]), state["buffer"]
        if len(fast) != len(self.online_levels):
            raise ValueError(
                f"state['fast'] has {len(fast)} entries; allowed: {len(self.online_levels)} (one per online level)"
            )
        for f in fast:
            if f[0].shape[0] != batch_size:
                raise ValueError(f"state['fast'] batch size = {f[0].shape[0]}; allowed: {batch_size} (batch of x)")
        m = pos % self.chunk_size
        if (buffer is None) != (m == 0 or not self.online_levels):
            raise ValueError(f"state['buffer'] = {'None' if buffer is None else 'tensors'} at pos = {pos}; "
                             f"allowed: None exactly when pos % chunk_size == 0 (chunk_size = {self.chunk_size})")
        if buffer is not None:
            buffer = tuple(buffer)
            if len(buffer) != len(self.online_levels) or any(b.shape[:2] != (batch_size, m) for b in buffer):
                raise ValueError(f"state['buffer'] shapes {[tuple(b.shape) for b in buffer]}; allowed: one "
                                 f"({batch_size}, {m}, {self.hidden_size}) tensor per online level")
        return pos, fast, buffer

    # -- forward -------------------------------------------------------------------------------------------

    def slow_parameters(self) -> list[tuple[nn.Parameter, int]]:
        """(parameter, m) for every parameter of a level in slow(m) mode."""
        return [(p, m) for i, m in self.slow_every.items() for p in self.levels[i].parameters()]

    def _online(self, i: int, j: int, x: Tensor, fast: FastWeights, buffer: Tensor | None, pos: int):
        """Online level i (j-th online level) on x (B, T, d) -> (y (B, T, d) in x.dtype, new fast weights, new
        buffer (>= fp32))."""
        xc = x.to(_compute_dtype(x.dtype))
        if self.inner_lr == 0.0:  # no update can ever happen: compute exactly as a static level
            return self.levels[i](x), fast, _roll_buffer(buffer, xc, pos, self.chunk_size)
        kv = self.local_proj[j]
        proj = (kv.k_proj.weight.to(xc.dtype), kv.v_proj.weight.to(xc.dtype))
        with torch.autocast(device_type=x.device.type, enabled=False):  # fast weights stay fp32
            y, fast, buffer = online_level_forward(
                xc, fast, buffer, self.chunk_size, self.inner_lr, self.update_clip, self.act_fn, self.act_grad, proj
            )
        return y.to(x.dtype), fast, buffer

    def forward(self, x: Tensor, state: dict | None = None, use_cache: bool = False,
                token_mask: Tensor | None = None) -> tuple[Tensor, dict | None]:
        """x: (B, N, hidden) already normed by the block -> (y (B, N, hidden), new state if use_cache else None).

        token_mask: None or (B, N) bool, False at pad tokens. With a live online level (inner_lr > 0) pads never
        enter the fast weights or the chunk buffer, chunks count from each row's first real token, and pad
        positions output 0 (row by row, see `padding`); without one, every token is independent and the mask is
        not needed.
        """
        if x.dim() != 3 or x.shape[-1] != self.hidden_size:
            raise ValueError(f"x shape = {tuple(x.shape)} is invalid; allowed: (B, N, {self.hidden_size})")
        if self.online_levels and self.inner_lr > 0 and needs_rows(token_mask, state):
            return run_rows(self._forward, x, token_mask, state, use_cache, self.hidden_size)
        return self._forward(x, state, use_cache)

    def _forward(self, x: Tensor, state: dict | None, use_cache: bool) -> tuple[Tensor, dict | None]:
        B, T, _ = x.shape
        pos, fast_in, buf_in = self._unpack_state(state, B, x.dtype)
        fast_out, buf_out = [], []
        acc = None  # Σ_ℓ MLP_ℓ(n_ℓ) — (B, T, d)
        stream = x  # chain: u_ℓ = x + Σ_{ℓ' ≤ ℓ} MLP_ℓ'(n_ℓ')
        j = 0  # index among online levels
        for i, level in enumerate(self.levels):
            inp = x if (self.topology == "sum" or i == 0) else self.norms[i - 1](stream)  # (B, T, d)
            if i in self.online_levels:
                out, f, b = self._online(i, j, inp, fast_in[j], None if buf_in is None else buf_in[j], pos)
                fast_out.append(f)
                buf_out.append(b)
                j += 1
            else:
                out = level(inp)  # (B, T, d)
            acc = out if acc is None else acc + out
            if self.topology == "chain" and i + 1 < len(self.levels):
                stream = stream + out
        if not use_cache:
            return acc, None
        new_pos = pos + T
        buffer = None if (new_pos % self.chunk_size == 0 or not buf_out) else tuple(buf_out)
        return acc, {"fast": tuple(fast_out), "buffer": buffer, "pos": new_pos}

    def extra_repr(self) -> str:
        return (f"widths={self.widths}, modes={self.modes}, topology={self.topology!r}, "
                f"chunk_size={self.chunk_size}, inner_lr={self.inner_lr}, update_clip={self.update_clip}")


__all__ = [
    "ContinuumMemory",
    "parse_mode",
    "split_level_widths",
    "cms_num_params",
    "activation_derivative",
    "online_level_forward",
    "MODES",
    "TOPOLOGIES",
]
