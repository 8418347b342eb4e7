"""How a run ends, other than done (exit 0) or a rank's traceback (exit 1): an exception class
with its exit code for each of 2-5, which `harness.exits.main_guard` turns into one `error: ...`
line and that code, and the exit code of a preempted run, which saved and exits quietly.

    2   UserError              bad input, refused before anything on disk changes
    3   Diverged               too many non-finite steps (the last good weights are saved), or
                               non-finite weights (never saved)
    4   CheckpointWriteFailed  a checkpoint write failed (earlier ones intact, no partial one)
    5   OutOfMemory            with a memory snapshot where the device has one
    75  PREEMPTED_EXIT_CODE    SIGTERM / SIGUSR1 / SIGHUP: the step was saved; continue with --resume
    130 INTERRUPTED_EXIT_CODE  Ctrl-C: the step was saved (a second Ctrl-C: not); continue with --resume
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

# EX_TEMPFAIL from sysexits.h: "try again later". A checkpoint was saved; `--resume` continues.
PREEMPTED_EXIT_CODE = 75
# The shell's code for a process that SIGINT ended: a person stopped the run (not a preemption
# to requeue).
INTERRUPTED_EXIT_CODE = 130


class HarnessExit(Exception):
    """Ends the run with one `error: ...` line and `exit_code`, no traceback."""

    exit_code = 1


class UserError(HarnessExit):
    exit_code = 2


class Diverged(HarnessExit):
    exit_code = 3


class CheckpointWriteFailed(HarnessExit):
    exit_code = 4


class OutOfMemory(HarnessExit):
    exit_code = 5


# The line on stdout when the loop catches out-of-memory: what a driver times the run's way out
# from (bench/gpu_validation.py), since the `error:` line comes only once the loader's workers and
# the profiler have stopped.
CAUGHT_OUT_OF_MEMORY = "caught out of memory at micro-batch {}; stopping"


@contextmanager
def out_of_memory(advice: str, micro_batch_size: int | None = None, snapshots=None):
    """Out-of-memory ends the run with one line and `advice` (where to see what fits): in the loop
    (a `micro_batch_size` given) also where the memory snapshot is (`snapshots.dump()`), said on
    stdout the moment it is caught (CAUGHT_OUT_OF_MEMORY); outside it with torch's own words."""
    try:
        yield
    except torch.OutOfMemoryError as e:
        if snapshots is None:
            torch_says = (str(e).strip().splitlines() or ["torch.OutOfMemoryError"])[0]
            raise OutOfMemory(f"out of memory outside the training steps ({torch_says}); {advice}") from None
        print(CAUGHT_OUT_OF_MEMORY.format(micro_batch_size), flush=True)
        path = snapshots.dump()
        where = f"memory snapshot: {path}" if path else "no memory snapshot on this device"
        raise OutOfMemory(
            f"out of memory at micro-batch {micro_batch_size} ({where}); lower --micro-batch-size; {advice}"
        ) from None
