"""The processes of a run: one, or one per rank under ``torchrun`` (DDP, or FSDP with ``train.parallel: fsdp``).

:func:`setup_distributed` reads the ranks torchrun sets and picks the device; :class:`Dist` holds them with the few
collective operations the loop needs (every rank calls them, a single process skips them). :func:`wrap` puts the
model under DDP or FSDP; :func:`full_state_dict` / :func:`full_optim_state` gather the whole (unsharded) model and
optimizer state a checkpoint writes, and :func:`load_full_state` puts one back (torch.distributed.checkpoint is
imported only when a run is sharded).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from tlm_io.errors import TrainError


@dataclass
class Dist:
    world: int
    rank: int
    local_rank: int
    device: torch.device

    @property
    def main(self) -> bool:
        return self.rank == 0

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()

    def all_mean(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return float(t) / self.world

    def all_max(self, value: float) -> float:
        if self.world == 1:
            return value
        t = torch.tensor([value], dtype=torch.float64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def all_sum(self, values: list[float]) -> list[float]:
        """Each value summed over the ranks (fp64)."""
        if self.world == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def any(self, flag: bool) -> bool:
        if self.world == 1:
            return flag
        t = torch.tensor([int(flag)], device=self.device)
        dist.all_reduce(t)
        return bool(t.item())


def setup_distributed(device_pref: str) -> Dist:
    """This process's rank and device (``train.device``: auto, cpu, cuda, cuda:N); joins the process group under
    torchrun (NCCL on CUDA, gloo on the CPU)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device_pref == "auto":
        device = torch.device(f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu")
    else:
        device = torch.device(device_pref)
        if device.type == "cuda" and device.index is None:
            device = torch.device(f"cuda:{local_rank}")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise TrainError(f"train.device {device_pref!r}: CUDA is not available here; use auto or cpu")
        torch.cuda.set_device(device)
    if world > 1 and not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device.type == "cuda" else "gloo")
    return Dist(world, rank, local_rank, device)


def wrap(model, parallel: str, d: Dist):
    """``model`` as the ranks train it: itself on one process, else FSDP (each layer, then the whole) or DDP."""
    if d.world == 1:
        return model
    if parallel == "fsdp":
        from torch.distributed.fsdp import fully_shard

        for layer in model.model.layers:
            fully_shard(layer)
        fully_shard(model)
        return model
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(model, device_ids=[d.device.index] if d.device.type == "cuda" else None)


def unwrap(model):
    """The TLMForCausalLM inside a DDP wrapper (FSDP shards it in place: the module itself)."""
    return getattr(model, "module", model)


def _sharded(parallel: str) -> bool:
    return parallel == "fsdp" and dist.is_initialized()


def full_state_dict(model, parallel: str) -> dict:
    """The whole model's weights (gathered to the CPU under FSDP)."""
    if _sharded(parallel):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return unwrap(model).state_dict()


def full_optim_state(model, optimizer, parallel: str) -> dict:
    """The whole optimizer state (gathered to the CPU under FSDP)."""
    if _sharded(parallel):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        return get_optimizer_state_dict(model, optimizer,
                                        options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return optimizer.state_dict()


def load_full_state(model, optimizer, weights: dict, optim_state: dict) -> None:
    """Put whole weights and optimizer state back into an FSDP-sharded model and its optimizer."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, weights, options=opts)
    set_optimizer_state_dict(model, optimizer, optim_state, options=opts)


__all__ = ["Dist", "setup_distributed", "wrap", "unwrap", "full_state_dict", "full_optim_state", "load_full_state"]
