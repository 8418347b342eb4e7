"""A lent GPU's measurements in one command that fits its lease.

Validation (the default): the card's attention-kernel facts, the profile end to end (step time,
tokens/s, MFU, memory, compile time, recompiles), an evaluation with text baselines, the eager
lever, find_batch against the memory plan, then what time is left: no recompute, the plan's
largest micro-batch.

Levers (`--levers`): what the profiles ship, measured on the one card lent, an H100 or an H200,
read from what torch.cuda says of it (its name and memory: `lever_card`; `--card` names one). Its
parts (LEVER_CARDS) run in the order of what they decide, so that the parts a deadline cuts are
those that matter least; the first is the baseline, against which every entry's
`ratio_to_baseline` is its samples/s over this part's. On an H100 (`h100-levers.json`):
1. `h100`, the h100 profile as shipped (compiled, full recompute, 64 x 1): the baseline, and the
   number beside its 37.4% MFU;
2. `h100_selective`, the same under selective recompute, 64 x 1 (on the check's rows the shipped
   plans fit 39 without recompute, 83 selective, 325 full);
3. `h100_none`, without recompute at the largest micro-batch its plan fits that divides the global
   batch, accumulation keeping it (32 x 2);
4. `fp8_tensorwise`, `fp8_rowwise`: the frozen linears in FP8 by each of torchao's recipes, at the
   fastest of 1-3 (its flags and environment), torchao on these parts' path alone;
5. `profile`, a torch.profiler summary of the fastest run's steady steps (top kernels, the GPU's
   idle share: <out>/profile.txt), and `fails_at_first_step`, the card's first configuration without
   recompute made to fail at its first step (four times the micro-batch its plan fits, eager, the
   profile's 8 pinned-memory loader workers: its saved activations fill the card within the first
   layers), timed from the line the loop prints when it catches the failure to the exit, so that
   the loader's shutdown is in it.
On an H200 (`h200-levers.json`), as issue 45 laid them out:
1. `h200`, the h200 profile as shipped (compiled, no recompute, 64 x 1): the baseline;
2. `h100`, the h100 profile as shipped, held to its memory_gb by the memory cap (harness.memory_cap,
   on by default; the run's opening `memory:` line is in the log and the entry): the number beside
   the H100's 37.4% MFU, and what the faster memory changes;
3. `h100_selective`, the h100 profile under selective recompute at 64 x 1, under the cap;
4. and 5. as on the H100, at the fastest of 1-3;
6. if time is left, `fp8_tensorwise_largest` and `fp8_rowwise_largest`: each recipe at the largest
   micro-batch its own plan fits, one micro-batch a step, with expandable segments (a GEMM's rows
   decide which recipe pays: torchao's table puts rowwise above 1x only past about 8,000).
A part that runs out of memory is retried at half the micro-batch while its budget lasts
(accumulation keeping the global batch; at the largest micro-batch, one micro-batch a step).
Every run entry has `mfu`, `hfu` (the recompute counted), `step_time_s`, `tokens_per_s`,
`peak_mem_gb`, `micro_batch_size`, `activation_checkpointing`, `fp8`, the memory cap (`memory_gb`,
`cap_memory`, `memory_capped`, `memory_fraction`, `memory_cap_line`, `alloc_retries`),
`ratio_to_baseline` and what the compile cache did (below); every FP8 part's, the `torch` and
`torchao` it ran with (torchao read from its metadata where the part imports it; train.py refuses in
one line a torchao older than its torch needs, latentwire.fp8.TORCHAO_NEEDED).

Time. On the H100 a compiled part took about 20 s to start (two 8B-class models drawn on the
card), 45-56 s for its first step (the compile) and 0.4-0.7 s a step after, then a few seconds to
exit. Every part reads and writes one inductor cache (TORCHINDUCTOR_CACHE_DIR in --work), keyed by
graph, so a part reads back what an earlier part compiled of the same graphs: the byte encoder's
and the pooler's regions are the same in every part, the decoder layers differ by recompute policy
and by FP8 recipe, and the kernel summary and the largest micro-batches (dynamic shapes) are
expected to compile nothing new. Each entry records its `first_step_s` and the AOTAutograd cache's
`cache_hits` and `cache_misses` (one per compiled graph: `compile_cache` warm, partly warm or
cold). Expected, in order, under `--deadline 480` (460 s of parts after the 20-s margin), taking a
warm first step as about 15 s (dynamo's tracing is not cached: on the CPU the cache took a first
step from 64.5 to 7.0 s, docs/performance.md) and one with the decoder layers still to compile as
about 40 s, after about 5 s of the driver's own (the check's data, the shipped plans read):

    H100 part                budget  expected  ends by  its first step
    h100                        120        80       85  cold
    h100_selective              110        70      155  the encoder and pooler from the cache
    h100_none                   110        70      225  the same
    fp8_tensorwise              100        70      295  the same
    fp8_rowwise                 100        70      365  the same
    profile                      80        55      420  warm (and the trace's export)
    fails_at_first_step          45        28      448  eager: loads, fails, exits

    H200 part                budget  expected  ends by  its first step
    h200                        120        80       85  cold
    h100                        110        70      155  the encoder and pooler from the cache
    h100_selective              110        70      225  the same
    fp8_tensorwise              100        70      295  the same
    fp8_rowwise                 100        70      365  the same
    profile                      80        55      420  warm (and the trace's export)
    fails_at_first_step          45        28      448  eager: loads, fails, exits
    fp8_tensorwise_largest       80        50     (498) warm: cut unless earlier parts ran faster
    fp8_rowwise_largest          80        50     (548) warm: cut

The next lent card, either, runs the levers with torchao's wheel carried (the card has no network
and no torchao; without it the FP8 parts are recorded as refused). Here, once:

    echo /.whl/ >> .git/info/exclude
    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 -d .whl -r requirements-fp8.txt

then one command on the card, the same on an H100 and an H200, carrying `.whl`, with a 540-s
timeout (the machine's 1-2 minutes of start are outside it; 60 s are left for the wheel's install,
the interpreter's start and the last part's stop):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site \
        .whl/*.whl || exit; PYTHONUNBUFFERED=1 python3 bench/gpu_validation.py --levers \
        --torchao /tmp/site --out $OUT --deadline 480

Not `PYTHONPATH=/tmp/site`: `--torchao` puts that folder on the FP8 parts' path alone
(TORCHAO_FOR_FP8): transformers imports torchao wherever it finds it, so on everyone's path it
would be imported, and could fail to load, in every part, the bf16 ones too.

    python bench/gpu_validation.py --out $OUT --deadline 530      # the validation (one command, 570 s limit)
    python bench/gpu_validation.py --out /tmp/v --cpu-check        # here: the cpu profile, the same code path
    python bench/gpu_validation.py --levers --card h100 --out /tmp/v --cpu-check   # each card's parts, here
    python bench/gpu_validation.py --prepare --torchao DIR         # here, before a GPU: the plans both compare with
    python bench/gpu_validation.py --out $OUT --deadline 530 --compile-mode max-autotune-no-cudagraphs \
        --budget preflight=0 --budget main=400                     # a second command: max-autotune's cost and gain

On the cpu check (`--cpu-check`) every part runs the cpu profile, eager, under the policy of the
card's part it stands for; a CPU has no memory cap (memory_fraction gives None there: no `memory:`
line, `memory_capped` false) and no out-of-memory to provoke.

A lent GPU gives minutes, and a command stopped at its limit returns only the files it had already
written, so nothing waits for the end: each part runs in its own process group, under
min(its budget, the time left to --deadline less --margin), and is stopped (SIGTERM, then SIGKILL)
when that runs out, its entry then saying "timed out" with whatever metrics it had flushed.
`<out>/<profile>.json` (`<card>-levers.json` for the levers) is rewritten atomically after every part, every
child's output goes to `<out>/validation.log` as it comes, and in the levers mode every run's
metrics.jsonl records are appended to `<out>/metrics.jsonl` as soon as it ends. Data, run
directories, checkpoints, traces and compile caches live in `--work` (a temporary directory by
default), so at most four small files come back.

Without network the LLMs are `random:` (the real architectures, seeded random weights: the same
FLOPs and memory), read through their family's tiny tokenizer; the data is a local .json of
synthetic examples shaped like SQuAD's: contexts of its length, answers of its answer lengths in
tokens (squad_length_examples). The memory plans are traced on the CPU for the longest of these
rows (half a minute or more of single-threaded Python each, which a GPU lease should not pay for):
`--prepare` writes those both commands compare with to bench/results/ (plan-<profile>-<policy>.json,
plan-<profile>-<policy>-<recipe>.json for FP8, which need torchao), and the driver reads each from
there when its flags match, tracing it itself only when they do not.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import importlib.util
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from common import REPO, child_env

# isort: split
from latentwire.fp8 import RECIPES  # found through the repository path that common puts on sys.path
from latentwire.harness.errors import CAUGHT_OUT_OF_MEMORY

# Readers for the GPU profiles: their architectures from latentwire.known_llms, no download.
REAL_LLMS = ["--llama", "random:meta-llama/Llama-3.1-8B", "--qwen", "random:Qwen/Qwen2.5-7B"]
# SQuAD contexts are about 750 characters; the profile cuts prompts at max_prompt_bytes.
SQUAD_CONTEXT_BYTES = 750
# SQuAD v1.1's answers in the readers' tokens, as a log-normal: median 3 tokens, mean 4.2 (SQuAD's
# mean of about 3.2 words at the 1.3 tokens a word of English BPE vocabularies such as Llama-3's
# and Qwen2.5's), so a fifth are one token, 8% ten or more and a few in a thousand 30 or more.
# Derived from those two figures, not from the dataset's own histogram, which is not on this
# machine; the realised lengths are recorded beside the results (rows_summary).
ANSWER_TOKENS_MEDIAN, ANSWER_TOKENS_SIGMA = 3.0, 0.82
RESULTS = REPO / "bench" / "results"
# Seconds a stopped part gets between SIGTERM and SIGKILL.
GRACE_S = 5
# Float8 training needs none of torchao's compiled extensions: skip loading them (and their failures).
TORCHAO_FOR_FP8 = {"TORCHAO_FORCE_SKIP_LOADING_SO_FILES": "1"}
# The failing part's clock starts at the loop's line when it catches the failure (else at its end).
CAUGHT = rf"^({re.escape(CAUGHT_OUT_OF_MEMORY.split('{')[0])}|error: |Traceback)"
# A run's opening line on the memory cap (harness.memory_cap), and the fraction it holds the card to.
MEMORY_LINE = re.compile(r"^memory: .*$", re.M)
HELD = re.compile(r"set_per_process_memory_fraction ([0-9.]+)")
# AOTAutograd's cache, logged at INFO for each compiled graph (TORCH_LOGS takes a module's name).
AOT_CACHE_LOG = "torch._functorch._aot_autograd.autograd_cache"
AOT_CACHE = re.compile(r"AOTAutograd cache (hit|miss) for key|(Bypassing) autograd cache")


def fp8_env(torchao: str | None) -> dict:
    """A float8 part's environment beyond the others': `torchao` (a folder pip installed it into,
    or None: wherever the interpreter finds it) first on its path, the extensions not loaded."""
    if torchao is None:
        return dict(TORCHAO_FOR_FP8)
    return {**TORCHAO_FOR_FP8, "PYTHONPATH": os.pathsep.join(filter(None, [torchao, os.environ.get("PYTHONPATH")]))}


def squad_length_examples(path: Path, n: int, seed: int = 0) -> Path:
    """`n` synthetic examples shaped like SQuAD's, written as one JSON document (read without
    `datasets`): contexts padded with other examples' facts to SQuAD's length (the answer's fact
    kept first), and answers that are spans of the context as long, in the Llama reader's tokens,
    as SQuAD's answer lengths (ANSWER_TOKENS_*), so a micro-batch pads to its longest answer as
    real training does. The readers are `random:` architectures read through their family's tiny
    tokenizer, so the ids stay in its small vocabulary while the head is the real one, which is
    what the loss costs."""
    import random

    from latentwire.dataset import synthetic_examples
    from latentwire.llm_sources import tiny_tokenizer

    tok, rng = tiny_tokenizer("llama"), random.Random(seed)
    pool = synthetic_examples(n * 4, seed)
    examples = []
    for i, ex in enumerate(pool[:n]):
        context, k = ex["context"], n + i
        while len(context.encode()) < SQUAD_CONTEXT_BYTES:
            context += " " + pool[k % len(pool)]["context"]
            k += n
        length = max(1, round(rng.lognormvariate(math.log(ANSWER_TOKENS_MEDIAN), ANSWER_TOKENS_SIGMA)))
        spans = tok(context, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
        at = context.index(ex["answers"]["text"][0])
        first = min(next(j for j, (_, end) in enumerate(spans) if end > at), max(len(spans) - length, 0))
        start, end = spans[first][0], spans[min(first + length, len(spans)) - 1][1]
        answer = context[start:end].strip()
        examples.append(
            {**ex, "context": context, "answers": {"text": [answer], "answer_start": [context.index(answer, start)]}}
        )
    path.write_text(json.dumps(examples))
    return path


def rows_summary(path: Path, max_answer_tokens: int, pad_multiple: int) -> dict:
    """What the check's rows are, measured: each reader family's answer lengths in its own tokens
    (cut at `max_answer_tokens`, as the collator cuts them) and the longest prompt, which sets the
    `--max-prompt-bytes` the plan traces (rounded up to `pad_multiple`, as the collator pads)."""
    from latentwire.dataset import answer_text, answer_token_ids, prompt_text, round_up
    from latentwire.llm_sources import tiny_tokenizer

    examples = json.loads(Path(path).read_text())
    answers = [answer_text(ex) for ex in examples]
    summary = {"examples": len(examples), "prompt_bytes_max": max(len(prompt_text(ex).encode()) for ex in examples)}
    summary["max_prompt_bytes"] = round_up(summary["prompt_bytes_max"], pad_multiple)
    for family in ("llama", "qwen"):
        lengths = sorted(min(len(ids), max_answer_tokens) for ids in answer_token_ids(tiny_tokenizer(family), answers))
        summary[f"answer_tokens_{family}"] = {
            "mean": round(statistics.fmean(lengths), 2),
            "median": statistics.median(lengths),
            "p90": lengths[int(0.9 * (len(lengths) - 1))],
            "max": lengths[-1],
            "one_token": round(lengths.count(1) / len(lengths), 3),
        }
    return summary


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
        facts["keyless_row"][backend] = attempt(backend, lambda q=q: keyless(q))
    for width in (12, 25, 64):
        x = torch.randn(2, 4, 16, width, device=device, dtype=dtype)
        pad = torch.ones(2, 1, 1, 16, dtype=torch.bool, device=device)
        pad[0, ..., 10:] = False
        facts["head_width"][str(width)] = [
            b
            for b in backends
            if not attempt(b, lambda x=x, pad=pad: str(sdpa(x, x, x, attn_mask=pad).shape)).startswith("refused")
        ]

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
        out = torch.compile(
            encoder_attention, dynamic=True, backend="inductor" if device.type == "cuda" else "aot_eager"
        )(x, key_mask)
        out.float().sum().backward()
        finite = bool(out.isfinite().all() and x.grad.isfinite().all())
        return "finite" if finite else "non-finite output or gradient"

    facts["compiled_masked_dropout"] = attempt(
        "EFFICIENT_ATTENTION" if device.type == "cuda" else "MATH", compiled_dropout
    )
    return facts


def versions() -> dict:
    import transformers

    cuda = torch.cuda.is_available()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if cuda else None,
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "capability": list(torch.cuda.get_device_capability()) if cuda else None,
    }


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
    seen_s: float | None = None  # when the watched line appeared (Runner's `watch`), from the start

    def entry(self) -> dict:
        return {"status": self.status, "exit": self.exit, "seconds": round(self.seconds, 1)}


class Runner:
    """Runs each part's command in a process group of its own, its output appended to the log as it
    comes, stopped when its time is up."""

    def __init__(self, log: Path, clock: Clock, env: dict):
        self.log, self.clock, self.env = log, clock, env

    def __call__(self, cmd: list[str], budget_s: float, env: dict | None = None, watch: str | None = None) -> Child:
        """`watch`: a regular expression; the time its first matching line of output appeared is
        kept (Child.seen_s), to a tenth of a second."""
        limit = self.clock.limit(budget_s)
        if limit < 1:
            return Child("skipped")
        with open(self.log, "a") as log:
            log.write(f"\n$ {' '.join(cmd)}\n(at {self.clock.elapsed():.0f} s, {limit:.0f} s allowed)\n")
            log.flush()
            offset = log.tell()
            started = time.monotonic()
            proc = subprocess.Popen(
                cmd,
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env={**self.env, **(env or {})},
            )
            seen = None
            try:
                if watch is None:
                    code, status = proc.wait(timeout=limit), None
                else:
                    (code, seen), status = wait_watching(proc, limit, self.log, offset, re.compile(watch, re.M)), None
            except subprocess.TimeoutExpired:
                code, status = stop_group(proc), "timed out"
            seconds = time.monotonic() - started
        with open(self.log, "r", errors="replace") as log:
            log.seek(offset)
            output = log.read()
        status = status or ("done" if code == 0 else "failed")
        with open(self.log, "a") as log:
            log.write(f"({status}, exit {code}, {seconds:.0f} s)\n")
        return Child(status, code, seconds, output, seen)


def wait_watching(proc: subprocess.Popen, limit: float, log: Path, offset: int, pattern) -> tuple[int, float | None]:
    """proc.wait(limit), reading its output in `log` from `offset` meanwhile: its exit code, and
    the seconds from now to the first line `pattern` matches (None if none did)."""
    started, seen = time.monotonic(), None
    while True:
        code = proc.poll()
        if seen is None:
            with open(log, "r", errors="replace") as f:
                f.seek(offset)
                seen = time.monotonic() - started if pattern.search(f.read()) else None
        if code is not None:
            return code, seen
        if time.monotonic() - started > limit:
            raise subprocess.TimeoutExpired(proc.args, limit)
        time.sleep(0.1)


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


def plan_flags(profile: str, readers: list[str], policy: str, rows: list[str], fp8: str = "none") -> list[str]:
    """The flags the plan is traced for and the runs share, `policy` the activation checkpointing:
    `rows`, the longest rows of the check's data (check_rows), so the plan traces those and not the
    profile's longest."""
    return [
        "--profile",
        profile,
        *readers,
        *rows,
        "--activation-checkpointing",
        policy,
        *(["--frozen-fp8", fp8] if fp8 != "none" else []),
    ]


