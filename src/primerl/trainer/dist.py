"""Process-group setup for torchrun launches: gloo on CPU, NCCL on GPU; a single process needs no group at all.

On GPU, rank r of a host uses CUDA device `LOCAL_RANK` of the devices it sees (the `rl` launcher hands the trainer
its GPUs in CUDA_VISIBLE_DEVICES, so local rank r gets the r-th of them), binds it before the process group starts
(`device_id`: NCCL communicators are created eagerly on that device), and NVLink multicast stays off
(`primerl.multicast`) unless the environment sets it.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist

from primerl.multicast import multicast_off


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def wants_cuda(device_choice: str) -> bool:
    """Whether `train.device` (`auto`, `cpu`, `cuda`) puts the trainer on CUDA: `auto` does where a device is visible."""
    return device_choice == "cuda" or (device_choice == "auto" and torch.cuda.is_available())


def setup(device_choice: str) -> tuple[DistInfo, torch.device]:
    """Read torchrun's environment, pick the device, and start the process group when there are several ranks."""
    info = DistInfo(
        rank=int(os.environ.get("RANK", "0")),
        world_size=int(os.environ.get("WORLD_SIZE", "1")),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    use_cuda = wants_cuda(device_choice)
    if use_cuda:
        if not torch.cuda.is_available():
            raise RuntimeError("train.device = 'cuda' but no CUDA device is visible")
        visible = torch.cuda.device_count()
        if info.local_rank >= visible:
            raise RuntimeError(
                f"local rank {info.local_rank} has no GPU of its own: {visible} visible (CUDA_VISIBLE_DEVICES="
                f"{os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}) for more ranks per host; start one rank per GPU"
            )
        torch.cuda.set_device(info.local_rank)
        device = torch.device("cuda", info.local_rank)
        multicast_off(os.environ)  # before any NCCL communicator exists (FSDP's, or a weight broadcast's)
    else:
        device = torch.device("cpu")
    if info.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(
            backend="nccl" if use_cuda else "gloo",
            device_id=device if use_cuda else None,
            timeout=datetime.timedelta(minutes=30),
        )
    return info, device


def teardown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_sum(tensor: torch.Tensor) -> torch.Tensor:
    """Sum across ranks in place (no-op on one process)."""
    if dist.is_initialized():
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
    return tensor


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
