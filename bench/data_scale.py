"""A rank's memory and start-up against the size of its dataset.

Builds SQuAD-layout JSON Lines files here (no download: contexts of about 700 bytes, each joined
from five of the built-in synthetic set's, the answer with its `answer_start`) of each size, and
starts train.py on each (the cpu profile, 2 steps, steps only, `--num-examples` the file's size:
the whole file, less its held-out tenth, is the training set) on one process and on 2 ranks
(torchrun). Per rank: its peak RSS (VmHWM), its peak private memory (Private_Clean + Private_Dirty
of each mapping in /proc/PID/smaps: what no other process maps), of which the pages of the
dataset's files, and the time from launch to the first step's record (of `--repeats` starts, the
shortest time and the largest memory). This checkout's first start on a file converts it
(data_store: once per content), timed on its own; the rows are later starts, as a requeued job or
a second run makes. `--before REV` runs the same on a worktree of that revision, up to
`--before-max` examples (it holds every example in every rank).

ratio = this checkout's private memory per rank (one process), less the dataset's mapped pages,
at the largest size over the smallest: 1 is flat. The mapped pages are the page cache's one copy
of the rows a rank has read (shared with the ranks that read them too, and dropped by the kernel
under pressure): they grow with the rows read, not with the file, and the table shows them apart.

    python bench/data_scale.py --before main                 # 8k, 300k, 3M examples (about 25 minutes)
    python bench/data_scale.py --quick                       # tiny files, this checkout only (the tests)
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from common import REPO, STEPS_ONLY, child_env, launcher, summary
from latentwire.dataset import synthetic_examples

FULL_SIZES = (8_000, 300_000, 3_000_000)
QUICK_SIZES = (64, 512)
POLL_S = 0.05  # how often each rank's memory is read


def write_squad_layout(path: Path, n: int, seed: int = 0) -> None:
    """`n` examples in SQuAD's layout, one JSON object a line: a context of five synthetic
    contexts, the question and answer of one of them, its `answer_start`."""
    pool = synthetic_examples(10_000, seed)
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            parts = rng.choices(pool, k=5)
            asked = rng.randrange(5)
            ex = parts[asked]
            before = " ".join(p["context"] for p in parts[:asked]) + (" " if asked else "")
            answer = ex["answers"]["text"][0]
            record = {
                "id": str(i),
                "context": " ".join(p["context"] for p in parts),
                "question": ex["question"],
                "answers": {"text": [answer], "answer_start": [len(before) + ex["context"].index(answer)]},
            }
            f.write(json.dumps(record) + "\n")


def rank_pids(proc: subprocess.Popen, nproc: int) -> list[int]:
    """The training processes: the child itself, or torchrun's children."""
    if nproc == 1:
        return [proc.pid]
    try:
        return [int(p) for p in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
    except OSError:
        return []


def read_memory(pid: int, data_dir: Path) -> tuple[int, int, int] | None:
    """(VmHWM, private bytes, private bytes of the files under `data_dir`) of a live process, or
    None once it is gone. Private: Private_Clean + Private_Dirty of each mapping in
    /proc/PID/smaps; the data's are the pages of its memory-mapped files that this process alone
    maps (page cache: the kernel maps a file's pages in folios of up to 2 MiB, so each row read
    maps a block around it)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
        smaps = Path(f"/proc/{pid}/smaps").read_text()
    except OSError:
        return None
    hwm = [int(line.split()[1]) * 1024 for line in status.splitlines() if line.startswith("VmHWM:")]
    if not hwm:  # exiting: its memory is gone
        return None
    private = data = 0
    in_data = False
    for line in smaps.splitlines():
        fields = line.split()
        if not line[0].isupper():  # a mapping's header: address range, perms, offset, device, inode, path
            in_data = len(fields) > 5 and fields[5].startswith(str(data_dir))
        elif fields[0] in ("Private_Clean:", "Private_Dirty:"):
            private += int(fields[1]) * 1024
            data += int(fields[1]) * 1024 if in_data else 0
    return hwm[0], private, data


def measured_start(repo: Path, nproc: int, data: Path, n: int, out_dir: Path, cache: Path, threads: int) -> dict:
    """One start of `repo`'s train.py on `data` (`n` examples): per rank its peak RSS and peak
    private memory (the largest over the ranks), and the seconds from launch to the first step's
    record."""
    flags = ["--profile", "cpu", "--max-steps", 2, "--log-every", 1, *STEPS_ONLY, "--num-examples", n]
    cmd = [*launcher(nproc, repo), *map(str, flags), "--dataset", str(data), "--out-dir", str(out_dir), "--overwrite"]
    launched = time.time()
    proc = subprocess.Popen(
        cmd,
        cwd=repo,
        env=child_env(threads) | {"HF_DATASETS_CACHE": str(cache)},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    peaks: dict[int, tuple[int, int, int]] = {}
    while proc.poll() is None:
        for pid in rank_pids(proc, nproc):
            seen = read_memory(pid, cache)
            if seen is not None:
                peaks[pid] = tuple(map(max, peaks.get(pid, (0, 0, 0)), seen))
        time.sleep(POLL_S)
    if proc.returncode != 0:
        sys.exit(f"error: train.py ({repo}) on {data.name} exited {proc.returncode}:\n{proc.stderr.read()[-3000:]}")
    first = json.loads((out_dir / "metrics.jsonl").read_text().splitlines()[0])
    return {
        "peak_rss_gb": max(p[0] for p in peaks.values()) / 1e9,
        "private_gb": max(p[1] for p in peaks.values()) / 1e9,
        "private_data_gb": max(p[2] for p in peaks.values()) / 1e9,
        "first_step_s": first["time"] - launched,
        "ranks": len(peaks),
    }


def worktree(revision: str, root: Path) -> Path:
    path = root / "before"
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-q", str(path), revision], check=True)
    return path


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="tiny files, this checkout only: checks the script runs")
    p.add_argument("--sizes", type=int, nargs="+", help=f"examples per file (default {FULL_SIZES})")
    p.add_argument("--before", help="a git revision to run beside this checkout")
    p.add_argument("--before-max", type=int, default=300_000, help="the largest file --before runs on")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--repeats", type=int, default=2, help="starts per row: the largest memory, the shortest time")
    p.add_argument("--work", type=Path, help="where the files go (default: a temporary directory, removed)")
    args = p.parse_args()
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    print("command: " + " ".join([Path(sys.executable).name, *sys.argv]), flush=True)
    work = Path(tempfile.mkdtemp(prefix="data_scale.", dir=args.work))
    repos = {"after": REPO}
    try:
        if args.before:
            repos["before"] = worktree(args.before, work)
        rows = []
        for n in sizes:
            data, cache = work / f"squad_{n}.jsonl", work / "hf_cache"
            started = time.perf_counter()
            write_squad_layout(data, n)
            print(f"{n} examples: {data.stat().st_size / 1e6:.0f} MB written in {time.perf_counter() - started:.0f} s")
            for name, repo in repos.items():
                if name == "before" and n > args.before_max:
                    continue
                started = time.perf_counter()
                measured_start(repo, 1, data, n, work / "run", cache, args.threads)  # converts (after), warms (both)
                print(f"  {name}: first start {time.perf_counter() - started:.1f} s", flush=True)
                for nproc in (1, 2):
                    starts = [
                        measured_start(repo, nproc, data, n, work / "run", cache, args.threads)
                        for _ in range(args.repeats)
                    ]
                    row = {"code": name, "examples": n, "nproc": nproc, **repeated(starts)}
                    rows.append(row)
                    print("  " + json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}))
            data.unlink()
            shutil.rmtree(work / "hf_cache", ignore_errors=True)  # a size's converted copy goes with it
        table(rows)
        small, large = [r for r in rows if r["code"] == "after" and r["nproc"] == 1][:: len(sizes) - 1]
        summary(
            "data_scale",
            own(large) / own(small),
            private_gb_smallest=small["private_gb"],
            private_gb_largest=large["private_gb"],
            private_ratio=large["private_gb"] / small["private_gb"],
            first_step_s_smallest=small["first_step_s"],
            first_step_s_largest=large["first_step_s"],
        )
    finally:
        if args.before:
            subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(work / "before")], check=False)
        shutil.rmtree(work, ignore_errors=True)


def repeated(starts: list[dict]) -> dict:
    """Several starts as one row: the largest memory of any, the shortest time (the machine's other
    load only ever adds to it)."""
    return {k: (min if k == "first_step_s" else max)(s[k] for s in starts) for k in starts[0]}


def own(row: dict) -> float:
    """A rank's private memory less the dataset's mapped pages (page cache, which a rank maps, not
    allocates): what it holds of its own."""
    return row["private_gb"] - row["private_data_gb"]


def table(rows: list[dict]) -> None:
    """The Markdown table of docs/performance.md."""
    print(
        "| code | examples | ranks | peak RSS per rank | private per rank | of it, the dataset's mapped pages | "
        "private less those | launch to first step |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['code']} | {r['examples']:,} | {r['nproc']} | {r['peak_rss_gb']:.2f} GB | "
            f"{r['private_gb']:.2f} GB | {r['private_data_gb']:.2f} GB | {own(r):.2f} GB | {r['first_step_s']:.1f} s |"
        )


if __name__ == "__main__":
    main()