def plan_path(profile: str, policy: str, fp8: str = "none") -> Path:
    return RESULTS / f"plan-{profile}-{policy}{'' if fp8 == 'none' else '-' + fp8}.json"


def shipped_plan(flags: list[str], path: Path) -> dict | None:
    """The plan `--prepare` traced for exactly these flags, if it is at `path` in bench/results/."""
    if not path.exists():
        return None
    shipped = json.loads(path.read_text())
    return shipped["plan"] if shipped["flags"] == flags else None


def trace_plan(flags: list[str], path: Path, run, budget_s: float = 300, env: dict | None = None) -> dict | str:
    """`python -m latentwire.plan` for `flags` (through `run`, a Runner): the plan, or why there is
    none. Flags the configuration refuses (an FP8 plan on a profile that cannot take it) are
    refused here, without a process."""
    from latentwire.harness.errors import UserError
    from latentwire.settings import load_config

    try:
        load_config(flags)
    except UserError as e:
        return f"plan refused: error: {e}"
    child = run([sys.executable, "-m", "latentwire.plan", *flags, "--json", str(path)], budget_s, env=env)
    if child.status != "done":
        return f"plan {child.status}: {error_line(child.output)}"
    return json.loads(path.read_text())


def the_plan(
    run,
    profile: str,
    readers: list[str],
    policy: str,
    rows: list[str],
    work: Path,
    fp8: str = "none",
    torchao: str | None = None,
) -> tuple[dict | str, str]:
    """The plan for these flags, and where it came from: bench/results/ where it is shipped, else
    traced now (an FP8 plan with torchao where `torchao` says)."""
    flags, path = plan_flags(profile, readers, policy, rows, fp8), plan_path(profile, policy, fp8)
    plan = shipped_plan(flags, path)
    if plan is not None:
        return plan, str(path.relative_to(REPO))
    return (
        trace_plan(flags, work / path.name, run, env=fp8_env(torchao) if fp8 != "none" else None),
        "traced by this run",
    )


