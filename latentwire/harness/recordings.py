"""Reading what a run recorded, afterwards, without running anything it holds:

- a torch.profiler trace (harness.profiling writes one per rank), as a few lines: the device's
  kernels by their time (a CPU's operators where the trace has no device), and the device's idle
  share over the profiled steps (`summarize_trace`);
- a CUDA memory snapshot (harness.profiling's MemorySnapshots, or torch.cuda.memory._dump_snapshot),
  replayed to the moment the most memory was allocated, the blocks live then grouped by the lines
  that allocated them (bench/peak_allocations.py).
"""

from __future__ import annotations

import gzip
import io
import json
import pickle
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

# Chrome-trace categories of the device's own work: what it executes, and copies and fills.
DEVICE_CATEGORIES = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize_trace(path: Path, top: int = 15) -> dict:
    """A torch.profiler trace (Chrome JSON, as `profiler_options` writes it) as numbers: over the
    profiled steps (from the first ProfilerStep's start to the last one's end), how long the
    device was busy (the union of its kernels, copies and fills) and idle, and the kernels with
    the most time, summed by name. A CPU run's trace has no device activity: its operators stand
    in, each by its self time (less the operators it called), and busy is the union of them."""
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt") as f:
        events = [e for e in json.load(f).get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [
        e
        for e in events
        if e.get("cat") in ("user_annotation", "cpu_op") and e.get("name", "").startswith("ProfilerStep#")
    ]
    device = [e for e in events if e.get("cat") in DEVICE_CATEGORIES]
    work = device or [e for e in events if e.get("cat") == "cpu_op" and not e["name"].startswith("ProfilerStep#")]
    timed = steps or work
    start, end = min(e["ts"] for e in timed), max(e["ts"] + e["dur"] for e in timed)
    busy, reach = 0.0, start
    for e in sorted(work, key=lambda e: e["ts"]):  # the union of the intervals, within the steps
        lo, hi = max(e["ts"], reach), min(e["ts"] + e["dur"], end)
        if hi > lo:
            busy, reach = busy + hi - lo, hi
    spent, calls = defaultdict(float), defaultdict(int)
    for e, own in zip(work, [e["dur"] for e in work] if device else _self_times(work), strict=True):
        spent[e["name"]] += own
        calls[e["name"]] += 1
    total = sum(spent.values()) or 1.0
    ranked = sorted(spent, key=spent.get, reverse=True)[:top]
    return {
        "activity": "device kernels" if device else "CPU operators",
        "steps": len(steps),
        "span_ms": (end - start) / 1e3,
        "busy_ms": busy / 1e3,
        "idle_share": 1 - busy / max(end - start, 1e-9),
        "total_ms": total / 1e3,
        "top": [{"name": n, "ms": spent[n] / 1e3, "share": spent[n] / total, "calls": calls[n]} for n in ranked],
    }


def _self_times(ops: list[dict]) -> list[float]:
    """Each operator's duration less that of the operators it called (nested in it, same thread)."""
    own = [e["dur"] for e in ops]
    by_thread = defaultdict(list)
    for i, e in enumerate(ops):
        by_thread[e.get("tid")].append(i)
    for indices in by_thread.values():
        stack = []
        for i in sorted(indices, key=lambda i: (ops[i]["ts"], -ops[i]["dur"])):
            while stack and ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"] <= ops[i]["ts"]:
                stack.pop()
            if stack:
                own[stack[-1]] -= ops[i]["dur"]
            stack.append(i)
    return own


def format_trace_summary(summary: dict) -> str:
    """summarize_trace's numbers as a short text: the idle share, then the top kernels."""
    lines = [
        f"{summary['steps']} profiled steps, {summary['span_ms']:.1f} ms: {summary['activity']} busy "
        f"{summary['busy_ms']:.1f} ms, idle {100 * summary['idle_share']:.1f}%",
        f"top {summary['activity']} by time (of {summary['total_ms']:.1f} ms summed):",
    ]
    lines += [
        f"  {100 * t['share']:5.1f}%  {t['ms']:9.1f} ms  {t['calls']:6d} calls  {t['name'][:140]}"
        for t in summary["top"]
    ]
    return "\n".join(lines) + "\n"


# Allocations the history keeps, the newest ones: torch's own default for the memory visualizer.

# --- What was live at the peak ----------------------------------------------------------------


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
    for event in trace[: at + 1]:
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
    return sorted(
        (Site(size, count, where) for (size, where), count in sites.items()),
        key=lambda site: -site.block_bytes * site.blocks,
    )
