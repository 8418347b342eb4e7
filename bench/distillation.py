"""Step time of train.py with distillation on (--kd-weight 1) versus off, on the cpu profile.

The teacher's targets are computed once, before the first step (latentwire.distillation), so a
distillation step adds only the KL against targets that come with the batch. The one-off pass is
reported beside the ratio: it reads every training example once, as a teacher run inside the step
did in each epoch. Both runs are real train.py runs on the default layout (2 gloo processes); they
alternate, in alternating order, so slow drift in the machine's load hits both.

Summary: ratio = median step time with distillation / without, after warm-up.

    python bench/distillation.py            # full: about 3 minutes
    python bench/distillation.py --quick    # a few steps (the tests)
"""

from __future__ import annotations

import re
import tempfile
from dataclasses import dataclass
from pathlib import Path

from common import median, parse_settings, summary, timed_run

PASS_SECONDS = re.compile(r"distillation targets of (\d+) examples .* computed once in ([\d.]+) s")


@dataclass(frozen=True)
class Settings:
    rounds: int  # pairs of runs (without, with distillation)
    steps: int  # optimizer steps per run
    warmup: int  # first logged steps left out
    micro_batch_size: int  # per rank
    grad_accum_steps: int
    num_examples: int


FULL = Settings(rounds=2, steps=40, warmup=5, micro_batch_size=16, grad_accum_steps=2, num_examples=8192)
QUICK = Settings(rounds=1, steps=3, warmup=1, micro_batch_size=4, grad_accum_steps=1, num_examples=64)


def run(kd: bool, s: Settings, out_dir: Path, threads: int) -> tuple[float, float | None]:
    """(median step time after warm-up, seconds of the teacher's one-off pass or None)."""
    what = f"{'with' if kd else 'without'} distillation"
    stdout, records = timed_run(2, s, out_dir, threads, what, "--kd-weight", 1 if kd else 0)
    found = PASS_SECONDS.search(stdout)
    return median([r["step_time_s"] for r in records if r["step"] > s.warmup]), float(found[2]) if found else None


def main() -> None:
    args, s = parse_settings(__doc__.splitlines()[0], QUICK, FULL)
    off, on, passes = [], [], []
    with tempfile.TemporaryDirectory(prefix="distillation_") as tmp:
        for r in range(s.rounds):
            for kd in (False, True) if r % 2 == 0 else (True, False):
                step, seconds = run(kd, s, Path(tmp) / f"round{r}_kd{int(kd)}", args.threads)
                (on if kd else off).append(step)
                passes += [seconds] if kd else []
            print(
                f"round {r + 1}/{s.rounds}: step {off[-1] * 1e3:.1f} ms without, {on[-1] * 1e3:.1f} ms with "
                f"distillation; the teacher's pass {passes[-1]:.1f} s",
                flush=True,
            )
    without, with_kd, teacher_pass = median(off), median(on), median(passes)
    summary(
        "distillation",
        with_kd / without,
        step_without_ms=without * 1e3,
        step_with_ms=with_kd * 1e3,
        teacher_pass_s=teacher_pass,
        examples=s.num_examples,
    )


if __name__ == "__main__":
    main()
