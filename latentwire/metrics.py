"""What a logged step reports: throughput, MFU, memory, data stalls; written to the console,
`metrics.jsonl` and TensorBoard (`tb/`), on rank 0 only. FLOPs come from `latentwire.flops`."""
from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

GIB = 2 ** 30


def peak_flops_per_s(cfg) -> float | None:
    """The card's dense peak for the precision the matmuls run in; None where unknown (CPU)."""
    tflops = {"bf16": cfg.peak_tflops_bf16, "fp16": cfg.peak_tflops_fp16, "fp32": cfg.peak_tflops_fp32}[cfg.precision]
    return None if tflops is None else tflops * 1e12


def peak_memory_gb(device: torch.device) -> float:
    """CUDA: the allocator's peak of allocated tensors. CPU: the process's peak resident set."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / GIB
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / GIB  # ru_maxrss is KiB on Linux


@dataclass
class Window:
    """Accumulates the steps between two log lines."""
    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    samples: int = 0
    tokens: int = 0
    flops: float = 0.0
    data_wait: float = 0.0

    def add(self, samples: int, tokens: int, flops: float, data_wait: float) -> None:
        self.steps += 1
        self.samples += samples
        self.tokens += tokens
        self.flops += flops
        self.data_wait += data_wait

    def rates(self, world_size: int, peak_flops: float | None) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        achieved = self.flops / elapsed  # this rank; every rank does the same work
        return {
            "samples_per_s": self.samples / elapsed,
            "tokens_per_s": self.tokens / elapsed,
            "step_time_s": elapsed / max(self.steps, 1),
            "tflops_per_gpu": achieved / 1e12,
            "mfu": None if peak_flops is None else achieved / peak_flops,
            "data_wait_frac": self.data_wait / elapsed,
        }


class MetricsLogger:
    """One JSON line per logged step, the same scalars in TensorBoard, a short console line."""

    def __init__(self, out_dir: Path, enabled: bool, first_step: int = 1):
        """`first_step` > 1 continues a resumed run: whatever the stopped run logged from that
        step on (after its last checkpoint) is dropped, so every step appears once."""
        self.enabled = enabled
        if not enabled:
            return
        from torch.utils.tensorboard import SummaryWriter
        path = out_dir / "metrics.jsonl"
        if path.exists():
            kept = [line for line in path.read_text().splitlines(keepends=True)
                    if line.strip() and json.loads(line)["step"] < first_step]
            path.write_text("".join(kept))
        self.jsonl = open(path, "a")
        self.tb = SummaryWriter(str(out_dir / "tb"), purge_step=first_step if first_step > 1 else None)

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        step = record["step"]
        for key, value in record.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.tb.add_scalar(key, value, step)
        print(format_line(record), file=sys.stdout, flush=True)

    def close(self) -> None:
        if self.enabled:
            self.jsonl.close()
            self.tb.close()


def format_line(r: dict) -> str:
    mfu = "" if r.get("mfu") is None else f" | mfu {100 * r['mfu']:.1f}%"
    return (f"step {r['step']:>6} | loss {r['loss']:.4f} | lr {r['lr']:.2e} | grad norm {r['grad_norm']:.3f}"
            f" | {r['samples_per_s']:.1f} samples/s | {r['tokens_per_s']:.0f} tok/s{mfu}"
            f" | mem {r['peak_mem_gb']:.2f} GiB | data wait {100 * r['data_wait_frac']:.1f}%")
