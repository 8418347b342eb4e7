"""The README's first command at two revisions, side by side: training time and the wire it makes.

Trains the default run (`torchrun --nproc_per_node=2 train.py --profile cpu`) from a worktree of
`--before` (a git revision) and from this checkout, one after the other on the same cores,
then evaluates each on the same held-out examples (`python -m latentwire.evaluate --eval-examples
N`). Reports each one's training wall time (the whole torchrun command: start-up, the teacher's
pass and every step), its median step time (train.py's own per-window `step_time_s`, first window
left out) and each reader's wire EM and share of the text's F1. The ratio is before / after
training time: above 1, this checkout trains the default faster.

    python bench/default_run.py --before 71410ce                 # the whole default, twice
    python bench/default_run.py --before 71410ce --max-steps 300 # a quicker look at speed only
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from wire_levers import evaluate_wire, train_cpu

from common import REPO, summary


def median_step_s(out_dir: Path) -> float:
    windows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines()]
    times = [w["step_time_s"] for w in windows if "step_time_s" in w][1:]  # the first holds step 1's start
    return statistics.median(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--before", required=True, help="the git revision to compare this checkout with")
    p.add_argument("--max-steps", type=int, help="train only this many steps (speed only: no evaluation)")
    p.add_argument("--eval-examples", type=int, default=300)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--out-root", type=Path, default=REPO / "runs" / "default_run")
    args = p.parse_args()
    extra = [] if args.max_steps is None else ["--max-steps", str(args.max_steps)]
    if (
        subprocess.run(
            ["git", "-C", str(REPO), "rev-parse", "--verify", "-q", f"{args.before}^{{commit}}"], capture_output=True
        ).returncode
        != 0
    ):
        print(f"error: --before {args.before}: not a commit of this repository", file=sys.stderr)
        sys.exit(2)
    with tempfile.TemporaryDirectory() as tmp:
        before_repo = Path(tmp) / "before"
        subprocess.run(
            ["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(before_repo), args.before], check=True
        )
        try:
            rows = {}
            for name, repo in (("before", before_repo), ("after", REPO)):
                out_dir = args.out_root / name
                train_s = train_cpu(out_dir, extra, args.threads, repo=repo)
                rows[name] = {
                    "train_s": train_s,
                    "step_s": median_step_s(out_dir),
                    "wire": None
                    if args.max_steps
                    else evaluate_wire(out_dir, args.eval_examples, args.threads, repo)[1],
                }
                print(
                    f"{name} ({args.before if name == 'before' else 'this checkout'}): "
                    f"trained in {train_s:.1f} s, {1000 * rows[name]['step_s']:.1f} ms a step",
                    flush=True,
                )
                if rows[name]["wire"]:
                    print(
                        "  "
                        + "; ".join(
                            f"{who} wire EM {w['em_wire']:.1f} ± {w['em_wire_se']:.1f}, "
                            f"{100 * w['f1_share']:.0f}% of the text's F1"
                            for who, w in rows[name]["wire"].items()
                        ),
                        flush=True,
                    )
        finally:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(before_repo)], check=False)
    before, after = rows["before"], rows["after"]
    summary(
        "default_run",
        before["train_s"] / after["train_s"],
        before_train_s=before["train_s"],
        after_train_s=after["train_s"],
        step_ratio=before["step_s"] / after["step_s"],
    )


if __name__ == "__main__":
    main()
