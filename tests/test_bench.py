"""Each bench/ script runs end to end with --quick and ends in the contract's summary line.

The ratios are timings on a shared machine, so only their form is checked, never their value.
"""

import gzip
import json
import math
import os
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
    proc = ok(
        subprocess.run(
            [sys.executable, str(REPO / "bench" / f"{script}.py"), "--quick"],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
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
    proc = ok(
        subprocess.run(
            [
                sys.executable,
                str(REPO / "bench" / "seed_spread.py"),
                "--quick",
                "--results",
                str(results),
                "--out-root",
                str(tmp_path / "runs"),
            ],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    ratio = float(RATIO.search(proc.stdout.strip().splitlines()[-1]).group(1))
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    assert [(r["seed"], r["data_seed"], r["settings"]) for r in rows] == [
        (0, 0, rows[0]["settings"]),
        (1, 0, rows[0]["settings"]),
    ]
    assert ratio == pytest.approx(min(r[who]["f1_share"] for r in rows for who in ("llama", "qwen")), abs=1e-4)
    reports = [
        json.loads(next((tmp_path / "runs" / "default" / f"seed{s}" / "eval").glob("*.json")).read_text())
        for s in (0, 1)
    ]
    text = [[(a["question"], a["text_llama"], a["text_qwen"]) for a in r["answers"]] for r in reports]
    assert text[0] == text[1] and len(text[0]) == 8


def gpu_validation(out: Path, *flags: str, timeout: int = 600) -> tuple[subprocess.CompletedProcess, dict, float]:
    """bench/gpu_validation.py on the cpu profile (`--cpu-check`): the code path a lent GPU runs,
    its results file and how long it took."""
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "gpu_validation.py"),
            "--out",
            str(out / "out"),
            "--work",
            str(out / "work"),
            "--cpu-check",
            *flags,
        ],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    card = flags[flags.index("--card") + 1] if "--card" in flags else None
    results = out / "out" / (f"cpu-{card}-levers.json" if card else "cpu.json")
    return proc, json.loads(results.read_text()), time.monotonic() - started


# Each card's levers (LEVER_CARDS): its bf16 parts with the policy each runs, then the parts after them.
CARD_PARTS = {
    "h100": ([("h100", "full"), ("h100_selective", "selective"), ("h100_none", "none")], []),
    "h200": (
        [("h200", "none"), ("h100", "full"), ("h100_selective", "selective")],
        ["fp8_tensorwise_largest", "fp8_rowwise_largest"],
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("card", CARD_PARTS)
def test_gpu_validation_levers_measure_each_lever_within_the_deadline(tmp_path, card):
    """Each card's levers on the cpu check, one run for every assertion: an entry per part, in the
    order of what it decides (the card's profile as shipped, the baseline, and the bf16
    configurations beside it, the H100's without recompute at the largest micro-batch its plan fits;
    FP8 by each recipe at the fastest of those, refused in one line where train.py or the device
    cannot run it, with the torch and torchao it ran with; the failing run; on the H200, each recipe
    at its plan's largest micro-batch, skipped where its plan is refused), each with the fields the
    card's results need: the recompute policy it ran, the memory cap (none on a CPU: memory_fraction
    gives None there, so no run says a `memory:` line), the compile cache's use (none: the cpu check
    runs eager); torchao on the FP8 parts' path alone, every run's metrics copied into the results
    folder, the kernel summary of the fastest (the CPU's operators here), and everything written
    whole within the deadline."""
    import torch
    from gpu_validation import GRACE_S, TORCHAO_FOR_FP8, global_batch, largest_split

    bf16, after = CARD_PARTS[card]
    deadline, site = 400, str(tmp_path / "torchao")  # where the card's torchao would be; the cpu check refuses FP8
    proc, results, seconds = gpu_validation(
        tmp_path, "--levers", "--card", card, "--deadline", str(deadline), "--torchao", site
    )
    ok(proc)
    assert seconds < deadline + GRACE_S + 5 and results["seconds"] < deadline
    out = tmp_path / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        f"cpu-{card}-levers.json",
        "metrics.jsonl",
        "profile.txt",
        "validation.log",
    ]
    runs = {r["name"]: r for r in results["runs"]}
    names = [name for name, _ in bf16]
    assert list(runs) == [*names, "fp8_tensorwise", "fp8_rowwise", "fails_at_first_step", *after]
    assert results["card"] == card and results["baseline"].startswith(f"{names[0]}: ")
    assert list(results["plans"]) == names
    fields = {
        "status",
        "micro_batch_size",
        "grad_accum_steps",
        "step_time_s",
        "tokens_per_s",
        "mfu",
        "hfu",
        "peak_mem_gb",
        "activation_checkpointing",
        "fp8",
        "ratio_to_baseline",
        "device",
        "torch",
        "memory_gb",
        "cap_memory",
        "memory_capped",
        "memory_fraction",
        "alloc_retries",
        "first_step_s",
        "compile_cache",
    }
    fastest = max((runs[name] for name in names), key=lambda r: r["samples_per_s"])
    policy_of_fastest = fastest["activation_checkpointing"]
    for name, policy, fp8 in (
        *((name, policy, "none") for name, policy in bf16),
        ("fp8_tensorwise", policy_of_fastest, "tensorwise"),
        ("fp8_rowwise", policy_of_fastest, "rowwise"),
    ):
        run = runs[name]
        assert (run["activation_checkpointing"], run["fp8"]) == (policy, fp8), name
        assert results["plans"].get(name, {"activation_checkpointing": policy})["activation_checkpointing"] == policy
        assert (run["env"].get("PYTHONPATH", "").split(os.pathsep)[0] == site) == (fp8 != "none"), run["env"]
        if fp8 != "none":
            assert run["env"] == {**fastest["env"], **TORCHAO_FOR_FP8, "PYTHONPATH": run["env"]["PYTHONPATH"]}
            assert run["flags"][: len(fastest["flags"])] == fastest["flags"] and run["of"] == fastest["name"]
            assert (run["torch"], run["torchao"]) == (torch.__version__, None)  # none in `site`, nor here
        else:
            assert run["env"] == {} and run["flags"][run["flags"].index("--profile") + 1] == "cpu"
            assert "torchao" not in run
        if fp8 != "none" and run["status"] == "refused":
            assert run["exit"] == 2 and run["error"].startswith("error: "), run
            continue
        assert run["status"] == "done" and fields <= run.keys(), (name, fields - run.keys())
        assert run["ratio_to_baseline"] > 0 and run["hfu"] is None  # no peak FLOP/s on a CPU: no MFU, no HFU
        assert (
            run["memory_gb"],
            run["cap_memory"],
            run["memory_capped"],
            run["memory_fraction"],
            run["memory_cap_line"],
            run["alloc_retries"],
        ) == (8.0, True, False, None, None, None), name
        assert (run["compile_cache"], run["cache_hits"], run["cache_misses"]) == (None, 0, 0), name
        assert run["first_step_s"] > 0
    if card == "h100":  # without recompute at the largest micro-batch its plan fits, the global batch kept
        none, batch = runs["h100_none"], global_batch(runs["h100"]["flags"])  # the cpu profile's 16 x 1 x 2 ranks
        assert none["micro_batch_size"] == largest_split(results["plans"]["h100_none"]["max_micro_batch"], batch)
        assert none["micro_batch_size"] * none["grad_accum_steps"] == batch
    for name in after:  # the cpu profile's fp32 refuses FP8 plans before a process
        assert runs[name]["why"].startswith("plan refused: error: "), runs
    assert runs[names[0]]["ratio_to_baseline"] == 1.0
    assert set(results["levers"]) == {*names, "fp8_tensorwise", "fp8_rowwise"}
    assert runs["fails_at_first_step"]["status"] == "skipped"
    log = (out / "validation.log").read_text()
    assert not re.search(r"^memory: ", log, re.M)
    copied = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for name in (*names, "profile"):
        mine = [r["step"] for r in copied if r["part"] == name]
        assert mine == list(range(1, len(mine) + 1)) and mine, name
        assert all("hfu" in r for r in copied if r["part"] == name)
    profile = results["profile"]
    assert profile["status"] == "done" and profile["of"] in runs and profile["top"]
    assert 0 <= profile["summary"]["idle_share"] < 1 and profile["summary"]["activity"] == "CPU operators"
    text = (out / "profile.txt").read_text()
    assert "3 profiled steps" in text and "idle" in text and "aten::mm" in text


def test_the_levers_read_the_card_they_are_on(monkeypatch, capsys):
    """Whose levers a card runs, from what torch.cuda says of it (its name, its memory): an H100's
    and an H200's figures as nvidia-smi gives them (81,559 and 143,771 MiB), an H100 NVL's, and cards
    the levers do not know (an A100 of the H100's memory, an H100 MIG slice). The card's parts are
    measured only with --card on the cpu check, and a GPU-less machine is told in one line."""
    from gpu_validation import LEVER_CARDS, lever_card, main

    mib = 2**20
    assert list(LEVER_CARDS) == ["h100", "h200"]
    assert lever_card("NVIDIA H100 80GB HBM3", 81559 * mib) == "h100"
    assert lever_card("NVIDIA H200", 143771 * mib) == "h200"
    assert lever_card("NVIDIA H100 NVL", 95830 * mib) == "h100"
    assert lever_card("NVIDIA A100-SXM4-80GB", 81920 * mib) is None
    assert lever_card("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 40192 * mib) is None
    for flags, said in (
        (["--levers", "--cpu-check"], "--levers --cpu-check: --card names the card whose parts it runs (h100, h200)"),
        (["--levers"], "--levers: this is no CUDA device; the levers know an H100 and an H200 (--card names one)"),
        (["--card", "h100"], "--card is the levers'"),
    ):
        monkeypatch.setattr(sys, "argv", ["gpu_validation.py", "--out", "unused", *flags])
        with pytest.raises(SystemExit) as exited:
            main()
        err = capsys.readouterr().err
        assert exited.value.code == 2 and said in err.splitlines()[-1], err


def test_an_entry_reads_the_memory_cap_and_the_compile_cache_from_what_the_run_said():
    """The memory cap's opening line as train.py says it on a card (memory_fraction with an H200's
    figures: held to the h100 profile's 79.6 GB; lifted by --cap-memory false; a CPU says nothing)
    and AOTAutograd's cache lines, read into a run's entry."""
    from gpu_validation import compile_cache_use, memory_cap

    from latentwire.harness.memory_cap import GIB, memory_fraction

    fraction, line = memory_fraction(int(140.4 * GIB), int(0.5 * GIB), 79.6, True, "cuda")
    print(line)  # the line a capped run's log holds
    said = memory_cap(f"batch: ...\n{line}\nstep 1/3 | ...")
    assert said["memory_capped"] and said["memory_cap_line"] == line
    assert abs(said["memory_fraction"] - fraction) < 1e-4  # the line's four decimals
    _, lifted = memory_fraction(int(140.4 * GIB), int(0.5 * GIB), 79.6, False, "cuda")
    assert memory_cap(lifted) == {"memory_capped": False, "memory_fraction": None, "memory_cap_line": lifted}
    assert memory_fraction(0, 0, 8.0, True, "cpu") == (None, None)
    assert memory_cap("step 1/3 | ...") == {"memory_capped": False, "memory_fraction": None, "memory_cap_line": None}
    hit, miss = "AOTAutograd cache hit for key a1", "AOTAutograd cache miss for key b2"
    assert compile_cache_use(f"{hit}\n{hit}\n") == {
        "cache_hits": 2,
        "cache_misses": 0,
        "cache_bypassed": 0,
        "compile_cache": "warm",
    }
    assert compile_cache_use(f"{hit}\n{miss}\n")["compile_cache"] == "partly warm"
    assert compile_cache_use(f"{miss}\nBypassing autograd cache due to: x\n")["compile_cache"] == "cold"
    assert compile_cache_use("step 1/3")["compile_cache"] is None


def test_the_plans_both_commands_compare_with_are_shipped():
    """Every plan --prepare ships (the validation's for h100, the levers' for the h200 and h100
    profiles and the policies they run, and each FP8 recipe at each of the levers' configurations)
    is in bench/results/ under the flags the driver looks it up by."""
    from gpu_validation import REAL_LLMS, lever_configs, plan_flags, plan_path, plans_to_ship

    for card, (bf16, _) in CARD_PARTS.items():
        configs = lever_configs(card, False)
        assert [(c.part, c.policy) for c in configs] == bf16 and all(c.profile.startswith("h") for c in configs)
        assert [(c.profile, c.largest) for c in lever_configs(card, True)] == [("cpu", c.largest) for c in configs]
    assert [c.part for c in lever_configs("h100", False) if c.largest] == ["h100_none"]
    # the part fails_at_first_step makes fail: each card's first without recompute
    assert [next(c.part for c in lever_configs(card, False) if c.policy == "none") for card in CARD_PARTS] == [
        "h100_none",
        "h200",
    ]
    for profile, policy, recipe in plans_to_ship("h100", fp8=True):
        path = plan_path(profile, policy, recipe)
        shipped = json.loads(path.read_text())
        rows = ["--max-prompt-bytes", str(shipped["rows"]["max_prompt_bytes"])]
        assert shipped["flags"] == plan_flags(profile, REAL_LLMS, policy, rows, recipe), path
        assert shipped["plan"]["activation_checkpointing"] == policy and shipped["plan"]["max_micro_batch"] > 0


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
        "preflight": "done",
        "main": "timed out",
        "evaluate": "done",
        "eager": "done",
        "find_batch": "done",
        "no_recompute": "done",
        "plan_micro_batch": "done",
    }
    fields = {
        "device",
        "torch",
        "profile",
        "micro_batch_size",
        "grad_accum_steps",
        "compile",
        "activation_checkpointing",
        "tokens_per_s",
        "step_time_s",
        "mfu",
        "tflops_per_gpu",
        "peak_mem_gb",
        "planned_peak_gb",
        "plan_max_micro_batch",
        "compile_s",
        "recompiles",
        "date",
    }
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
    stubborn = (
        "import os, signal, subprocess, sys; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()']); "
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); signal.pause()"
    )
    run = Runner(tmp_path / "log", Clock(deadline_s=4, margin_s=1), child_env())
    child = run([sys.executable, "-c", stubborn], budget_s=60)
    assert (child.status, child.exit) == ("timed out", -signal.SIGKILL) and "started" in child.output
    assert 3 <= child.seconds < 3 + GRACE_S + 5
    grandchild = int(pid_file.read_text())
    gone = time.monotonic() + 10  # SIGKILL went to the group; its delivery to the grandchild is the kernel's
    while process_state(grandchild) not in (None, "Z") and time.monotonic() < gone:
        time.sleep(0.05)
    assert process_state(grandchild) in (None, "Z")


# The loop's way out of an out-of-memory step, in small: train.py's `with` of its loader (whose
# workers may take long to stop) around the harness's out_of_memory, then main_guard's error line.
WAY_OUT = """
import sys, torch
sys.path.insert(0, {repo!r})
from latentwire.harness.errors import out_of_memory
from latentwire.harness.exits import main_guard

class NoSnapshots:
    def dump(self):
        return None

class Loader:
    def __enter__(self):
        return self
    def __exit__(self, *exc):
        print("loader stopped", flush=True)

def main():
    with Loader(), out_of_memory("see the plan", 4, NoSnapshots()):
        raise torch.OutOfMemoryError("CUDA out of memory")

main_guard(main)
"""


def test_the_failing_part_is_timed_from_the_loop_catching_the_failure(tmp_path):
    """The failing part's measure (the seconds from the failure to its exit) starts at the line the
    loop prints when it catches out-of-memory, before its loader stops, so a slow shutdown is in
    it: the `error:` line comes only after."""
    from gpu_validation import CAUGHT, Clock, Runner

    run = Runner(tmp_path / "log", Clock(deadline_s=120, margin_s=1), child_env())
    child = run([sys.executable, "-c", WAY_OUT.format(repo=str(REPO))], budget_s=100, watch=CAUGHT)
    assert (child.status, child.exit) == ("failed", 5) and child.seen_s is not None, child.output
    started_at = re.search(CAUGHT, child.output, re.M).group(0)  # the log's first match is the clock's
    assert started_at.startswith("caught out of memory"), child.output
    assert (
        child.output.index("caught out of memory at micro-batch 4")
        < child.output.index("loader stopped")
        < child.output.index("error: out of memory")
    )
    assert 0 <= child.seen_s <= child.seconds
    quiet = run([sys.executable, "-c", "print('fine')"], budget_s=30, watch=CAUGHT)
    assert (quiet.status, quiet.seen_s) == ("done", None)


def test_a_part_stopped_mid_write_leaves_files_the_driver_still_reads(tmp_path):
    """A part stopped while it wrote its metrics or exported its trace leaves a torn file: its
    records up to the tear are kept, the trace is reported unreadable, and the command goes on."""
    from gpu_validation import read_records, trace_summary

    metrics = tmp_path / "metrics.jsonl"
    metrics.write_text('{"step": 1, "loss": 2.0}\n{"step": 2, "lo')
    assert read_records(metrics) == ([{"step": 1, "loss": 2.0}], 1)
    assert read_records(tmp_path / "absent.jsonl") == ([], 0)
    trace = tmp_path / "rank0.pt.trace.json"
    trace.write_text('{"traceEvents": [{"ph": "X", "na')
    assert trace_summary(trace).startswith("trace rank0.pt.trace.json unreadable: JSONDecodeError")
    packed = tmp_path / "rank0.pt.trace.json.gz"
    packed.write_bytes(gzip.compress(b'{"traceEvents": []}')[:12])
    assert "unreadable: EOFError" in trace_summary(packed)


def test_torchao_is_on_the_fp8_parts_path_alone():
    """The FP8 parts' environment: the folder --torchao names first on their path (before any the
    driver inherited), torchao's compiled extensions skipped; without the folder, only the skip."""
    from gpu_validation import TORCHAO_FOR_FP8, fp8_env

    assert TORCHAO_FOR_FP8 == {"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
    assert fp8_env(None) == TORCHAO_FOR_FP8
    assert fp8_env("/opt/site") == {
        **TORCHAO_FOR_FP8,
        "PYTHONPATH": os.pathsep.join(filter(None, ["/opt/site", os.environ.get("PYTHONPATH")])),
    }


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
    ok(
        subprocess.run(
            [
                sys.executable,
                str(script),
                "--model",
                str(instruct_reader(tmp_path)),
                "--examples",
                "4",
                "--threads",
                "1",
                "--results",
                str(results),
            ],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    contracts = json.loads(results.read_text())["contracts"]
    assert list(contracts) == ["bare anchor", "chat template", "chat template + instruction"]
    assert [c["contract"].startswith("its chat template") for c in contracts.values()] == [False, True, True]
    assert all(0 <= c["em"] <= c["f1"] <= 100 and len(c["answers"]) == 4 for c in contracts.values())


def test_peak_allocations_lists_what_was_live_at_the_peak_and_refuses_other_files(tmp_path):
    """The report the H100's snapshot was read with: the peak, then its blocks by size and site."""
    import pickle

    where = [
        {"filename": "/venv/site-packages/torch/nn/functional.py", "line": 1, "name": "layer_norm"},
        {"filename": "/repo/latentwire/model.py", "line": 90, "name": "forward"},
    ]
    trace = [{"action": "alloc", "addr": a, "size": 2**27, "frames": where} for a in range(3)]
    trace.append({"action": "free_requested", "addr": 0, "size": 2**27})
    (tmp_path / "snapshot.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    (tmp_path / "other.pickle").write_bytes(pickle.dumps([1, 2]))
    script = [sys.executable, str(REPO / "bench" / "peak_allocations.py")]
    lines = ok(
        subprocess.run(
            [*script, str(tmp_path / "snapshot.pickle")],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=120,
        )
    ).stdout.splitlines()
    assert lines[0].startswith("device 0: 4 events recorded; at their peak 0.375 GiB in 3 blocks")
    assert lines[2].split() == ["0.375", "|", "3", "x", "128.00", "|", "/repo/latentwire/model.py:90", "forward"]
    refused = subprocess.run(
        [*script, str(tmp_path / "other.pickle")],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert refused.returncode == 2 and refused.stderr.strip().endswith("not a memory snapshot: no device_traces")