def check_rows(profile: str, work: Path, examples: int) -> tuple[Path, dict, list[str]]:
    """The check's data (squad_length_examples), what its rows are (rows_summary) and the flag
    that makes the plan trace its longest rows: the runs' batches are the same with it."""
    from latentwire.settings import load_config

    data = load_config(["--profile", profile]).data
    path = squad_length_examples(work / "squad_length.json", examples)
    rows = rows_summary(path, data.max_answer_tokens, data.pad_multiple)
    return path, rows, ["--max-prompt-bytes", str(rows["max_prompt_bytes"])]


def planned_peak_gib(plan: dict, micro_batch: int) -> float:
    """The plan's traced peak (without its reserve) at `micro_batch`: its fit, fixed + per sample."""
    return (plan["fixed_bytes"] + plan["activation_bytes_per_sample"] * micro_batch) / 2**30


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
    return {
        "steps_logged": timed[-1]["step"],
        "step_time_s": step,
        "samples_per_s": median("samples_per_s"),
        "tokens_per_s": median("tokens_per_s"),
        "mfu": median("mfu"),
        "hfu": median("hfu"),
        "tflops_per_gpu": median("tflops_per_gpu"),
        "data_wait_frac": median("data_wait_frac"),
        "peak_mem_gb": max(r["run_peak_mem_gb"] for r in timed),
        "peak_reserved_gb": max((r.get("peak_reserved_gb") or 0) for r in timed) or None,
        "alloc_retries": alloc_retries(timed),
        "first_step_s": timed[0]["step_time_s"],
        "compile_s": max(timed[0]["step_time_s"] - step, 0.0) if len(timed) > 1 else None,
        "loss_first": timed[0]["loss"],
        "loss_last": timed[-1]["loss"],
    }


def alloc_retries(records: list[dict]) -> int | None:
    """How often the caching allocator freed its cache and retried over the logged steps (each
    record counts its own window), None where it keeps no count (a CPU)."""
    counts = [r["alloc_retries"] for r in records if r.get("alloc_retries") is not None]
    return sum(counts) if counts else None


