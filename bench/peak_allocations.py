"""What was live at a CUDA memory snapshot's peak, by the lines that allocated it.

    python bench/peak_allocations.py RUN/memory/snapshot_rank0.pickle [--top 30]

The snapshot is the one `train.py --memory-snapshot true` or `python -m latentwire.find_batch
--memory-snapshot true` writes on a GPU. Its history is replayed to the moment the most memory was
allocated; the blocks live then are listed by size and the Python lines that allocated them, most
bytes first: set beside the plan's traced peak, the rows the plan lacks are what it has not counted.
"""

from __future__ import annotations

import argparse
import pickle
import sys
from pathlib import Path

import common  # noqa: F401  (puts the repository on sys.path)
from latentwire.harness.meters import GIB
from latentwire.harness.recordings import by_site, live_at_peak, read_snapshot


def report(snapshot: dict, top: int) -> str:
    lines = []
    for device, trace in enumerate(snapshot["device_traces"]):
        if not trace:
            continue
        peak, live = live_at_peak(trace)
        sites = by_site(live)
        lines.append(
            f"device {device}: {len(trace)} events recorded; at their peak {peak / GIB:.3f} GiB in "
            f"{len(live)} blocks allocated since recording began"
        )
        lines.append("     GiB | blocks x MiB | allocated at (innermost first)")
        for site in sites[:top]:
            lines.append(
                f"{site.block_bytes * site.blocks / GIB:8.3f} | {site.blocks:6d} x "
                f"{site.block_bytes / 2**20:9.2f} | " + "  <  ".join(site.frames)
            )
        rest = sum(s.block_bytes * s.blocks for s in sites[top:])
        if rest:
            lines.append(f"{rest / GIB:8.3f} | the other {len(sites) - top} sites")
    if not lines:
        return "no allocation history in this snapshot (recorded without --memory-snapshot true?)"
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("snapshot", type=Path)
    p.add_argument("--top", type=int, default=30, help="sites listed (default 30)")
    args = p.parse_args()
    try:
        snapshot = read_snapshot(args.snapshot)
    except (OSError, pickle.UnpicklingError) as e:
        print(f"error: {args.snapshot}: {e}", file=sys.stderr)
        sys.exit(2)
    print(report(snapshot, args.top))


if __name__ == "__main__":
    main()
