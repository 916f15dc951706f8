"""Upcycle attention layers into another mixer with a function-preserving init (the logits do not move).

* ``gated_attention``: gate weights and bias 0 (G ≡ ½) and ``o_proj`` doubled.
* ``titans``: the memory branch from a fresh (seeded) init, its combine ``memory_gate`` at 0 (gate ≡ 1).
* ``hope_attention``: the continuum memory in "sum" topology with the layer's MLP neurons partitioned across its
  levels (a SwiGLU output is a sum over neurons, so this is exact), the most important neurons going to the
  slowest (last) level, and the in-context learning rate 0 (ramp it up during continued pretraining). The scores
  must be at the layer's final width: after a taper, `carry_scores` maps the source scores through the kept
  neurons and puts grown neurons last (least important, so they go to the fastest level).
"""

from __future__ import annotations

import copy

import torch

from tlm import TLMConfig, TLMForCausalLM
from tlm.cms import split_level_widths
from tlm.mixers import cms_multiple_of
from tlm_io.errors import ConversionError


def upcycle(config: TLMConfig, state_dict: dict, mixer: str, scores: list[torch.Tensor] | None = None,
            seed: int = 0) -> tuple[TLMConfig, dict]:
    """(config, state_dict) of an attention TLM -> the same function with every layer's mixer set to ``mixer``."""
    new_config = upcycled_config(config, mixer)
    if mixer == "attention":
        return new_config, state_dict
    fresh = None
    if mixer == "titans":  # the new memory branches, from the whole model's seeded init
        torch.manual_seed(seed)
        fresh = TLMForCausalLM(new_config).state_dict()
    out = dict(state_dict)
    for i in range(config.num_hidden_layers):
        out = upcycle_layer(out, i, mixer, new_config, None if scores is None else scores[i], fresh)
    return new_config, out


def upcycled_config(config: TLMConfig, mixer: str) -> TLMConfig:
    """The config of ``config``'s model with every attention layer's mixer set to ``mixer`` (checked here)."""
    if mixer == "attention":
        return config
    if any(m != "attention" for m in config.mixer):
        raise ConversionError(f"--mixer {mixer} upcycles attention layers only; this model has {sorted(set(config.mixer))}")
    if mixer == "hope_attention" and (config.mlp_bias or not config.mlp_gated):
        raise ConversionError("--mixer hope_attention needs a gated MLP without biases (Llama, Qwen, Gemma); "
                              "GPT-2-style MLPs cannot be split into continuum-memory levels")
    new_config = copy.deepcopy(config)
    new_config.mixer = [mixer] * config.num_hidden_layers
    if mixer == "hope_attention":
        new_config.hope_topology, new_config.hope_inner_lr = "sum", 0.0
    return new_config


def upcycle_layer(state: dict, i: int, mixer: str, new_config: TLMConfig, scores: torch.Tensor | None = None,
                  fresh: dict | None = None) -> dict:
    """Layer i of ``state`` (TLM names; other layers pass through) upcycled to ``mixer`` of ``new_config``
    (:func:`upcycled_config`); ``fresh``: the seeded init of ``TLMForCausalLM(new_config)``, for titans only."""
    prefix = f"model.layers.{i}."
    out = dict(state)
    if mixer == "gated_attention":
        o_proj = state[prefix + "self_attn.o_proj.weight"]  # (d, heads * head_dim)
        gates = o_proj.shape[1] if new_config.gate_type == "elementwise" else new_config.num_attention_heads
        out[prefix + "self_attn.gate_proj.weight"] = o_proj.new_zeros(gates, new_config.hidden_size)
        out[prefix + "self_attn.gate_proj.bias"] = o_proj.new_zeros(gates)
        out[prefix + "self_attn.o_proj.weight"] = 2 * o_proj
    elif mixer == "titans":
        for key, value in fresh.items():
            if key.startswith(prefix + "self_attn.memory"):
                out[key] = torch.zeros_like(value) if "memory_gate" in key else value
    elif mixer == "hope_attention":
        out = {k: v for k, v in out.items() if not k.startswith(prefix + "mlp.")}
        out.update(_split_mlp(state, prefix, new_config, new_config.intermediate_sizes[i], scores))
    return out


SCORED_MIXERS = ("hope_attention",)  # upcycling that orders the MLP's neurons by their scores (_split_mlp)


def carry_scores(score: torch.Tensor | None, keep: list[int], grow: int = 0) -> torch.Tensor | None:
    """Source-width neuron scores -> the resized layer's (kept neurons in `keep` order, then `grow` new ones at
    -inf: a resized MLP holds the kept source neurons first and appends the grown ones). None (no calibration ran):
    None."""
    if score is None:
        return None
    kept = score.float()[torch.as_tensor(keep, dtype=torch.long)]
    return torch.cat([kept, kept.new_full((grow,), -float("inf"))])


def _split_mlp(sd, prefix, config, width, scores) -> dict:
    widths = split_level_widths(width, config.hope_level_shares, cms_multiple_of(config, width))
    if scores is not None and scores.numel() != width:
        raise ValueError(f"{prefix}: {scores.numel()} neuron scores for an MLP of width {width}; "
                         "map source scores through the resize with carry_scores")
    order = torch.arange(width) if scores is None else torch.sort(scores, stable=True).indices
    new, start = {}, 0
    for level, w in enumerate(widths):  # least important first: the last (slowest, static) level gets the top neurons
        idx = order[start : start + w].sort().values
        start += w
        for name in ("gate_proj", "up_proj"):
            new[f"{prefix}mlp.levels.{level}.{name}.weight"] = sd[f"{prefix}mlp.{name}.weight"][idx]
        new[f"{prefix}mlp.levels.{level}.down_proj.weight"] = sd[f"{prefix}mlp.down_proj.weight"][:, idx]
    return new


__all__ = ["upcycle", "upcycled_config", "upcycle_layer", "carry_scores", "SCORED_MIXERS"]
