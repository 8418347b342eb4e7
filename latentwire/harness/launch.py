"""torchrun, ending with the run's own exit code: `python -m PACKAGE.launch [torchrun flags] train.py [flags]`.

Plain torchrun exits 1 whatever its ranks' codes were, prints a bad input's `error:` line once per
rank, and adds its own traceback. launch.sh runs this module instead: the same torchrun (its flag
parser and its `run`, in this process), with every rank leaving its outcome, exit code and error
line, in a directory named by HARNESS_OUTCOME_DIR (`errors.main_guard` writes it: harness.outcomes). At the end
the run's error line is printed once and the run's code is the exit code: the lowest rank's
non-zero code (2 bad input, 3 diverged, 4 checkpoint write failed, 5 out of memory, 75 preempted);
else 1 with one line naming what failed (a rank's traceback is above it). Under SLURM each node
runs one launcher, so each node prints the line.

With --max-restarts torchrun starts the ranks again when one fails; the code and line are the last
attempt's (the outcomes of its ranks' processes). A rank that ends the run on purpose tells the
launcher (harness.outcomes), which then stops torchrun rather than let it restart a run that would
end the same way, or one a person or a scheduler stopped.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import tempfile
from pathlib import Path

from .errors import INTERRUPTED_EXIT_CODE, PREEMPTED_EXIT_CODE
from .outcomes import LAUNCHER_PID, OUTCOME_DIR, RUN_ENDED, recorded_outcomes, stop_passed_on
from .preemption import mute_a_lost_console

# Stop signals the launcher passes to its ranks (pass_stop_signals_to_ranks)
PASSED_ON = (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT, signal.SIGHUP)


def run_outcome(directory: Path, pids: set[int]) -> dict | None:
    """The outcome of the lowest rank of the processes `pids` (an attempt's) that ended with a
    non-zero code, or None if none did."""
    return next((o for o in recorded_outcomes(directory, pids) if o["code"] != 0), None)


def silence_torchrun() -> None:
    """torchrun's own log lines (a rank failed, closing signals sent) repeat what the outcome says."""
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)


def ranks(launcher: int | str = "self") -> list[int]:
    """The pids of a launcher's children (this one's by default): the ranks torchrun started (Linux's /proc)."""
    return [int(pid) for path in Path(f"/proc/{launcher}/task").glob("*/children") for pid in path.read_text().split()]


def exit_code_of(stop: signal.Signals) -> int:
    """The run's exit code for a stop signal passed on: Ctrl-C's 130, a preemption's 75 for the others."""
    return INTERRUPTED_EXIT_CODE if stop == signal.SIGINT else PREEMPTED_EXIT_CODE


class RunEnd:
    """RUN_ENDED's handler: a rank has ended the run on purpose (its outcome is recorded), so torchrun
    is stopped as its own signal handling stops it (SignalException: it stops the ranks left and does
    not restart them). `ranks`: the processes of that attempt, whose outcomes are the run's."""

    def __init__(self):
        self.ranks: set[int] | None = None  # None: no rank has ended the run
        signal.signal(RUN_ENDED, self)

    def __call__(self, signum, frame) -> None:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        if self.ranks is None:  # once: torchrun is stopping
            self.ranks = set(ranks())  # an exited rank too: torchrun reaps it in this thread, after the handler
            raise SignalException("a rank ended the run", sigval=signal.SIGTERM)


def pass_stop_signals_to_ranks(args, run_end: RunEnd) -> None:
    """SIGTERM and SIGUSR1 (a scheduler's preemption, launch.sh, srun on each node) go straight to
    the ranks as SIGTERM, and SIGINT (Ctrl-C) and SIGHUP (a terminal's hangup; the terminal signals
    this launcher, not the ranks, which torchrun starts in sessions of their own) as themselves, each
    time they come: a second Ctrl-C is a second one for the ranks too. torchrun goes on waiting for
    them to save and exit (75, or 130). Left to torchrun, it would pass the signal on too, but then
    kill ranks still saving after its shutdown timeout, which torch < 2.13 fixes at 30 s. While no
    rank runs, torchrun stops as usual; once a rank has ended the run (`run_end`), it is stopping."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    def stop(signum, frame):
        if signum == signal.SIGHUP:  # the run's own code and error line must still come out
            mute_a_lost_console()
        pids = ranks()
        if not pids and run_end.ranks is None:
            raise SignalException(f"launcher got {signal.Signals(signum).name}", sigval=signal.Signals(signum))
        # The ranks' preemption (75) ends the run: torchrun must not restart it
        stop_passed_on(exit_code_of(signum))
        for pid in pids:
            try:
                os.kill(pid, signum if signum in (signal.SIGINT, signal.SIGHUP) else signal.SIGTERM)
            except ProcessLookupError:  # a rank that has just exited
                pass

    handled = [name.strip() for name in args.signals_to_handle.split(",")]
    args.signals_to_handle = ",".join(name for name in handled if name not in {s.name for s in PASSED_ON})
    for sig in PASSED_ON:
        signal.signal(sig, stop)


def main(argv: list[str] | None = None) -> int:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    args = parse_args(argv)
    silence_torchrun()
    run_end = RunEnd()
    with tempfile.TemporaryDirectory(prefix="outcome-") as directory:
        os.environ[OUTCOME_DIR], os.environ[LAUNCHER_PID] = directory, str(os.getpid())
        pass_stop_signals_to_ranks(args, run_end)
        failed, attempt = None, set()
        try:
            run(args)
        except ChildFailedError as e:  # the last attempt's failed ranks
            rank, failure = e.get_first_failure()
            failed = f"rank {rank} failed with exit code {failure.exitcode} (see its output above)"
            attempt = {f.pid for f in e.failures.values()}
        except SignalException as e:
            attempt = run_end.ranks or set()
            if run_end.ranks is None and e.sigval in PASSED_ON:  # no rank was running (a rendezvous, a restart)
                code = exit_code_of(e.sigval)
                stopped = "interrupted" if code == INTERRUPTED_EXIT_CODE else "preempted"
                print(f"{stopped} while no rank was running: nothing to save", file=sys.stderr, flush=True)
                return code  # 75: launch.sh requeues the job under SLURM
            failed = f"torchrun received {e.sigval.name} and stopped the ranks"
        outcome = run_outcome(Path(directory), attempt)
    if outcome is not None:
        if outcome["error"]:
            print(f"error: {outcome['error']}", file=sys.stderr, flush=True)
        return outcome["code"]
    if failed:
        print(f"error: {failed}", file=sys.stderr, flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
