"""How a process leaves: `main_guard` runs a command's `main()` and turns how it ended into one
`error: ...` line and the exit code of `harness.errors` (or, under the launcher, each rank's
outcome for it, `harness.outcomes`), and `leave` exits without hanging on a process group's
threads."""

from __future__ import annotations

import gc
import os
import sys
import traceback

from .errors import INTERRUPTED_EXIT_CODE, HarnessExit
from .outcomes import a_peer_left_with, record_outcome, stopped_before_this_start

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
        stopped = stopped_before_this_start()
        if stopped is not None:  # torchrun restarted a rank that a stop ended while it loaded
            raise SystemExit(stopped)
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
