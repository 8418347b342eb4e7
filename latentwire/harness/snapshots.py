"""Reading a CUDA memory snapshot afterwards (one MemorySnapshots wrote, or
torch.cuda.memory._dump_snapshot): without running anything it holds, and replayed to the moment
the most memory was allocated, the blocks live then grouped by the lines that allocated them
(bench/peak_allocations.py).
"""
from __future__ import annotations

import io
import pickle
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path


class _DataOnly(pickle.Unpickler):
    """A snapshot is dicts, lists, strings and numbers: a pickle naming any class or function is
    refused rather than run."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"not a memory snapshot: it names {module}.{name}")


def read_snapshot(path: Path) -> dict:
    """A snapshot MemorySnapshots (or torch.cuda.memory._dump_snapshot) wrote, read without running code."""
    data = Path(path).read_bytes()
    try:
        snapshot = _DataOnly(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a damaged pickle fails in any of the unpickler's opcodes
        raise pickle.UnpicklingError(f"not a memory snapshot ({type(e).__name__}: {e})") from None
    if not isinstance(snapshot, dict) or not isinstance(snapshot.get("device_traces"), list):
        raise pickle.UnpicklingError("not a memory snapshot: no device_traces")
    return snapshot


@dataclass(frozen=True)
class Site:
    """Blocks of one size live at the peak that the same lines allocated."""
    block_bytes: int
    blocks: int
    frames: tuple[str, ...]  # innermost first: "file:line name"


def _apply(event: dict, live: dict) -> int:
    """One event of a history on `live` (address -> its alloc event): the change in allocated bytes."""
    if event["action"] == "alloc":
        live[event["addr"]] = event
        return event["size"]
    if event["action"] in ("free_requested", "free_completed") and event["addr"] in live:
        return -live.pop(event["addr"])["size"]
    return 0


def live_at_peak(trace: list[dict]) -> tuple[int, list[dict]]:
    """Replays one device's history (`snapshot["device_traces"][d]`): the most bytes its recorded
    allocations held at once, and the allocation events live at that moment. The allocated count
    falls when a block is freed (free_requested), as torch.cuda.max_memory_allocated counts it;
    blocks allocated before the history began are not in it."""
    live, total, peak, at = {}, 0, 0, -1
    for i, event in enumerate(trace):
        total += _apply(event, live)
        if total > peak:
            peak, at = total, i
    live = {}
    for event in trace[:at + 1]:
        _apply(event, live)
    return peak, list(live.values())


def by_site(events: list[dict], skip: tuple[str, ...] = ("/site-packages/torch/",), depth: int = 3) -> list[Site]:
    """`events` grouped by block size and their `depth` innermost frames outside the `skip` paths
    (torch's own layers say little about which tensor it is), most bytes first. What backward
    allocates on the autograd engine's device thread has no Python frame: its sizes tell it apart."""
    sites = defaultdict(int)
    for event in events:
        frames = [f for f in event.get("frames", []) if not any(part in f["filename"] for part in skip)]
        where = tuple(f"{f['filename']}:{f['line']} {f['name']}" for f in frames[:depth]) or ("(no Python frame)",)
        sites[event["size"], where] += 1
    return sorted((Site(size, count, where) for (size, where), count in sites.items()),
                  key=lambda site: -site.block_bytes * site.blocks)
