"""What a logged step reports of the steps since the last: throughput and MFU over a window of
steps, this rank's memory, the GPU's utilisation and power (`StepMeter`). A step's FLOPs are the
model's count (`StepMeter(flops=...)`, a `harness.recipe.StepFlops`): the harness knows no model.
Where the records go is `harness.metrics`'s."""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field

import torch

GIB = 2**30


def _cpu_resident() -> tuple[int, int]:
    """(current, peak since the last reset) resident set of this process, in bytes (Linux)."""
    fields = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                fields[key] = int(value.split()[0]) * 1024  # kB
    return fields["VmRSS"], max(fields["VmHWM"], fields["VmRSS"])


def _reset_cpu_peak() -> None:
    # Writing 5 to clear_refs sets the peak resident set (VmHWM) back to the current one (Linux 4.0+).
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass  # not permitted here: the peak then runs from the process's start


class MemoryMeter:
    """Memory of this rank's device, per window between two log lines and over the whole run.

    `peak_mem_gb` is the window's peak, so an evaluation or an autotuning spike shows in the window
    it happened in and not in every later one; `run_peak_mem_gb` is the run's. CUDA: the caching
    allocator's allocated and reserved bytes, and how often it had to free its cache and retry (a
    sign of fragmentation just below out-of-memory; counted per window, as the peak, so it says when
    it began). CPU: the process's resident set; the allocator fields are null."""

    def __init__(self, device: torch.device):
        self.device = device
        self.run_peak = 0
        self.start_window()

    def _raw(self) -> dict:
        if self.device.type == "cuda":
            s = torch.cuda.memory_stats(self.device)
            return {
                "mem": s["allocated_bytes.all.current"],
                "peak": s["allocated_bytes.all.peak"],
                "reserved_gb": s["reserved_bytes.all.current"] / GIB,
                "peak_reserved_gb": s["reserved_bytes.all.peak"] / GIB,
                "alloc_retries": s["num_alloc_retries"],
            }
        current, peak = _cpu_resident()
        return {"mem": current, "peak": peak, "reserved_gb": None, "peak_reserved_gb": None, "alloc_retries": None}

    def read(self) -> dict:
        raw = self._raw()
        self.run_peak = max(self.run_peak, raw["peak"])
        if raw["alloc_retries"] is not None:  # the allocator counts from the process's start
            raw["alloc_retries"] -= self.retries_before
        return {
            "mem_gb": raw.pop("mem") / GIB,
            "peak_mem_gb": raw.pop("peak") / GIB,
            "run_peak_mem_gb": self.run_peak / GIB,
            **raw,
        }

    def start_window(self) -> None:
        """The peak so far counts for the run; the next window's peak starts from what is in use now."""
        raw = self._raw()
        self.run_peak = max(self.run_peak, raw["peak"])
        self.retries_before = raw["alloc_retries"]
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            _reset_cpu_peak()


class GpuMonitor:
    """GPU utilisation and power through NVML when the optional `nvidia-ml-py` is installed and
    the device is a GPU; null fields otherwise. Monitoring never ends a run: an NVML error (no
    driver library in a container, a device it cannot see, a query the card refuses), at the start
    or at any read, leaves the fields null from then on, said once on stderr."""

    NULL = {"gpu_util_pct": None, "gpu_power_w": None}

    def __init__(self, device: torch.device):
        self.handle = None
        if device.type != "cuda":
            return
        try:
            import pynvml
        except ImportError:
            return
        try:
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            self.handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        except Exception as e:  # pynvml.NVMLError and its many subclasses, or a broken install
            self.give_up(e)
        self.nvml = pynvml

    def give_up(self, error: Exception) -> None:
        self.handle = None
        print(
            f"note: no GPU utilisation or power in the metrics (NVML: {type(error).__name__}: {error})",
            file=sys.stderr,
            flush=True,
        )

    def read(self) -> dict:
        if self.handle is None:
            return dict(self.NULL)
        try:
            return {
                "gpu_util_pct": float(self.nvml.nvmlDeviceGetUtilizationRates(self.handle).gpu),
                "gpu_power_w": self.nvml.nvmlDeviceGetPowerUsage(self.handle) / 1000.0,
            }
        except Exception as e:
            self.give_up(e)
            return dict(self.NULL)


