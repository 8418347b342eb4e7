"""A lent GPU's measurements in one command that fits its lease.

The card's attention-kernel facts, the profile end to end (step time, tokens/s, MFU, memory,
compile time, recompiles), an evaluation with text baselines, the eager lever, find_batch against
the memory plan, then what time is left: no recompute, the plan's largest micro-batch.

    python bench/gpu_validation.py --out $OUT --deadline 530      # on the GPU machine (one command, 570 s limit)
    python bench/gpu_validation.py --out /tmp/v --cpu-check        # here: the cpu profile, the same code path
    python bench/gpu_validation.py --prepare                       # here, before a GPU: the plans it compares with
    python bench/gpu_validation.py --out $OUT --deadline 530 --compile-mode max-autotune-no-cudagraphs \
        --budget preflight=0 --budget main=400                     # a second command: max-autotune's cost and gain

A lent GPU gives minutes, and a command stopped at its limit returns only the files it had already
written, so nothing waits for the end: each part runs in its own process group, under
min(its budget, the time left to --deadline less --margin), and is stopped (SIGTERM, then SIGKILL)
when that runs out, its entry then saying "timed out" with whatever metrics it had flushed.
`<out>/<profile>.json` is rewritten atomically after every part, and every child's output goes to
`<out>/validation.log` as it comes. Data, run directories, checkpoints and compile caches live in
`--work` (a temporary directory by default), so two small files come back.

Without network the LLMs are `random:` (the real architectures, seeded random weights: the same
FLOPs and memory), read through their family's tiny tokenizer; the data is a local .json of
SQuAD-length synthetic examples. The memory plan is traced on the CPU (minutes of single-threaded
Python that a GPU lease should not pay for): `--prepare` writes it to bench/results/, and the
driver reads it from there when its flags match, tracing it itself only when they do not.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from common import REPO, child_env

# Readers for the GPU profiles: their architectures from latentwire.known_llms, no download.
REAL_LLMS = ["--llama", "random:meta-llama/Llama-3.1-8B", "--qwen", "random:Qwen/Qwen2.5-7B"]
# SQuAD contexts are about 750 characters; the profile cuts prompts at max_prompt_bytes.
SQUAD_CONTEXT_BYTES = 750
RESULTS = REPO / "bench" / "results"
# Seconds a stopped part gets between SIGTERM and SIGKILL.
GRACE_S = 5


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


# --- the card's attention kernels (run in a child: `--kernel-facts`) --------------------------------

def kernel_facts(device: torch.device) -> dict:
    """What each SDPA kernel does with the inputs this project gives it: a query row that sees no
    key (an all-padding row), head widths without a fused kernel, the LLMs' grouped-query causal
    attention at head width 128 (forward and backward, against the math kernel in fp32), and the
    encoder's masked attention with dropout, compiled."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    sdpa = torch.nn.functional.scaled_dot_product_attention
    dtype = torch.bfloat16
    backends = ("CUDNN_ATTENTION", "EFFICIENT_ATTENTION", "FLASH_ATTENTION")

    def attempt(backend: str, fn) -> str:
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                return fn()
        except RuntimeError as e:
            return "refused: " + (str(e).splitlines() or ["?"])[0][:160]

    def keyless(q):
        out = sdpa(q, q, q, attn_mask=mask)
        out.sum().backward()
        row = out[0, :, 3].float()
        said = "nan" if row.isnan().any() else "zeros" if (row == 0).all() else "values"
        return said + ("; nan gradient" if q.grad.isnan().any() else "")

    facts = {"keyless_row": {}, "head_width": {}, "gqa_causal_128": {}}
    mask = torch.ones(2, 1, 16, 16, dtype=torch.bool, device=device).tril()
    mask[0, :, 3] = False  # one query row that sees no key
    for backend in backends:
        q = torch.randn(2, 4, 16, 64, device=device, dtype=dtype, requires_grad=True)
        facts["keyless_row"][backend] = attempt(backend, lambda: keyless(q))
    for width in (12, 25, 64):
        x = torch.randn(2, 4, 16, width, device=device, dtype=dtype)
        pad = torch.ones(2, 1, 1, 16, dtype=torch.bool, device=device)
        pad[0, ..., 10:] = False
        facts["head_width"][str(width)] = [b for b in backends
                                           if not attempt(b, lambda: str(sdpa(x, x, x, attn_mask=pad).shape))
                                           .startswith("refused")]

    # Llama-3.1-8B's attention: 32 query heads over 8 key/value heads of width 128, causal, no mask.
    q0, k0, v0 = (torch.randn(2, h, 256, 128, device=device) for h in (32, 8, 8))
    ref = [t.double() for t in (q0, k0, v0)]
    for t in ref:
        t.requires_grad_(True)
    ref_out = sdpa(*ref, is_causal=True, enable_gqa=True)
    ref_out.backward(torch.ones_like(ref_out))

    def gqa():
        q, k, v = (t.to(dtype).requires_grad_(True) for t in (q0, k0, v0))
        out = sdpa(q, k, v, is_causal=True, enable_gqa=True)
        out.backward(torch.ones_like(out))
        err = lambda a, b: float((a.detach().double() - b.detach()).norm() / b.detach().norm())  # noqa: E731
        return f"forward {err(out, ref_out):.1e}, dq {err(q.grad, ref[0].grad):.1e}, dk {err(k.grad, ref[1].grad):.1e}"

    for backend in backends:
        facts["gqa_causal_128"][backend] = attempt(backend, gqa)

    # The encoder's attention as train.py runs it: compiled, a padding mask, dropout, backward.
    def encoder_attention(x, key_mask):
        return sdpa(x, x, x, attn_mask=key_mask[:, None, None, :], dropout_p=0.1)

    x = torch.randn(4, 8, 96, 64, device=device, dtype=dtype, requires_grad=True)
    key_mask = torch.arange(96, device=device)[None, :] < torch.tensor([96, 70, 33, 1], device=device)[:, None]

    def compiled_dropout():  # inductor's kernels are the GPU's fact; on a CPU the check's code path is enough
        out = torch.compile(encoder_attention, dynamic=True,
                            backend="inductor" if device.type == "cuda" else "aot_eager")(x, key_mask)
        out.float().sum().backward()
        finite = bool(out.isfinite().all() and x.grad.isfinite().all())
        return "finite" if finite else "non-finite output or gradient"

    facts["compiled_masked_dropout"] = attempt("EFFICIENT_ATTENTION" if device.type == "cuda" else "MATH",
                                               compiled_dropout)
    return facts


