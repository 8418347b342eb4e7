"""What train.py's loop costs on top of forward, backward and the optimizer step.

The same model, batches, micro-batch and accumulation go through two loops in this process,
alternated round by round so the machine's other load hits both alike:

- train.py: `train.main(...)`, the real loop with every feature on: DDP in a one-process gloo
  group, exact accumulation with its token-count all-reduce and no_sync, clipping, the non-finite
  check, OneCycle, and metrics logged at every step (jsonl, TensorBoard, console). A step's time
  is the difference of consecutive metrics records' wall-clock `time`, so logging is inside it.
- bare: AdamW, forward and backward per micro-batch, step, zero_grad; timed at each step's end.

Neither loop has loader workers (`--num-workers 0`): both collate in the timed step alike.
Summary: median step times and ratio = train.py / bare; the target is <= 1.05.

    python bench/loop_overhead.py            # full: about 2-3 minutes on 2 cores
    python bench/loop_overhead.py --quick    # a few steps (the tests)
"""
from __future__ import annotations

import json
import os
import tempfile
import time
from contextlib import redirect_stdout
from dataclasses import dataclass
from pathlib import Path

import torch

from common import (DIST_ENV, STEPS_ONLY, bare_step, build_model, cpu_config, free_port, make_loader, median,
                    parse_settings, step_durations, summary)
import train  # found through the repository path that common puts on sys.path


@dataclass(frozen=True)
class Settings:
    rounds: int            # train.py runs, each followed (or preceded) by a bare run
    steps: int             # optimizer steps per run
    warmup: int            # first steps of each run left out (allocator, optimizer state)
    micro_batch_size: int
    grad_accum_steps: int
    num_examples: int


FULL = Settings(rounds=10, steps=12, warmup=2, micro_batch_size=16, grad_accum_steps=2, num_examples=8192)
QUICK = Settings(rounds=2, steps=4, warmup=1, micro_batch_size=4, grad_accum_steps=2, num_examples=256)


def train_flags(s: Settings) -> list:
    """The cpu profile as train.py reads it, with the batch layout of `s`, no loader workers and
    a metrics record at every step."""
    return ["--micro-batch-size", s.micro_batch_size, "--grad-accum-steps", s.grad_accum_steps,
            "--num-examples", s.num_examples, "--max-steps", s.steps, "--num-workers", 0, "--log-every", 1,
            *STEPS_ONLY]


def train_py_run(s: Settings, out_dir: Path) -> list[float]:
    """One train.main() run as rank 0 of a one-process gloo group; step durations after warm-up."""
    argv = ["--profile", "cpu", *map(str, train_flags(s)), "--out-dir", str(out_dir)]
    # train.py joins a process group (and wraps the model in DDP) when torchrun's variables are
    # set; a fresh port per run, because each run creates and destroys its own group.
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    try:
        # Its console lines still get formatted and written (that is part of its cost), just not shown.
        with open(os.devnull, "w") as sink, redirect_stdout(sink):
            train.main(argv)
    finally:
        for name in DIST_ENV:
            os.environ.pop(name, None)
    records = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    return step_durations({r["step"]: r["time"] for r in records}, s.warmup)


class BareLoop:
    """The reference loop, built once; every run restarts its data at the same first batch as
    train.py's run, so both loops see the same shapes."""

    def __init__(self, s: Settings):
        self.cfg = cpu_config(*train_flags(s))
        self.llms, self.model = build_model(self.cfg)
        self.loader = make_loader(self.cfg, self.llms)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=self.cfg.lr)

    def run(self, s: Settings) -> list[float]:
        batches = iter(self.loader)
        ends = {0: time.perf_counter()}
        for step in range(1, s.steps + 1):
            bare_step(self.model, self.llms, self.optimizer, [next(batches) for _ in range(s.grad_accum_steps)])
            ends[step] = time.perf_counter()
        return step_durations(ends, s.warmup)


def main() -> None:
    _, s = parse_settings(__doc__.splitlines()[0], QUICK, FULL)
    bare = BareLoop(s)
    train_times, bare_times, round_ratios = [], [], []
    with tempfile.TemporaryDirectory(prefix="loop_overhead_") as tmp:
        for r in range(s.rounds):
            # Alternate which loop goes first, so neither always runs right after the other's set-up.
            if r % 2 == 0:
                t_py, t_bare = train_py_run(s, Path(tmp) / f"round{r}"), bare.run(s)
            else:
                t_bare, t_py = bare.run(s), train_py_run(s, Path(tmp) / f"round{r}")
            train_times += t_py
            bare_times += t_bare
            round_ratios.append(median(t_py) / median(t_bare))
            print(f"round {r + 1}/{s.rounds}: train.py {1e3 * median(t_py):.1f} ms/step, "
                  f"bare {1e3 * median(t_bare):.1f} ms/step (medians of {len(t_py)} and {len(t_bare)} steps)",
                  flush=True)
    train_ms, bare_ms = 1e3 * median(train_times), 1e3 * median(bare_times)
    # The spread of the per-round ratios shows how much of the result is the machine's other load.
    summary("loop_overhead", train_ms / bare_ms, bare_step_ms=bare_ms, train_py_step_ms=train_ms,
            steps_each=len(train_times), samples_per_step=s.micro_batch_size * s.grad_accum_steps,
            round_ratios=f"{min(round_ratios):.3f}..{max(round_ratios):.3f}")


if __name__ == "__main__":
    main()
