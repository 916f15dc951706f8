"""Feed-forward blocks whose width is a constructor argument, so every layer can have its own.

`GatedMLP` is Llama's SwiGLU (Gemma's GeGLU with ``hidden_act="gelu_pytorch_tanh"``); `PlainMLP` is GPT-2's
ungated MLP. Tensor names follow transformers (``gate_proj`` / ``up_proj`` / ``down_proj``) so checkpoints and
PEFT target lists carry over; a neuron j is row j of ``gate_proj``/``up_proj`` and column j of ``down_proj``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,  # GPT-2's tanh approximation; identical formula
    "gelu_fast": _gelu_tanh,
    "relu": F.relu,
}


def get_activation(name: str):
    """The activation function called `name` (transformers' names); unknown names list the valid ones."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown hidden_act {name!r}; expected one of {', '.join(sorted(ACTIVATIONS))}") from None


class GatedMLP(nn.Module):
    """down_proj(act(gate_proj(x)) * up_proj(x)); x: (..., hidden_size) -> (..., hidden_size)."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "silu", bias: bool = False):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


class PlainMLP(nn.Module):
    """down_proj(act(up_proj(x))), GPT-2's c_fc / c_proj under transformers' Llama names."""

    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str = "gelu_new", bias: bool = True):
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=bias)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=bias)
        self.act_fn = get_activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.up_proj(x)))


def mlp_num_params(hidden_size: int, intermediate_size: int, gated: bool = True, bias: bool = False) -> int:
    """Parameters of one MLP of the given width (linear in the width, which is what keeps the taper exact)."""
    mats = 3 if gated else 2
    biases = ((2 if gated else 1) * intermediate_size + hidden_size) if bias else 0
    return mats * hidden_size * intermediate_size + biases


__all__ = ["GatedMLP", "PlainMLP", "get_activation", "mlp_num_params", "ACTIVATIONS"]
