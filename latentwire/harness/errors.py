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
import json
import os
import sys
import traceback
from pathlib import Path

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


# Set by distributed.leave_together once this process has joined a process group, for the rest
# of the process: the group's threads outlive destroy_process_group (see leave).
process_group_started = False


# Where the launcher (`harness.launch`) waits for every rank's outcome: exit code and error line.
OUTCOME_DIR = "HARNESS_OUTCOME_DIR"


def record_outcome(code: int, error: str | None) -> bool:
    """Leave this rank's outcome for the launcher, if one is waiting for it; True if so (the
    launcher then prints the error line, once for all ranks)."""
    directory = os.environ.get(OUTCOME_DIR)
    if not directory:
        return False
    rank = this_rank()
    path = Path(directory) / f"rank{rank}.json"
    try:  # written whole or not at all: a rank killed mid-write leaves no half outcome
        path.with_suffix(".tmp").write_text(json.dumps({"rank": rank, "code": code, "error": error}))
        os.replace(path.with_suffix(".tmp"), path)
    except OSError:
        return False
    return True


def a_peer_stopped_at_once() -> bool:
    """Under the launcher, in a process group: whether another rank has left on a second Ctrl-C
    (its outcome, 130, is written before it exits). Then this rank's collectives fail for want of
    that peer, and the failure is the stop, not an error of this rank's: the launcher's relayed
    signal can reach this rank after its peer has gone, under load."""
    directory = os.environ.get(OUTCOME_DIR)
    if not (directory and process_group_started):
        return False
    return any(o["rank"] != this_rank() and o["code"] == INTERRUPTED_EXIT_CODE for o in recorded_outcomes(directory))


def recorded_outcomes(directory: str | Path) -> list[dict]:
    """The outcomes the ranks have left in `directory` so far, by rank (each file is whole: see
    record_outcome)."""
    return sorted((json.loads(p.read_text()) for p in Path(directory).glob("rank*.json")), key=lambda o: o["rank"])


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


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
        if a_peer_stopped_at_once():
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
    if process_group_started:
        gc.collect()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        sys.exit(code)
