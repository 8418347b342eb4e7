"""What train.py's loop costs on top of forward, backward and the optimizer step.

The same model, batches, micro-batch and accumulation go through two loops in this process,
interleaved step by step so the machine's other load hits both alike:

- train.py: `train.main(...)`, the real loop as one process runs it (a world of one has no process
  group, so no DDP and no all-reduce; bench/ddp_scaling.py measures ranks): exact accumulation,
  clipping, the non-finite check, OneCycle, and metrics logged at every step (jsonl, TensorBoard,
  console).
- bare: AdamW, forward and backward per micro-batch, step, zero_grad, on its own copy of the model.

Each train.py step ends in its metrics record; right after the record is written, one bare step
runs and is timed. A train.py step's time is the time between the starts of two consecutive
records minus the bare step in between, so its logging is inside it and the bare step is not.
Pairing each step with its neighbour cancels the drift of a shared machine's load, which
alternating whole runs did not (their ratios spread from 0.95 to 1.10).

Neither loop has loader workers (`--num-workers 0`): both collate in the timed step alike.
Summary: median step times and ratio = the median over steps of (train.py step / the bare step
paired with it); the target is <= 1.05.

    python bench/loop_overhead.py            # full: about 2 minutes on 2 cores
    python bench/loop_overhead.py --quick    # a few steps (the tests)
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import torch

from common import STEPS_ONLY, bare_step, build_model, cpu_config, make_loader, median, parse_settings, summary

# isort: split
import train  # found through the repository path that common puts on sys.path


@dataclass(frozen=True)
class Settings:
    steps: int  # optimizer steps of each loop
    warmup: int  # first steps left out (allocator, optimizer state, first records)
    micro_batch_size: int
    grad_accum_steps: int
    num_examples: int


FULL = Settings(steps=120, warmup=4, micro_batch_size=16, grad_accum_steps=2, num_examples=8192)
QUICK = Settings(steps=6, warmup=2, micro_batch_size=4, grad_accum_steps=2, num_examples=256)


def train_flags(s: Settings) -> list:
    """The cpu profile as train.py reads it, with the batch layout of `s`, no loader workers and
    a metrics record at every step."""
    return [
        "--micro-batch-size",
        s.micro_batch_size,
        "--grad-accum-steps",
        s.grad_accum_steps,
        "--num-examples",
        s.num_examples,
        "--max-steps",
        s.steps,
        "--num-workers",
        0,
        "--log-every",
        1,
        *STEPS_ONLY,
    ]


class BareLoop:
    """The reference loop, on its own model, optimizer and loader; its data starts at the same
    first batch as train.py's, so both loops see the same shapes step for step."""

    def __init__(self, s: Settings):
        self.cfg = cpu_config(*train_flags(s))
        self.llms, self.model = build_model(self.cfg)
        self.batches = iter(make_loader(self.cfg, self.llms))
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.optimizer.lr)

    def step(self) -> None:
        micro_batches = [next(self.batches) for _ in range(self.cfg.training.grad_accum_steps)]
        bare_step(self.model, self.llms, self.optimizer, micro_batches)


class PairedTimer:
    """Runs one bare step after each of train.py's metrics records and keeps the times needed
    to tell the two loops' steps apart."""

    def __init__(self, bare: BareLoop):
        self.bare = bare
        self.record_starts: dict[int, float] = {}  # step -> when its record began to be logged
        self.bare_times: dict[int, float] = {}  # step -> the bare step run after its record

    def logger_class(self, base: type) -> type:
        timer = self

        class PairedLogger(base):
            def log(self, record: dict) -> None:
                timer.record_starts[record["step"]] = time.perf_counter()
                super().log(record)
                t = time.perf_counter()
                timer.bare.step()
                timer.bare_times[record["step"]] = time.perf_counter() - t

        return PairedLogger

    def train_py_times(self, warmup: int) -> dict[int, float]:
        """Step k's time in train.py: from the start of record k-1 to the start of record k (so
        record k-1's logging is in it), less the bare step run in between."""
        starts = self.record_starts
        return {k: starts[k] - starts[k - 1] - self.bare_times[k - 1] for k in starts if k > warmup and k - 1 in starts}

    def bare_step_times(self, warmup: int) -> dict[int, float]:
        return {k: t for k, t in self.bare_times.items() if k > warmup}


def run_paired(s: Settings, out_dir: Path) -> PairedTimer:
    """One train.main() run, a bare step after each of its steps."""
    timer = PairedTimer(BareLoop(s))
    argv = ["--profile", "cpu", *map(str, train_flags(s)), "--out-dir", str(out_dir)]
    logger_class = train.MetricsLogger
    train.MetricsLogger = timer.logger_class(logger_class)
    try:
        # Its console lines still get formatted and written (that is part of its cost), just not shown.
        with open(os.devnull, "w") as sink, redirect_stdout(sink):
            train.main(argv)
    finally:
        train.MetricsLogger = logger_class
    return timer


def main() -> None:
    _, s = parse_settings(__doc__.splitlines()[0], QUICK, FULL)
    with tempfile.TemporaryDirectory(prefix="loop_overhead_") as tmp:
        timer = run_paired(s, Path(tmp) / "run")
    train_times, bare_times = timer.train_py_times(s.warmup), timer.bare_step_times(s.warmup)
    steps = sorted(train_times.keys() & bare_times.keys())
    pair_ratios = [train_times[k] / bare_times[k] for k in steps]
    train_ms = 1e3 * median([train_times[k] for k in steps])
    bare_ms = 1e3 * median([bare_times[k] for k in steps])
    quartiles = statistics.quantiles(pair_ratios, n=4) if len(pair_ratios) > 1 else pair_ratios * 3
    # The quartiles of the per-step ratios show how much of a single pair is the machine's other load.
    summary(
        "loop_overhead",
        median(pair_ratios),
        bare_step_ms=bare_ms,
        train_py_step_ms=train_ms,
        steps=len(steps),
        samples_per_step=s.micro_batch_size * s.grad_accum_steps,
        step_ratio_quartiles=f"{quartiles[0]:.3f}/{quartiles[1]:.3f}/{quartiles[2]:.3f}",
    )


if __name__ == "__main__":
    main()
