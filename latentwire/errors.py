"""How a run ends, other than done (exit 0) or a rank's traceback (exit 1): an exception class
with its exit code for each of 2-5, which `main_guard` turns into one `error: ...` line and that
code, and the exit code of a preempted run, which saved and exits quietly.

    2   UserError              bad input, refused before anything on disk changes
    3   Diverged               too many non-finite steps (the last good weights are saved), or
                               non-finite weights (never saved)
    4   CheckpointWriteFailed  a checkpoint write failed (earlier ones intact, no partial one)
    5   OutOfMemory            with a memory snapshot where the device has one
    75  PREEMPTED_EXIT_CODE    SIGTERM / SIGUSR1: the step was saved; continue with --resume
"""
from __future__ import annotations

import os
import sys

# EX_TEMPFAIL from sysexits.h: "try again later". A checkpoint was saved; `--resume` continues.
PREEMPTED_EXIT_CODE = 75


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


# Set by distributed.init_distributed once this process has started a process group (see leave).
process_group_started = False


def main_guard(main) -> None:
    """Run `main()`; a HarnessExit becomes `error: ...` on stderr and its exit code. Under
    launch.sh (`latentwire.launch`) every rank leaves its outcome for the launcher instead, which
    prints the error line once."""
    from .launch import record_outcome
    try:
        main()
    except HarnessExit as e:
        if not record_outcome(e.exit_code, str(e)):
            print(f"error: {e}", file=sys.stderr, flush=True)
        leave(e.exit_code)
    except SystemExit as e:  # preempted: 75
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else int(e.code is not None)
        record_outcome(code, None)
        leave(code)
    record_outcome(0, None)
    leave(0)


def leave(code: int) -> None:
    """Exit with `code`. A process that started a process group leaves without the interpreter's
    finalization, once its output is flushed: a gloo worker thread that frees a finished
    collective's tensors takes the GIL, and a thread that asks for the GIL while the interpreter
    finalizes aborts the whole process ("terminate called without an active exception",
    pytorch/pytorch#190489; 3 of 60 sharded evaluations under load). Whatever a command writes
    is closed by then."""
    if process_group_started:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    sys.exit(code)
