"""Each rank's outcome, left for the launcher (`harness.launch`): its exit code and error line, in
a directory the launcher names in HARNESS_OUTCOME_DIR. The launcher waits for every rank's, prints
the error line once for all of them, and exits with the run's own code rather than torchrun's."""

from __future__ import annotations

import json
import os
from pathlib import Path

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


def a_peer_left_with(code: int) -> bool:
    """Under the launcher: whether another rank has left with `code` (its outcome is written before
    it exits). A peer that stopped at once on a second Ctrl-C makes this rank's collectives fail for
    want of it, and that failure is the stop, not an error of this rank's: the launcher's relayed
    signal can reach this rank after its peer has gone, under load."""
    directory = os.environ.get(OUTCOME_DIR)
    return bool(directory) and any(o["rank"] != this_rank() and o["code"] == code for o in recorded_outcomes(directory))


def recorded_outcomes(directory: str | Path) -> list[dict]:
    """The outcomes the ranks have left in `directory` so far, by rank (each file is whole: see
    record_outcome)."""
    return sorted((json.loads(p.read_text()) for p in Path(directory).glob("rank*.json")), key=lambda o: o["rank"])


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))
