"""The processes a run trains in and their devices: one process, or torchrun's group (WORLD_SIZE
> 1) with the model wrapped in DDP; sums over the processes; mixed precision per device."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from eaglenest.common.devices import resolve_device

if TYPE_CHECKING:
    from eaglenest.drafter.model import Eagle3Drafter


@dataclass(frozen=True)
class Processes:
    rank: int = 0
    world_size: int = 1
    device: str = "cpu"

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def setup_processes(device: str) -> Processes:
    """One process, or torchrun's group (NCCL on CUDA, gloo on CPU)."""
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    device = resolve_device(device)
    if world_size == 1:
        return Processes(device=device)
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    if device.startswith("cuda"):
        torch.cuda.set_device(local_rank)
        device = f"cuda:{local_rank}"
    dist.init_process_group("nccl" if device.startswith("cuda") else "gloo")
    return Processes(rank=rank, world_size=world_size, device=device)


def all_reduce_sum(values: list[float], processes: Processes) -> list[float]:
    if processes.world_size == 1:
        return values
    import torch.distributed as dist

    tensor = torch.tensor(values, dtype=torch.float64, device=processes.device)
    dist.all_reduce(tensor)
    return tensor.tolist()


def global_counts(counts: list[int], processes: Processes) -> list[int]:
    """Each TTT step's count of loss positions, summed over the processes."""
    return [round(n) for n in all_reduce_sum([float(n) for n in counts], processes)]


def data_parallel(model: Eagle3Drafter, processes: Processes) -> torch.nn.Module:
    """The model itself in one process; under torchrun its DDP wrapper, which averages the
    gradients of the processes in backward."""
    if processes.world_size == 1:
        return model
    from torch.nn.parallel import DistributedDataParallel

    ids = [int(processes.device.split(":")[1])] if processes.device.startswith("cuda") else None
    return DistributedDataParallel(model, device_ids=ids)


def autocast(device: str, precision: str):
    bf16 = precision == "bf16" or (precision == "auto" and device.startswith("cuda"))
    return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16, enabled=bf16)
