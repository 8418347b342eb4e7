"""Issue 21's measurements on a lent GPU, in one command: the card's attention-kernel facts, the
profile end to end (step time, tokens/s, MFU, memory, compile time, recompiles), the memory plan
and find_batch against it, an evaluation with text baselines, the levers as ratios, and a short
profiler trace. Each part runs in its own process and is recorded even when another fails, so a
crash costs one entry, not the GPU time.

    python bench/gpu_validation.py --out $OUT                  # on the GPU machine: h100, real architectures
    python bench/gpu_validation.py --out /tmp/v --cpu-check    # here: the cpu profile, the same code path

Without network the LLMs are `random:` (the real architectures, seeded random weights: the same
FLOPs and memory); the data is a local .json of SQuAD-length synthetic examples (no `datasets`
needed). Writes `<out>/<profile>.json` (the runs issue 21 lists: copy it to bench/results/) and
`<out>/validation.log`. The kernel facts need CUDA; everything else runs in the CPU check too
(tests/test_bench.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from common import REPO, child_env

# Readers for the GPU profiles: their architectures from latentwire.known_llms, no download.
REAL_LLMS = ["--llama", "random:meta-llama/Llama-3.1-8B", "--qwen", "random:Qwen/Qwen2.5-7B"]
# SQuAD contexts are about 750 characters; the profile cuts prompts at max_prompt_bytes.
SQUAD_CONTEXT_BYTES = 750


def squad_length_examples(path: Path, n: int, seed: int = 0) -> Path:
    """`n` synthetic examples whose contexts are padded with other examples' facts to SQuAD's length,
    the answer's fact kept first, written as one JSON document (read without `datasets`)."""
    from latentwire.data import synthetic_examples

    pool = synthetic_examples(n * 4, seed)
    examples = []
    for i, ex in enumerate(pool[:n]):
        context, k = ex["context"], n + i
        while len(context.encode()) < SQUAD_CONTEXT_BYTES:
            context += " " + pool[k % len(pool)]["context"]
            k += n
        examples.append({**ex, "context": context})
    path.write_text(json.dumps(examples))
    return path


# --- the card's attention kernels -----------------------------------------------------------------

KERNEL_FACTS = r"""
import json, torch
from torch.nn.attention import SDPBackend, sdpa_kernel
facts = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
         "cudnn": torch.backends.cudnn.version(), "keyless_row": {}, "head_width": {}}
q = torch.randn(2, 4, 16, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device="cuda").tril()
mask[0, :, 3] = False  # one query row that sees no key
for backend in ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION"):
    try:
        with sdpa_kernel([getattr(SDPBackend, backend)]):
            out = torch.nn.functional.scaled_dot_product_attention(q, q, q, attn_mask=mask)
            out.sum().backward()
        row = out[0, :, 3].float()
        facts["keyless_row"][backend] = ("nan" if row.isnan().any() else "zeros" if (row == 0).all() else "values") + \
            ("; nan gradient" if q.grad.isnan().any() else "")
    except RuntimeError as e:
        facts["keyless_row"][backend] = "refused: " + str(e).splitlines()[0][:160]
    q.grad = None
for width in (12, 25, 64):
    x = torch.randn(2, 4, 16, width, device="cuda", dtype=torch.bfloat16)
    pad = torch.ones(2, 1, 1, 16, dtype=torch.bool, device="cuda")
    pad[0, ..., 10:] = False
    runs = []
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                torch.nn.functional.scaled_dot_product_attention(x, x, x, attn_mask=pad)
            runs.append(backend)
        except RuntimeError:
            pass
    facts["head_width"][str(width)] = runs
print(json.dumps(facts))
"""


# --- the runs -------------------------------------------------------------------------------------

def error_line(proc: subprocess.CompletedProcess, fallback: str) -> str:
    """What a failed part said: its `error:` line, else its last line of output."""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("error:")), lines[-1] if lines else fallback)[:300]


