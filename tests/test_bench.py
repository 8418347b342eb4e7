"""Each bench/ script runs end to end with --quick and ends in the contract's summary line.

The ratios are timings on a shared machine, so only their form is checked, never their value.
"""
import json
import math
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import REPO, child_env, instruct_reader, ok

sys.path.insert(0, str(REPO / "bench"))  # gpu_validation's pieces, imported as its own script imports them

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
def test_seed_spread_evaluates_every_seed_on_the_same_examples_and_records_each_run(tmp_path):
    """--quick: two seeds of a few steps, each evaluated on the same held-out examples (the same
    text answers), each run appended to the results file as it finished, and the ratio the smallest
    share of any run and reader."""
    results = tmp_path / "spread.jsonl"
    proc = ok(subprocess.run([sys.executable, str(REPO / "bench" / "seed_spread.py"), "--quick", "--results",
                              str(results), "--out-root", str(tmp_path / "runs")], cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=600))
    ratio = float(RATIO.search(proc.stdout.strip().splitlines()[-1]).group(1))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["seed"], r["data_seed"], r["settings"]) for r in rows] == [(0, 0, rows[0]["settings"]),
                                                                          (1, 0, rows[0]["settings"])]
    assert ratio == pytest.approx(min(r[who]["f1_share"] for r in rows for who in ("llama", "qwen")), abs=1e-4)
    reports = [json.loads(next((tmp_path / "runs" / "default" / f"seed{s}" / "eval").glob("*.json")).read_text())
               for s in (0, 1)]
    text = [[(a["question"], a["text_llama"], a["text_qwen"]) for a in r["answers"]] for r in reports]
    assert text[0] == text[1] and len(text[0]) == 8


def gpu_validation(out: Path, *flags: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, dict, float]:
    """bench/gpu_validation.py on the cpu profile (`--cpu-check`): the code path a lent GPU runs,
    its results file and how long it took."""
    started = time.monotonic()
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu_validation.py"), "--out", str(out / "out"),
                           "--work", str(out / "work"), "--cpu-check", *flags], cwd=REPO, env=child_env(),
                          capture_output=True, text=True, timeout=timeout)
    results = out / "out" / ("cpu-levers.json" if "--levers" in flags else "cpu.json")
    return proc, json.loads(results.read_text()), time.monotonic() - started


@pytest.mark.slow
def test_gpu_validation_levers_measure_each_lever_within_the_deadline(tmp_path):
    """The levers mode on the cpu check, one run for every assertion: an entry per lever with the
    fields the card's results need (FP8 refused in one line where train.py or the device cannot
    run it), every run's metrics copied into the results folder, the kernel summary of the fastest
    (the CPU's operators here), and everything written whole within the deadline."""
    from gpu_validation import GRACE_S

    deadline = 400
    proc, results, seconds = gpu_validation(tmp_path, "--levers", "--deadline", str(deadline))
    ok(proc)
    assert seconds < deadline + GRACE_S + 5 and results["seconds"] < deadline
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == ["cpu-levers.json", "metrics.jsonl", "profile.txt",
                                                     "validation.log"]
    runs = {r["name"]: r for r in results["runs"]}
    assert list(runs) == ["baseline", "no_recompute", "fp8_no_recompute", "fp8_recompute", "fails_at_first_step"]
    fields = {"status", "micro_batch_size", "grad_accum_steps", "step_time_s", "tokens_per_s", "mfu", "hfu",
              "peak_mem_gb", "activation_checkpointing", "fp8", "ratio_to_baseline", "device", "torch"}
    for name, recompute, fp8 in (("baseline", True, False), ("no_recompute", False, False),
                                 ("fp8_no_recompute", False, True), ("fp8_recompute", True, True)):
        run = runs[name]
        assert (run["activation_checkpointing"], run["fp8"]) == (recompute, fp8), name
        if fp8 and run["status"] == "refused":
            assert run["exit"] == 2 and run["error"].startswith("error: "), run
            continue
        assert run["status"] == "done" and fields <= run.keys(), (name, fields - run.keys())
        assert run["ratio_to_baseline"] > 0 and run["hfu"] is None  # no peak FLOP/s on a CPU: no MFU, no HFU
    assert runs["baseline"]["ratio_to_baseline"] == 1.0
    assert runs["no_recompute"]["env"] == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert runs["fails_at_first_step"]["status"] == "skipped"
    copied = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in ("baseline", "no_recompute", "profile"):
        mine = [r["step"] for r in copied if r["part"] == name]
        assert mine == list(range(1, len(mine) + 1)) and mine, name
        assert all("hfu" in r for r in copied if r["part"] == name)
    profile = results["profile"]
    assert profile["status"] == "done" and profile["of"] in runs and profile["top"]
    assert 0 <= profile["summary"]["idle_share"] < 1 and profile["summary"]["activity"] == "CPU operators"
    text = (out / "profile.txt").read_text()
    assert "3 profiled steps" in text and "idle" in text and "aten::mm" in text


