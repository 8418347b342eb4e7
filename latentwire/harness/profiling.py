"""The profiler hook and CUDA memory snapshots.

- `torch.profiler` on the profile's wait/warmup/active schedule writes one trace per rank under
  `out_dir/traces` (TensorBoard's profiler plugin, Perfetto, chrome://tracing read it), with
  switches for input shapes, memory and Python stacks.
- A CUDA memory snapshot (`torch.cuda.memory._record_memory_history`) shows every live block and
  the stack that allocated it (drag the pickle into https://pytorch.org/memory_viz). On request
  it records from the start and is written at the end; on out-of-memory it is always written, with
  the allocation history if recording was on and the allocator's current state if not.
  `live_at_peak` replays a snapshot's history to the moment the most memory was allocated and
  groups the blocks live then by the lines that allocated them (bench/peak_allocations.py).
"""
from __future__ import annotations

import io
import pickle
from collections import defaultdict
from dataclasses import dataclass
from typing import ClassVar
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler


class NoProfiler:
    """Stands in when profiling is off, so the loop calls `.step()` unconditionally."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self) -> None:
        pass


@dataclass(frozen=True)
class ProfilerConfig:
    """What a run records to be looked at later: a torch.profiler trace (the schedule in steps and
    what it records) and the CUDA allocator's history."""
    enabled: bool
    wait: int
    warmup: int
    active: int
    shapes: bool
    memory: bool
    stacks: bool
    memory_snapshot: bool
    FLAT_NAMES: ClassVar[dict] = {"enabled": "profiler", "wait": "profiler_wait", "warmup": "profiler_warmup",
                                  "active": "profiler_active", "shapes": "profiler_shapes",
                                  "memory": "profiler_memory", "stacks": "profiler_stacks"}


def profiler_options(config: ProfilerConfig, out_dir: Path, rank: int, device: torch.device) -> dict:
    """torch.profiler.profile's arguments: CPU and, on a GPU, CUDA activity; the schedule once; a
    TensorBoard trace per rank."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return dict(activities=activities,
                schedule=schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
                on_trace_ready=tensorboard_trace_handler(str(Path(out_dir) / "traces"), worker_name=f"rank{rank}"),
                record_shapes=config.shapes, profile_memory=config.memory, with_stack=config.stacks)


# Allocations the history keeps, the newest ones: torch's own default for the memory visualizer.
HISTORY_ENTRIES = 200_000


class MemorySnapshots:
    """What can be recorded depends on the device: CUDA has a caching allocator with history and
    state; the CPU allocator keeps neither, so on CPU this only says so and writes nothing.
    `recording`: whether train.py starts the allocation history (`HISTORY_ENTRIES` of them)."""

    def __init__(self, requested: bool, device: torch.device, out_dir: Path, rank: int):
        self.available = device.type == "cuda" and torch.cuda.is_available()
        self.recording = requested and self.available
        self.path = Path(out_dir) / "memory" / f"snapshot_rank{rank}.pickle"

    def start(self) -> None:
        """Start the allocation history if asked for. Python frames only: they name the model's
        line that allocated; C++ frames would add minutes of symbolizing to the dump."""
        if self.recording:
            torch.cuda.memory._record_memory_history(max_entries=HISTORY_ENTRIES, stacks="python")

    def dump(self) -> Path | None:
        """Write the snapshot; returns its path, or None where the device has no allocator state."""
        if not self.available:
            return None
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "wb") as f:
            pickle.dump(torch.cuda.memory._snapshot(), f)
        return self.path

    def finish(self) -> Path | None:
        if not self.recording:
            return None
        path = self.dump()
        torch.cuda.memory._record_memory_history(enabled=None)
        return path


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
