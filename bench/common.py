"""What the bench scripts share: the cpu profile's model and data built the way train.py builds
them, the bare training step they are compared with, settings, timing and the summary line.

Every script compares two things run side by side in one process (or alternated runs), so the
machine's speed and its other load cancel out of the ratio it reports; absolute times are printed
for context only.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# `python bench/NAME.py` puts bench/, not the repository, on the path; train.py and latentwire
# are imported from the checkout itself, with nothing installed.
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from latentwire.dataset import Collator, DataSources, PromptDataset  # noqa: E402
from latentwire.harness.data import Mixture, ShardSampler  # noqa: E402
from latentwire.harness.data import make_loader as harness_loader  # noqa: E402
from latentwire.harness.recompute import checkpoint_options  # noqa: E402
from latentwire.model import WireEncoder  # noqa: E402
from latentwire.objectives import Objectives, forward_loss_sums, target_counts  # noqa: E402
from latentwire.parallelize import frozen_llms  # noqa: E402
from latentwire.settings import load_config  # noqa: E402

CPU = torch.device("cpu")
# Flags for every timed train.py run: periodic evaluation and checkpoints are work between steps,
# not the loop's per-step cost, so a profile that turns them on must not leak them into step times.
STEPS_ONLY = ["--eval-every", 0, "--checkpoint-every", 0]
# Variables torchrun sets; a child started from a shell inside torchrun must not inherit them.
DIST_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


# --- command line and settings ----------------------------------------------------------------


def parse_settings(description: str, quick, full, extra=None):
    """`--quick` picks the `quick` settings (the tests' few steps), otherwise `full` (a meaningful
    measurement); every settings field is also a flag that overrides either; `extra(parser)` may add
    a script's own flags. Sets the thread count and prints the command and the resolved settings,
    so a summary line can be traced to how it was measured."""
    p = argparse.ArgumentParser(description=description)
    if extra is not None:
        extra(p)
    p.add_argument("--quick", action="store_true", help="a few steps only: checks the script runs")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads per process (1: ranks and loaders do not oversubscribe the cores)",
    )
    for f in dataclasses.fields(full):
        p.add_argument(
            "--" + f.name.replace("_", "-"),
            type=int,
            default=None,
            help=f"default {getattr(full, f.name)} ({getattr(quick, f.name)} with --quick)",
        )
    args = p.parse_args()
    chosen = quick if args.quick else full
    settings = dataclasses.replace(
        chosen,
        **{f.name: getattr(args, f.name) for f in dataclasses.fields(chosen) if getattr(args, f.name) is not None},
    )
    torch.set_num_threads(args.threads)
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]))
    print(
        f"config: mode={'quick' if args.quick else 'full'} threads={args.threads} "
        + " ".join(f"{k}={v}" for k, v in dataclasses.asdict(settings).items())
    )
    print(
        f"machine: {os.cpu_count()} cpus, load average {os.getloadavg()[0]:.2f}, torch {torch.__version__}", flush=True
    )
    return args, settings


def cpu_config(*overrides):
    """The cpu profile plus train.py flags, resolved and validated by the same code train.py uses."""
    return load_config(["--profile", "cpu", *map(str, overrides)])


# --- model, data and the bare step ------------------------------------------------------------


def build_model(cfg) -> tuple[dict, WireEncoder]:
    """The two frozen LLMs and the trainable WireEncoder, built and wrapped as train.py builds them
    (eager: a bench compiles what it compares itself)."""
    torch.manual_seed(cfg.training.seed)
    llms = frozen_llms(
        cfg.frozen, cfg.prompt, cfg.numerics.precision, CPU, checkpointing=checkpoint_options(cfg.recompute.policy)
    )
    model = WireEncoder.for_llms(cfg.wire, llms)
    return llms, model.train()


def make_loader(cfg, llms: dict) -> DataLoader:
    """train.py's DataLoader for a world of one: the same examples, sampler (so the same batch
    order), collate, workers and prefetch; no pinned memory, as on CPU there is no copy to overlap."""
    dataset = PromptDataset(DataSources.of(cfg.data, cfg.training.seed).train_examples(cfg.data.num_examples))
    collate = Collator.for_llms(
        llms,
        cfg.data.max_prompt_bytes,
        cfg.data.max_answer_tokens,
        cfg.data.pad_multiple,
        teacher=cfg.objectives.teacher,
        word_patch=cfg.wire.word_patch,
    )
    sampler = ShardSampler(Mixture.single(len(dataset), cfg.training.seed), num_replicas=1, rank=0)
    return harness_loader(
        dataset, sampler, collate, cfg.training.micro_batch_size, cfg.loader, "cpu", seed=cfg.training.seed
    )


def take(loader: DataLoader, n: int) -> list[dict]:
    it = iter(loader)
    return [next(it) for _ in range(n)]


def forward_backward(forward, model, llms: dict, batch: dict, micro_steps: int) -> None:
    """One micro-batch as a minimal loop writes it: each LLM's answer cross-entropy per answer
    token, averaged over the LLMs and over the step's micro-batches, then backward."""
    objectives = Objectives()
    loss = (forward(model, llms, batch, objectives) / target_counts(batch, objectives)).mean() / micro_steps
    loss.backward()


def bare_step(model, llms: dict, optimizer: torch.optim.Optimizer, micro_batches: list[dict]) -> None:
    """The reference the harness is measured against: no DDP, no clipping, no schedule, no logging."""
    for batch in micro_batches:
        forward_backward(forward_loss_sums, model, llms, batch, len(micro_batches))
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


# --- processes --------------------------------------------------------------------------------


def launcher(nproc: int, repo: Path = REPO) -> list[str]:
    """`repo`'s train.py as users start it: plain python for one process, torchrun for more."""
    if nproc == 1:
        return [sys.executable, str(repo / "train.py")]
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={nproc}",
        str(repo / "train.py"),
    ]


def child_env(threads: int) -> dict:
    """The environment of a train.py subprocess: no inherited torchrun variables, a fixed thread
    count per process, and no tokenizer thread pool competing for the same cores."""
    env = {k: v for k, v in os.environ.items() if k not in DIST_ENV}
    env.update(OMP_NUM_THREADS=str(threads), TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    return env


def timed_run(nproc: int, s, out_dir: Path, threads: int, what: str, *extra) -> tuple[str, list[dict]]:
    """train.py on the cpu profile at the settings' batch and steps (steps only: STEPS_ONLY), with
    `extra` flags: its stdout and its per-step metrics records. A failed run ends the script with
    one line, `error: train.py WHAT exited N`, and the end of its stderr."""
    flags = [
        "--profile",
        "cpu",
        "--micro-batch-size",
        s.micro_batch_size,
        "--grad-accum-steps",
        s.grad_accum_steps,
        "--max-steps",
        s.steps,
        "--num-examples",
        s.num_examples,
        "--log-every",
        1,
        *STEPS_ONLY,
        *extra,
        "--out-dir",
        out_dir,
    ]
    proc = subprocess.run(
        [*launcher(nproc), *map(str, flags)], cwd=REPO, env=child_env(threads), capture_output=True, text=True
    )
    if proc.returncode != 0:
        sys.exit(f"error: train.py {what} exited {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout, [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]


# --- timing and the summary line --------------------------------------------------------------


def median(values: list[float]) -> float:
    return statistics.median(values)


def summary(name: str, ratio: float, **fields) -> None:
    """The contract's last line: `name: key=value ... ratio=<number>`."""
    parts = [f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in fields.items()]
    print(f"{name}: {' '.join(parts)} ratio={ratio:.4f}", flush=True)