def run(cmd: list[str], log, env: dict | None = None, timeout: int = 3600) -> subprocess.CompletedProcess:
    """One part in its own process; its output goes to the log, whatever it returns."""
    started = time.perf_counter()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout,
                          env={**child_env(torch.get_num_threads()), **(env or {})})
    log.write(f"\n$ {' '.join(cmd)}\n(exit {proc.returncode}, {time.perf_counter() - started:.0f} s)\n"
              f"{proc.stdout[-20000:]}\n{proc.stderr[-20000:]}\n")
    log.flush()
    return proc


def steady_state(records: list[dict]) -> dict:
    """Medians over the log windows after the first (which holds the compile and the warm-up)."""
    later = [r for r in records if r["step"] > records[0]["step"] and "step_time_s" in r] or records
    median = lambda key: statistics.median(r[key] for r in later if r.get(key) is not None) \
        if any(r.get(key) is not None for r in later) else None
    return {"step_time_s": median("step_time_s"), "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"),
            "tflops_per_gpu": median("tflops_per_gpu"), "data_wait_frac": median("data_wait_frac"),
            "peak_mem_gb": max(r["run_peak_mem_gb"] for r in records),
            "peak_reserved_gb": max((r["peak_reserved_gb"] or 0) for r in records) or None,
            "compile_s": max(records[0]["step_time_s"] - median("step_time_s"), 0.0)}


def train_run(name: str, flags: list[str], out: Path, log) -> dict:
    """train.py on one process with `flags`, its steady state and recompiles."""
    from latentwire.config import load_config

    run_dir = out / "runs" / name
    proc = run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=1",
                "train.py", *flags, "--out-dir", str(run_dir), "--overwrite"], log, env={"TORCH_LOGS": "recompiles"})
    cfg = load_config([*flags, "--out-dir", str(run_dir)])
    entry = {"name": name, "profile": cfg.run.profile, "micro_batch_size": cfg.training.micro_batch_size,
             "grad_accum_steps": cfg.training.grad_accum_steps, "compile": cfg.compile.enabled,
             "activation_checkpointing": cfg.frozen.activation_checkpointing, "exit": proc.returncode,
             "recompiles": len(re.findall(r"Recompiling function", proc.stderr)), "run_dir": str(run_dir)}
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    records = [r for r in records if "step_time_s" in r]
    if records:
        entry |= steady_state(records)
    else:
        entry["error"] = error_line(proc, "no metrics")
    return entry


def planned(flags: list[str], out: Path, log) -> dict:
    path = out / "plan.json"
    proc = run([sys.executable, "-m", "latentwire.plan", *flags, "--json", str(path)], log)
    if proc.returncode or not path.exists():
        return {"error": error_line(proc, "plan failed")}
    plan = json.loads(path.read_text())
    return {"plan_max_micro_batch": plan["max_micro_batch"], "peak_bytes": plan["peak_bytes"]}


def found_batch(flags: list[str], out: Path, log, most: int) -> int | None:
    path = out / "find_batch.json"
    run([sys.executable, "-m", "latentwire.find_batch", *flags, "--steps", "2", "--max-micro-batch", str(most),
         "--json", str(path), "--out-dir", str(out / "find_batch")], log)
    if not path.exists():
        return None
    return json.loads(path.read_text()).get("max_micro_batch")