@pytest.mark.slow
def test_gpu_validation_runs_every_part_and_keeps_a_part_stopped_at_its_budget(tmp_path):
    """Every part runs; the main run, given more steps than its budget allows, is stopped (SIGTERM:
    train.py saves its step and exits 75), recorded as timed out with the metrics it had flushed,
    and evaluated from what it saved. Each run has the fields the GPU results file needs, and only
    the results file and the log come back from the output folder."""
    proc, results, _ = gpu_validation(tmp_path, "--steps", "100000", "--budget", "main=15")
    ok(proc)
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cpu.json", "validation.log"]
    assert {name: part["status"] for name, part in results["parts"].items()} == {
        "preflight": "done", "main": "timed out", "evaluate": "done", "eager": "done", "find_batch": "done",
        "no_recompute": "done", "plan_micro_batch": "done"}
    fields = {"device", "torch", "profile", "micro_batch_size", "grad_accum_steps", "compile",
              "activation_checkpointing", "tokens_per_s", "step_time_s", "mfu", "tflops_per_gpu", "peak_mem_gb",
              "planned_peak_gb", "plan_max_micro_batch", "compile_s", "recompiles", "date"}
    assert all(fields <= run.keys() for run in results["runs"]), [fields - run.keys() for run in results["runs"]]
    main = results["runs"][0]
    assert main["exit"] == 75 and main["steps_logged"] >= 1 and main["find_batch_max"] == 32
    assert [t["micro_batch"] for t in results["find_batch"]["trials"]] == [16, 32]
    assert all(t["fits"] and t["peak_gb"] > 0 and t["planned_peak_gb"] > 0 for t in results["find_batch"]["trials"])
    assert results["evaluate"]["answers"] > 0 and not results["evaluate"]["nonfinite_nll"]
    assert set(results["levers"]) == {"eager_over_compiled", "no_recompute_over_eager", "plan_micro_batch_over_eager"}
    assert set(results["kernel_facts"]) == {"keyless_row", "head_width", "gqa_causal_128", "compiled_masked_dropout"}


def test_gpu_validation_returns_by_its_deadline_with_a_valid_results_file(tmp_path):
    """A deadline too short for the parts: the part running at it is stopped, the later ones are
    skipped, and the results file says so, whole, by the deadline (plus the stopped part's grace)."""
    from gpu_validation import GRACE_S

    proc, results, seconds = gpu_validation(tmp_path, "--deadline", "8", "--margin", "2")
    ok(proc)
    statuses = {name: part["status"] for name, part in results["parts"].items()}
    assert set(statuses.values()) <= {"done", "timed out", "skipped"} and statuses["main"] != "done", statuses
    assert statuses["evaluate"] == "skipped" and statuses["eager"] == "skipped"
    assert seconds < 8 + GRACE_S + 5  # the interpreter's start and the results file's writing


