"""Each bench/ script runs end to end with --quick and ends in the contract's summary line.

The ratios are timings on a shared machine, so only their form is checked, never their value.
"""
import math
import re
import subprocess
import sys

import pytest

from conftest import REPO, child_env, instruct_reader, ok

# The last whitespace-separated field of the last line is `ratio=<number>`.
RATIO = re.compile(r"(?:^|\s)ratio=(\S+)$")


@pytest.mark.slow
@pytest.mark.parametrize("script", ["loop_overhead", "dataloader", "compile", "ddp_scaling", "distillation"])
def test_quick_run_ends_in_a_ratio(script):
    proc = ok(subprocess.run([sys.executable, str(REPO / "bench" / f"{script}.py"), "--quick"], cwd=REPO,
                             env=child_env(), capture_output=True, text=True, timeout=600))
    last = proc.stdout.strip().splitlines()[-1]
    match = RATIO.search(last)
    assert match, f"last line has no ratio=<number> field: {last!r}"
    ratio = float(match.group(1))
    assert math.isfinite(ratio) and ratio > 0, last


@pytest.mark.slow
def test_gpu_validation_runs_every_part_and_records_what_issue_21_asks(tmp_path):
    """bench/gpu_validation.py on the cpu profile (`--cpu-check`): the code path a lent GPU runs,
    prepared here so GPU time goes to measuring. Every part finishes, and each run records the
    fields the GPU results file needs."""
    import json

    proc = ok(subprocess.run([sys.executable, str(REPO / "bench" / "gpu_validation.py"), "--out", str(tmp_path),
                              "--cpu-check"], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=900))
    assert "6 of 6 runs finished" in proc.stdout, proc.stdout
    results = json.loads((tmp_path / "cpu.json").read_text())
    fields = {"device", "torch", "profile", "micro_batch_size", "grad_accum_steps", "compile",
              "activation_checkpointing", "tokens_per_s", "step_time_s", "mfu", "tflops_per_gpu", "peak_mem_gb",
              "compile_s", "date"}
    assert all(fields <= run.keys() and run["exit"] == 0 for run in results["runs"])
    main = results["runs"][0]
    assert main["planned_peak_gb"] > 0 and main["plan_max_micro_batch"] > 0 and main["find_batch_max"] > 0
    assert set(results["levers"]) == {"eager", "no_recompute"}
    assert results["checks"]["evaluate"]["answers"] > 0 and not results["checks"]["evaluate"]["nan_metrics"]


def test_instruct_reader_scores_the_text_under_each_contract(tmp_path):
    """bench/instruct_reader.py on the tiny Llama with a chat template: one row per contract, the
    bare anchor's without the template, the other two inside it."""
    import json

    results = tmp_path / "instruct.json"
    script = REPO / "bench" / "instruct_reader.py"
    ok(subprocess.run([sys.executable, str(script), "--model", str(instruct_reader(tmp_path)),
                       "--examples", "4", "--threads", "1", "--results", str(results)],
                      cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300))
    contracts = json.loads(results.read_text())["contracts"]
    assert list(contracts) == ["bare anchor", "chat template", "chat template + instruction"]
    assert [c["contract"].startswith("its chat template") for c in contracts.values()] == [False, True, True]
    assert all(0 <= c["em"] <= c["f1"] <= 100 and len(c["answers"]) == 4 for c in contracts.values())
