"""Checking a state dict against its config: exactly the names and shapes the model has (:func:`check_shapes`,
:func:`check_tlm_state_dict`), and its parameter count with tied tensors counted once (:func:`count_params`)."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from tlm import TLMConfig

from .archs import tlm_shapes
from .errors import ConversionError, first_few


def check_tlm_state_dict(config: TLMConfig, tensors: Mapping[str, torch.Tensor], where: str = "the state dict") -> None:
    """ConversionError unless ``tensors`` has exactly the names and shapes of ``TLMForCausalLM(config)``."""
    check_shapes(tlm_shapes(config), {k: tuple(v.shape) for k, v in tensors.items()}, where)


def check_shapes(expected: Mapping[str, tuple], shapes: Mapping[str, tuple], where: str) -> None:
    """ConversionError unless ``shapes`` (name -> shape) has exactly the names and shapes of ``expected``."""
    missing = [k for k in expected if k not in shapes]
    extra = [k for k in shapes if k not in expected]
    wrong = [f"{k} {shapes[k]} (expected {expected[k]})" for k in expected if k in shapes and shapes[k] != expected[k]]
    problems = [f"{what} {first_few(names)}" for what, names in (("missing", missing), ("unexpected", extra),
                                                                   ("wrong shape", wrong)) if names]
    if problems:
        raise ConversionError(f"the tensors of {where} do not match its config: {'; '.join(problems)}; "
                              "re-download the checkpoint or fix config.json")


def count_params(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Parameters in a state dict, tensors shared under several names (tied embeddings) counted once."""
    seen, total = set(), 0
    for tensor in state_dict.values():
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset(), tuple(tensor.shape))
        if key not in seen:
            seen.add(key)
            total += tensor.numel()
    return total


__all__ = ["check_shapes", "check_tlm_state_dict", "count_params"]
