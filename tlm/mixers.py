"""The mixer registry: ``MIXERS[name](config, layer_idx)`` builds a layer's token mixer.

Every mixer follows the contract written in ``attention.py`` and lives at ``layers[i].self_attn``, so checkpoint
key paths never depend on the mixer. ``build_mlp`` builds the layer's feed-forward block from
``config.intermediate_sizes[i]`` — the only place the taper enters (Hope layers get a continuum memory of that
width; Titans' memory MLP is part of the mixer and is never tapered).
"""

from __future__ import annotations

from torch import nn

from .attention import Attention, GatedAttention
from .cms import ContinuumMemory, split_level_widths
from .mlp import GatedMLP, PlainMLP
from .titans_attention import TitansAttention

MIXERS: dict[str, type[nn.Module]] = {
    "attention": Attention,
    "gated_attention": GatedAttention,
    "hope_attention": Attention,  # Hope = softmax attention + a continuum-memory MLP (see build_mlp)
    "titans": TitansAttention,
}


def build_mixer(config, layer_idx: int) -> nn.Module:
    name = config.mixer[layer_idx]
    if name not in MIXERS:
        raise ValueError(f"unknown mixer {name!r}; expected one of {', '.join(MIXERS)}")
    return MIXERS[name](config, layer_idx)


def cms_multiple_of(config, width: int) -> int:
    """Rounding multiple of Hope's level widths for an MLP of ``width`` neurons: the taper's ``multiple_of`` (1 when
    unset), or 1 when that multiple would leave a level empty (a narrow layer is split exactly instead)."""
    q = config.multiple_of or 1
    try:
        split_level_widths(width, config.hope_level_shares, q)
    except ValueError:
        return 1
    return q


def build_mlp(config, layer_idx: int) -> nn.Module:
    width = config.intermediate_sizes[layer_idx]
    if config.mixer[layer_idx] == "hope_attention":
        return ContinuumMemory(
            config.hidden_size,
            width,
            shares=config.hope_level_shares,
            modes=config.hope_level_modes,
            topology=config.hope_topology,
            chunk_size=config.hope_chunk_size,
            inner_lr=config.hope_inner_lr,
            hidden_act=config.hidden_act,
            multiple_of=cms_multiple_of(config, width),
            norm_eps=config.norm_eps,
        )
    if config.mlp_gated:
        return GatedMLP(config.hidden_size, width, config.hidden_act, bias=config.mlp_bias)
    return PlainMLP(config.hidden_size, width, config.hidden_act, bias=config.mlp_bias)


__all__ = ["MIXERS", "build_mixer", "build_mlp", "cms_multiple_of"]
