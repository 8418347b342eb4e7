"""Frozen LLMs sharded by FSDP2 (--frozen-sharding fsdp) on two gloo ranks: the same training as
whole LLMs on every rank, a resume as exact as unsharded, and each rank holding half the frozen
bytes."""
import json
import re

import pytest
import torch

from conftest import RUN, assert_same_run, final_weights, ok, read_metrics, run_module, run_train

# Two ranks, accumulation 2, fp32 without dropout, the decoder layers recomputed in backward as on
# the GPU profiles; the last step evaluates, which under fsdp must make the same LLM calls on every
# rank (a rank that called fewer would leave the others waiting).
ARGS = [*RUN, "--max-steps", "4", "--micro-batch-size", "2", "--activation-checkpointing", "true",
        "--eval-every", "4", "--eval-examples", "6"]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The unbroken run with whole LLMs and with sharded ones: their out_dirs and train.py's output."""
    root = tmp_path_factory.mktemp("sharding")
    procs = {mode: ok(run_train([*ARGS, "--frozen-sharding", mode, "--out-dir", str(root / mode)], nproc=2))
             for mode in ("none", "fsdp")}
    return {mode: (root / mode, proc) for mode, proc in procs.items()}


def held_mib(proc) -> float:
    """The frozen parameter bytes rank 0 holds, in MiB, as train.py's opening line reports them."""
    return float(re.search(r"\(([\d.]+) MiB held per rank\)", proc.stdout).group(1))


@pytest.mark.slow
def test_sharded_frozen_llms_train_as_whole_ones(runs):
    (whole, whole_proc), (sharded, sharded_proc) = runs["none"], runs["fsdp"]
    a, b = final_weights(whole), final_weights(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise: the same arithmetic
    for x, y in zip(read_metrics(whole), read_metrics(sharded), strict=True):
        scalars = [k for k in x if k == "loss" or k.startswith(("loss_", "eval_"))]
        assert {k: y[k] for k in scalars} == {k: x[k] for k in scalars}
    assert "eval_nll_wire_llama" in read_metrics(sharded)[-1]
    assert held_mib(sharded_proc) == pytest.approx(held_mib(whole_proc) / 2, rel=0.02)


@pytest.mark.slow
def test_stop_and_resume_under_fsdp_is_bitwise_exact(runs, tmp_path):
    args, split = [*ARGS, "--frozen-sharding", "fsdp"], tmp_path / "split"
    ok(run_train([*args, "--out-dir", str(split), "--stop-at-step", "2"], nproc=2))
    ok(run_train([*args, "--out-dir", str(split), "--resume"], nproc=2))
    assert_same_run(runs["fsdp"][0], split, 2)


@pytest.mark.slow
def test_the_memory_plan_holds_what_a_sharded_rank_holds(runs, tmp_path):
    """The plan computes the shards (padding included) and the all-gathered units rather than
    tracing them: its frozen bytes per rank are what rank 0 of the real run holds."""
    ok(run_module("latentwire.plan", ["--profile", "cpu", "--frozen-sharding", "fsdp", "--json", str(tmp_path / "p.json")]))
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["world_size"] == 2 and plan["frozen_sharding"] == "fsdp"  # the cpu profile's num_gpus
    assert plan["params_frozen_bytes"] / 2 ** 20 == pytest.approx(held_mib(runs["fsdp"][1]), abs=0.006)
    assert 0 < plan["fsdp_gathered_bytes"] < plan["params_frozen_bytes"]