@dataclass
class Window:
    """Accumulates the steps between two log lines. Consecutive windows share their boundary,
    so logging itself is inside the measured time, not between windows."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    counts: dict = field(default_factory=dict)  # name -> what the window's steps processed, e.g. samples
    flops: float = 0.0
    hardware_flops: float = 0.0
    useful_flops: float | None = None  # the FLOPs without padding, where the caller counts them
    data_wait: float = 0.0
    end: float | None = None

    def add(
        self, counts: dict, flops: float, hardware_flops: float, useful_flops: float | None, data_wait: float
    ) -> None:
        self.steps += 1
        for name, n in counts.items():
            self.counts[name] = self.counts.get(name, 0) + n
        self.flops += flops
        self.hardware_flops += hardware_flops
        if useful_flops is not None:
            self.useful_flops = (self.useful_flops or 0.0) + useful_flops
        self.data_wait += data_wait

    def rates(self, peak_flops: float | None) -> dict:
        self.end = time.perf_counter()
        elapsed = max(self.end - self.start, 1e-9)
        achieved = self.flops / elapsed  # this rank; every rank does the same work
        useful = None if self.useful_flops is None else self.useful_flops / elapsed
        return {
            **{f"{name}_per_s": n / elapsed for name, n in self.counts.items()},
            "step_time_s": elapsed / max(self.steps, 1),
            "tflops_per_gpu": achieved / 1e12,
            "mfu": None if peak_flops is None else achieved / peak_flops,
            "hfu": None if peak_flops is None else self.hardware_flops / elapsed / peak_flops,
            "mfu_useful": None if peak_flops is None or useful is None else useful / peak_flops,
            "data_wait_frac": self.data_wait / elapsed,
        }

    def next(self) -> "Window":
        return Window(start=self.end if self.end is not None else time.perf_counter())


class StepMeter:
    """What a log record says of the steps since the previous one: throughput and MFU (a Window),
    this rank's memory (a MemoryMeter), the GPU's utilisation and power (a GpuMonitor)."""

    def __init__(self, device: torch.device, flops, peak_tflops: float | None):
        """`flops`: the model's FLOP count (harness.recipe.StepFlops: of a step's micro-batches as they
        run, padding included, for MFU; what the device executes, for HFU; without padding, counted on
        the batches' device), None where the model counts none (no MFU, no HFU); `peak_tflops`: the
        card's peak for the arithmetic the matmuls run in, None where unknown."""
        self.flops, self.device, self.useful_counted = flops, device, False
        self.peak_flops = None if peak_tflops is None or flops is None else peak_tflops * 1e12  # FLOP/s
        self.window, self.memory, self.gpu = Window(), MemoryMeter(device), GpuMonitor(device)

    def useful_flops(self, micro_batches: list[dict]) -> torch.Tensor:
        """The step's FLOPs without the padding, a 0-dim tensor on the batches' device: for the
        loop to read with its other values in the step's one host sync, and hand back to `add`
        (0 where not counted)."""
        counted = None if self.flops is None else self.flops.useful_flops(micro_batches)
        self.useful_counted = counted is not None
        return torch.zeros((), dtype=torch.int64, device=self.device) if counted is None else counted

    def add(self, micro_batches: list[dict], data_wait: float, useful_flops: float | None = None, **counts) -> None:
        """One step: its `counts` (`samples=`, `tokens=`, ...; each becomes `<name>_per_s`) and
        `useful_flops`, as read (`mfu_useful`; None: not counted)."""
        if self.flops is None:
            self.window.add(counts, 0.0, 0.0, None, data_wait)
            return
        self.window.add(
            counts,
            self.flops.step_flops(micro_batches),
            self.flops.step_hardware_flops(micro_batches),
            useful_flops if self.useful_counted else None,
            data_wait,
        )

    def read(self) -> dict:
        rates = self.window.rates(self.peak_flops)
        if self.flops is None:
            rates["tflops_per_gpu"] = None
        return {**rates, **self.memory.read(), **self.gpu.read()}

    def next_window(self, after_pause: bool) -> None:
        """The next window starts where this one was read, so logging counts as training time;
        after a pause that is not training (an evaluation), it starts now instead."""
        self.window = Window() if after_pause else self.window.next()
        self.memory.start_window()
