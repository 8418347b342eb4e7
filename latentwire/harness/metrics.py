"""Where a logged step's record goes, on rank 0 only: `metrics.jsonl`, TensorBoard (`tb/`) and the
console. What the record measures is `harness.meters`'s. A resumed run's log keeps every whole
record before its step, whatever a killed run left at its end (`keep_log_before`)."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

from .preemption import mute_a_lost_console


class MetricsLogger:
    """One JSON line per logged step, the same scalars in TensorBoard, and the console: a progress
    bar (step, loss, tokens/s, ETA) when stdout is a terminal, and a line per logged step saying
    where the run is (`step 10/2400`), how long it has run and how long it has left."""

    def __init__(
        self,
        out_dir: Path,
        enabled: bool,
        first_step: int = 1,
        total_steps: int | None = None,
        first_record: dict | None = None,
        started: float | None = None,
    ):
        """`first_step` > 1 continues a resumed run: whatever the stopped run logged from that
        step on (after its last checkpoint) is dropped, so every step appears once. `first_record`
        joins the first record this process logs (facts of the run, such as its data). `started`:
        the run's start on time.monotonic()'s clock, for the elapsed time (default: now)."""
        self.enabled = enabled
        self.total_steps, self.first_step = total_steps, first_step
        self.started = time.monotonic() if started is None else started
        self.bar = None
        self.pending = dict(first_record or {})
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter

        path = out_dir / "metrics.jsonl"
        if path.exists():
            keep_log_before(path, first_step)
        self.jsonl = open(path, "a")
        # TensorBoard, reading the older files, drops their events of steps from `purge_step` on, and
        # reads each up to a torn last record; the writer itself never reads them.
        self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=first_step)
        if sys.stdout.isatty() and total_steps is not None:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=first_step - 1, unit="step", dynamic_ncols=True, file=sys.stdout)

    def step_done(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        record, self.pending = record | self.pending, {}
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                self.tb.add_scalar(key, value, record["step"])
        self.tb.flush()  # on disk now, like the JSON line: a run that ends in an error may not close it
        line = format_line(
            record, self.total_steps, time.monotonic() - self.started, first=record["step"] == self.first_step
        )
        mute_a_lost_console()  # a terminal hung up before this rank heard its SIGHUP
        if self.bar is not None:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self.bar.write(line)
        else:
            print(line, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()
            if self.bar is not None:
                self.bar.close()


def keep_log_before(path: Path, first_step: int) -> None:
    """A resumed run's `metrics.jsonl`: the whole records of the steps before `first_step` (the
    stopped run may have logged steps after its checkpoint, which the resumed run logs again), put
    in place by a rename, so that a kill during the rewrite leaves the old file or the new one. No
    line stops a resume: a torn last line (a kill while it was appended) is dropped, said in one
    line; any other damage is said in one line, and the file is kept beside it as it was."""
    raw = path.read_bytes()
    records, torn, damaged = read_log(raw)
    if damaged:
        aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
        aside.write_bytes(raw)
        print(
            f"warning: {path} has {damaged + torn} damaged line(s), left out; the file as it was is kept as {aside}",
            file=sys.stderr,
            flush=True,
        )
    elif torn:
        print(
            f"note: dropped the torn last line of {path} (its run was stopped while writing it)",
            file=sys.stderr,
            flush=True,
        )
    kept = b"".join(line + b"\n" for step, line in records if step < first_step)
    if kept != raw:
        tmp = path.with_name(f".{path.name}.tmp")
        with open(tmp, "wb") as f:
            f.write(kept)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)


def read_log(raw: bytes) -> tuple[list[tuple[int, bytes]], bool, int]:
    """What a `metrics.jsonl` holds: (step, line) of each whole record, whether its last line is
    torn (no newline, and not a record), and how many other lines are not records."""
    *lines, last = raw.split(b"\n")  # `last` is what follows the last newline: b"" if nothing
    records, damaged = [], 0
    for line in lines:
        step = record_step(line)
        if step is not None:
            records.append((step, line))
        elif line.strip():
            damaged += 1
    step = record_step(last)
    if step is not None:  # whole but for its newline
        records.append((step, last))
    return records, step is None and bool(last.strip()), damaged


def record_step(line: bytes) -> int | None:
    """The step of a line that is a whole record, else None."""
    try:
        record = json.loads(line)
    except ValueError:  # not JSON, or not UTF-8
        return None
    step = record.get("step") if isinstance(record, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) else None


def format_line(r: dict, total_steps: int | None = None, elapsed: float | None = None, first: bool = False) -> str:
    """A logged step for the console. With the run's length and elapsed time: `step 10/2400` and
    the time left at the window's step time; the first step this process runs holds its start-up
    (the compile, the allocator's warm-up), so its line says how long it took instead."""
    mfu = "" if r.get("mfu") is None else f" | mfu {100 * r['mfu']:.1f}%"
    step = f"{r['step']:>6}" if total_steps is None else f"{r['step']:>{len(str(total_steps))}}/{total_steps}"
    clock = ""
    if elapsed is not None:
        clock = f" | {hms(elapsed)} elapsed"
        if first:
            clock += f", first step {r['step_time_s']:.1f} s"
        elif total_steps is not None:
            clock += f", {hms((total_steps - r['step']) * r['step_time_s'])} left"
    return (
        f"step {step} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f}"
        f" | {r['samples_per_s']:.1f} samples/s | {r['tokens_per_s']:.0f} tok/s{mfu}"
        f" | mem {r['peak_mem_gb']:.2f} GiB | data wait {100 * r['data_wait_frac']:.1f}%{clock}"
    )


def hms(seconds: float) -> str:
    """0:04:10: hours, minutes, seconds."""
    minutes, secs = divmod(round(seconds), 60)
    return f"{minutes // 60}:{minutes % 60:02d}:{secs:02d}"