def memory_cap(output: str) -> dict:
    """What a run's opening `memory:` line (harness.memory_cap.memory_fraction) said: whether it held
    itself to its profile's memory_gb, and the fraction of the card. No line (a CPU, whose cap is
    None, or a card of the profile's size): not capped."""
    line = MEMORY_LINE.search(output)
    held = HELD.search(line.group(0)) if line else None
    return {
        "memory_capped": held is not None,
        "memory_fraction": float(held.group(1)) if held else None,
        "memory_cap_line": line.group(0) if line else None,
    }


def compile_cache_use(output: str) -> dict:
    """What the compile cache gave a run, from AOTAutograd's log lines (one a compiled graph, its
    forward and backward together): hits, misses, bypasses, and whether its cache was warm (every
    graph read back), partly warm or cold; None where nothing compiled."""
    said = [hit_or_miss or bypassed for hit_or_miss, bypassed in AOT_CACHE.findall(output)]
    hits, misses, bypassed = (said.count(word) for word in ("hit", "miss", "Bypassing"))
    state = None if not said else "warm" if not (misses or bypassed) else "cold" if not hits else "partly warm"
    return {"cache_hits": hits, "cache_misses": misses, "cache_bypassed": bypassed, "compile_cache": state}


def train_run(
    run, name: str, flags: list[str], work: Path, budget_s: float, env: dict | None = None, watch: str | None = None
) -> dict:
    """train.py in one process (no process group, no DDP), its steady state, recompiles and graph
    breaks, its memory cap and what the compile cache gave it; a run stopped at its time keeps the
    records it had flushed (`records`). A run refused in one line (exit 2: a flag this train.py
    lacks, a lever this device cannot run) says so."""
    from latentwire.harness.errors import UserError
    from latentwire.settings import load_config

    run_dir = work / "runs" / name
    started = time.time()
    child = run(
        [sys.executable, "train.py", *flags, "--out-dir", str(run_dir), "--overwrite"],
        budget_s,
        env={"TORCH_LOGS": f"recompiles,graph_breaks,{AOT_CACHE_LOG}", **(env or {})},
        watch=watch,
    )
    entry = {"name": name, **child.entry(), "flags": flags, "run_dir": str(run_dir), "env": env or {}}
    try:
        cfg = load_config([*flags, "--out-dir", str(run_dir)])
    except (UserError, SystemExit):  # what train.py refused is in its error line
        cfg = None
    if cfg is not None:
        entry |= {
            "profile": cfg.invocation.profile,
            "micro_batch_size": cfg.training.micro_batch_size,
            "grad_accum_steps": cfg.training.grad_accum_steps,
            "compile": cfg.compile.enabled,
            "compile_mode": cfg.compile.mode if cfg.compile.enabled else None,
            "activation_checkpointing": cfg.recompute.policy,
            "fp8": cfg.frozen.fp8,
            "memory_gb": cfg.card.memory_gb,
            "cap_memory": cfg.card.cap_memory,
        }
    entry |= {
        "recompiles": child.output.count("Recompiling function"),
        "graph_breaks": len(re.findall(r"Graph break", child.output)),
        **memory_cap(child.output),
        **compile_cache_use(child.output),
    }
    entry["records"], torn = read_records(run_dir / "metrics.jsonl")
    if torn:
        entry["unreadable_metrics_lines"] = torn
    entry |= steady_state(entry["records"])
    timed = [r for r in entry["records"] if "step_time_s" in r]
    if timed:  # process start, imports, data and the LLMs' loading: up to the first step's start
        entry["startup_s"] = round(timed[0]["time"] - timed[0]["step_time_s"] - started, 1)
    if child.status == "failed":
        entry["error"] = error_line(child.output)
    if child.seen_s is not None:
        entry["exit_after_caught_s"] = round(child.seconds - child.seen_s, 1)
    return entry


def read_records(path: Path) -> tuple[list[dict], int]:
    """A run's metrics.jsonl records, and how many of its lines could not be read: a part stopped
    while it wrote leaves a torn last line, which must not end the command."""
    records, torn = [], 0
    for line in path.read_text(errors="replace").splitlines() if path.exists() else []:
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict):
            records.append(record)
        else:
            torn += 1
    return records, torn


def evaluated(run, run_dir: str, work: Path, examples: int, budget_s: float) -> dict:
    """The trained wire with text baselines: non-finite NLLs and empty answers counted. Random
    readers' answers through a tiny tokenizer are mostly empty or noise: expected, not a failure."""
    out = work / "eval"
    child = run(
        [
            sys.executable,
            "-m",
            "latentwire.evaluate",
            "--ckpt",
            run_dir,
            "--eval-examples",
            str(examples),
            "--out-dir",
            str(out),
        ],
        budget_s,
    )
    entry = child.entry()
    reports = sorted(out.glob("*.json"))
    if child.status != "done" or not reports:
        return entry | {"error": error_line(child.output)} if child.status == "failed" else entry
    report = json.loads(reports[-1].read_text())
    answers = [v for a in report["answers"] for k, v in a.items() if k not in ("index", "question", "gold")]
    nll = {k: v for k, v in report["metrics"].items() if k.startswith("nll_")}
    return entry | {
        "examples": examples,
        "nll": nll,
        "nonfinite_nll": [k for k, v in nll.items() if v != v or abs(v) == float("inf")],
        "em": {k: v for k, v in report["metrics"].items() if k.startswith("em_")},
        "empty_answers": sum(not a for a in answers),
        "answers": len(answers),
        "note": "random weights read through a tiny tokenizer: empty or noise answers are expected",
    }


def found_batch(run, flags: list[str], work: Path, most: int, budget_s: float) -> dict:
    """find_batch from the profile's micro-batch up to the plan's largest (`most`): two real steps
    at each trial on the plan's longest rows, the measured peak of each."""
    path = work / "find_batch.json"
    child = run(
        [
            sys.executable,
            "-m",
            "latentwire.find_batch",
            *flags,
            "--steps",
            "2",
            "--max-micro-batch",
            str(most),
            "--json",
            str(path),
            "--out-dir",
            str(work / "find_batch"),
        ],
        budget_s,
    )
    entry = child.entry()
    if child.status == "failed":
        entry["error"] = error_line(child.output)
    if path.exists():
        found = json.loads(path.read_text())
        entry |= {
            "find_batch_max": found["max_micro_batch"],
            "cap_gb": found["cap_bytes"] / 2**30,
            "trials": [
                {
                    "micro_batch": t["micro_batch"],
                    "fits": t["fits"],
                    "peak_gb": t["peak_allocated"] and t["peak_allocated"] / 2**30,
                    "peak_reserved_gb": t["peak_reserved"] and t["peak_reserved"] / 2**30,
                    "seconds": round(t["seconds"], 1),
                    "error": t["error"],
                }
                for t in found["trials"]
            ],
        }
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
BUDGETS_S = {
    "preflight": 60,
    "main": 270,
    "evaluate": 60,
    "eager": 60,
    "find_batch": 90,
    "no_recompute": 60,
    "plan_micro_batch": 60,
}


@dataclass(frozen=True)
class Lever:
    """A bf16 configuration the levers measure: its part, its profile, its recompute policy (None:
    the profile's own) and whether it runs at the largest micro-batch its plan fits, the accumulation
    keeping the profile's global batch, instead of the profile's own micro-batch."""

    part: str
    profile: str
    policy: str | None = None
    largest: bool = False


@dataclass(frozen=True)
class LeverCard:
    """What the levers measure on one card (--levers): its bf16 configurations in the order of what
    they decide, the first the baseline (its profile the card's), and each part's most seconds in
    the order the parts run; the module's docstring has the time each is expected to take, and
    which the deadline cuts first."""

    levers: tuple[Lever, ...]
    budgets: dict


