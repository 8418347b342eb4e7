"""The newcomer's run: `torchrun --nproc_per_node=2 train.py --profile cpu`, unchanged but for out_dir."""

import json
import math
import subprocess
import sys

import pytest

from conftest import ok, read_metrics
from latentwire.settings import load_config

CPU = load_config(["--profile", "cpu"])
STEPS = CPU.training.max_steps

REQUIRED = (
    "step",
    "time",
    "epoch",
    "loss",
    "loss_llama",
    "loss_qwen",
    "lr",
    "grad_norm",
    "skipped_steps",
    "samples_per_s",
    "tokens_per_s",
    "target_tokens_per_s",
    "step_time_s",
    "tflops_per_gpu",
    "mfu",
    "mfu_useful",
    "data_wait_frac",
    "mem_gb",
    "peak_mem_gb",
    "reserved_gb",
    "peak_reserved_gb",
    "alloc_retries",
    "gpu_util_pct",
    "gpu_power_w",
)


@pytest.fixture(scope="module")
def cpu_run(default_cpu_run):
    return default_cpu_run


@pytest.mark.slow
def test_loss_falls_clearly(cpu_run):
    losses = [m["loss"] for m in read_metrics(cpu_run)]
    every = CPU.output.log_every
    assert [m["step"] for m in read_metrics(cpu_run)] == [1, *range(every, STEPS + 1, every)]
    assert losses[0] > math.log(384)  # a random wire: no better than a uniform guess
    assert sum(losses[-3:]) / 3 < losses[0] - 1.5


@pytest.mark.slow
def test_metrics_lines_have_every_field(cpu_run):
    for record in read_metrics(cpu_run):
        assert set(REQUIRED) <= set(record)
        assert record["mfu"] is None and record["mfu_useful"] is None  # no peak FLOP/s is known for a CPU
        assert record["tflops_per_gpu"] > 0 and record["skipped_steps"] == 0
        assert record["samples_per_s"] > 0 and record["tokens_per_s"] > record["target_tokens_per_s"] > 0
        assert 0 <= record["data_wait_frac"] < 1 and record["peak_mem_gb"] > 0


@pytest.mark.slow
def test_tensorboard_has_the_same_scalars(cpu_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cpu_run / "tb"))
    events.Reload()
    logged = read_metrics(cpu_run)
    numeric = [k for k in REQUIRED if k != "step" and logged[0][k] is not None]
    assert set(numeric) <= set(events.Tags()["scalars"])
    for key in numeric:
        scalars = events.Scalars(key)
        assert [s.step for s in scalars] == [m["step"] for m in logged]
        assert [s.value for s in scalars] == pytest.approx([m[key] for m in logged], rel=1e-6)


@pytest.mark.slow
def test_final_checkpoint_loads_with_safetensors_alone(cpu_run):
    ckpt = cpu_run / "checkpoints" / f"step_{STEPS:08d}"
    # A fresh interpreter that imports safetensors and numpy only: no torch, no latentwire.
    code = (
        "import sys, safetensors.numpy as s; t = s.load_file(sys.argv[1]); "
        "assert 'torch' not in sys.modules; print(len(t), sum(v.size for v in t.values()))"
    )
    proc = ok(
        subprocess.run(
            [sys.executable, "-c", code, str(ckpt / "trainable.safetensors")], capture_output=True, text=True
        )
    )
    n_tensors, n_params = map(int, proc.stdout.split())
    assert n_tensors > 10 and 100_000 < n_params < 10_000_000
    meta = json.loads((ckpt / "meta.json").read_text())
    assert meta["profile"] == "cpu" and meta["step"] == STEPS and meta["config"]["llama"] == "tiny"
    assert {"train_state.pt", "rng_rank0.pt", "rng_rank1.pt"} <= {p.name for p in ckpt.iterdir()}
    # meta.json's "wire" and the LLMs' sizes are all it takes to rebuild the model for the weights.
    from safetensors.torch import load_file

    from latentwire.model import WireConfig, WireEncoder

    weights = load_file(str(ckpt / "trainable.safetensors"))
    hidden = {name: weights[f"adapters.{name}.norm.weight"].numel() for name in ("llama", "qwen")}
    model = WireEncoder(WireConfig(**meta["wire"]), {name: (size, 1.0) for name, size in hidden.items()})
    model.load_state_dict(weights)  # strict: every name and shape
