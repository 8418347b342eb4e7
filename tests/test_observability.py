"""What a run reports beyond the loss: the console, memory snapshots, NVML, out-of-memory."""

import fcntl
import json
import os
import pty
import struct
import subprocess
import sys
import termios
import types

import pytest
import torch

from conftest import FAST, REPO, assert_one_line_error, child_env, ok, run_train
from latentwire.harness.meters import GpuMonitor, MemoryMeter, StepMeter
from latentwire.harness.profiling import MemorySnapshots
from latentwire.harness.recordings import format_trace_summary, summarize_trace

SHORT = ["--profile", "cpu", *FAST, "--max-steps", "3", "--micro-batch-size", "2", "--grad-accum-steps", "1"]


def run_in_terminal(args, tmp_path) -> str:
    """train.py with its stdout on a pseudo-terminal, as when a person watches it."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 160, 0, 0))  # rows, columns
    proc = subprocess.Popen(
        [sys.executable, str(REPO / "train.py"), *args],
        cwd=REPO,
        env=child_env(),
        stdout=follower,
        stderr=subprocess.DEVNULL,
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            data = os.read(leader, 4096)
        except OSError:  # the terminal closes when the process exits
            break
        if not data:
            break
        chunks.append(data)
    assert proc.wait(timeout=300) == 0
    return b"".join(chunks).decode(errors="replace")


def trace(path, events) -> str:
    """A Chrome trace as torch.profiler writes it, of complete events (ts and dur in µs)."""
    keys = ("cat", "name", "ts", "dur", "tid")
    path.write_text(json.dumps({"traceEvents": [{"ph": "X", **dict(zip(keys, e, strict=True))} for e in events]}))
    return path


def test_a_trace_summary_has_the_top_kernels_and_the_device_idle_share(tmp_path):
    """Two steps of 100 µs: kernels busy 20-50 (two overlapping), 60-70 and 150-190, one past the
    steps' end clipped; the CPU's operators are not the device's time."""
    summary = summarize_trace(
        trace(
            tmp_path / "gpu.json",
            [
                ("user_annotation", "ProfilerStep#4", 0, 100, 1),
                ("user_annotation", "ProfilerStep#5", 100, 100, 1),
                ("cpu_op", "aten::mm", 10, 150, 1),
                ("kernel", "gemm", 20, 20, 7),
                ("kernel", "gemm", 30, 20, 7),
                ("kernel", "softmax", 60, 10, 7),
                ("gpu_memcpy", "Memcpy HtoD", 150, 40, 8),
                ("kernel", "gemm", 195, 10, 7),
            ],
        )
    )
    assert summary["activity"] == "device kernels" and summary["steps"] == 2
    assert summary["busy_ms"] * 1e3 == pytest.approx(30 + 10 + 40 + 5)
    assert summary["idle_share"] == pytest.approx(1 - 85 / 200)
    assert [(t["name"], t["calls"], t["ms"] * 1e3) for t in summary["top"]] == [
        ("gemm", 3, pytest.approx(50)),
        ("Memcpy HtoD", 1, pytest.approx(40)),
        ("softmax", 1, pytest.approx(10)),
    ]
    assert "idle 57.5%" in format_trace_summary(summary)


def test_a_cpu_trace_is_summarised_by_its_operators_self_time(tmp_path):
    """No device in the trace: the CPU's operators, each less the ones it called."""
    summary = summarize_trace(
        trace(
            tmp_path / "cpu.json",
            [
                ("user_annotation", "ProfilerStep#2", 0, 100, 1),
                ("cpu_op", "aten::linear", 10, 60, 1),
                ("cpu_op", "aten::addmm", 15, 50, 1),
                ("cpu_op", "aten::relu", 80, 10, 1),
                ("cpu_op", "aten::mm", 20, 30, 2),
            ],
        )
    )
    assert summary["activity"] == "CPU operators"
    assert {t["name"]: t["ms"] * 1e3 for t in summary["top"]} == {
        "aten::addmm": pytest.approx(50),
        "aten::mm": pytest.approx(30),
        "aten::relu": pytest.approx(10),
        "aten::linear": pytest.approx(10),
    }
    assert summary["idle_share"] == pytest.approx(1 - (60 + 10) / 100)


@pytest.mark.slow
def test_progress_bar_on_a_terminal_plain_lines_otherwise(tmp_path):
    shown = run_in_terminal([*SHORT, "--out-dir", str(tmp_path / "tty")], tmp_path)
    assert "3/3" in shown and ("step/s" in shown or "s/step" in shown)  # tqdm's bar and its rate
    assert "loss=" in shown and "tok_s=" in shown
    piped = ok(run_train([*SHORT, "--out-dir", str(tmp_path / "pipe")])).stdout
    assert "%|" not in piped  # no bar (tqdm's "33%|###") where nobody watches
    lines = [line for line in piped.splitlines() if line.startswith("step ")]
    assert lines[0].startswith("step 1/3 | loss") and "elapsed, first step" in lines[0]
    assert lines[-1].startswith("step 3/3 | loss") and "elapsed, 0:00:00 left" in lines[-1]


