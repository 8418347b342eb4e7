"""How much of the text baseline the cpu profile's wire carries, for each lever tried on it.

Each lever is the default run (`torchrun --nproc_per_node=2 train.py --profile cpu`) with a few
flags changed, trained from scratch, then evaluated on held-out examples with text baselines
(`python -m latentwire.evaluate --eval-examples N`), as a user would. One row per lever: the
wall time of its training, each reader's wire EM with its standard error and the wire's share of
the text's F1. Runs are serial (two ranks already fill two cores), so the wall times compare.

    python bench/wire_levers.py                                 # every lever in LEVERS
    python bench/wire_levers.py --lever deep "--encoder-layers 4"   # one lever of your own
    python bench/wire_levers.py --only default "M 16"           # some of LEVERS
    python bench/wire_levers.py --table                         # every run recorded so far
    python bench/wire_levers.py --by-attribute runs/levers/default  # EM per attribute asked

Results append to bench/results/wire_levers.jsonl (one JSON object per run, with its command),
and the table of this invocation's runs is printed in Markdown.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

from common import REPO, child_env, launcher
from latentwire.dataset import ATTRIBUTES, DataSources, answer_text
from latentwire.evaluate import read_meta, resolve_checkpoint

RESULTS = REPO / "bench" / "results" / "wire_levers.jsonl"
READERS = ("llama", "qwen")

# name -> flags over the cpu profile's defaults
LEVERS = {
    "default": "",
    "steps 1800": "--max-steps 1800",
    "encoder 4 layers": "--encoder-layers 4",
    "encoder 128 wide": "--encoder-dim 128",
    "encoder 4 layers x 128 wide": "--encoder-layers 4 --encoder-dim 128",
    "M 16": "--num-latents 16",
    "lr 2e-3": "--lr 2e-3",
}


def train_cpu(out_dir: Path, flags: list[str], threads: int, nproc: int = 2, repo: Path = REPO) -> float:
    """`torchrun --nproc_per_node=NPROC train.py --profile cpu FLAGS` from `repo` into `out_dir`
    (overwritten): the default run with `flags`; its wall time in seconds."""
    start = time.perf_counter()
    run([*launcher(nproc, repo), "--profile", "cpu", *flags, "--out-dir", str(out_dir), "--overwrite"], threads, repo)
    return time.perf_counter() - start


def train_and_evaluate(name: str, flags: str, out_root: Path, examples: int, threads: int) -> dict:
    out_dir = out_root / name.replace(" ", "_")
    train_s = train_cpu(out_dir, shlex.split(flags), threads)
    n, wire = evaluate_wire(out_dir, examples, threads)
    return {
        "lever": name,
        "flags": flags,
        "train_s": round(train_s, 1),
        "examples": n,
        "command": " ".join(["torchrun --nproc_per_node=2 train.py --profile cpu", flags]).strip(),
        "date": datetime.date.today().isoformat(),
        **wire,
    }


def evaluate_wire(out_dir: Path, examples: int, threads: int, repo: Path = REPO) -> tuple[int, dict]:
    """`repo`'s evaluation of the run in `out_dir` on `examples` held-out examples, in one process
    with the threads of both ranks: how many it scored, and each reader's wire and text EM and F1,
    the wire EM's standard error and the wire's share of the text's F1."""
    shutil.rmtree(out_dir / "eval", ignore_errors=True)  # a report of an earlier run is not this one's
    run(
        [
            sys.executable,
            "-m",
            "latentwire.evaluate",
            "--ckpt",
            str(out_dir),
            "--eval-examples",
            str(examples),
            "--out-dir",
            str(out_dir / "eval"),
        ],
        2 * threads,
        repo,
    )
    report = json.loads(next((out_dir / "eval").glob("*.json")).read_text())
    m, n = report["metrics"], report["examples"]
    return n, {
        who: {
            "em_wire": m[f"em_wire_{who}"],
            "em_wire_se": binomial_se(m[f"em_wire_{who}"], n),
            "em_text": m[f"em_text_{who}"],
            "f1_wire": m[f"f1_wire_{who}"],
            "f1_text": m[f"f1_text_{who}"],
            "f1_share": report["wire_share_of_text"][who]["f1"],
        }
        for who in READERS
    }