LEVER_CARDS = {
    # An H100 holds the h100 profile as shipped (full recompute, 64 x 1), the same under selective
    # recompute, and without recompute a smaller micro-batch than the global batch.
    "h100": LeverCard(
        (
            Lever("h100", "h100"),
            Lever("h100_selective", "h100", "selective"),
            Lever("h100_none", "h100", "none", largest=True),
        ),
        {
            "h100": 120,
            "h100_selective": 110,
            "h100_none": 110,
            **{f"fp8_{recipe}": 100 for recipe in RECIPES},
            "profile": 80,
            "fails_at_first_step": 45,
        },
    ),
    # An H200 holds the h200 profile as shipped (no recompute, 64 x 1), and the h100 profile's
    # configurations under its memory cap; its spare memory gives FP8 the larger micro-batches.
    "h200": LeverCard(
        (Lever("h200", "h200"), Lever("h100", "h100"), Lever("h100_selective", "h100", "selective")),
        {
            "h200": 120,
            "h100": 110,
            "h100_selective": 110,
            **{f"fp8_{recipe}": 100 for recipe in RECIPES},
            "profile": 80,
            "fails_at_first_step": 45,
            **{f"fp8_{recipe}_largest": 80 for recipe in RECIPES},
        },
    ),
}
# What the allocator runs with at the largest micro-batch a plan fits: expandable segments grow a
# segment in place instead of stranding freed blocks of other sizes, the fragmentation that runs
# out of memory first where the micro-batch is near the card's limit. The CUDA-named variable is read by
# torch 2.11-2.13 (2.13 also reads the device-neutral PYTORCH_ALLOC_CONF).
EXPANDABLE = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
# Profiler schedule for the kernel summary: past the compile and the recompiles, then three steps.
PROFILED_STEPS = 3


def settings(args, card: str | None) -> tuple[str, list[str], int, int, int]:
    """(profile, the readers' flags, main-run steps, lever steps, evaluation examples); the levers'
    profile is their baseline's, `card`'s."""
    if args.cpu_check:  # every part, small: the code path, not the numbers
        return "cpu", [], args.steps or 3, 2, 16
    profile = LEVER_CARDS[card].levers[0].profile if args.levers else args.profile or "h100"
    return profile, REAL_LLMS, args.steps or (12 if args.levers else 20), 8, 64


def lever_card(name: str, total_bytes: int) -> str | None:
    """Whose levers a GPU runs, from what torch.cuda says of it (its name, its memory in bytes): an
    H100 or H200 by name (a GH200 too), and of LEVER_CARDS the one with the largest baseline profile
    whose memory_gb it holds (to harness.memory_cap's SAME_CARD); None for another card, or one
    smaller than the h100 profile's (a MIG slice)."""
    from latentwire.harness.memory_cap import GIB, SAME_CARD
    from latentwire.settings import load_config

    if not re.search(r"H100|H200", name):
        return None
    held = {card: load_config(["--profile", c.levers[0].profile]).card.memory_gb for card, c in LEVER_CARDS.items()}
    fits = [card for card in held if total_bytes / GIB >= held[card] * (1 - SAME_CARD)]
    return max(fits, key=held.get, default=None)


def card_here() -> tuple[str | None, str]:
    """lever_card of this process's GPU, and what it is in words."""
    if not torch.cuda.is_available():
        return None, "no CUDA device"
    props = torch.cuda.get_device_properties(0)
    return lever_card(props.name, props.total_memory), f"{props.name}, {props.total_memory / 2**30:.1f} GiB"


def lever_configs(card: str, cpu_check: bool) -> list[Lever]:
    """`card`'s bf16 configurations (LEVER_CARDS), each policy named; on the cpu check the cpu
    profile under the policy of the card's part it stands for."""
    from latentwire.settings import load_config

    return [
        replace(
            lever,
            profile="cpu" if cpu_check else lever.profile,
            policy=lever.policy or load_config(["--profile", lever.profile]).recompute.policy,
        )
        for lever in LEVER_CARDS[card].levers
    ]


def plans_to_ship(profile: str, fp8: bool) -> list[tuple[str, str, str]]:
    """The plans both commands compare with, as (profile, policy, FP8 recipe): the validation's for
    `profile` (full recompute, none), every card's levers' bf16 configurations, and with `fp8` each
    recipe at each of those (the fastest of which the FP8 parts run at)."""
    levers = [(c.profile, c.policy) for card in LEVER_CARDS for c in lever_configs(card, False)]
    wanted = [
        (profile, "full", "none"),
        (profile, "none", "none"),
        *((p, policy, "none") for p, policy in levers),
        *((p, policy, recipe) for recipe in (RECIPES if fp8 else ()) for p, policy in levers),
    ]
    return list(dict.fromkeys(wanted))


def prepare(profile: str, torchao: str | None) -> None:
    """Trace the plans both commands compare with (plans_to_ship), for the check's rows, on this
    CPU, into bench/results/; the FP8 ones where torchao is at hand (`torchao`, else this
    interpreter's), else said not to be shipped (the levers' largest FP8 parts would trace theirs on
    the card)."""
    fp8 = torchao is not None or importlib.util.find_spec("torchao") is not None
    if not fp8:
        print("no FP8 plans: torchao is not installed here (--torchao DIR): they are not shipped")
    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        run = Runner(Path(tmp) / "plan.log", Clock(float("inf"), 0), child_env(torch.get_num_threads()))
        for plan_profile, policy, recipe in plans_to_ship(profile, fp8):
            if plan_profile not in rows:
                rows[plan_profile] = check_rows(plan_profile, Path(tmp), EXAMPLES)[1:]
            summary, rows_flags = rows[plan_profile]
            flags = plan_flags(plan_profile, REAL_LLMS, policy, rows_flags, recipe)
            plan = trace_plan(
                flags, Path(tmp) / "plan.json", run, budget_s=3600, env=fp8_env(torchao) if recipe != "none" else None
            )
            if isinstance(plan, str) and recipe != "none" and plan.startswith("plan refused"):
                print(f"no {recipe} plan for {plan_profile} ({policy}): {plan}")
                continue
            if isinstance(plan, str):
                sys.exit(f"error: {plan}")
            path = plan_path(plan_profile, policy, recipe)
            path.write_text(
                json.dumps({"flags": flags, "torch": torch.__version__, "rows": summary, "plan": plan}, indent=2) + "\n"
            )
            print(f"wrote {path}: largest micro-batch {plan['max_micro_batch']}")


# The check's examples: a GPU run's 64-example batches for a few dozen steps, 128 for the CPU's.
EXAMPLES, CPU_EXAMPLES = 4096, 128


