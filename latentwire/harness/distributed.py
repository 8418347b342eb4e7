"""Process-group set-up from the torchrun environment, and the few collectives the loop needs.

Plain `python train.py` (no RANK in the environment) runs as a world of one without a process
group, so every helper here also works single-process.

torchrun (--max-restarts, or an elastic --nnodes=MIN:MAX job) starts the ranks again when one dies
or the nodes change. With its c10d rendezvous its agent hosts the TCP store the workers connect
their process group through (TORCHELASTIC_USE_AGENT_STORE), and that store outlives them: a
restarted rank can read the addresses the previous attempt's ranks wrote there and fail to connect
(pytorch/pytorch#135712; #167288 with NCCL; with gloo on torch 2.13 too, docs/faults.md). Its
keys would need a prefix every rank of an attempt agrees on, and TORCHELASTIC_RESTART_COUNT is not
one: each agent counts its own restarts, and one restarted for a node that joined counts none. So
each attempt's rank 0 hosts the group's store itself, found through the agent's store
(`attempt_store`).
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import exits
from .errors import UserError


@dataclass(frozen=True)
class DistInfo:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    joins_group: bool  # one of several ranks torchrun started: joins their process group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def is_distributed(self) -> bool:
        return self.world_size > 1 or dist.is_initialized()

    def say(self, line: str | None, warning: bool = False) -> None:
        """Print `line` once for the run, from rank 0 (on stderr if a `warning`); None says nothing."""
        if self.is_main and line is not None:
            print(line, file=sys.stderr if warning else sys.stdout, flush=True)

    def warn(self, line: str | None) -> None:
        self.say(line, warning=True)


def select_device(device_type: str, local_rank: int) -> torch.device:
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise UserError("this profile needs a CUDA GPU and none is visible; use --profile cpu")
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def torchrun_rank(device_type: str) -> DistInfo:
    """This process's place in the world torchrun describes in RANK / LOCAL_RANK / WORLD_SIZE, and
    its device; plain `python` is a world of one. A world of one joins no group, whatever started
    it: `torchrun --nproc_per_node=1` is a common way to start one GPU, and a group would wrap the
    model in DDP (its buckets, an all-reduce of every gradient with itself, dynamo's graph split at
    every bucket) and run every collective for nothing."""
    if "RANK" not in os.environ:
        return DistInfo(0, 0, 1, select_device(device_type, 0), joins_group=False)
    local_rank, world = int(os.environ["LOCAL_RANK"]), int(os.environ["WORLD_SIZE"])
    return DistInfo(
        int(os.environ["RANK"]), local_rank, world, select_device(device_type, local_rank), joins_group=world > 1
    )


def group_options(device: torch.device, timeout_s: int) -> dict:
    """dist.init_process_group's arguments: NCCL moves CUDA tensors over NVLink/InfiniBand, gloo is
    the CPU backend; an explicit timeout, so a rank that dies or hangs makes the others fail instead
    of waiting forever; on CUDA the rank's GPU, so NCCL binds its communicator to it at once; under a
    torchrun agent's store, this attempt's own store (see the module's docstring)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    options = {
        "backend": "nccl" if device.type == "cuda" else "gloo",
        "timeout": timeout,
        "device_id": device if device.type == "cuda" else None,
    }
    agent = agent_store(timeout)
    if agent is not None:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        options |= {"store": attempt_store(agent, rank, timeout), "rank": rank, "world_size": world}
    return options


def agent_store(timeout: datetime.timedelta) -> dist.TCPStore | None:
    """A client of the store torchrun's agent hosts for its workers, which outlives the job's
    attempts (TORCHELASTIC_USE_AGENT_STORE, at MASTER_ADDR:MASTER_PORT); None where they share none."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != str(True):
        return None
    return dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=timeout)


# The number of this torchrun job's attempts that have started a group so far, this one included
# (attempt_store's; 0: none here).
_attempts = 0


def attempt_store(agent: dist.TCPStore, rank: int, timeout: datetime.timedelta) -> dist.TCPStore:
    """The store of this attempt's process group: rank 0 hosts a new one and names its port in the
    agent's store under the attempt's number (a count there: rank 0 of each attempt adds one); the
    other ranks read the count and take the store of that number whose host answers as it. A number
    they read before this attempt's rank 0 added its own names the store of an earlier attempt's rank
    0, which died with it (torchrun stops every rank before it starts any again), on the host of
    the agent's store (`agent`), which refuses at once: they take the next number, which blocks
    until set."""
    global _attempts
    host = os.environ["MASTER_ADDR"]
    count = f"harness/{os.environ['TORCHELASTIC_RUN_ID']}/group_stores"
    if rank == 0:
        own = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        _attempts = agent.add(count, 1)
        own.set("harness/attempt", str(_attempts))
        agent.set(f"{count}/{_attempts}", str(own.port))
        return own
    _attempts = max(agent.add(count, 0), 1)
    while True:
        own_port = int(agent.get(f"{count}/{_attempts}"))
        try:
            socket.create_connection((host, own_port), timeout=timeout.total_seconds()).close()
            own = dist.TCPStore(host, own_port, is_master=False, timeout=timeout)
            if own.check(["harness/attempt"]) and own.get("harness/attempt") == str(_attempts).encode():
                return own
        except (OSError, RuntimeError):  # refused, or not a store (another process has the port now)
            pass
        _attempts += 1


def restarted_by_torchrun() -> bool:
    """Collective: whether torchrun started this run's ranks again (a rank died, a node was lost or
    joined): some rank's agent counted a restart, or an earlier attempt of this job started a group
    on the agent's store. The same on every rank."""
    here = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0 or _attempts > 1
    return any(gather_objects(here))


