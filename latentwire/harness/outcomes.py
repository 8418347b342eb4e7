"""Each rank's outcome, left for the launcher (`harness.launch`): its exit code and error line, in
a directory the launcher names in HARNESS_OUTCOME_DIR. The launcher prints the error line once for
all of them, and exits with the run's own code rather than torchrun's.

torchrun restarts every rank when one fails (--max-restarts), whatever its code: a run a rank ended
on purpose (a bad input, divergence, a failed write, out of memory, or a stop the launcher passed
on) would be started again, to end the same way. So a rank that records such an outcome also tells
its launcher (RUN_ENDED, to the launcher's pid in HARNESS_LAUNCHER_PID), which stops torchrun
instead; each outcome names the process that left it, so the launcher reads those of the ranks of
the attempt that ended, not an earlier attempt's. A preemption (75) that torchrun's own stop caused
(it stops the ranks to restart them when a node joins) is not the run's end: only one the launcher
passed on is (`stop_passed_on`). A stop that reaches ranks before they hear signals (still
importing) ends them, and torchrun starts them again: those ranks end the run at once
(`stopped_before_this_start`)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

from .errors import PREEMPTED_EXIT_CODE

OUTCOME_DIR = "HARNESS_OUTCOME_DIR"
LAUNCHER_PID = "HARNESS_LAUNCHER_PID"
RUN_ENDED = signal.SIGUSR2  # a rank to its launcher: do not let torchrun restart this run
STOP_PASSED_ON = "stop_passed_on"  # a file the launcher leaves in the directory before it passes a stop signal on


def record_outcome(code: int, error: str | None) -> bool:
    """Leave this rank's outcome for the launcher, if one is waiting for it; True if so (the
    launcher then prints the error line, once for all ranks). A non-zero outcome ends the run, and
    the launcher is told so, unless torchrun's own stop caused it."""
    directory = os.environ.get(OUTCOME_DIR)
    if not directory:
        return False
    rank = this_rank()
    path = Path(directory) / f"rank{rank}.json"
    outcome = {"rank": rank, "pid": os.getpid(), "code": code, "error": error}
    try:
        write_whole(path, json.dumps(outcome))
    except OSError:
        return False
    if code != 0 and (code != PREEMPTED_EXIT_CODE or (Path(directory) / STOP_PASSED_ON).exists()):
        tell_the_launcher()
    return True


def tell_the_launcher() -> None:
    """RUN_ENDED to the launcher that started this rank (its parent: torchrun runs in it)."""
    launcher = int(os.environ.get(LAUNCHER_PID, "0"))
    if launcher and launcher == os.getppid():
        os.kill(launcher, RUN_ENDED)


def stop_passed_on(code: int) -> None:
    """The launcher's mark, before it passes a stop signal to its ranks: their preemption ends the
    run, and `code` (75, or 130 for Ctrl-C) is what a rank started after it exits with."""
    write_whole(Path(os.environ[OUTCOME_DIR]) / STOP_PASSED_ON, str(code))


def stopped_before_this_start() -> int | None:
    """Under the launcher: the exit code of a stop it passed on before this process started, else
    None. Such a process is one torchrun started again because the stop ended its predecessor
    before that one had set its signal handlers: it must end the run, not start it over."""
    directory = os.environ.get(OUTCOME_DIR)
    try:
        return int((Path(directory) / STOP_PASSED_ON).read_text()) if directory else None
    except FileNotFoundError:
        return None


def write_whole(path: Path, text: str) -> None:
    """`text` in `path`, whole or not at all: a process killed mid-write leaves no half of it."""
    path.with_suffix(".tmp").write_text(text)
    os.replace(path.with_suffix(".tmp"), path)


def a_peer_left_with(code: int) -> bool:
    """Under the launcher: whether another rank has left with `code` (its outcome is written before
    it exits). A peer that stopped at once on a second Ctrl-C makes this rank's collectives fail for
    want of it, and that failure is the stop, not an error of this rank's: the launcher's relayed
    signal can reach this rank after its peer has gone, under load."""
    directory = os.environ.get(OUTCOME_DIR)
    return bool(directory) and any(o["rank"] != this_rank() and o["code"] == code for o in recorded_outcomes(directory))


def recorded_outcomes(directory: str | Path, pids: set[int] | None = None) -> list[dict]:
    """The outcomes the ranks have left in `directory` so far, by rank (each file is whole: see
    record_outcome); only those of the processes `pids`, if given."""
    outcomes = (json.loads(p.read_text()) for p in Path(directory).glob("rank*.json"))
    return sorted((o for o in outcomes if pids is None or o["pid"] in pids), key=lambda o: o["rank"])


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))
