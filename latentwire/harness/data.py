"""Data for a data-parallel loop, whatever the examples are: the global batch's layout on the
world that runs it, a sampler that deals each rank a disjoint shard and can start an epoch
part-way (resume), the DataLoader the loop reads, its global batches of accumulated
micro-batches, and the copy of a collated batch to the device."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from .preemption import shield_worker_from_stop_signals


def scaled_lr(lr: float, old_batch: int, new_batch: int, rule: str) -> float:
    """sqrt: the square-root rule for Adam-type optimizers (Malladi et al., 2022); linear: the
    linear rule for SGD (Goyal et al., 2017)."""
    ratio = new_batch / old_batch
    return lr * (math.sqrt(ratio) if rule == "sqrt" else ratio)


@dataclass(frozen=True)
class Layout:
    micro_batch_size: int
    grad_accum_steps: int
    lr: float
    why: str  # one line for the run's start


def layout_for_world(micro: int, accum: int, laid_out_for: int, world: int, lr: float, rule: str) -> Layout:
    """A profile's batch on the world that runs it. The profile means a global batch (micro x
    accum x the ranks it is laid out for), and its lr was tuned for that batch: another world size
    keeps it, each rank taking its share in micro-batches no larger than the profile's (so what fit
    still fits) and as large as an exact split allows. Where no exact split keeps micro-batches of
    at least half the profile's (the share is not a whole number, or has no such divisor), each rank
    keeps the profile's micro-batch and accumulation, the global batch follows the world, and the
    lr follows the profile's `rule` (scaled_lr)."""
    profile_batch = micro * accum * laid_out_for
    said = f"global batch {profile_batch} ({micro} x {accum} x {laid_out_for}, as the profile lays it out)"
    if world == laid_out_for:
        return Layout(micro, accum, lr, said)
    share = profile_batch / world
    if share.is_integer():
        share = int(share)
        split = max(d for d in range(1, min(micro, share) + 1) if share % d == 0)
        if 2 * split >= min(micro, share):
            return Layout(split, share // split, lr, f"{said} kept on {world} rank(s) as {split} x "
                                                     f"{share // split} x {world}; lr {lr:.3g} unchanged")
    new_batch = micro * accum * world
    new_lr = scaled_lr(lr, profile_batch, new_batch, rule)
    return Layout(micro, accum, new_lr, f"{said} does not split well over {world} rank(s), so each keeps "
                                        f"{micro} x {accum}: global batch {new_batch}, lr {lr:.3g} -> {new_lr:.3g} by "
                                        f"the {rule} rule")


class ShardSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler that can start an epoch part-way (resume) without loading what it skips.

    The permutation depends only on (seed, epoch), and rank r takes every world_size-th index of
    it, so skipping the first `done // world_size` indices on every rank skips exactly the first
    `done` examples of the epoch in the global order, for any world size.
    """

    def __init__(self, dataset, num_replicas: int, rank: int, seed: int):
        super().__init__(dataset, num_replicas=num_replicas, rank=rank, shuffle=True, seed=seed, drop_last=True)
        self.skip = 0

    def start_epoch(self, epoch: int, global_examples_done: int = 0) -> None:
        self.set_epoch(epoch)
        self.skip = global_examples_done // self.num_replicas

    def __iter__(self):
        return itertools.islice(super().__iter__(), self.skip, None)

    def __len__(self) -> int:
        return self.num_samples - self.skip


def to_device(batch: dict, device: torch.device) -> dict:
    """A collated batch on `device`; non_blocking overlaps the copy with compute from pinned memory."""
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch.to(device, non_blocking=True)


def make_loader(dataset, sampler, collate, *, micro_batch_size: int, num_workers: int, prefetch_factor: int,
                device_type: str, seed: int) -> DataLoader:
    """Workers tokenise and pad while the model computes; pinned host memory makes the
    host-to-device copy asynchronous (non_blocking) on CUDA; persistent workers skip a fork of
    every worker at each epoch. The loader's own generator keeps its worker seeds off the global
    RNG, so dropout draws do not depend on when an epoch starts. Workers leave the trainer's
    process group, so a preemption signal to the group cannot kill them before it has saved."""
    return DataLoader(dataset, batch_size=micro_batch_size, sampler=sampler, collate_fn=collate, drop_last=True,
                      num_workers=num_workers, pin_memory=device_type == "cuda", persistent_workers=num_workers > 0,
                      worker_init_fn=shield_worker_from_stop_signals,
                      prefetch_factor=prefetch_factor if num_workers > 0 else None,
                      generator=torch.Generator().manual_seed(seed))


def examples_visited(n: int, *, seed: int, world: int, micro: int, accum: int, epoch: int, examples_done: int,
                     steps: int) -> list[int]:
    """The dataset indices that `steps` optimizer steps will draw, starting `examples_done` into
    `epoch` (global_batches' position), in increasing order: decided in advance by the sampler's
    permutation of each epoch (the same for any world size), of which step s takes positions
    [s x global batch, (s + 1) x global batch), each epoch's incomplete last step dropped."""
    global_batch = micro * accum * world
    steps_per_epoch = n // world // micro // accum
    sampler = ShardSampler(range(n), num_replicas=1, rank=0, seed=seed)
    visited: set[int] = set()
    while steps > 0 and len(visited) < n:
        sampler.start_epoch(epoch)
        taken = min(steps, steps_per_epoch - examples_done // global_batch)
        visited.update(itertools.islice(sampler, examples_done, examples_done + taken * global_batch))
        steps, epoch, examples_done = steps - taken, epoch + 1, 0
    return sorted(visited)


def global_batches(loader, sampler, accum: int, epoch: int, examples_done: int, global_batch: int):
    """Yields (epoch, examples of the epoch done after this step, [accum micro-batches]) forever,
    starting `examples_done` into `epoch`; a partial group at an epoch's end is dropped. Closed
    (or failing), it stops the loader's workers at once (stop_workers)."""
    it = None
    try:
        while True:
            sampler.start_epoch(epoch, examples_done)  # a new permutation each epoch, the same on every rank
            it = iter(loader)
            for _ in range(len(loader) // accum):
                examples_done += global_batch
                yield epoch, examples_done, [next(it) for _ in range(accum)]
            epoch, examples_done = epoch + 1, 0
    finally:
        stop_workers(it)


def stop_workers(iterator) -> None:
    """Stop a DataLoader iterator's worker processes and pin-memory thread now. torch stops them
    when the iterator is collected, and with persistent workers the loader holds its iterator, so
    a run that fails holds them as long as its traceback holds the loader: until the interpreter
    exits, where torch 2.11 (with pinned memory) joins each worker for 5 s at exit, 40 s for 8
    workers, before terminating it (pytorch/pytorch#81794; three failed H100 runs "hung" so,
    docs/performance.md). `_shutdown_workers` is what collecting the iterator runs; torch has no
    public call for it. Idempotent; a single-process iterator has nothing to stop."""
    shutdown = getattr(iterator, "_shutdown_workers", None)
    if shutdown is not None:
        shutdown()