def binomial_se(percent: float, n: int) -> float:
    """The standard error of an exact-match rate in %, over n examples."""
    p = percent / 100
    return 100 * math.sqrt(p * (1 - p) / n)


def run(command: list[str], threads: int, cwd: Path = REPO) -> None:
    proc = subprocess.run(command, cwd=cwd, env=child_env(threads), capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"error: {' '.join(command)} exited {proc.returncode}:\n{proc.stderr[-3000:]}")


def table(rows: list[dict]) -> str:
    lines = [
        "| lever (flags over `--profile cpu`) | train s | wire EM: llama / qwen | share of text F1: llama / qwen |",
        "|---|---:|---:|---:|",
    ]
    for r in rows:
        em = " / ".join(f"{r[w]['em_wire']:.1f} ± {r[w]['em_wire_se']:.1f}" for w in READERS)
        share = " / ".join(f"{100 * r[w]['f1_share']:.0f}%" for w in READERS)
        lines.append(f"| {r['lever']} (`{r['flags'] or 'defaults'}`) | {r['train_s']:.0f} | {em} | {share} |")
    return "\n".join(lines)


def by_attribute(run: Path) -> str:
    """Each reader's wire and text EM per attribute the synthetic set asks about, from the run's
    evaluation report (its answers, matched to the held-out examples it evaluated)."""
    cfg, _ = read_meta(resolve_checkpoint(run, "--by-attribute"))
    report = json.loads(next((run / "eval").glob("*.json")).read_text())
    sources = DataSources.of(cfg.data, cfg.training.seed)
    examples = sources.held_out_examples(report["examples"], sources.held_out_source())
    lines = [
        "| question | values | examples | " + " | ".join(f"{who}: wire / text EM" for who in READERS) + " |",
        "|---|---:|---:|" + "---:|" * len(READERS),
    ]
    for attr in ATTRIBUTES:
        before, after = attr.question.split("{name}")
        asked = [
            a
            for a in report["answers"]
            if examples[a["index"]]["question"].startswith(before) and examples[a["index"]]["question"].endswith(after)
        ]

        def em(key: str, asked: list[dict] = asked) -> float:
            return 100 * sum(a[key] == answer_text(examples[a["index"]]) for a in asked) / len(asked)

        cells = [f"{em(f'wire_{who}'):.0f} / {em(f'text_{who}'):.0f}" for who in READERS]
        lines.append(
            f"| {attr.question.format(name='X')} | {len(attr.values)} | {len(asked)} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--lever",
        nargs=2,
        action="append",
        metavar=("NAME", "FLAGS"),
        default=[],
        help="a lever of your own: its name and its train.py flags",
    )
    p.add_argument("--only", nargs="+", choices=list(LEVERS), help="run only these of LEVERS")
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out-root", type=Path, default=REPO / "runs" / "levers")
    p.add_argument("--table", action="store_true", help="print the table of every recorded run, and run nothing")
    p.add_argument(
        "--by-attribute",
        type=Path,
        metavar="RUN",
        help="print a lever run's EM per attribute asked (the synthetic set), and run nothing",
    )
    args = p.parse_args()
    if args.table:
        print(table([json.loads(line) for line in RESULTS.read_text().splitlines()]))
        return
    if args.by_attribute:
        print(by_attribute(args.by_attribute))
        return
    levers = [(name, LEVERS[name]) for name in args.only] if args.only else [] if args.lever else list(LEVERS.items())
    rows = []
    for name, flags in [*levers, *map(tuple, args.lever)]:
        row = train_and_evaluate(name, flags, args.out_root, args.eval_examples, args.threads)
        rows.append(row)
        RESULTS.parent.mkdir(parents=True, exist_ok=True)
        with open(RESULTS, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(table([row]).splitlines()[-1], flush=True)
    print(table(rows))


if __name__ == "__main__":
    main()