def versions() -> dict:
    import transformers

    cuda = torch.cuda.is_available()
    return {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
            "cuda": torch.version.cuda, "cudnn": torch.backends.cudnn.version() if cuda else None,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "capability": list(torch.cuda.get_device_capability()) if cuda else None}


# --- time and children ----------------------------------------------------------------------------

class Clock:
    """The deadline every part is fitted under: `margin` seconds are kept for stopping the last part
    and writing the results."""

    def __init__(self, deadline_s: float, margin_s: float):
        self.start, self.deadline_s, self.margin_s = time.monotonic(), deadline_s, margin_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def limit(self, budget_s: float) -> float:
        return min(budget_s, self.deadline_s - self.elapsed() - self.margin_s)


@dataclass
class Child:
    status: str  # done, failed, timed out, skipped
    exit: int | None = None
    seconds: float = 0.0
    output: str = ""

    def entry(self) -> dict:
        return {"status": self.status, "exit": self.exit, "seconds": round(self.seconds, 1)}


class Runner:
    """Runs each part's command in a process group of its own, its output appended to the log as it
    comes, stopped when its time is up."""

    def __init__(self, log: Path, clock: Clock, env: dict):
        self.log, self.clock, self.env = log, clock, env

    def __call__(self, cmd: list[str], budget_s: float, env: dict | None = None) -> Child:
        limit = self.clock.limit(budget_s)
        if limit < 1:
            return Child("skipped")
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n(at {self.clock.elapsed():.0f} s, {limit:.0f} s allowed)\n")
            log.flush()
            offset = log.tell()
            started = time.monotonic()
            proc = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**self.env, **(env or {})})
            try:
                code, status = proc.wait(timeout=limit), None
            except subprocess.TimeoutExpired:
                code, status = stop_group(proc), "timed out"
            seconds = time.monotonic() - started
        with open(self.log, "r", errors="replace") as log:
            log.seek(offset)
            output = log.read()
        status = status or ("done" if code == 0 else "failed")
        with open(self.log, "a") as log:
            log.write(f"({status}, exit {code}, {seconds:.0f} s)\n")
        return Child(status, code, seconds, output)


