"""MLP width surgery: a pure function (state_dict, layer, plan) -> the layer's resized MLP tensors.

A neuron j of layer l is the triple (row j of ``gate_proj``, row j of ``up_proj``, column j of ``down_proj``)
(GPT-2's ungated MLP: row j of ``up_proj`` with its bias entry, column j of ``down_proj``). Shrinking keeps the
listed neurons in their original order (or, for a fold, merges every neuron into clusters: ``LayerPlan.merge``,
tlm_convert.fold); growing appends new neurons initialised by ``grow_init``:

* ``noise`` (default): input rows drawn at the RMS of the layer's rows, output columns at ``noise_scale`` times
  the RMS of the existing columns — the output barely moves and every new neuron gets gradients at once;
* ``zero``: the same input rows, zero output columns — exactly function-preserving;
* ``split``: Net2Net — copy the most important neurons, halve the copied output column between the twins
  (exact; twins stay symmetric under training, so use it as an ablation).

The layer loop (calibrate) resizes each layer with it before the next layer sees its output; a model whose every
layer is resized loads strictly into ``TLMForCausalLM`` of its config with the new ``intermediate_sizes``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .options import GROW_INITS


@dataclass
class LayerPlan:
    """What happens to one layer: the kept source neurons (ascending) and how many new ones are appended."""

    keep: list[int]
    grow: int = 0
    split_from: list[int] = field(default_factory=list)  # for grow_init="split": source neurons to copy
    down_override: torch.Tensor | None = None  # a refitted down projection (d, width) for a shrinking layer
    merge: dict[str, torch.Tensor] | None = None  # a fold (tlm_convert.fold): per input projection (width, I), the
    # new rows as merge @ rows; "down_proj" (I, width), the new down projection as down @ merge. keep: the seeds

    @property
    def width(self) -> int:
        return len(self.keep) + self.grow


def plan_from_scores(scores: list[torch.Tensor], widths: list[int]) -> list[LayerPlan]:
    """Shrinking layers keep their top-scored neurons; growing layers keep all and copy the top ones for split."""
    plans = []
    for score, width in zip(scores, widths):
        n = score.numel()
        order = _rank(score)  # most important first, ties by index
        if width <= n:
            plans.append(LayerPlan(keep=sorted(order[:width].tolist())))
        else:
            grow = width - n
            plans.append(LayerPlan(keep=list(range(n)), grow=grow, split_from=order[: min(grow, n)].tolist()))
    return plans


def _rank(score: torch.Tensor) -> torch.Tensor:
    # stable descending sort: equal scores keep index order, so plans are reproducible
    return torch.sort(-score.double(), stable=True).indices


def resize_layer(sd: dict, layer_idx: int, plan: LayerPlan, grow_init: str = "noise", noise_scale: float = 1e-2,
                 seed: int = 0, gated: bool = True) -> dict:
    """The resized MLP tensors of one layer (same keys as in ``sd``); new neurons draw from a per-layer seed."""
    prefix = f"model.layers.{layer_idx}.mlp."
    gen = torch.Generator().manual_seed(seed * 100_003 + layer_idx)
    rows = ["gate_proj", "up_proj"] if gated else ["up_proj"]
    keep = torch.tensor(plan.keep, dtype=torch.long)
    new = {}
    for name in rows:  # neuron = a row of the input projections (and its bias entry)
        w = sd[prefix + name + ".weight"]
        new[prefix + name + ".weight"] = torch.cat([_pick(w, keep, plan, name), _new_rows(w, plan, grow_init, gen)])
        if prefix + name + ".bias" in sd:
            b = sd[prefix + name + ".bias"]
            extra = b[_split_sources(plan)] if grow_init == "split" else b.new_zeros(plan.grow)
            new[prefix + name + ".bias"] = torch.cat([_pick(b, keep, plan, name), extra])
    down = sd[prefix + "down_proj.weight"]  # (d, I)
    if plan.down_override is not None:
        new[prefix + "down_proj.weight"] = plan.down_override.to(down.dtype)
    elif plan.merge is not None:
        new[prefix + "down_proj.weight"] = (down.double() @ plan.merge["down_proj"].to(down.device)).to(down.dtype)
    else:
        new[prefix + "down_proj.weight"] = _new_down(down, keep, plan, grow_init, noise_scale, gen)
    return new


def _pick(t, keep, plan, name):
    """The kept neurons' entries of a neuron-indexed tensor t (I, ...), or with a fold their merges."""
    if plan.merge is None:
        return t[keep]
    return (plan.merge[name].to(t.device) @ t.double()).to(t.dtype)


def _new_rows(w, plan, grow_init, gen):
    if plan.grow == 0:
        return w[:0]
    if grow_init == "split":
        return w[_split_sources(plan)]
    rms = w.float().pow(2).mean().sqrt()
    return (torch.randn(plan.grow, w.shape[1], generator=gen).to(w.device) * rms).to(w.dtype)  # host draw: any device


def _split_sources(plan) -> torch.Tensor:
    src = plan.split_from
    return torch.tensor([src[k % len(src)] for k in range(plan.grow)], dtype=torch.long)


def _new_down(down, keep, plan, grow_init, noise_scale, gen):
    kept = down[:, keep]
    if plan.grow == 0:
        return kept
    if grow_init == "zero":
        return torch.cat([kept, down.new_zeros(down.shape[0], plan.grow)], 1)
    if grow_init == "noise":
        rms = down.float().pow(2).mean().sqrt()
        cols = torch.randn(down.shape[0], plan.grow, generator=gen).to(down.device) * rms * noise_scale
        return torch.cat([kept, cols.to(down.dtype)], 1)
    # split: every copy of neuron m shares its column equally with the original
    src = _split_sources(plan)
    copies = torch.bincount(src, minlength=down.shape[1]).to(down.device, down.dtype) + 1  # (I,) twins per neuron
    scaled = down / copies  # (d, I)
    return torch.cat([scaled[:, keep], scaled[:, src]], 1)


__all__ = ["LayerPlan", "plan_from_scores", "resize_layer", "GROW_INITS"]