class Check:
    """What every part of a command shares: the results file, rewritten after every part; the
    runner under the deadline; the work folder; the check's data, flags and plans."""

    def __init__(self, args, name: str, budgets: dict, card: str | None = None):
        """`name`: the results file's, without .json; `card`: whose levers these are (LEVER_CARDS)."""
        self.args, self.budgets, self.card = args, budgets, card
        self.clock = Clock(args.deadline, args.margin)
        self.out = Path(args.out)
        self.out.mkdir(parents=True, exist_ok=True)
        self.work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="gpu_validation_"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.profile, self.readers, self.steps, self.lever_steps, self.eval_examples = settings(args, card)
        self.log = self.out / "validation.log"
        self.log.write_text(f"gpu_validation: {' '.join(sys.argv)}; work in {self.work}\n")
        self.run = Runner(
            self.log,
            self.clock,
            {**child_env(torch.get_num_threads()), "TORCHINDUCTOR_CACHE_DIR": str(self.work / "inductor_cache")},
        )
        self.results = Results(
            self.out / f"{name}.json",
            {
                "date": datetime.date.today().isoformat(),
                "profile": self.profile,
                "command": " ".join(sys.argv),
                "deadline_s": args.deadline,
                "parts": {},
                "runs": [],
            },
        )
        self.record, self.parts = self.results.record, self.results.record["parts"]
        self.record["versions"] = versions()
        self.stamp = {
            "device": self.record["versions"]["device"],
            "torch": torch.__version__,
            "date": self.record["date"],
        }

    def card_state(self) -> None:
        """The card as nvidia-smi sees it (clocks, power, other processes), in the record and the log."""
        self.record["nvidia_smi"] = None
        if torch.cuda.is_available():
            smi = subprocess.run(
                [
                    "nvidia-smi",
                    "--query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit",
                    "--format=csv,noheader",
                ],
                capture_output=True,
                text=True,
            )
            self.record["nvidia_smi"] = smi.stdout.strip()
            with open(self.log, "a") as f:
                f.write(subprocess.run(["nvidia-smi"], capture_output=True, text=True).stdout)

    def rows(self) -> None:
        """The check's data, and the flag every run and plan shares that makes a plan trace its
        longest rows."""
        self.data, self.record["rows"], self.rows_flags = check_rows(
            self.profile, self.work, CPU_EXAMPLES if self.args.cpu_check else EXAMPLES
        )
        self.results.write()

    def flags(self, profile: str, policy: str) -> list[str]:
        """A run's flags: the plan's for this profile and activation checkpointing, on the check's data."""
        base = [
            *plan_flags(profile, self.readers, policy, self.rows_flags),
            "--dataset",
            str(self.data),
            "--eval-every",
            "0",
            "--checkpoint-every",
            "0",
        ]
        return base if self.args.cpu_check else [*base, "--compile-mode", self.args.compile_mode]

    def plan(self, policy: str, fp8: str = "none", profile: str | None = None) -> tuple[dict | str, str]:
        """The plan for `profile` (default: the check's) under this policy and FP8 recipe, and its source."""
        return the_plan(
            self.run, profile or self.profile, self.readers, policy, self.rows_flags, self.work, fp8, self.args.torchao
        )

    def add_run(self, entry: dict, plan: dict | str | None = None) -> dict:
        """A run's entry in the results, its records left out (they are train.py's metrics.jsonl),
        against `plan` (the one for its flags) where there is one."""
        entry.pop("records", None)
        entry |= self.stamp
        if isinstance(plan, dict) and "micro_batch_size" in entry:
            entry |= {
                "planned_peak_gb": planned_peak_gib(plan, entry["micro_batch_size"]),
                "plan_max_micro_batch": plan["max_micro_batch"],
            }
        self.record["runs"].append(entry)
        self.parts[entry["name"]] = {k: entry[k] for k in ("status", "exit", "seconds")}
        self.results.write()
        return entry

    def finish(self) -> None:
        self.record["seconds"] = round(self.clock.elapsed(), 1)
        self.results.write()
        print(table(self.record))
        runs = self.record["runs"]
        print(
            f"wrote {self.results.path}; {sum(r['status'] == 'done' for r in runs)} of {len(runs)} runs finished "
            f"in {self.clock.elapsed():.0f} s; log: {self.log}"
        )


def validate(check: Check) -> None:
    """The validation: kernel facts, the profile end to end, evaluation, the eager lever,
    find_batch against the plan, and what time is left."""
    run, work, budgets, record, parts = check.run, check.work, check.budgets, check.record, check.parts
    args = check.args

    # (0) preflight: versions, the card as nvidia-smi sees it, the attention kernels' facts
    child = run([sys.executable, str(Path(__file__).resolve()), "--kernel-facts"], budgets["preflight"])
    parts["preflight"] = child.entry()
    if child.status == "done":
        record["kernel_facts"] = json.loads(child.output.strip().splitlines()[-1])
    check.card_state()
    check.results.write()

    # Activation checkpointing named: the GPU profiles have it on, and the cpu check turns it on so
    # that the no-recompute lever has something to turn off.
    check.rows()
    base = check.flags(check.profile, "full")
    plan, source = check.plan("full")
    record["plan"] = (
        plan
        if isinstance(plan, str)
        else {
            "source": source,
            "max_micro_batch": plan["max_micro_batch"],
            "fixed_gb": plan["fixed_bytes"] / 2**30,
            "per_sample_gb": plan["activation_bytes_per_sample"] / 2**30,
        }
    )
    largest = 0 if isinstance(plan, str) else min(plan["max_micro_batch"], 32 if args.cpu_check else 10**6)

    def add_run(entry: dict) -> dict:
        return check.add_run(entry, plan if entry.get("activation_checkpointing") == "full" else None)

    # (1) the main run: the profile as users run it, one process, compiled
    main_run = add_run(
        train_run(run, "main", [*base, "--max-steps", str(check.steps), "--log-every", "1"], work, budgets["main"])
    )

    # (2) the wire it trained, with text baselines (a run stopped before its end saved nothing)
    saved = any((Path(main_run["run_dir"]) / "checkpoints").glob("step_*"))
    record["evaluate"] = (
        evaluated(run, main_run["run_dir"], work, check.eval_examples, budgets["evaluate"])
        if saved
        else {"status": "skipped", "why": "the main run saved no checkpoint"}
    )
    parts["evaluate"] = {k: record["evaluate"].get(k) for k in ("status", "exit", "seconds")}
    check.results.write()

    # (3) the eager lever, against the main run's steady state
    lever = [*base, "--max-steps", str(check.lever_steps), "--log-every", "1"]
    eager = add_run(train_run(run, "eager", [*lever, "--compile", "false"], work, budgets["eager"]))
    record["levers"] = {"eager_over_compiled": ratio(eager, main_run)}
    check.results.write()

    # (4) find_batch from the profile's micro-batch to the plan's largest, each against the plan
    if largest:
        found = found_batch(run, base, work, largest, budgets["find_batch"])
        for trial in found.get("trials", []):
            trial["planned_peak_gb"] = planned_peak_gib(plan, trial["micro_batch"])
        record["find_batch"] = found
        parts["find_batch"] = {k: found.get(k) for k in ("status", "exit", "seconds")}
        main_run["find_batch_max"] = found.get("find_batch_max")
        check.results.write()

    # (5) while time is left: no recompute at the largest micro-batch its own plan fits, and the
    # plan's largest micro-batch as one step; both eager, against the eager lever
    no_ac_plan, _ = check.plan("none")
    if not isinstance(no_ac_plan, str):
        m = min(no_ac_plan["max_micro_batch"], main_run["micro_batch_size"])
        entry = check.add_run(
            train_run(
                run,
                "no_recompute",
                [*lever, "--compile", "false", "--activation-checkpointing", "none", "--micro-batch-size", str(m)],
                work,
                budgets["no_recompute"],
            ),
            no_ac_plan,
        )
        record["levers"]["no_recompute_over_eager"] = ratio(entry, eager)
        check.results.write()
    if largest:
        entry = add_run(
            train_run(
                run,
                "plan_micro_batch",
                [*lever, "--compile", "false", "--micro-batch-size", str(largest), "--grad-accum-steps", "1"],
                work,
                budgets["plan_micro_batch"],
            )
        )
        record["levers"]["plan_micro_batch_over_eager"] = ratio(entry, eager)
    check.finish()