def stop_group(proc: subprocess.Popen) -> int:
    """SIGTERM to the part's process group (train.py saves at the end of its step), SIGKILL after
    GRACE_S."""
    for sig, wait in ((signal.SIGTERM, GRACE_S), (signal.SIGKILL, None)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            break
        try:
            return proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue
    return proc.wait()


def error_line(output: str) -> str:
    """What a failed part said: its `error:` line, else its last line of output."""
    lines = [line for line in output.splitlines() if line.strip()]
    return next((line for line in lines if line.startswith("error:")), lines[-1] if lines else "no output")[:300]


class Results:
    """The results file, rewritten whole and atomically (a temporary file renamed over it)."""

    def __init__(self, path: Path, record: dict):
        self.path, self.record = path, record

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.record, indent=2) + "\n")
        os.replace(tmp, self.path)


# --- the plan, traced on the CPU --------------------------------------------------------------------

def plan_flags(profile: str, readers: list[str], recompute: bool) -> list[str]:
    return ["--profile", profile, *readers, "--activation-checkpointing", str(recompute).lower()]


def plan_path(profile: str, recompute: bool) -> Path:
    return RESULTS / f"plan-{profile}{'' if recompute else '-no-recompute'}.json"


def shipped_plan(profile: str, readers: list[str], recompute: bool) -> dict | None:
    """The plan `--prepare` traced for exactly these flags, if it is in bench/results/."""
    path = plan_path(profile, recompute)
    if not path.exists():
        return None
    shipped = json.loads(path.read_text())
    return shipped["plan"] if shipped["flags"] == plan_flags(profile, readers, recompute) else None


def trace_plan(flags: list[str], path: Path, run) -> dict | str:
    """`python -m latentwire.plan` for `flags` (through `run`, a Runner): the plan, or why there is none."""
    child = run([sys.executable, "-m", "latentwire.plan", *flags, "--json", str(path)], 300)
    return json.loads(path.read_text()) if child.status == "done" else f"plan {child.status}: {error_line(child.output)}"


def the_plan(run, profile: str, readers: list[str], recompute: bool, work: Path) -> tuple[dict | str, str]:
    """The plan for these flags, and where it came from: bench/results/ where it is shipped, else
    traced now."""
    plan = shipped_plan(profile, readers, recompute)
    if plan is not None:
        return plan, str(plan_path(profile, recompute).relative_to(REPO))
    flags = plan_flags(profile, readers, recompute)
    return trace_plan(flags, work / f"plan-{recompute}.json", run), "traced by this run"


def planned_peak_gib(plan: dict, micro_batch: int) -> float:
    """The plan's traced peak (without its reserve) at `micro_batch`: its fit, fixed + per sample."""
    return (plan["fixed_bytes"] + plan["activation_bytes_per_sample"] * micro_batch) / 2 ** 30


# --- the parts --------------------------------------------------------------------------------------

