"""How a run ends, other than done (exit 0) or a rank's traceback (exit 1): an exception class
with its exit code for each of 2-5, which `main_guard` turns into one `error: ...` line and that
code, and the exit code of a preempted run, which saved and exits quietly.

    2   UserError              bad input, refused before anything on disk changes
    3   Diverged               too many non-finite steps (the last good weights are saved), or
                               non-finite weights (never saved)
    4   CheckpointWriteFailed  a checkpoint write failed (earlier ones intact, no partial one)
    5   OutOfMemory            with a memory snapshot where the device has one
    75  PREEMPTED_EXIT_CODE    SIGTERM / SIGUSR1: the step was saved; continue with --resume
    130 INTERRUPTED_EXIT_CODE  Ctrl-C: the step was saved (a second Ctrl-C: not); continue with --resume
"""
from __future__ import annotations

import gc
import os
import sys
import traceback
from contextlib import contextmanager

import torch

from .outcomes import a_peer_left_with, record_outcome

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
        raise OutOfMemory(f"out of memory at micro-batch {micro_batch_size} ({where}); lower --micro-batch-size; "
                          f"{advice}") from None


# Whether this process joined a process group: it then leaves without finalizing (see leave). Set
# by `started_a_process_group`, for the rest of the process: the group's threads outlive
# destroy_process_group.
_in_a_process_group = False


def started_a_process_group() -> None:
    global _in_a_process_group
    _in_a_process_group = True


def main_guard(main) -> None:
    """Run `main()`; a HarnessExit becomes `error: ...` on stderr and its exit code. Under
    the launcher (`harness.launch`) every rank leaves its outcome for the launcher instead, which
    prints the error line once."""
    try:
        main()
        code = 0
        record_outcome(code, None)
    except HarnessExit as e:
        code = e.exit_code
        if not record_outcome(code, str(e)):
            print(f"error: {e}", file=sys.stderr, flush=True)
    except SystemExit as e:  # preempted: 75; interrupted: 130
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        record_outcome(code, None)
    except KeyboardInterrupt:  # Ctrl-C before a run's handler was installed, or in a command without one
        code = INTERRUPTED_EXIT_CODE
        print("interrupted", file=sys.stderr, flush=True)
        record_outcome(code, None)
    except Exception:
        if _in_a_process_group and a_peer_left_with(INTERRUPTED_EXIT_CODE):
            code = INTERRUPTED_EXIT_CODE
            record_outcome(code, None)
        else:  # printed here, not by the interpreter, so that what the failed frames hold goes now
            traceback.print_exc()
            code = 1
    leave(code)  # after the except: the traceback, and the run's frames and loader with it, are gone


def leave(code: int) -> None:
    """Exit with `code`, or return on 0 where no process group was started. A failed command
    leaves through here too, its traceback printed and dropped: the interpreter's own handler
    would keep it (sys.last_exc) and with it every object of the failed frames until the very end
    of finalization, a DataLoader's workers among them. A process that
    started one leaves without the interpreter's finalization: a gloo worker thread that frees a
    finished collective's tensors takes the GIL, and a thread that asks for the GIL while the
    interpreter finalizes aborts the whole process ("terminate called without an active
    exception", pytorch/pytorch#190489; 3 of 60 sharded evaluations under load). First, while the
    interpreter is whole, what is left is collected (a DataLoader's workers stop when their
    iterator goes) and the output flushed."""
    if _in_a_process_group:
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
