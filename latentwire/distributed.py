"""Process-group set-up from the torchrun environment, and the few collectives the loop needs.

Plain `python train.py` (no RANK in the environment) runs as a world of one without a process
group, so every helper here also works single-process.
"""
from __future__ import annotations

import datetime
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import errors


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()


def select_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise errors.UserError("this profile needs a CUDA GPU and none is visible; use --profile cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def backend_for(device: torch.device) -> str:
    """NCCL moves CUDA tensors over NVLink/InfiniBand; gloo is the CPU backend."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_distributed(device_type: str, timeout_s: int) -> DistInfo:
    """Join the process group torchrun describes in RANK / LOCAL_RANK / WORLD_SIZE."""
    if "RANK" not in os.environ:
        return DistInfo(0, 0, 1, select_device(device_type, 0))
    rank, local_rank = int(os.environ["RANK"]), int(os.environ["LOCAL_RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = select_device(device_type, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    # An explicit timeout: a rank that dies or hangs makes the others fail instead of waiting forever.
    dist.init_process_group(backend_for(device), timeout=datetime.timedelta(seconds=timeout_s),
                            device_id=device if device.type == "cuda" else None)
    errors.process_group_started = True  # the process will leave without finalizing (errors.leave)
    return DistInfo(rank, local_rank, world_size, device)


@contextmanager
def process_group(device_type: str, timeout_s: int) -> Iterator[DistInfo]:
    """The process group for the body of a command, torn down however the body ends."""
    info = init_distributed(device_type, timeout_s)
    try:
        yield info
        # Leave together: a rank that destroys the group and exits while a peer is still busy
        # (rank 0 writing a report) can be aborted by gloo's connection threads at exit. Only
        # on success: after an error the peers may never arrive, and the timeout must decide.
        if dist.is_initialized():
            dist.barrier()
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def ddp_buffer_options() -> dict:
    """DDP keyword arguments that skip the buffer broadcast before every forward. torch 2.13 names
    it `forward_sync_buffers=False` (and deprecates `broadcast_buffers`); older versions have only
    `broadcast_buffers=False`, which also skips the sync at construction: harmless here, since
    the buffers are constants computed alike on every rank."""
    import inspect

    from torch.nn.parallel import DistributedDataParallel

    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel.__init__).parameters:
        return {"forward_sync_buffers": False}
    return {"broadcast_buffers": False}


def all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    """Sum over ranks, in place; a no-op in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t


def all_reduce_max(t: torch.Tensor) -> torch.Tensor:
    if dist.is_initialized():
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t