# This torchrun job's name in its agent's store, "" where it has none (torchrun_job's; None: not
# read yet).
_job_name: str | None = None


def torchrun_job() -> str | None:
    """The torchrun job this process belongs to, None outside torchrun: its rendezvous id (--rdzv-id,
    SLURM's job id under launch.sh, a new one for each --standalone start) and, where the agent's
    store outlives the job's attempts (TORCHELASTIC_USE_AGENT_STORE), a name the first rank to ask
    left there. A rendezvous id alone can be every job's: "none" for a static multi-node one,
    launch.sh's default without SLURM, a --rdzv-id a script reuses."""
    global _job_name
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id is None:
        return None
    if _job_name is None:
        agent = agent_store(datetime.timedelta(seconds=300))  # TCPStore's own default
        key = f"harness/{run_id}/job"
        _job_name = "" if agent is None else "/" + agent.compare_set(key, "", uuid.uuid4().hex).decode()
    return run_id + _job_name


@contextmanager
def leave_together() -> Iterator[None]:
    """The body of a command in its process group (if it joined one), the group torn down when
    the body ends well. A body that raises leaves the group standing: the process is on its way
    out (exits.leave ends it with os._exit, which ends gloo's threads with it), and tearing the
    group down is what can hang it. Unregistered, the group dies with the last object holding
    it, DDP's reducer, when the failed frames or the collector free it: its destructor joins
    gloo's worker threads while holding the GIL, and a worker still finishing a collective waits
    for the GIL to free the collective's tensors. Both wait forever (`--resume` from a corrupt
    checkpoint on 2 ranks hung in some runs, until torchrun killed it 30 s later)."""
    if dist.is_initialized():
        exits.started_a_process_group()  # the process will leave without finalizing (exits.leave)
    yield
    # Leave together: a rank that destroys the group and exits while a peer is still busy
    # (rank 0 writing a report) can be aborted by gloo's connection threads at exit. Only on
    # success: after an error the peers may never arrive, and the timeout must decide.
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


@contextmanager
def process_group(device_type: str, timeout_s: int) -> Iterator[DistInfo]:
    """The commands' process group, joined as train.py joins it, for the body of the command."""
    info = torchrun_rank(device_type)
    if info.joins_group:
        if info.device.type == "cuda":
            torch.cuda.set_device(info.device)
        dist.init_process_group(**group_options(info.device, timeout_s))
    with leave_together():
        yield info


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


def all_reduce(t: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """`op` (the sum, or the max) over ranks, in place; a no-op in a world of one."""
    if dist.is_initialized():
        dist.all_reduce(t, op=op)
    return t


def all_reduce_together(*parts: torch.Tensor) -> list[torch.Tensor]:
    """`parts` summed over the ranks in one all-reduce (one collective, not one each), each given
    back in its own shape, in the dtype `torch.cat` promotes them all to."""
    summed = all_reduce(torch.cat([p.flatten() for p in parts]))
    return [chunk.view_as(p) for chunk, p in zip(summed.split([p.numel() for p in parts]), parts, strict=True)]


def gather_objects(obj) -> list:
    """Every rank's `obj` (a picklable value), in rank order, on every rank; [obj] in a world of one.
    all_gather_object works on gloo and NCCL alike."""
    if not dist.is_initialized():
        return [obj]
    objects = [None] * dist.get_world_size()
    dist.all_gather_object(objects, obj)
    return objects


def broadcast_from_main(obj):
    """Rank 0's `obj` (a picklable value) on every rank; itself in a world of one."""
    if not dist.is_initialized():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]