def steady_state(records: list[dict]) -> dict:
    """Medians over the steps after the first three (the first compiles, the next may recompile for
    a new shape), or after the first where the run logged fewer."""
    timed = [r for r in records if "step_time_s" in r]
    if not timed:
        return {}
    later = [r for r in timed if r["step"] > 3] or timed[1:] or timed

    def median(key):
        values = [r[key] for r in later if r.get(key) is not None]
        return statistics.median(values) if values else None

    step = median("step_time_s")
    return {"steps_logged": timed[-1]["step"], "step_time_s": step, "samples_per_s": median("samples_per_s"),
            "tokens_per_s": median("tokens_per_s"), "mfu": median("mfu"), "tflops_per_gpu": median("tflops_per_gpu"),
            "data_wait_frac": median("data_wait_frac"), "peak_mem_gb": max(r["run_peak_mem_gb"] for r in timed),
            "peak_reserved_gb": max((r.get("peak_reserved_gb") or 0) for r in timed) or None,
            "first_step_s": timed[0]["step_time_s"],
            "compile_s": max(timed[0]["step_time_s"] - step, 0.0) if len(timed) > 1 else None,
            "loss_first": timed[0]["loss"], "loss_last": timed[-1]["loss"]}


def train_run(run, name: str, flags: list[str], work: Path, budget_s: float) -> dict:
    """train.py in one process (no process group, no DDP), its steady state, recompiles and graph
    breaks; a run stopped at its time keeps the records it had flushed."""
    from latentwire.config import load_config

    run_dir = work / "runs" / name
    started = time.time()
    child = run([sys.executable, "train.py", *flags, "--out-dir", str(run_dir), "--overwrite"], budget_s,
                env={"TORCH_LOGS": "recompiles,graph_breaks"})
    cfg = load_config([*flags, "--out-dir", str(run_dir)])
    entry = {"name": name, **child.entry(), "profile": cfg.run.profile,
             "micro_batch_size": cfg.training.micro_batch_size, "grad_accum_steps": cfg.training.grad_accum_steps,
             "compile": cfg.compile.enabled, "compile_mode": cfg.compile.mode if cfg.compile.enabled else None,
             "activation_checkpointing": cfg.frozen.activation_checkpointing,
             "recompiles": child.output.count("Recompiling function"),
             "graph_breaks": len(re.findall(r"Graph break", child.output)), "run_dir": str(run_dir)}
    metrics = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in metrics.read_text().splitlines()] if metrics.exists() else []
    entry |= steady_state(records)
    timed = [r for r in records if "step_time_s" in r]
    if timed:  # process start, imports, data and the LLMs' loading: up to the first step's start
        entry["startup_s"] = round(timed[0]["time"] - timed[0]["step_time_s"] - started, 1)
    if child.status == "failed":
        entry["error"] = error_line(child.output)
    return entry


def evaluated(run, run_dir: str, work: Path, examples: int, budget_s: float) -> dict:
    """The trained wire with text baselines: non-finite NLLs and empty answers counted. Random
    readers' answers through a tiny tokenizer are mostly empty or noise: expected, not a failure."""
    out = work / "eval"
    child = run([sys.executable, "-m", "latentwire.evaluate", "--ckpt", run_dir, "--eval-examples", str(examples),
                 "--out-dir", str(out)], budget_s)
    entry = child.entry()
    reports = sorted(out.glob("*.json"))
    if child.status != "done" or not reports:
        return entry | {"error": error_line(child.output)} if child.status == "failed" else entry
    report = json.loads(reports[-1].read_text())
    answers = [v for a in report["answers"] for k, v in a.items() if k not in ("index", "question", "gold")]
    nll = {k: v for k, v in report["metrics"].items() if k.startswith("nll_")}
    return entry | {"examples": examples, "nll": nll, "nonfinite_nll": [k for k, v in nll.items() if v != v or
                                                                       abs(v) == float("inf")],
                    "em": {k: v for k, v in report["metrics"].items() if k.startswith("em_")},
                    "empty_answers": sum(not a for a in answers), "answers": len(answers),
                    "note": "random weights read through a tiny tokenizer: empty or noise answers are expected"}


