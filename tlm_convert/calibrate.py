"""Sequential, layer-by-layer calibration and resizing of a TLM.

The calibration tokens flow through the model one layer at a time, and every layer is converted before the
next one sees its input ("sequential" calibration, as SparseGPT processes layers): layer l's statistics are
taken on the output of the already-converted layers 0..l-1, so each refit absorbs the error upstream of it.

Per layer l:  z = mix(h) for every batch  ->  MLP forward with an activation hook (importance statistics, and
the Gram matrix for a shrinking layer)  ->  plan (keep the top-scored neurons or grow)  ->  resize the layer's
MLP in place (least-squares refit of the down projection when shrinking)  ->  h = feed_forward(z) with the
new MLP. The cost is one forward pass over the calibration tokens, plus a second MLP pass for resized layers.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .compensate import obs_prune, refit_down_proj
from .importance import activation_stats, neuron_scores
from .surgery import LayerPlan, plan_from_scores, resize_layer

logger = logging.getLogger(__name__)


@dataclass
class CalibrationResult:
    plans: list[LayerPlan]
    scores: list[torch.Tensor]  # per layer, source neurons
    tokens: int
    hidden: list[torch.Tensor]  # the converted model's last-layer output per batch (before the final norm)


@torch.no_grad()
def calibrate_and_plan(model, blocks: torch.Tensor, widths: list[int], importance: str = "activation",
                       grow_init: str = "noise", refit: bool = True, batch_size: int = 8, seed: int = 0,
                       noise_scale: float = 1e-2, damp: float = 0.01, refit_target: str = "local",
                       progress=None, timer=None) -> CalibrationResult:
    """Convert ``model`` (a TLMForCausalLM with plain MLPs) in place to ``widths``; return the plans.

    blocks: (n, S) token ids. ``progress(layer_idx)`` is called after each layer; ``timer(phase)`` is a context
    manager that accounts seconds to "calibrate" (forward passes with hooks), "rank" (scores, plan, refit) and
    "resize" (new weights and the second MLP pass).

    ``refit_target``: "local" fits each pruned MLP to its own full-width output on the converted stream;
    "residual" fits it to the MLP output that restores the *source* model's residual stream after the layer,
    h_src(l+1) − z_conv(l), so every pruned layer also cancels the error accumulated upstream. "residual" runs the
    source model alongside (one more forward pass) and does not apply to sandwich-norm (Gemma 3) blocks.
    """
    timer = timer or _no_timer
    residual = refit and refit_target == "residual" and not model.config.sandwich_norm
    base = model.model
    cfg = model.config
    device = next(model.parameters()).device
    batches = [blocks[i : i + batch_size].to(device) for i in range(0, len(blocks), batch_size)]
    positions = [torch.arange(b.shape[1], device=device).expand(b.shape[0], -1) for b in batches]
    hidden = [base.embed(base.embed_tokens(b), p) for b, p in zip(batches, positions)]
    source_hidden = list(hidden) if residual else None  # the source model's residual stream
    plans, scores = [], []
    for i, layer in enumerate(base.layers):
        width, source_width = widths[i], layer.mlp.down_proj.in_features
        shrinking = width < source_width
        with timer("calibrate"):
            mixed = [_mix(base, layer, h, p) for h, p in zip(hidden, positions)]
            with activation_stats(layer.mlp.down_proj, gram=shrinking and (refit or importance == "obs"),
                                  keep=width != source_width) as stats:
                hidden = [layer.feed_forward(z) for z in mixed]
            if residual:  # the source layer's output (outside the hook: these are not calibration statistics)
                source_hidden = [layer.feed_forward(_mix(base, layer, h, p)) for h, p in zip(source_hidden, positions)]
                cross = _residual_cross(layer, mixed, stats.kept, source_hidden) if shrinking else None
        with timer("rank"):
            weights = {n: getattr(layer.mlp, n).weight for n in ("gate_proj", "up_proj", "down_proj")
                       if hasattr(layer.mlp, n)}
            score = neuron_scores(importance, stats, weights, seed=seed + i)
            if shrinking and importance == "obs":
                keep, down = obs_prune(stats.gram, weights["down_proj"], width, damp=damp)
                plan = LayerPlan(keep=keep, down_override=down)
            else:
                plan = plan_from_scores([score], [width])[0]
                if shrinking and refit:
                    plan.down_override = refit_down_proj(stats.gram, weights["down_proj"], plan.keep, damp=damp,
                                                         cross=cross if residual else None)
        if width != source_width:
            with timer("resize"):
                _resize_in_place(layer, i, plan, cfg, grow_init, noise_scale, seed)
                hidden = [_feed_forward_reusing(layer, z, a, plan) for z, a in zip(mixed, stats.kept)]
            stats.kept.clear()
        plans.append(plan)
        scores.append(score.float())
        if progress is not None:
            progress(i)
    return CalibrationResult(plans=plans, scores=scores, tokens=int(blocks.numel()), hidden=hidden)


def _residual_cross(layer, mixed, acts, source_hidden) -> torch.Tensor:
    """Σ aᵀ (h_src − z − b): (I, d) fp64 — the right-hand side of the residual-target least squares."""
    bias = layer.mlp.down_proj.bias
    cross = 0
    for z, a, h in zip(mixed, acts, source_hidden):
        target = (h - z) if bias is None else (h - z - bias)  # (B, S, d)
        cross = cross + (a.flatten(0, 1).T.float() @ target.flatten(0, 1).float()).double()
    return cross


def _feed_forward_reusing(layer, z, a, plan):
    """feed_forward(z) after resizing, reusing the first pass's activations a (B, S, I_source): kept neurons are
    sliced from a, only new neurons are computed. Equals ``layer.feed_forward(z)`` with the new weights."""
    mlp = layer.mlp
    a = a[..., plan.keep]
    if plan.grow:
        x = layer.post_attention_layernorm(z)
        new = slice(len(plan.keep), plan.width)
        up = F.linear(x, mlp.up_proj.weight[new], None if mlp.up_proj.bias is None else mlp.up_proj.bias[new])
        if hasattr(mlp, "gate_proj"):
            gate = mlp.gate_proj
            extra = mlp.act_fn(F.linear(x, gate.weight[new], None if gate.bias is None else gate.bias[new])) * up
        else:
            extra = mlp.act_fn(up)
        a = torch.cat([a, extra], dim=-1)
    y = mlp.down_proj(a)
    if layer.sandwich:
        y = layer.post_feedforward_layernorm(y)
    return z + y


def _mix(base, layer, h, positions):
    rope, masks = base.block_context(h, positions)
    return layer.mix(h, rope.get(layer.layer_type), masks[layer.layer_type], None)


@contextmanager
def _no_timer(_phase):
    yield


def _resize_in_place(layer, idx, plan, cfg, grow_init, noise_scale, seed) -> None:
    prefix = f"model.layers.{idx}.mlp."
    sd = {prefix + k: v for k, v in layer.mlp.state_dict().items()}
    new = resize_layer(sd, idx, plan, grow_init, noise_scale, seed, cfg.mlp_gated)
    mlp = layer.mlp
    for name, module in mlp.named_children():
        if not isinstance(module, nn.Linear):
            continue
        weight = new[prefix + name + ".weight"]
        bias = new.get(prefix + name + ".bias", module.bias)  # down_proj's bias is per output, never resized
        linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device,
                           dtype=weight.dtype)
        linear.weight.copy_(weight)
        if bias is not None:
            linear.bias.copy_(bias)
        setattr(mlp, name, linear)
    mlp.intermediate_size = plan.width


__all__ = ["calibrate_and_plan", "CalibrationResult"]