def evaluated(run_dir: str, out: Path, examples: int, log) -> dict:
    """The trained wire with text baselines: NaN and empty answers counted."""
    proc = run([sys.executable, "-m", "latentwire.evaluate", "--ckpt", run_dir, "--eval-examples", str(examples),
                "--out-dir", str(out / "eval")], log)
    reports = sorted((out / "eval").glob("*.json"))
    if proc.returncode or not reports:
        return {"error": error_line(proc, "evaluate failed")}
    report = json.loads(reports[-1].read_text())
    answers = [v for a in report["answers"] for k, v in a.items() if k not in ("index", "question", "gold")]
    return {"metrics": report["metrics"], "nan_metrics": [k for k, v in report["metrics"].items() if v != v],
            "empty_answers": sum(not a for a in answers), "answers": len(answers)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="where the results go ($OUT on the GPU machine)")
    p.add_argument("--profile", default="h100")
    p.add_argument("--steps", type=int, default=30, help="optimizer steps of the main run")
    p.add_argument("--cpu-check", action="store_true",
                   help="the cpu profile with its tiny readers and a few steps: the code path, here")
    args = p.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    profile = "cpu" if args.cpu_check else args.profile
    # The CPU check runs every part, small: the code path, not the numbers.
    steps = 3 if args.cpu_check else args.steps
    data = squad_length_examples(out / "squad_length.json", 128 if args.cpu_check else 4096)
    base = ["--profile", profile, *([] if args.cpu_check else REAL_LLMS), "--dataset", str(data),
            "--num-workers", "0" if args.cpu_check else "4", "--eval-every", "0", "--checkpoint-every", "0"]
    main_run = [*base, "--max-steps", str(steps), "--log-every", "1" if args.cpu_check else "5"]
    lever = [*base, "--max-steps", "2" if args.cpu_check else "10", "--log-every", "1" if args.cpu_check else "2"]
    results = {"date": datetime.date.today().isoformat(), "profile": profile, "runs": [], "checks": {}}

    with open(out / "validation.log", "w") as log:
        if torch.cuda.is_available():
            proc = run([sys.executable, "-c", KERNEL_FACTS], log)
            results["kernel_facts"] = json.loads(proc.stdout) if proc.returncode == 0 else {"error": proc.stderr[-300:]}
        plan = planned(base, out, log)
        results["checks"]["plan"] = plan
        # The plan's largest micro-batch as a lever (on the CPU check, no more than its data holds).
        largest = min(plan.get("plan_max_micro_batch", 0), 16 if args.cpu_check else 10 ** 6)
        entry = train_run("main", main_run, out, log)
        if "plan_max_micro_batch" in plan:
            entry["plan_max_micro_batch"] = plan["plan_max_micro_batch"]
            entry["planned_peak_gb"] = plan["peak_bytes"].get(str(entry["micro_batch_size"]), 0) / 2 ** 30 or None
        entry["find_batch_max"] = found_batch(base, out, log, most=32 if args.cpu_check else 512)
        results["runs"].append(entry)
        # The wire after the main run: saved at its last step.
        results["checks"]["evaluate"] = evaluated(entry["run_dir"], out, 16 if args.cpu_check else 200, log)
        # The levers, each against the same short run at the profile's settings.
        for name, flags in (("eager", ["--compile", "false"]), ("no_recompute", ["--activation-checkpointing", "false"]),
                            *((("plan_micro_batch", ["--micro-batch-size", str(largest), "--grad-accum-steps", "1"]),)
                              if largest else ())):
            results["runs"].append(train_run(name, [*lever, *flags], out, log))
        results["runs"].append(train_run("lever_base", lever, out, log))
        # Step time of each lever over the profile's own, and samples/s for the micro-batch lever.
        by_name = {r["name"]: r for r in results["runs"]}
        base_step = by_name["lever_base"].get("step_time_s")
        results["levers"] = {name: by_name[name]["step_time_s"] / base_step
                             for name in ("eager", "no_recompute") if base_step and by_name[name].get("step_time_s")}
        results["runs"].append(train_run("profiled", [*lever, "--profiler", "true"], out, log))
    for entry in results["runs"]:
        entry |= {"device": results.get("kernel_facts", {}).get("device", "cpu"), "torch": torch.__version__,
                  "date": results["date"]}
    path = out / f"{profile}.json"
    path.write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path}; {sum(1 for r in results['runs'] if r.get('exit') == 0)} of {len(results['runs'])} runs "
          f"finished; log: {out / 'validation.log'}")


if __name__ == "__main__":
    main()
