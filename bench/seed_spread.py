"""How much of the text the cpu profile's wire carries over seeds: the spread a newcomer's run lands in.

Trains the default run (`torchrun --nproc_per_node=2 train.py --profile cpu`) once per seed
(`--seed S`: the initial weights, the data order and dropout; `--data-seed` holds the examples at
the profile's seed, so every run trains on the same examples and is evaluated on the same held-out
ones), with any train.py flags given after `--`, evaluates each (`python -m latentwire.evaluate
--eval-examples N`) and prints each run, then per reader the mean, the standard deviation, the
standard error of the mean and the minimum of the wire's share of the text's F1 over the runs.
Every run is appended to bench/results/seed_spread.jsonl as it finishes, with its candidate's name,
flags and revision; `--table` prints the statistics of every candidate recorded. The ratio is the
smallest share of any run and reader: the worst run's, which the cpu profile's goal bounds.

    python bench/seed_spread.py                                    # the default run, seeds 0-7
    python bench/seed_spread.py --seeds 4 --name eps -- --adam-eps 1e-6   # a candidate, seeds 0-3
    python bench/seed_spread.py --table                            # every candidate recorded
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import math
import shlex
import statistics
import subprocess
import sys
from pathlib import Path

from wire_levers import READERS, evaluate_wire, train_cpu

from common import REPO, summary
from latentwire.dataset import DataSources
from latentwire.settings import load_config

RESULTS = REPO / "bench" / "results" / "seed_spread.jsonl"
# --quick: the plumbing only, a few steps on a few examples in one process; its shares mean nothing.
QUICK_FLAGS = ["--max-steps", "2", "--num-examples", "64", "--micro-batch-size", "4", "--log-every", "1"]


def settings_digest(cfg) -> str:
    """What the runs of one candidate share, whatever flags or profile gave it: its resolved settings
    but the seed, where it writes and the profile's prose."""
    settings = {k: v for k, v in cfg.to_dict().items() if k not in ("seed", "data_seed", "out_dir", "description")}
    return hashlib.sha1(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:10]


def train_and_evaluate(name: str, flags: list[str], seed: int, data_seed: int, settings: str, args) -> dict:
    out_dir = args.out_root / name.replace(" ", "_") / f"seed{seed}"
    seeds = ["--seed", str(seed), "--data-seed", str(data_seed)]
    train_s = train_cpu(out_dir, [*seeds, *flags], args.threads, args.nproc)
    n, wire = evaluate_wire(out_dir, args.eval_examples, args.threads)
    return {
        "name": name,
        "flags": shlex.join(flags),
        "settings": settings,
        "seed": seed,
        "data_seed": data_seed,
        "command": shlex.join([f"torchrun --nproc_per_node={args.nproc} train.py", "--profile", "cpu", *seeds, *flags]),
        "revision": revision(),
        "date": datetime.date.today().isoformat(),
        "train_s": round(train_s, 1),
        "examples": n,
        **wire,
    }


def revision() -> str:
    """The checkout's commit, marked + where its tracked files differ from it."""
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        return "unknown"  # a copy of a checkout, without its git metadata
    dirty = subprocess.run(["git", "-C", str(REPO), "diff", "--quiet", "HEAD"]).returncode != 0
    return head.stdout.strip() + ("+" if dirty else "")


def spread(rows: list[dict], who: str) -> dict:
    """A reader's wire share of the text's F1 over the runs, in %: mean, sd, its standard error, min;
    and the wire's and the text's mean EM."""
    shares = [100 * r[who]["f1_share"] for r in rows]
    sd = statistics.stdev(shares) if len(shares) > 1 else math.nan
    return {
        "runs": len(shares),
        "mean": statistics.fmean(shares),
        "sd": sd,
        "se": sd / math.sqrt(len(shares)),
        "min": min(shares),
        "em_wire": statistics.fmean(r[who]["em_wire"] for r in rows),
        "em_text": statistics.fmean(r[who]["em_text"] for r in rows),
    }


