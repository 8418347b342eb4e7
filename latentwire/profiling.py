"""The profiler hook: torch.profiler on the profile's wait/warmup/active schedule, one trace per rank
under `out_dir/traces`, readable by TensorBoard's profiler plugin and by Perfetto / chrome://tracing."""
from __future__ import annotations

from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, schedule, tensorboard_trace_handler


class NoProfiler:
    """Stands in when profiling is off, so the loop calls `.step()` unconditionally."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def step(self) -> None:
        pass


def make_profiler(cfg, out_dir: Path, rank: int, device: torch.device):
    if not cfg.profiler:
        return NoProfiler()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    return profile(
        activities=activities,
        schedule=schedule(wait=cfg.profiler_wait, warmup=cfg.profiler_warmup, active=cfg.profiler_active, repeat=1),
        on_trace_ready=tensorboard_trace_handler(str(Path(out_dir) / "traces"), worker_name=f"rank{rank}"),
        record_shapes=False,
    )
