"""Sequential, layer-by-layer calibration and resizing of a TLM.

The calibration tokens flow through the model one layer at a time, and every layer is converted before the
next one sees its input ("sequential" calibration, as SparseGPT processes layers): layer l's statistics are
taken on the output of the already-converted layers 0..l-1, so each refit absorbs the error upstream of it.

Per layer l, after z = mix(h) for every batch:

* a growing layer (``noise`` / ``zero`` growth, whose plan needs no statistics) is resized first and run once,
  its activation hook recording the source neurons' statistics (the importance profile);
* a shrinking layer runs its MLP only up to the down projection (the hook records the activations and stops the
  forward), keeps its top-scored neurons, refits the down projection by least squares on the kept neurons'
  activations (their Gram matrix only: |K|² instead of I²), and forms h = z + D′ a_K from the recorded
  activations;
* a layer that keeps its width (or grows by ``split``, which copies the top-scored neurons) runs its MLP with
  the hook, then is resized and run again.

The cost is one forward pass over the calibration tokens plus the refit's products, and with
``refit_target="residual"`` the source model's layers from the first shrinking layer on.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F

from .compensate import DAMP, obs_prune, refit_kept
from .importance import StopForward, activation_stats, neuron_scores
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
                       noise_scale: float = 1e-2, damp: float = DAMP, refit_target: str = "local",
                       progress=None, timer=None) -> CalibrationResult:
    """Convert ``model`` (a TLMForCausalLM with plain MLPs) in place to ``widths``; return the plans.

    blocks: (n, S) token ids. ``progress(layer_idx)`` is called after each layer; ``timer(phase)`` is a context
    manager that accounts seconds to "calibrate" (forward passes with hooks, the refit's Gram matrices), "rank"
    (scores, plan, the refit's solve) and "resize" (new weights and the MLP passes that use them).

    ``refit_target``: "local" fits each pruned MLP to its own full-width output on the converted stream;
    "residual" fits it to the MLP output that restores the residual stream the *source* layers would produce,
    h_src(l+1) − z_conv(l), so every pruned layer also cancels the error accumulated upstream. The source stream
    starts from the converted one at the first shrinking layer (the layers before it only grow, which changes
    their output by the growth noise alone) and costs one more forward pass through the shrinking layers; it
    does not apply to sandwich-norm (Gemma 3) blocks.
    """
    timer = timer or _no_timer
    residual = refit and refit_target == "residual" and not model.config.sandwich_norm
    base = model.model
    device = next(model.parameters()).device
    batches = [blocks[i : i + batch_size].to(device) for i in range(0, len(blocks), batch_size)]
    positions = [torch.arange(b.shape[1], device=device).expand(b.shape[0], -1) for b in batches]
    hidden = [base.embed(base.embed_tokens(b), p) for b, p in zip(batches, positions)]
    source_hidden = None  # the source layers' residual stream, from the first shrinking layer on
    step = _LayerStep(base, positions, importance, grow_init, refit, seed, noise_scale, damp, timer)
    plans, scores = [], []
    for i, layer in enumerate(base.layers):
        width, source_width = widths[i], layer.mlp.down_proj.in_features
        with timer("calibrate"):
            if residual and width < source_width and source_hidden is None:
                source_hidden = list(hidden)
            mixed = step.mix(layer, hidden)
            if source_hidden is not None:  # the source layer (not yet resized) on the source stream
                source_hidden = [layer.feed_forward(z) for z in step.mix(layer, source_hidden)]
        if width < source_width:
            plan, score, hidden = step.shrink(i, layer, mixed, width, source_hidden)
        elif width > source_width and grow_init != "split":
            plan, score, hidden = step.grow(i, layer, mixed, width)
        else:
            plan, score, hidden = step.keep_or_split(i, layer, mixed, width)
        plans.append(plan)
        scores.append(score.float())
        if progress is not None:
            progress(i)
    return CalibrationResult(plans=plans, scores=scores, tokens=int(blocks.numel()), hidden=hidden)


class _LayerStep:
    """The three ways a layer is calibrated and resized (see the module docstring); each returns
    (plan, scores of the source neurons, the layer's output per batch). Consumes ``mixed`` batch by batch."""

    def __init__(self, base, positions, importance, grow_init, refit, seed, noise_scale, damp, timer):
        self.base, self.positions, self.timer = base, positions, timer
        self.importance, self.grow_init, self.refit = importance, grow_init, refit
        self.seed, self.noise_scale, self.damp = seed, noise_scale, damp

    def mix(self, layer, hidden: list) -> list:
        """z = mix(h) per batch; frees each input batch as soon as it is mixed."""
        out = []
        for b, p in enumerate(self.positions):
            out.append(_mix(self.base, layer, hidden[b], p))
            hidden[b] = None
        return out

    def scores(self, i, layer, stats, width=None) -> torch.Tensor:
        with self.timer("rank"):
            return neuron_scores(self.importance, stats, _weights(layer.mlp, width), seed=self.seed + i)

    def resize(self, i, layer, plan) -> None:
        _resize_in_place(layer, i, plan, self.grow_init, self.noise_scale, self.seed)

    def grow(self, i, layer, mixed, width):
        source_width = layer.mlp.down_proj.in_features
        plan = LayerPlan(keep=list(range(source_width)), grow=width - source_width)
        with self.timer("resize"):
            self.resize(i, layer, plan)
            with activation_stats(layer.mlp.down_proj, columns=source_width) as stats:
                hidden = _consume(mixed, layer.feed_forward)
        return plan, self.scores(i, layer, stats, source_width), hidden

    def keep_or_split(self, i, layer, mixed, width):
        source_width = layer.mlp.down_proj.in_features
        with self.timer("calibrate"), activation_stats(layer.mlp.down_proj) as stats:
            hidden = [layer.feed_forward(z) for z in mixed]
        score = self.scores(i, layer, stats)
        plan = plan_from_scores([score], [width])[0]
        if width != source_width:  # split growth: the plan copies the top-scored neurons
            with self.timer("resize"):
                self.resize(i, layer, plan)
                hidden = _consume(mixed, layer.feed_forward)
        return plan, score, hidden

    def shrink(self, i, layer, mixed, width, source_hidden):
        obs = self.importance == "obs"
        with self.timer("calibrate"):
            with activation_stats(layer.mlp.down_proj, gram=obs and source_hidden is None, keep=True,
                                  stop=True) as stats:
                for z in mixed:  # the MLP up to its down projection: the hook records a and stops the forward
                    try:
                        layer.feed_forward(z)
                    except StopForward:
                        pass
        score = self.scores(i, layer, stats)
        down = layer.mlp.down_proj
        if obs:  # OBS prunes from the least-squares optimum of the target: D itself (local), D* (residual)
            start = down.weight
            if source_hidden is not None:
                with self.timer("calibrate"):
                    stats.gram, rhs = _kept_system(down, stats.kept, mixed, None, source_hidden)
                with self.timer("rank"):
                    start = refit_kept(stats.gram, rhs, damp=self.damp)
            with self.timer("rank"):
                keep, new_down = obs_prune(stats.gram, start, width, damp=self.damp)
            plan = LayerPlan(keep=keep, down_override=new_down.to(down.weight.dtype))
        else:
            plan = plan_from_scores([score], [width])[0]
            if self.refit:
                with self.timer("calibrate"):
                    gram, rhs = _kept_system(down, stats.kept, mixed, plan.keep, source_hidden)
                with self.timer("rank"):
                    plan.down_override = refit_kept(gram, rhs, damp=self.damp).to(down.weight.dtype)
        stats.gram = None
        with self.timer("resize"):
            self.resize(i, layer, plan)
            hidden = []
            for b in range(len(mixed)):  # z + D′ a_K from the recorded activations; frees both per batch
                hidden.append(_feed_forward_reusing(layer, mixed[b], stats.kept[b], plan))
                mixed[b] = stats.kept[b] = None
        return plan, score, hidden


def _consume(mixed: list, fn) -> list:
    """[fn(z) for z in mixed], freeing each z once used."""
    out = []
    for b in range(len(mixed)):
        out.append(fn(mixed[b]))
        mixed[b] = None
    return out


def _weights(mlp, width=None) -> dict:
    """The layer's gate/up/down weights, restricted to its first ``width`` neurons (the source ones)."""
    width = width or mlp.down_proj.in_features
    out = {n: getattr(mlp, n).weight[:width] for n in ("gate_proj", "up_proj") if hasattr(mlp, n)}
    out["down_proj"] = mlp.down_proj.weight[:, :width]
    return out


def _kept_system(down, acts, mixed, keep, source_hidden=None) -> tuple[torch.Tensor, torch.Tensor]:
    """The kept neurons' least-squares system: G_KK = Σ a_Kᵀ a_K (K, K) and Σ a_Kᵀ Y (K, d), fp64 (``keep`` None:
    all neurons, no copy of the activations).

    Y is the layer's own full-width MLP output a Dᵀ ("local"), or with ``source_hidden`` the output that restores
    the source stream, h_src − z − b ("residual"). fp32 products per batch, accumulated in fp64."""
    idx = None if keep is None else torch.as_tensor(keep, dtype=torch.long, device=down.weight.device)
    gram = rhs = 0
    for b, a in enumerate(acts):
        a = a.flatten(0, 1).float()  # (N_b, I)
        a_k = a if idx is None else a.index_select(1, idx)  # (N_b, K)
        if source_hidden is None:
            target = F.linear(a, down.weight.float())  # (N_b, d)
        else:
            target = (source_hidden[b] - mixed[b]).flatten(0, 1).float()
            if down.bias is not None:
                target = target - down.bias.float()
        gram = gram + (a_k.T @ a_k).double()
        rhs = rhs + (a_k.T @ target).double()
    return gram, rhs


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


def _resize_in_place(layer, idx, plan, grow_init, noise_scale, seed) -> None:
    """Give the layer's MLP projections their resized tensors (``surgery.resize_layer``) in place."""
    prefix = f"model.layers.{idx}.mlp."
    mlp = layer.mlp
    sd = {prefix + k: v for k, v in mlp.state_dict().items()}
    new = resize_layer(sd, idx, plan, grow_init, noise_scale, seed, gated=hasattr(mlp, "gate_proj"))
    for name, module in mlp.named_children():
        if not isinstance(module, nn.Linear):
            continue
        weight = new[prefix + name + ".weight"]
        module.weight = nn.Parameter(weight, requires_grad=module.weight.requires_grad)
        if prefix + name + ".bias" in new:  # down_proj's bias is per output, never resized
            module.bias = nn.Parameter(new[prefix + name + ".bias"], requires_grad=module.bias.requires_grad)
        module.out_features, module.in_features = weight.shape
    mlp.intermediate_size = plan.width


__all__ = ["calibrate_and_plan", "CalibrationResult"]
