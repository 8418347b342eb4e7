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
        sys.exit(e.exit_code)
    except SystemExit as e:  # preempted: 75
        record_outcome(e.code if isinstance(e.code, int) else int(e.code is not None), None)
        raise
    record_outcome(0, None)
