"""The profiler hook and CUDA memory snapshots.

- `torch.profiler` on the profile's wait/warmup/active schedule writes one trace per rank under
  `out_dir/traces` (TensorBoard's profiler plugin, Perfetto, chrome://tracing read it), with
  switches for input shapes, memory and Python stacks.
- A CUDA memory snapshot (`torch.cuda.memory._record_memory_history`) shows every live block and
  the stack that allocated it (drag the pickle into https://pytorch.org/memory_viz). On request
  it records from the start and is written at the end; on out-of-memory it is always written, with
  the allocation history if recording was on and the allocator's current state if not.

Reading either afterwards is `harness.recordings`'.
"""

from __future__ import annotations

import pickle
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, schedule, tensorboard_trace_handler

from .config import setting


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

    enabled: bool = setting(False, "run torch.profiler and write traces under out_dir", key="profiler")
    wait: int = setting(5, "profiler schedule: steps skipped", key="profiler_wait", ge=0)
    warmup: int = setting(2, "profiler schedule: steps traced but discarded", key="profiler_warmup", ge=0)
    active: int = setting(3, "profiler schedule: steps recorded", key="profiler_active", gt=0)
    shapes: bool = setting(True, "profiler: record operator input shapes", key="profiler_shapes")
    memory: bool = setting(False, "profiler: record tensor allocations and frees", key="profiler_memory")
    stacks: bool = setting(False, "profiler: record Python stacks (slower, larger traces)", key="profiler_stacks")
    memory_snapshot: bool = setting(False, "CUDA: record allocation history, write a snapshot at the end")


def profiler_options(config: ProfilerConfig, out_dir: Path, rank: int, device: torch.device) -> dict:
    """torch.profiler.profile's arguments: CPU and, on a GPU, CUDA activity; the schedule once; a
    TensorBoard trace per rank."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return dict(
        activities=activities,
        schedule=schedule(wait=config.wait, warmup=config.warmup, active=config.active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(Path(out_dir) / "traces"), worker_name=f"rank{rank}"),
        record_shapes=config.shapes,
        profile_memory=config.memory,
        with_stack=config.stacks,
    )


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