def levers(check: Check) -> None:
    """The levers mode on the check's card (LEVER_CARDS), its parts in the order of what they decide
    (the module's docstring): the bf16 configurations the profiles ship and the recompute policies
    beside them, FP8 by each recipe at the fastest of them, where the fastest's time goes, a run that
    fails at its first step, then, where the card lists them, each FP8 recipe at the largest
    micro-batch its plan fits. Every run entry has `hfu`, the memory cap and `ratio_to_baseline`
    (its samples/s over the first part's, the card's profile as shipped: the baseline's time per
    sample over its own), every FP8 part's the torch and torchao it ran with, and each run's metrics
    are appended to <out>/metrics.jsonl as soon as it ends."""
    run, work, budgets, record, args = check.run, check.work, check.budgets, check.record, check.args
    check.card_state()
    check.rows()
    configs = lever_configs(check.card, args.cpu_check)
    plans, record["plans"], record["card"] = {}, {}, check.card
    for c in configs:
        plans[c.part], source = check.plan(c.policy, profile=c.profile)
        record["plans"][c.part] = (
            plans[c.part]
            if isinstance(plans[c.part], str)
            else {
                "profile": c.profile,
                "activation_checkpointing": c.policy,
                "max_micro_batch": plans[c.part]["max_micro_batch"],
                "source": source,
            }
        )
    record["baseline"] = f"{configs[0].part}: the {configs[0].profile} profile as shipped"
    steps = ["--max-steps", str(check.steps), "--log-every", "1"]
    metrics_copy = check.out / "metrics.jsonl"
    metrics_copy.write_text("")
    torchao = {"torch": torch.__version__, "torchao": torchao_on_path(args.torchao)}

    def lever(
        name: str, flags: list[str], plan: dict | str, env: dict | None = None, keep_batch: bool = True, **why
    ) -> dict:
        """One part: train_run under the part's budget, halving the micro-batch while it runs out
        of memory (exit 5) and time is left (accumulation keeping the global batch, or with
        `keep_batch` false one micro-batch a step), the metrics appended to the copy at once;
        compared with `plan`, and with the baseline, the first part."""
        budget_until = check.clock.elapsed() + budgets[name]
        tried = []
        while True:
            entry = train_run(run, name, flags, work, budget_until - check.clock.elapsed(), env)
            copy_metrics(metrics_copy, entry)
            micro = entry.get("micro_batch_size")
            if entry["exit"] != 5 or not micro or micro == 1:
                break
            tried.append(micro)
            flags = with_micro_batch(flags, micro // 2, global_batch(flags) if keep_batch else None)
        entry |= {"out_of_memory_at": tried, **why}
        entry.setdefault("activation_checkpointing", flag_value(flags, "--activation-checkpointing", None))
        entry.setdefault("fp8", flag_value(flags, "--frozen-fp8", "none"))
        if entry["fp8"] != "none":  # the software float8 depends on (latentwire.fp8.TORCHAO_NEEDED)
            entry |= torchao
        if entry["exit"] == 2:  # one line: this train.py, this device or this torchao cannot run the lever
            entry["status"] = "refused"
        entry["ratio_to_baseline"] = ratio(entry, record["runs"][0]) if record["runs"] else 1.0
        return check.add_run(entry, plan)

    def skipped(name: str, why: str) -> None:
        record["runs"].append({"name": name, "status": "skipped", "why": why})
        check.parts[name] = {"status": "skipped", "exit": None, "seconds": 0.0}
        check.results.write()

    # (1)-(3) the bf16 configurations, each at the profile's micro-batch or the largest its plan fits
    for c in configs:
        flags = [*check.flags(c.profile, c.policy), *steps]
        if c.largest and not isinstance(plans[c.part], str):
            batch = global_batch(flags)
            flags = with_micro_batch(flags, largest_split(plans[c.part]["max_micro_batch"], batch), batch)
        lever(c.part, flags, plans[c.part])
    # (4) FP8 frozen linears by each recipe, at the fastest bf16 configuration (its flags and
    # environment), torchao on these parts' path alone
    bf16 = [r for r in record["runs"] if r["status"] == "done" and r.get("samples_per_s")]
    fastest = max(bf16, key=lambda r: r["samples_per_s"]) if bf16 else record["runs"][0]
    of = next(c for c in configs if c.part == fastest["name"])
    fp8_env_of = {**fastest["env"], **fp8_env(args.torchao)}
    fp8_plans = {recipe: check.plan(of.policy, recipe, of.profile) for recipe in RECIPES}
    for recipe in RECIPES:
        lever(
            f"fp8_{recipe}",
            [*fastest["flags"], "--frozen-fp8", recipe],
            fp8_plans[recipe][0],
            fp8_env_of,
            of=fastest["name"],
        )
    check.results.write()

    # (5) where the fastest's time goes: torch.profiler over three steady steps
    done = [r for r in record["runs"] if r["status"] == "done" and r.get("samples_per_s")]
    if done:
        best = max(done, key=lambda r: r["samples_per_s"])
        record["profile"] = profiled(check, best, budgets["profile"])
    else:
        record["profile"] = {"status": "skipped", "why": "no run finished"}
    check.parts["profile"] = {k: record["profile"].get(k) for k in ("status", "exit", "seconds")}
    check.results.write()

    # (5) ... and the first configuration without recompute failing at its first step, with the
    # profile's loader (its workers, pinned memory): four times the micro-batch its plan fits fills
    # the card with saved activations within its first layers
    failing = next(c for c in configs if c.policy == "none")
    if args.cpu_check or isinstance(plans[failing.part], str):
        why = "a CPU has no out-of-memory to provoke" if args.cpu_check else plans[failing.part]
        skipped("fails_at_first_step", why)
    else:
        entry = train_run(
            run,
            "fails_at_first_step",
            with_micro_batch(
                [*check.flags(failing.profile, failing.policy), *steps, "--compile", "false", "--max-steps", "2"],
                4 * plans[failing.part]["max_micro_batch"],
                None,
            ),
            work,
            budgets["fails_at_first_step"],
            watch=CAUGHT,
        )
        check.add_run(entry | {"of": failing.part})

    # (6) where the card lists them and time is left, each recipe at the largest micro-batch its own
    # plan fits, one micro-batch a step, with expandable segments: rowwise scaling pays only past
    # some thousands of rows a GEMM
    for recipe in RECIPES:
        name = f"fp8_{recipe}_largest"
        plan, source = fp8_plans[recipe]
        if name not in budgets:
            continue
        if isinstance(plan, str):
            skipped(name, plan)
            continue
        lever(
            name,
            with_micro_batch([*fastest["flags"], "--frozen-fp8", recipe], plan["max_micro_batch"], None),
            plan,
            {**fp8_env_of, **EXPANDABLE},
            keep_batch=False,
            of=fastest["name"],
            plan_source=source,
        )
    record["levers"] = {r["name"]: r["ratio_to_baseline"] for r in record["runs"] if "ratio_to_baseline" in r}
    check.finish()


def torchao_on_path(site: str | None) -> str | None:
    """The torchao an FP8 part imports (from `site`, first on its path, else this interpreter's
    path), from its distribution's metadata: nothing of it is imported here."""
    path = [site, *sys.path] if site else sys.path
    found = next(iter(importlib.metadata.distributions(name="torchao", path=path)), None)
    return found.version if found else None


def global_batch(flags: list[str]) -> int:
    """The global batch these flags train: micro-batch x accumulation x the profile's GPUs."""
    from latentwire.settings import load_config

    training = load_config(flags).training
    return training.micro_batch_size * training.grad_accum_steps * training.num_gpus


def flag_value(flags: list[str], flag: str, default: str | None) -> str | None:
    """The value the last `flag` in `flags` gives (argparse's rule), else `default`."""
    at = [i for i, f in enumerate(flags[:-1]) if f == flag]
    return flags[at[-1] + 1] if at else default


def copy_metrics(path: Path, entry: dict) -> None:
    """A run's metrics.jsonl records appended to `path`, each with the part's name and micro-batch."""
    with open(path, "a") as f:
        f.writelines(
            json.dumps({"part": entry["name"], "micro_batch_size": entry.get("micro_batch_size"), **r}) + "\n"
            for r in entry["records"]
        )


def with_micro_batch(flags: list[str], micro: int, global_batch: int | None) -> list[str]:
    """`flags` with this micro-batch, and the accumulation that keeps `global_batch` (None: 1)."""
    accum = max(1, global_batch // micro) if global_batch else 1
    return [*flags, "--micro-batch-size", str(micro), "--grad-accum-steps", str(accum)]


def largest_split(most: int, global_batch: int) -> int:
    """The largest micro-batch of at most `most` that divides `global_batch` (at least 1)."""
    return max(d for d in range(1, max(1, min(most, global_batch)) + 1) if global_batch % d == 0)


def profiled(check: Check, best: dict, budget_s: float) -> dict:
    """`best`'s run again under train.py's profiler (the loop's own steps, past compiling and
    recompiling), summarised into <out>/profile.txt: the top kernels by device time (CPU operators
    on a CPU) and the device's idle share."""
    from latentwire.harness.recordings import format_trace_summary

    wait = 1 if check.args.cpu_check else 3
    flags = [
        *best["flags"],
        "--max-steps",
        str(wait + 1 + PROFILED_STEPS + 1),
        "--profiler",
        "true",
        "--profiler-wait",
        str(wait),
        "--profiler-warmup",
        "1",
        "--profiler-active",
        str(PROFILED_STEPS),
        "--profiler-shapes",
        "false",
    ]
    entry = train_run(check.run, "profile", flags, check.work, budget_s, best.get("env"))
    copy_metrics(check.out / "metrics.jsonl", entry)
    entry.pop("records")
    traces = sorted((Path(entry["run_dir"]) / "traces").glob("*.json*"))
    entry["of"] = best["name"]
    if not traces:
        return entry | {"summary": None, "why": "no trace written"}
    summary = trace_summary(traces[-1])
    if isinstance(summary, str):
        return entry | {"summary": None, "why": summary}
    (check.out / "profile.txt").write_text(f"{best['name']}: {' '.join(flags)}\n" + format_trace_summary(summary))
    return entry | {"summary": {k: v for k, v in summary.items() if k != "top"}, "top": summary["top"][:10]}


def trace_summary(path: Path) -> dict | str:
    """summarize_trace of a profiler trace, or why it could not be read: a part stopped while it
    exported leaves a truncated file, which must not end the command."""
    from latentwire.harness.recordings import summarize_trace

    try:
        return summarize_trace(path)
    except (OSError, EOFError, ValueError, KeyError, TypeError) as e:
        return f"trace {path.name} unreadable: {type(e).__name__}: {str(e)[:200]}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", help="where the results file and the log go ($OUT on the GPU machine)")
    p.add_argument("--work", help="data, runs, checkpoints and caches (default: a new temporary directory)")
    p.add_argument("--profile", help="the validation's profile (default h100); the levers measure their card's")
    p.add_argument(
        "--levers",
        action="store_true",
        help="measure the levers instead (the card's profiles as shipped and the recompute policies beside them, "
        "FP8, a kernel profile, a failing run)",
    )
    p.add_argument(
        "--card",
        choices=list(LEVER_CARDS),
        help="whose levers to run (default: the card this runs on, as torch.cuda names it; needed with --cpu-check)",
    )
    p.add_argument("--deadline", type=float, default=530, help="seconds from now by which every part has ended")
    p.add_argument("--margin", type=float, default=20, help="seconds kept for stopping a part and writing results")
    p.add_argument(
        "--budget",
        action="append",
        default=[],
        metavar="PART=SECONDS",
        help=f"a part's most seconds (parts and defaults: {BUDGETS_S}; with --levers, each card's: "
        f"{ {card: c.budgets for card, c in LEVER_CARDS.items()} })",
    )
    p.add_argument(
        "--steps", type=int, help="optimizer steps of the main run (default 20, 12 with --levers; 3 with --cpu-check)"
    )
    p.add_argument(
        "--compile-mode",
        default="default",
        choices=("default", "max-autotune-no-cudagraphs"),
        help="the runs' torch.compile mode: max-autotune's minutes of tuning get a command of their own",
    )
    p.add_argument("--cpu-check", action="store_true", help="the cpu profile with its tiny readers, every part small")
    p.add_argument(
        "--torchao",
        metavar="DIR",
        help="a folder torchao is installed in (pip install --target): on the FP8 parts' path alone",
    )
    p.add_argument(
        "--prepare",
        action="store_true",
        help="trace the plans the validation of --profile and the levers compare with into bench/results/",
    )
    p.add_argument("--kernel-facts", action="store_true", help=argparse.SUPPRESS)  # the preflight's child
    args = p.parse_args()
    if args.kernel_facts:
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(json.dumps(kernel_facts(device)))
        return
    if args.prepare:
        return prepare(args.profile or "h100", args.torchao)
    if not args.out:
        p.error("--out is required")
    if args.levers and args.profile:
        p.error("--profile is the validation's: the levers measure their card's profiles")
    if args.card and not args.levers:
        p.error("--card is the levers': the validation measures --profile")
    card = args.card
    if args.levers and card is None:
        if args.cpu_check:
            p.error(f"--levers --cpu-check: --card names the card whose parts it runs ({', '.join(LEVER_CARDS)})")
        card, this = card_here()
        if card is None:
            p.error(f"--levers: this is {this}; the levers know an H100 and an H200 (--card names one)")
    budgets = dict(LEVER_CARDS[card].budgets if args.levers else BUDGETS_S)
    for item in args.budget:
        part, _, seconds = item.partition("=")
        if part not in budgets or not re.fullmatch(r"\d+(\.\d*)?", seconds):
            p.error(f"--budget {item}: expected PART=SECONDS with PART one of {', '.join(budgets)}")
        budgets[part] = float(seconds)
    if args.levers:
        levers(Check(args, f"{'cpu-' if args.cpu_check else ''}{card}-levers", budgets, card))
    else:
        validate(Check(args, settings(args, None)[0], budgets))


def table(record: dict) -> str:
    """The runs as a short table: the end of the output is what a lent machine's reply carries."""
    rows = [
        "run | status | mb x accum | recompute | fp8 | step s | tokens/s | mfu | hfu | x baseline | peak GiB | "
        "plan GiB | cap fraction | alloc retries | first step s | cache hit/miss | recompiles"
    ]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for r in record["runs"]:
        rows.append(
            f"{r['name']} | {r['status']} | {r.get('micro_batch_size', '-')} x "
            f"{r.get('grad_accum_steps', '-')} | {r.get('activation_checkpointing', '-')} | "
            f"{r.get('fp8', '-')} | {fmt(r.get('step_time_s'), '.3f')} | "
            f"{fmt(r.get('tokens_per_s'), '.0f')} | {fmt(r.get('mfu'), '.3f')} | {fmt(r.get('hfu'), '.3f')} | "
            f"{fmt(r.get('ratio_to_baseline'), '.2f')} | "
            f"{fmt(r.get('peak_mem_gb'), '.2f')} | {fmt(r.get('planned_peak_gb'), '.2f')} | "
            f"{fmt(r.get('memory_fraction'), '.4f')} | {r.get('alloc_retries', '-')} | "
            f"{fmt(r.get('first_step_s'), '.1f')} | {r.get('cache_hits', '-')}/{r.get('cache_misses', '-')} | "
            f"{r.get('recompiles', '-')}"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    main()
