"""Samples/s of train.py with one process versus two gloo processes (DDP), on the cpu profile.

Both are real train.py runs in subprocesses, as users start them (`python train.py` and
`python -m torch.distributed.run --standalone --nproc_per_node=2 train.py`), with the same
per-rank micro-batch and accumulation, so the two-process global batch is twice as large.
Throughput is the median of the `samples_per_s` records (global samples) after warm-up;
the two runs alternate, in alternating order, so slow drift in the machine's load hits both.

Summary: ratio = two-process / one-process samples/s. The ideal 2 needs a free core for each
rank's `--threads` threads; on a 2-core machine the two ranks share the cores (with any loader
workers and any other job), so the ratio measures DDP's overhead on gloo (the gradient
all-reduce, the token-count all-reduce, no_sync bookkeeping) plus contention for the cores, not
how the harness scales on GPUs.

    python bench/ddp_scaling.py            # full: about 2-3 minutes
    python bench/ddp_scaling.py --quick    # a few steps (the tests)
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import median, parse_settings, summary, timed_run


@dataclass(frozen=True)
class Settings:
    rounds: int  # pairs of runs (one process, two processes)
    steps: int  # optimizer steps per run
    warmup: int  # first logged steps left out (start-up, allocator, optimizer state)
    micro_batch_size: int  # per rank
    grad_accum_steps: int
    num_examples: int


FULL = Settings(rounds=3, steps=16, warmup=3, micro_batch_size=16, grad_accum_steps=2, num_examples=8192)
QUICK = Settings(rounds=1, steps=3, warmup=1, micro_batch_size=4, grad_accum_steps=1, num_examples=256)


def run(nproc: int, s: Settings, out_dir: Path, threads: int) -> float:
    """Median global samples/s of one train.py run after warm-up."""
    _, records = timed_run(nproc, s, out_dir, threads, f"with {nproc} process(es)")
    return median([r["samples_per_s"] for r in records if r["step"] > s.warmup])


def main() -> None:
    args, s = parse_settings(__doc__.splitlines()[0], QUICK, FULL)
    print(
        f"note: the 2 ranks x {args.threads} thread(s) share {os.cpu_count()} cores (and any other job there)"
        ": the ratio measures DDP's overhead on gloo plus contention for the cores, not GPU scaling",
        flush=True,
    )
    one, two = [], []
    with tempfile.TemporaryDirectory(prefix="ddp_scaling_") as tmp:
        for r in range(s.rounds):
            order = (1, 2) if r % 2 == 0 else (2, 1)
            rates = {n: run(n, s, Path(tmp) / f"round{r}_nproc{n}", args.threads) for n in order}
            one.append(rates[1])
            two.append(rates[2])
            print(
                f"round {r + 1}/{s.rounds}: 1 process {rates[1]:.1f} samples/s, 2 processes {rates[2]:.1f} samples/s",
                flush=True,
            )
    one_rate, two_rate = median(one), median(two)
    summary(
        "ddp_scaling",
        two_rate / one_rate,
        one_process_samples_per_s=one_rate,
        two_process_samples_per_s=two_rate,
        per_rank_batch=f"{s.micro_batch_size}x{s.grad_accum_steps}",
    )


if __name__ == "__main__":
    main()
