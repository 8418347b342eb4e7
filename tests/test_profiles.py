"""The shipped GPU profiles against their own memory plans: each profile's micro-batch fits its
card at its num_gpus, and a single-card profile fills the card. A change to the model, the
profiles or the planner that breaks either fails here, before anyone rents the card."""

import json
import multiprocessing
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from conftest import REPO, full_logits_sums
from latentwire.objectives import WireTask
from latentwire.planner.budget import GIB, Fit, fit_line
from latentwire.planner.memory_plan import make_plan
from latentwire.planner.script import script_step
from latentwire.settings import load_config

HW_PROFILES = REPO / "hw_profiles.json"


def gpu_profiles() -> list[str]:
    """Every key of the shipped hw_profiles.json whose resolved device is cuda."""
    keys = json.loads(HW_PROFILES.read_text())
    return [
        key for key in keys if load_config(["--profile", key, "--hw-profiles", str(HW_PROFILES)]).card.device == "cuda"
    ]


def test_the_shipped_gpu_profiles_are_the_ones_planned_below():
    assert {
        "h100",
        "h100x4",
        "h100x8-70b",
        "h200",
        "a100-80gb",
        "a100-40gb",
        "a100-40gbx4",
        "rtx6000ada",
        "v100",
    } <= set(gpu_profiles())


def planned(key: str) -> tuple[int, int, Fit]:
    """The plan of a profile at its micro-batch and num_gpus (what `python -m latentwire.plan
    --profile KEY` prints): its largest micro-batch, the largest one it traced and its fitted peak."""
    torch.set_num_threads(1)  # a fresh worker process: the suite's thread count
    cfg = load_config(["--profile", key, "--hw-profiles", str(HW_PROFILES)])
    plan = make_plan(cfg, cfg.training.num_gpus, script_step())
    return plan.max_micro_batch, max(t.micro_batch for t in plan.traces), plan.fit


@pytest.fixture(scope="module")
def plans() -> dict[str, tuple[int, int, Fit]]:
    """Every GPU profile's plan, two at a time: a trace is single-threaded Python over fake tensors
    (6-21 s a profile), so on CI's two cores that nearly halves the nine plans' wall time."""
    keys = gpu_profiles()
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn")) as pool:
        return dict(zip(keys, pool.map(planned, keys), strict=True))


@pytest.mark.slow
@pytest.mark.parametrize("key", gpu_profiles())
def test_a_gpu_profile_fits_its_card_by_the_plan_and_a_single_card_one_fills_it(key, plans):
    """Fits: the profile's micro-batch is at most the plan's largest. Fills (one card): a rank's
    share of the global batch (micro-batch x accumulation) that fits is one micro-batch; one that
    does not is split into micro-batches of at least half the largest. The answer is interpolated:
    the plan's second trace lands next to it (FSDP's all-gathered units do not grow with the batch,
    and once counted as if they did, sent it to half the answer)."""
    best, traced, _ = plans[key]
    assert traced >= 0.9 * best
    cfg = load_config(["--profile", key, "--hw-profiles", str(HW_PROFILES)])
    micro, accum = cfg.training.micro_batch_size, cfg.training.grad_accum_steps
    where = f"{key}: {micro} x {accum} on {cfg.training.num_gpus} GPU(s), the plan fits micro-batch <= {best}"
    assert micro <= best, f"{where}: does not fit"
    if cfg.training.num_gpus == 1:
        if micro * accum <= best:
            assert accum == 1, f"{where}: {micro * accum} per step fits as one micro-batch"
        else:
            assert 2 * micro >= best, f"{where}: micro-batch {micro} is under half of what fits"


@pytest.mark.slow
def test_the_h100_plan_is_what_an_h100_measured_for_the_same_rows(plans, monkeypatch):
    """find_batch on an H100 (bench/results/h100.json: two real steps at each micro-batch, on the
    plan's own longest rows) against the plan's line: its cost per sample and its fixed part. The
    card ran the step before the heads ran at the labels only (every kept position's logits, in
    fp32 for the loss: conftest.full_logits_sums), so that step is traced for the comparison. The
    trials' own line is exact to the allocator's rounding (512 bytes a block), and the trace's
    tensors have fixed shapes whatever CPU traces them, so 2% is the margin for what the trace
    leaves out (0.6% here: the adapters' fp32 norms). Without CUDA's layer norm and dropout
    (planner.memtrace.cuda_kernels) the plan counted 7% too little per sample. The step as it is
    now holds less per sample than the card measured for that one."""
    runs = json.loads((REPO / "bench" / "results" / "h100.json").read_text())
    trials = [t for run in runs for t in (run.get("find_batch") or {}).get("trials", []) if t["fits"]]
    measured = fit_line({t["micro_batch"]: t["peak_gb"] * GIB for t in trials})
    monkeypatch.setattr(
        WireTask, "loss_sums", lambda task, model, batch: full_logits_sums(model, task.llms, batch, task.objectives)
    )
    plan = make_plan(load_config(["--profile", "h100", "--hw-profiles", str(HW_PROFILES)]), 1, script_step()).fit
    assert plan.per_sample == pytest.approx(measured.per_sample, rel=0.02)
    assert plan.fixed == pytest.approx(measured.fixed, rel=0.02)
    assert plans["h100"][2].per_sample < 0.98 * measured.per_sample  # less, beyond the margin above