def found_batch(run, flags: list[str], work: Path, most: int, budget_s: float) -> dict:
    """find_batch from the profile's micro-batch up to the plan's largest (`most`): two real steps
    at each trial on the plan's longest rows, the measured peak of each."""
    path = work / "find_batch.json"
    child = run([sys.executable, "-m", "latentwire.find_batch", *flags, "--steps", "2", "--max-micro-batch", str(most),
                 "--json", str(path), "--out-dir", str(work / "find_batch")], budget_s)
    entry = child.entry()
    if child.status == "failed":
        entry["error"] = error_line(child.output)
    if path.exists():
        found = json.loads(path.read_text())
        entry |= {"find_batch_max": found["max_micro_batch"], "cap_gb": found["cap_bytes"] / 2 ** 30,
                  "trials": [{"micro_batch": t["micro_batch"], "fits": t["fits"],
                              "peak_gb": t["peak_allocated"] and t["peak_allocated"] / 2 ** 30,
                              "peak_reserved_gb": t["peak_reserved"] and t["peak_reserved"] / 2 ** 30,
                              "seconds": round(t["seconds"], 1), "error": t["error"]} for t in found["trials"]]}
    else:  # stopped mid-search: the trials it printed
        entry["trials_said"] = re.findall(r"trial micro-batch.*", child.output)
    return entry


def ratio(run: dict, reference: dict, key: str = "samples_per_s") -> float | None:
    """`run`'s throughput over `reference`'s (above 1: the lever is faster)."""
    a, b = run.get(key), reference.get(key)
    return a / b if a and b else None


# --- the driver -------------------------------------------------------------------------------------

# Each part's most seconds, in the order they run; the deadline may cut any of them shorter. An H100
# is expected to take about half of each (a cold compile of the two LLMs' layers is most of main).
BUDGETS_S = {"preflight": 60, "main": 270, "evaluate": 60, "eager": 60, "find_batch": 90, "no_recompute": 60,
             "plan_micro_batch": 60}


def settings(args) -> tuple[str, list[str], int, int, int]:
    """(profile, the readers' flags, main-run steps, lever steps, evaluation examples)."""
    if args.cpu_check:  # every part, small: the code path, not the numbers
        return "cpu", [], args.steps or 3, 2, 16
    return args.profile, REAL_LLMS, args.steps or 20, 8, 64