def run_line(r: dict) -> str:
    return f"seed {r['seed']}: trained in {r['train_s']:.0f} s; " + "; ".join(
        f"{who} wire EM {r[who]['em_wire']:.1f} (text {r[who]['em_text']:.1f}), "
        f"{100 * r[who]['f1_share']:.1f}% of the text's F1"
        for who in READERS
    )


def table(groups: dict[tuple, list[dict]]) -> str:
    lines = [
        "| candidate (flags over `--profile cpu`) | runs | share of text F1: mean ± sd (s.e.), min: "
        + " | ".join(READERS)
        + " | wire EM: "
        + " / ".join(READERS)
        + " |",
        "|---|---:|" + "---:|" * len(READERS) + "---:|",
    ]
    for (name, flags, settings), rows in groups.items():
        s = {who: spread(rows, who) for who in READERS}
        cells = [f"{s[w]['mean']:.1f} ± {s[w]['sd']:.1f} ({s[w]['se']:.1f}), {s[w]['min']:.1f}" for w in READERS]
        em = " / ".join(f"{s[w]['em_wire']:.1f}" for w in READERS)
        label = f"{name} (`{flags or 'defaults'}`{f', settings {settings}' if settings else ''})"
        lines.append(f"| {label} | {len(rows)} | " + " | ".join(cells) + f" | {em} |")
    return "\n".join(lines)


def grouped(rows: list[dict]) -> dict[tuple, list[dict]]:
    """The runs of each candidate: one name and flags over the same settings."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["name"], r["flags"], r.get("settings")), []).append(r)
    return groups


def main() -> None:
    argv = sys.argv[1:]
    flags = argv[argv.index("--") + 1 :] if "--" in argv else []
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], epilog="train.py flags for every run go after `--`")
    p.add_argument("--seeds", type=int, default=8, help="how many seeds (runs)")
    p.add_argument("--first-seed", type=int, default=0)
    p.add_argument("--name", default="default", help="the candidate's name in the results")
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--nproc", type=int, default=2, help="ranks of each run (the default run's 2)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per process")
    p.add_argument("--out-root", type=Path, default=REPO / "runs" / "seed_spread")
    p.add_argument("--results", type=Path, default=RESULTS, help="the JSON-lines file runs are appended to")
    p.add_argument("--quick", action="store_true", help="2 seeds of a few steps: checks the script runs")
    p.add_argument("--table", action="store_true", help="print every candidate recorded, and run nothing")
    args = p.parse_args(argv[: argv.index("--")] if "--" in argv else argv)
    if args.table:
        print(table(grouped([json.loads(line) for line in args.results.read_text().splitlines()])))
        return
    if args.quick:
        args.seeds, args.nproc, args.eval_examples, flags = 2, 1, 8, [*QUICK_FLAGS, *flags]
    cfg = load_config(["--profile", "cpu", *flags])  # a bad flag is train.py's one error line, before any run
    data_seed, settings = DataSources.of(cfg.data, cfg.training.seed).seed, settings_digest(cfg)
    print("command: " + shlex.join([Path(sys.executable).name, *sys.argv]), flush=True)
    rows = []
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        row = train_and_evaluate(args.name, flags, seed, data_seed, settings, args)
        rows.append(row)
        args.results.parent.mkdir(parents=True, exist_ok=True)
        with open(args.results, "a") as f:
            f.write(json.dumps(row) + "\n")
        print(run_line(row), flush=True)
    print(table(grouped(rows)))
    stats = {who: spread(rows, who) for who in READERS}
    fields = {f"{who}_{k}": stats[who][k] / 100 for who in READERS for k in ("mean", "sd", "min")}
    summary("seed_spread", min(s["min"] for s in stats.values()) / 100, runs=len(rows), **fields)


if __name__ == "__main__":
    main()