def test_the_meter_reports_each_count_per_second_and_mfu_with_and_without_padding():
    """Every count a step hands in becomes `<name>_per_s` over the same window; `mfu` is the FLOPs the
    step ran, `mfu_useful` those without padding, over the same peak."""
    from latentwire.harness.recipe import StepFlops

    class Counted(StepFlops):
        def step_flops(self, micro_batches):
            return 4e12 * len(micro_batches)

        def useful_flops(self, micro_batches):
            return torch.tensor(3e12 * len(micro_batches))

    meter = StepMeter(torch.device("cpu"), Counted(), peak_tflops=100.0)
    for _ in range(2):
        useful = meter.useful_flops([{}, {}]).item()
        meter.add([{}, {}], data_wait=0.0, useful_flops=useful, samples=64, tokens=9000, target_tokens=300)
    rates = meter.read()
    elapsed = 2 * rates["step_time_s"]
    assert rates["samples_per_s"] * elapsed == pytest.approx(128)
    assert rates["tokens_per_s"] * elapsed == pytest.approx(18000)
    assert rates["target_tokens_per_s"] * elapsed == pytest.approx(600)
    assert rates["mfu"] == pytest.approx(16e12 / elapsed / 100e12)
    assert rates["mfu_useful"] / rates["mfu"] == pytest.approx(12 / 16)
    assert rates["hfu"] == rates["mfu"]  # no recompute counted: the device ran what the model counts
    unknown_peak = StepMeter(torch.device("cpu"), Counted(), peak_tflops=None).read()
    assert unknown_peak["mfu"] is None and unknown_peak["mfu_useful"] is None
    uncounted = StepMeter(torch.device("cpu"), None, peak_tflops=100.0)  # a recipe without a FLOP count
    uncounted.add([{}], data_wait=0.0, useful_flops=uncounted.useful_flops([{}]).item(), samples=8)
    assert {uncounted.read()[k] for k in ("mfu", "hfu", "mfu_useful", "tflops_per_gpu")} == {None}


def test_memory_fields_on_cpu():
    stats = MemoryMeter(torch.device("cpu")).read()
    assert 0 < stats["mem_gb"] <= stats["peak_mem_gb"] <= stats["run_peak_mem_gb"]
    assert stats["reserved_gb"] is None and stats["alloc_retries"] is None


def test_nvml_is_skipped_without_a_gpu_and_read_with_one(monkeypatch):
    assert GpuMonitor(torch.device("cpu")).read() == {"gpu_util_pct": None, "gpu_power_w": None}
    fake = types.SimpleNamespace(
        nvmlInit=lambda: None,
        nvmlDeviceGetHandleByUUID=lambda uuid: ("handle", uuid),
        nvmlDeviceGetUtilizationRates=lambda h: types.SimpleNamespace(gpu=87),
        nvmlDeviceGetPowerUsage=lambda h: 612_500,
    )  # milliwatts
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="abc-123"))
    monitor = GpuMonitor(torch.device("cuda", 0))
    assert monitor.handle == ("handle", "GPU-abc-123")
    assert monitor.read() == {"gpu_util_pct": 87.0, "gpu_power_w": 612.5}


@pytest.mark.parametrize("fails_at", ["init", "handle", "read"])
def test_an_nvml_error_leaves_gpu_fields_null_and_says_so_once(monkeypatch, capsys, fails_at):
    """NVML that fails (no driver library in a container, a device it cannot see) must not end a
    run at its first log line, after minutes of compiling."""

    class NVMLError(Exception):
        pass

    def fail(*args):
        raise NVMLError("Driver Not Loaded")

    fake = types.SimpleNamespace(
        nvmlInit=fail if fails_at == "init" else lambda: None,
        nvmlDeviceGetHandleByUUID=fail if fails_at == "handle" else lambda uuid: "handle",
        nvmlDeviceGetUtilizationRates=fail,
        nvmlDeviceGetPowerUsage=fail,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: types.SimpleNamespace(uuid="abc-123"))
    monitor = GpuMonitor(torch.device("cuda", 0))
    assert [monitor.read() for _ in range(3)] == [{"gpu_util_pct": None, "gpu_power_w": None}] * 3
    said = capsys.readouterr().err.splitlines()
    assert len(said) == 1 and "NVMLError: Driver Not Loaded" in said[0], said


def test_memory_snapshot_selection(monkeypatch, tmp_path):
    cpu = MemorySnapshots(requested=True, device=torch.device("cpu"), out_dir=tmp_path, rank=0)
    assert not cpu.recording and cpu.dump() is None and not (tmp_path / "memory").exists()
    calls = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: {"segments": [], "device_traces": [[]]})
    off = MemorySnapshots(requested=False, device=torch.device("cuda", 0), out_dir=tmp_path, rank=1)
    assert not off.recording and calls == [] and off.finish() is None
    assert off.dump() == tmp_path / "memory" / "snapshot_rank1.pickle"  # out-of-memory: state only
    on = MemorySnapshots(requested=True, device=torch.device("cuda", 0), out_dir=tmp_path, rank=0)
    assert on.recording and calls == []  # start() begins the history (_record_memory_history), when told
    path = on.finish()
    assert path.exists() and calls[-1] == {"enabled": None}
    import pickle

    assert pickle.loads(path.read_bytes())["segments"] == []