def test_a_stopped_part_takes_its_whole_process_group_with_it(tmp_path):
    """A part that ignores SIGTERM (a process stuck at exit) is killed after the grace, and so is
    every process it started."""
    from gpu_validation import GRACE_S, Clock, Runner

    pid_file = tmp_path / "grandchild.pid"
    stubborn = ("import os, signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); "
                f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); signal.pause()")
    run = Runner(tmp_path / "log", Clock(deadline_s=4, margin_s=1), child_env())
    child = run([sys.executable, "-c", stubborn], budget_s=60)
    assert (child.status, child.exit) == ("timed out", -signal.SIGKILL) and "started" in child.output
    assert 3 <= child.seconds < 3 + GRACE_S + 5
    grandchild = int(pid_file.read_text())
    gone = time.monotonic() + 10  # SIGKILL went to the group; its delivery to the grandchild is the kernel's
    while process_state(grandchild) not in (None, "Z") and time.monotonic() < gone:
        time.sleep(0.05)
    assert process_state(grandchild) in (None, "Z")


def test_a_watched_line_is_timed_to_the_part_s_exit(tmp_path):
    """The failing part's measure (the seconds from its error line to its exit) on a child that
    prints one and exits with its code."""
    from gpu_validation import Clock, Runner

    run = Runner(tmp_path / "log", Clock(deadline_s=60, margin_s=1), child_env())
    child = run([sys.executable, "-c", "import sys; print('warming up'); print('error: out of memory', flush=True); "
                 "sys.exit(5)"], budget_s=30, watch=r"^error: ")
    assert (child.status, child.exit) == ("failed", 5) and child.seen_s is not None
    assert 0 <= child.seen_s <= child.seconds
    quiet = run([sys.executable, "-c", "print('fine')"], budget_s=30, watch=r"^error: ")
    assert (quiet.status, quiet.seen_s) == ("done", None)


def process_state(pid: int) -> str | None:
    """A process's state letter (Z: a zombie, dead and not yet reaped), None once it is gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return None


def test_instruct_reader_scores_the_text_under_each_contract(tmp_path):
    """bench/instruct_reader.py on the tiny Llama with a chat template: one row per contract, the
    bare anchor's without the template, the other two inside it."""
    results = tmp_path / "instruct.json"
    script = REPO / "bench" / "instruct_reader.py"
    ok(subprocess.run([sys.executable, str(script), "--model", str(instruct_reader(tmp_path)),
                       "--examples", "4", "--threads", "1", "--results", str(results)],
                      cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300))
    contracts = json.loads(results.read_text())["contracts"]
    assert list(contracts) == ["bare anchor", "chat template", "chat template + instruction"]
    assert [c["contract"].startswith("its chat template") for c in contracts.values()] == [False, True, True]
    assert all(0 <= c["em"] <= c["f1"] <= 100 and len(c["answers"]) == 4 for c in contracts.values())


def test_peak_allocations_lists_what_was_live_at_the_peak_and_refuses_other_files(tmp_path):
    """The report the H100's snapshot was read with: the peak, then its blocks by size and site."""
    import pickle

    where = [{"filename": "/venv/site-packages/torch/nn/functional.py", "line": 1, "name": "layer_norm"},
             {"filename": "/repo/latentwire/model.py", "line": 90, "name": "forward"}]
    trace = [{"action": "alloc", "addr": a, "size": 2 ** 27, "frames": where} for a in range(3)]
    trace.append({"action": "free_requested", "addr": 0, "size": 2 ** 27})
    (tmp_path / "snapshot.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    (tmp_path / "other.pickle").write_bytes(pickle.dumps([1, 2]))
    script = [sys.executable, str(REPO / "bench" / "peak_allocations.py")]
    lines = ok(subprocess.run([*script, str(tmp_path / "snapshot.pickle")], cwd=REPO, env=child_env(),
                              capture_output=True, text=True, timeout=120)).stdout.splitlines()
    assert lines[0].startswith("device 0: 4 events recorded; at their peak 0.375 GiB in 3 blocks")
    assert lines[2].split() == ["0.375", "|", "3", "x", "128.00", "|", "/repo/latentwire/model.py:90", "forward"]
    refused = subprocess.run([*script, str(tmp_path / "other.pickle")], cwd=REPO, env=child_env(),
                             capture_output=True, text=True, timeout=120)
    assert refused.returncode == 2 and refused.stderr.strip().endswith("not a memory snapshot: no device_traces")
