"""Data for a data-parallel loop, whatever the examples are: a sampler that deals each rank a
disjoint shard and can start an epoch part-way (resume), the examples a run's steps will draw,
the DataLoader the loop reads, its global batches of accumulated micro-batches, and the copy of a
collated batch to the device. How large those batches are is `harness.layout`'s."""

from __future__ import annotations

import itertools

import torch
from torch.utils.data import DataLoader

from .errors import UserError
from .loop_config import Loader
from .preemption import shield_worker_from_stop_signals


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


def make_loader(
    dataset, sampler, collate, micro_batch_size: int, workers: Loader, device_type: str, *, seed: int
) -> DataLoader:
    """Workers tokenise and pad while the model computes; pinned host memory makes the
    host-to-device copy asynchronous (non_blocking) on CUDA; persistent workers skip a fork of
    every worker at each epoch. The loader's own generator keeps its worker seeds off the global
    RNG, so dropout draws do not depend on when an epoch starts. Workers leave the trainer's
    process group, so a preemption signal to the group cannot kill them before it has saved."""
    num_workers = workers.num_workers
    return DataLoader(
        dataset,
        batch_size=micro_batch_size,
        sampler=sampler,
        collate_fn=collate,
        drop_last=True,
        num_workers=num_workers,
        pin_memory=device_type == "cuda",
        persistent_workers=num_workers > 0,
        worker_init_fn=shield_worker_from_stop_signals,
        prefetch_factor=workers.prefetch_factor if num_workers > 0 else None,
        generator=torch.Generator().manual_seed(seed),
    )


def examples_visited(
    n: int, *, seed: int, world: int, micro: int, accum: int, epoch: int, examples_done: int, steps: int
) -> list[int]:
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


def examples_drawn(n: int, *, seed: int, state, steps: int) -> list[int]:
    """The dataset indices a run of `steps` optimizer steps draws, in increasing order: those of the
    whole run from its first step, and those from `state`'s position (a TrainState: a resumed run's,
    whose layout or --new-data may draw others). Work done once per example before training covers
    the whole run's whether it stops early or resumes late: the same examples then pass through it
    in the same batches, so a run that stopped and resumed trains bitwise as the one that did not."""
    world, micro, accum = state.layout
    starts = {(0, 0, steps), (state.epoch, state.examples_done, steps - state.step)}  # one, unless resumed
    return sorted(
        {
            i
            for epoch, done, left in starts
            for i in examples_visited(
                n, seed=seed, world=world, micro=micro, accum=accum, epoch=epoch, examples_done=done, steps=left
            )
        }
    )


def check_one_global_batch(n: int, micro: int, accum: int, world: int) -> None:
    """The loader drops an epoch's incomplete last step: a dataset smaller than one global batch
    would leave none."""
    if n < micro * accum * world:
        raise UserError(f"dataset of {n} examples is smaller than one global batch ({micro} x {accum} x {world} ranks)")