def prepare(profile: str) -> None:
    """Trace the plans the driver compares with, on this CPU, into bench/results/."""
    with tempfile.TemporaryDirectory() as tmp:
        run = Runner(Path(tmp) / "plan.log", Clock(float("inf"), 0), child_env(torch.get_num_threads()))
        for recompute in (True, False):
            flags = plan_flags(profile, REAL_LLMS, recompute)
            plan = trace_plan(flags, Path(tmp) / "plan.json", run)
            if isinstance(plan, str):
                sys.exit(f"error: {plan}")
            path = plan_path(profile, recompute)
            path.write_text(json.dumps({"flags": flags, "torch": torch.__version__, "plan": plan}, indent=2) + "\n")
            print(f"wrote {path}: largest micro-batch {plan['max_micro_batch']}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="where the results file and the log go ($OUT on the GPU machine)")
    p.add_argument("--work", help="data, runs, checkpoints and caches (default: a new temporary directory)")
    p.add_argument("--profile", default="h100")
    p.add_argument("--deadline", type=float, default=530, help="seconds from now by which every part has ended")
    p.add_argument("--margin", type=float, default=20, help="seconds kept for stopping a part and writing results")
    p.add_argument("--budget", action="append", default=[], metavar="PART=SECONDS",
                   help=f"a part's most seconds (parts and defaults: {BUDGETS_S})")
    p.add_argument("--steps", type=int, help="optimizer steps of the main run (default 20; 3 with --cpu-check)")
    p.add_argument("--compile-mode", default="default", choices=("default", "max-autotune-no-cudagraphs"),
                   help="the runs' torch.compile mode: max-autotune's minutes of tuning get a command of their own")
    p.add_argument("--cpu-check", action="store_true", help="the cpu profile with its tiny readers, every part small")
    p.add_argument("--prepare", action="store_true", help="trace the profile's plans into bench/results/ and exit")
    p.add_argument("--kernel-facts", action="store_true", help=argparse.SUPPRESS)  # the preflight's child
    args = p.parse_args()
    if args.kernel_facts:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(json.dumps(kernel_facts(device)))
        return
    if args.prepare:
        return prepare(args.profile)
    if not args.out:
        p.error("--out is required")
    budgets = dict(BUDGETS_S)
    for item in args.budget:
        part, _, seconds = item.partition("=")
        if part not in budgets or not re.fullmatch(r"\d+(\.\d*)?", seconds):
            p.error(f"--budget {item}: expected PART=SECONDS with PART one of {', '.join(budgets)}")
        budgets[part] = float(seconds)
    clock = Clock(args.deadline, args.margin)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_validation_"))
    work.mkdir(parents=True, exist_ok=True)
    profile, readers, steps, lever_steps, eval_examples = settings(args)
    log = out / "validation.log"
    log.write_text(f"gpu_validation: {' '.join(sys.argv)}; work in {work}\n")
    run = Runner(log, clock, {**child_env(torch.get_num_threads()),
                              "TORCHINDUCTOR_CACHE_DIR": str(work / "inductor_cache")})
    results = Results(out / f"{profile}.json", {"date": datetime.date.today().isoformat(), "profile": profile,
                                                "command": " ".join(sys.argv), "deadline_s": args.deadline,
                                                "parts": {}, "runs": []})
    record, parts = results.record, results.record["parts"]

    # (0) preflight: versions, the card as nvidia-smi sees it, the attention kernels' facts
    record["versions"] = versions()
    child = run([sys.executable, str(Path(__file__).resolve()), "--kernel-facts"], budgets["preflight"])
    parts["preflight"] = child.entry()
    if child.status == "done":
        record["kernel_facts"] = json.loads(child.output.strip().splitlines()[-1])
    record["nvidia_smi"] = None
    if torch.cuda.is_available():  # the card's state as found (clocks, power, other processes) goes to the log
        smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                              "--format=csv,noheader"], capture_output=True, text=True)
        record["nvidia_smi"] = smi.stdout.strip()
        with open(log, "a") as f:
            f.write(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)
    stamp = {"device": record["versions"]["device"], "torch": torch.__version__, "date": record["date"]}
    results.write()

    data = squad_length_examples(work / "squad_length.json", 128 if args.cpu_check else 4096)
    # Activation checkpointing named: the GPU profiles have it on, and the cpu check turns it on so
    # that the no-recompute lever has something to turn off.
    base = [*plan_flags(profile, readers, True), "--dataset", str(data), "--eval-every", "0", "--checkpoint-every", "0"]
    if not args.cpu_check:
        base += ["--compile-mode", args.compile_mode]
    plan, source = the_plan(run, profile, readers, True, work)
    record["plan"] = plan if isinstance(plan, str) else {
        "source": source, "max_micro_batch": plan["max_micro_batch"], "fixed_gb": plan["fixed_bytes"] / 2 ** 30,
        "per_sample_gb": plan["activation_bytes_per_sample"] / 2 ** 30}
    largest = 0 if isinstance(plan, str) else min(plan["max_micro_batch"], 32 if args.cpu_check else 10 ** 6)

    def add_run(entry: dict) -> dict:
        entry |= stamp
        if not isinstance(plan, str) and entry["activation_checkpointing"]:
            entry |= {"planned_peak_gb": planned_peak_gib(plan, entry["micro_batch_size"]),
                      "plan_max_micro_batch": plan["max_micro_batch"]}
        record["runs"].append(entry)
        parts[entry["name"]] = {k: entry[k] for k in ("status", "exit", "seconds")}
        results.write()
        return entry

    # (1) the main run: the profile as users run it, one process, compiled
    main_run = add_run(train_run(run, "main", [*base, "--max-steps", str(steps), "--log-every", "1"], work,
                                 budgets["main"]))

    # (2) the wire it trained, with text baselines (a run stopped before its end saved nothing)
    saved = any((Path(main_run["run_dir"]) / "checkpoints").glob("step_*"))
    record["evaluate"] = (evaluated(run, main_run["run_dir"], work, eval_examples, budgets["evaluate"]) if saved
                          else {"status": "skipped", "why": "the main run saved no checkpoint"})
    parts["evaluate"] = {k: record["evaluate"].get(k) for k in ("status", "exit", "seconds")}
    results.write()

    # (3) the eager lever, against the main run's steady state
    lever = [*base, "--max-steps", str(lever_steps), "--log-every", "1"]
    eager = add_run(train_run(run, "eager", [*lever, "--compile", "false"], work, budgets["eager"]))
    record["levers"] = {"eager_over_compiled": ratio(eager, main_run)}
    results.write()

    # (4) find_batch from the profile's micro-batch to the plan's largest, each against the plan
    if largest:
        found = found_batch(run, base, work, largest, budgets["find_batch"])
        for trial in found.get("trials", []):
            trial["planned_peak_gb"] = planned_peak_gib(plan, trial["micro_batch"])
        record["find_batch"] = found
        parts["find_batch"] = {k: found.get(k) for k in ("status", "exit", "seconds")}
        main_run["find_batch_max"] = found.get("find_batch_max")
        results.write()

    # (5) while time is left: no recompute at the largest micro-batch its own plan fits, and the
    # plan's largest micro-batch as one step; both eager, against the eager lever
    no_ac_plan, _ = the_plan(run, profile, readers, False, work)
    if not isinstance(no_ac_plan, str):
        m = min(no_ac_plan["max_micro_batch"], main_run["micro_batch_size"])
        entry = add_run(train_run(run, "no_recompute", [*lever, "--compile", "false", "--activation-checkpointing",
                                                        "false", "--micro-batch-size", str(m)], work,
                                  budgets["no_recompute"]))
        entry |= {"planned_peak_gb": planned_peak_gib(no_ac_plan, m), "plan_max_micro_batch": no_ac_plan["max_micro_batch"]}
        record["levers"]["no_recompute_over_eager"] = ratio(entry, eager)
        results.write()
    if largest:
        entry = add_run(train_run(run, "plan_micro_batch", [*lever, "--compile", "false", "--micro-batch-size",
                                                            str(largest), "--grad-accum-steps", "1"], work,
                                  budgets["plan_micro_batch"]))
        record["levers"]["plan_micro_batch_over_eager"] = ratio(entry, eager)
    record["seconds"] = round(clock.elapsed(), 1)
    results.write()
    print(table(record))
    print(f"wrote {results.path}; {sum(r['status'] == 'done' for r in record['runs'])} of {len(record['runs'])} runs "
          f"finished in {clock.elapsed():.0f} s; log: {log}")


def table(record: dict) -> str:
    """The runs as a short table: the end of the output is what a lent machine's reply carries."""
    rows = ["run | status | mb x accum | step s | tokens/s | mfu | peak GiB | plan GiB | compile s | recompiles"]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in record["runs"]:
        rows.append(f"{r['name']} | {r['status']} | {r['micro_batch_size']} x {r['grad_accum_steps']} | "
                    f"{fmt(r.get('step_time_s'), '.3f')} | {fmt(r.get('tokens_per_s'), '.0f')} | "
                    f"{fmt(r.get('mfu'), '.3f')} | {fmt(r.get('peak_mem_gb'), '.2f')} | "
                    f"{fmt(r.get('planned_peak_gb'), '.2f')} | {fmt(r.get('compile_s'), '.1f')} | {r['recompiles']}")
    return "\n".join(rows)


if __name__ == "__main__":
    main()
