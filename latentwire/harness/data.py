"""Data for a data-parallel loop, whatever the examples are: how a run draws them, from one source
or from several by weight (`Mixture`), a sampler that deals each rank a disjoint shard of each
epoch's draws and can start an epoch part-way (resume), the examples a run's steps will draw,
the DataLoader the loop reads, its global batches of accumulated micro-batches, and the copy of a
collated batch to the device. How large those batches are is `harness.layout`'s."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import torch
from torch.utils.data import DataLoader

from .errors import UserError
from .loop_config import Loader
from .preemption import shield_worker_from_stop_signals

# A mixture's weights repeat every `period` draws; past this many, the weights are too finely written.
MAX_PERIOD = 1_000_000
SOURCE_SEED_STRIDE = 1 << 32  # source i permutes with seed + i x this + its epoch: no two sources share a seed


class Mixture:
    """How a run draws its examples from one or several sources, each a contiguous block of the
    dataset's indices (source i: `offsets[i]` on, `sizes[i]` long), in proportion to `weights`.

    The draws form one sequence, cut into epochs of `epoch_length` positions. Each source's weight,
    as an exact fraction of their sum, makes it `quotas[i]` of every `period` consecutive positions
    (7 of 10 for 0.7), the slots of each period shuffled by a hash of the seed and the position
    (any period is found without the ones before it). A source's own draws go through its examples
    in a seeded permutation per pass (`torch.randperm` of seed + i x SOURCE_SEED_STRIDE + pass), so
    each source is seen whole before any of its examples repeats. Every position's example depends
    only on the seed and the position: the same on any world size, and from any position (resume).

    One source is the plain case: its epochs are its passes, permuted as DistributedSampler
    permutes (`torch.randperm` of seed + epoch), so a run on one source draws what it always did.
    """

    def __init__(self, sizes, weights, seed: int):
        if len(sizes) != len(weights) or not sizes:
            raise ValueError("a mixture has one weight per source, and at least one source")
        if min(sizes) < 1:
            raise UserError("every source of a mixture needs at least one example")
        total = sum(Fraction(w) for w in weights)
        shares = [Fraction(w) / total for w in weights]
        if min(shares) <= 0:
            raise UserError("every weight of a mixture must be positive")
        self.period = math.lcm(*(s.denominator for s in shares))
        if self.period > MAX_PERIOD:
            raise UserError(
                f"mixture weights {', '.join(map(str, weights))} repeat only every {self.period} draws (at most "
                f"{MAX_PERIOD}): write them with fewer digits"
            )
        self.sizes, self.seed = tuple(sizes), seed
        self.shares = tuple(shares)
        self.quotas = tuple(int(s * self.period) for s in shares)
        self.offsets = tuple(itertools.accumulate(self.sizes, initial=0))[:-1]
        # int32 indices where they fit (the same permutations): a rank keeps its share of an epoch's order
        self.dtype = torch.int32 if sum(self.sizes) < 2**31 else torch.int64
        # An epoch is about one pass over all the examples, in whole periods.
        self.epoch_length = -(-sum(self.sizes) // self.period) * self.period

    @classmethod
    def single(cls, n: int, seed: int) -> Mixture:
        return cls((n,), (1,), seed)

    def order(self, epoch: int) -> torch.Tensor:
        """The dataset indices of `epoch`'s positions, in draw order (of `dtype`)."""
        if len(self.sizes) == 1:
            return self._source_draws(0, epoch * self.epoch_length, self.epoch_length)
        periods = self.epoch_length // self.period
        slots = torch.from_numpy(self.slots(epoch * periods, periods))
        out = torch.empty(self.epoch_length, dtype=self.dtype)
        for i, quota in enumerate(self.quotas):
            where = (slots == i).nonzero().squeeze(1)
            out[where] = self.offsets[i] + self._source_draws(i, epoch * periods * quota, len(where))
        return out

    def slots(self, first_period: int, periods: int) -> np.ndarray:
        """The source of each position of `periods` periods from `first_period` on: each period
        holds quotas[i] slots of source i, in an order drawn from the seed and its positions."""
        pattern = np.repeat(np.arange(len(self.quotas), dtype=np.int16), self.quotas)
        if len(self.quotas) == 1:
            return np.zeros(periods * self.period, dtype=np.int16)
        positions = np.arange(first_period * self.period, (first_period + periods) * self.period, dtype=np.uint64)
        keys = _splitmix64(positions + _splitmix64(np.uint64(self.seed))).reshape(periods, self.period)
        return pattern[np.argsort(keys, axis=1, kind="stable")].reshape(-1)

    def counts(self, epoch: int, positions: int) -> list[int]:
        """How many of `epoch`'s first `positions` positions draw from each source: whole periods
        give each its quota exactly, and only the last, partial one is looked at."""
        periods, rest = divmod(positions, self.period)
        counts = [periods * q for q in self.quotas]
        if rest:
            last = self.slots(epoch * (self.epoch_length // self.period) + periods, 1)[:rest]
            counts = [c + int((last == i).sum()) for i, c in enumerate(counts)]
        return counts

    def _source_draws(self, i: int, first: int, count: int) -> torch.Tensor:
        """Source i's local indices of its draws first .. first + count - 1, across its passes."""
        n, pieces = self.sizes[i], []
        for p in range(first // n, -(-(first + count) // n)):
            g = torch.Generator().manual_seed(self.seed + i * SOURCE_SEED_STRIDE + p)
            perm = torch.randperm(n, generator=g, dtype=self.dtype)
            pieces.append(perm[max(first - p * n, 0) : min(first + count - p * n, n)])
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces)


def _splitmix64(x: np.ndarray) -> np.ndarray:
    """A bijective 64-bit mix (Steele et al.'s SplitMix64 finaliser): counter-based random keys."""
    with np.errstate(over="ignore"):
        x = (x + np.uint64(0x9E3779B97F4A7C15)).astype(np.uint64)
        x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return x ^ (x >> np.uint64(31))


class ShardSampler(torch.utils.data.DistributedSampler):
    """DistributedSampler over a Mixture's epochs that can start an epoch part-way (resume) without
    loading what it skips.

    An epoch's order depends only on (seed, epoch), and rank r takes every world_size-th index of
    it, so skipping the first `done // world_size` indices on every rank skips exactly the first
    `done` examples of the epoch in the global order, for any world size. A rank keeps only its own
    share of the order (its memory does not grow with the others'), and yields it lazily.
    """

    def __init__(self, draws: Mixture, num_replicas: int, rank: int):
        super().__init__(
            range(draws.epoch_length),
            num_replicas=num_replicas,
            rank=rank,
            shuffle=True,
            seed=draws.seed,
            drop_last=True,
        )
        self.draws, self.skip = draws, 0

    def start_epoch(self, epoch: int, global_examples_done: int = 0) -> None:
        self.set_epoch(epoch)
        self.skip = global_examples_done // self.num_replicas

    def __iter__(self):
        order = self.draws.order(self.epoch)[self.rank : self.total_size : self.num_replicas][self.skip :]
        return itertools.chain.from_iterable(chunk.tolist() for chunk in order.clone().split(4096))

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
    draws: Mixture, *, world: int, micro: int, accum: int, epoch: int, examples_done: int, steps: int
) -> torch.Tensor:
    """The dataset indices that `steps` optimizer steps will draw, starting `examples_done` into
    `epoch` (global_batches' position), in increasing order: decided in advance by the order of
    each epoch (the same for any world size), of which step s takes positions
    [s x global batch, (s + 1) x global batch), each epoch's incomplete last step dropped."""
    visited, seen = [], 0
    for at, start, stop in spans_drawn(draws, world, micro, accum, epoch, examples_done, steps):
        if seen == sum(draws.sizes):  # all of them already
            break
        visited.append(draws.order(at)[start:stop])
        visited = [torch.cat(visited).unique()]
        seen = len(visited[0])
    return visited[0] if visited else torch.empty(0, dtype=draws.dtype)


def spans_drawn(draws: Mixture, world: int, micro: int, accum: int, epoch: int, examples_done: int, steps: int):
    """(epoch, first position, end position) of each epoch's part that `steps` optimizer steps from
    `examples_done` into `epoch` take."""
    global_batch = micro * accum * world
    steps_per_epoch = draws.epoch_length // world // micro // accum
    while steps > 0 and steps_per_epoch:  # none: smaller than a global batch (check_one_global_batch)
        taken = min(steps, steps_per_epoch - examples_done // global_batch)
        yield epoch, examples_done, examples_done + taken * global_batch
        steps, epoch, examples_done = steps - taken, epoch + 1, 0


def draws_per_source(draws: Mixture, *, world: int, micro: int, accum: int, steps: int) -> list[int]:
    """How many of the examples a run of `steps` optimizer steps draws come from each source."""
    totals = [0] * len(draws.sizes)
    for epoch, _, stop in spans_drawn(draws, world, micro, accum, 0, 0, steps):  # each from its epoch's start
        totals = [t + c for t, c in zip(totals, draws.counts(epoch, stop), strict=True)]
    return totals


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


def examples_drawn(draws: Mixture, *, state, steps: int) -> torch.Tensor:
    """The dataset indices a run of `steps` optimizer steps draws, in increasing order: those of the
    whole run from its first step, and those from `state`'s position (a TrainState: a resumed run's,
    whose layout or --new-data may draw others). Work done once per example before training covers
    the whole run's whether it stops early or resumes late: the same examples then pass through it
    in the same batches, so a run that stopped and resumed trains bitwise as the one that did not."""
    world, micro, accum = state.layout
    starts = {(0, 0, steps), (state.epoch, state.examples_done, steps - state.step)}  # one, unless resumed
    return torch.cat(
        [
            examples_visited(draws, world=world, micro=micro, accum=accum, epoch=epoch, examples_done=done, steps=left)
            for epoch, done, left in starts
        ]
    ).unique()


def check_one_global_batch(n: int, micro: int, accum: int, world: int) -> None:
    """The loader drops an epoch's incomplete last step: a dataset smaller than one global batch
    would leave none."""
    if n < micro * accum * world:
        raise UserError(f"dataset of {n} examples is smaller than one global batch ({micro} x {accum} x {world} ranks)")