def test_train_starts_the_allocation_history_when_the_snapshot_records(monkeypatch, tmp_path):
    """The CUDA-only call in train.py's snapshot block, taken on CPU: a MemorySnapshots that says it
    records makes train.py start the allocator's history, once, before the first step."""
    import train

    calls = []

    class Recording(MemorySnapshots):
        def __init__(self, *args):
            super().__init__(*args)
            self.recording = True

        def finish(self):
            calls.append("finish")

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(train, "MemorySnapshots", Recording)
    torch.set_num_threads(1)
    train.main([*SHORT, "--max-steps", "1", "--out-dir", str(tmp_path / "run")])
    assert calls == [{"max_entries": 200_000, "stacks": "python"}, "finish"]


def test_find_batch_records_its_trials_when_the_snapshot_records(monkeypatch, tmp_path, capsys):
    """find_batch takes train.py's --memory-snapshot: on CUDA the history covers its trials and the
    snapshot is written once they are done (the CUDA-only calls taken on CPU, as above)."""
    from latentwire import find_batch

    calls = []

    class Recording(MemorySnapshots):
        def __init__(self, *args):
            super().__init__(*args)
            self.available = self.recording = True

    monkeypatch.setattr(torch.cuda.memory, "_record_memory_history", lambda **kw: calls.append(kw))
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", lambda: calls.append("snapshot") or {"device_traces": [[]]})
    monkeypatch.setattr(find_batch, "MemorySnapshots", Recording)
    monkeypatch.setattr(
        find_batch, "run_trial", lambda probe, m, device: calls.append(m) or find_batch.Trial(m, True, 1, None, 0.0, "")
    )
    torch.set_num_threads(1)
    find_batch.main(
        [
            "--profile",
            "cpu",
            "--memory-snapshot",
            "true",
            "--micro-batch-size",
            "2",
            "--max-micro-batch",
            "2",
            "--out-dir",
            str(tmp_path / "fb"),
        ]
    )
    assert calls == [{"max_entries": 200_000, "stacks": "python"}, 2, "snapshot", {"enabled": None}]
    path = tmp_path / "fb" / "memory" / "snapshot_rank0.pickle"
    assert path.exists() and f"memory snapshot: {path}" in capsys.readouterr().out


OOM_AT_STEP_2 = """
import sys, torch
sys.path.insert(0, {repo!r}); sys.argv[0] = {train!r}
import train
import latentwire.recipe as recipe
from latentwire.harness.exits import main_guard
real, calls = recipe.forward_loss_sums, [0]
def oom(*args):
    calls[0] += 1
    if calls[0] == 2:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    return real(*args)
recipe.forward_loss_sums = oom
main_guard(lambda: train.main(sys.argv[1:]))
"""


OOM_IN = """
import os, sys, torch
sys.path.insert(0, {repo!r}); sys.argv[0] = {train!r}
import train
import {module} as target
from latentwire.harness.exits import main_guard
real = target.{name}
def oom(*args, **kwargs):
    if os.environ.get("RANK", "1") == "1":
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 15.00 GiB")
    return real(*args, **kwargs)
target.{name} = oom
main_guard(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
@pytest.mark.parametrize("module, name, nproc", [("latentwire.llm", "read_weights", 1), ("train", "DDP", 2)])
def test_out_of_memory_before_the_loop_is_one_line_and_exit_5(tmp_path, module, name, nproc):
    """While an LLM is read into place (one process), or while DDP starts on rank 1 of two."""
    script = tmp_path / "oom.py"
    script.write_text(OOM_IN.format(repo=str(REPO), train=str(REPO / "train.py"), module=module, name=name))
    launcher = [] if nproc == 1 else ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"]
    proc = subprocess.run(
        [sys.executable, *launcher, str(script), *SHORT, "--dist-timeout-s", "30", "--out-dir", str(tmp_path / "run")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    line = (
        "error: out of memory outside the training steps (CUDA out of memory. Tried to allocate 15.00 GiB); "
        "python -m latentwire.plan --profile cpu says what a rank holds"
    )
    if nproc == 1:
        assert_one_line_error(proc, line.removeprefix("error: "))
        assert proc.returncode == 5
    else:  # plain torchrun: its own exit code and report, with the rank's line and code in them
        assert line in proc.stderr and "exitcode  : 5" in proc.stderr, proc.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()


@pytest.mark.slow
def test_out_of_memory_is_one_line_with_the_snapshot_and_the_planner(tmp_path):
    script = tmp_path / "oom.py"
    script.write_text(OOM_AT_STEP_2.format(repo=str(REPO), train=str(REPO / "train.py")))
    proc = subprocess.run(
        [sys.executable, str(script), *SHORT, "--memory-snapshot", "true", "--out-dir", str(tmp_path / "run")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_error(
        proc,
        "out of memory at micro-batch 2",
        "no memory snapshot on this device",
        "python -m latentwire.plan --profile cpu",
    )
    assert proc.returncode == 5
