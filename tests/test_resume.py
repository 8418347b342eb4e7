"""Checkpoints, exact resume, preemption, non-finite steps and a failing rank."""

import json
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

from conftest import (
    EXACT,
    FAST,
    NOBODY,
    REPO,
    RUN,
    TWENTY,
    assert_one_line_error,
    assert_same_run,
    child_env,
    exit_and_leftovers,
    final_weights,
    free_port,
    ok,
    rank_pid,
    read_metrics,
    run_train,
    wait_for_path,
    wait_for_step,
)
from latentwire.dataset import synthetic_examples
from latentwire.harness.checkpoint import list_checkpoints, load_checkpoint
from latentwire.harness.launch import ranks
from latentwire.settings import DEFAULT_PROFILES, load_config


def popen_train(args, nproc=1, max_restarts=0, **env):
    launcher = (
        [sys.executable]
        if nproc == 1
        else [
            *[sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}"],
            f"--max-restarts={max_restarts}",
        ]
    )
    return subprocess.Popen(
        [*launcher, str(REPO / "train.py"), *args],
        cwd=REPO,
        env=child_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


@pytest.mark.slow
@pytest.mark.parametrize("workers", ["0", "2"])
def test_stop_and_resume_is_bitwise_exact(tmp_path, straight, workers):
    """Compared with an unbroken run without loader workers: with them, the split run is still
    bitwise the same."""
    args = [*TWENTY[1], "--num-workers", workers]
    split = tmp_path / "split"
    ok(run_train([*args, "--out-dir", str(split), "--stop-at-step", "10"]))
    assert [p.name for p in list_checkpoints(split)] == ["step_00000010"]
    ok(run_train([*args, "--out-dir", str(split), "--resume"]))
    assert_same_run(straight(1), split, 10)


@pytest.mark.slow
def test_stop_and_resume_under_torchrun_from_a_checkpoint_every_rank_reads(tmp_path, straight):
    """Rank 1 cannot read its RNG state in the newest checkpoint: both ranks resume from the one
    before (a rank on its own newest would train other weights from another data position)."""
    args, split = [*TWENTY[2], "--checkpoint-every", "5", "--keep-checkpoints", "3"], tmp_path / "split"
    ok(run_train([*args, "--out-dir", str(split), "--stop-at-step", "10"], nproc=2))
    (split / "checkpoints" / "step_00000010" / "rng_rank1.pt").write_bytes(b"truncated")
    proc = ok(run_train([*args, "--out-dir", str(split), "--resume"], nproc=2))
    assert "resumed from" in proc.stdout and "(step 5," in proc.stdout
    assert "skipping unreadable checkpoint" in proc.stderr and "another rank" in proc.stderr
    assert_same_run(straight(2), split, 5)


@pytest.mark.slow
def test_sigterm_to_torchrun_saves_within_a_step_and_resumes_exactly(tmp_path, straight):
    """torchrun passes SIGTERM to each trainer's whole process group: with loader workers in it
    (every GPU profile has them), a worker killed by it used to fail the trainer before it saved."""
    args, cut = [*TWENTY[2], "--checkpoint-every", "100", "--num-workers", "2"], tmp_path / "cut"
    proc = popen_train([*args, "--out-dir", str(cut)], nproc=2)
    wait_for_step(cut, 4, proc)
    proc.send_signal(signal.SIGTERM)  # what SLURM and spot reclaim send; torchrun forwards it
    stdout, stderr, left = exit_and_leftovers(proc, str(cut))
    assert proc.returncode != 0
    assert "exiting with code 75" in stdout, stdout + stderr
    assert left == []  # the loader workers stopped with their ranks
    logged = max(m["step"] for m in read_metrics(cut))
    saved = [p.name for p in list_checkpoints(cut)]
    assert saved == [f"step_{logged:08d}"]  # the step that was running when the signal came
    ok(run_train([*args, "--out-dir", str(cut), "--resume"], nproc=2))
    assert_same_run(straight(2), cut, logged)


@pytest.mark.slow
@pytest.mark.parametrize("killed", ["after_the_second_checkpoint", "before_the_first_checkpoint"])
def test_a_rank_killed_under_torchrun_s_restarts_continues_the_run_exactly(tmp_path, straight, killed):
    """torchrun --max-restarts=1 (plain, as the README runs it), one rank SIGKILLed (a GPU fault, the
    OOM killer): torchrun starts both ranks again, with the same command, and they resume from the
    newest checkpoint, or start the run over where it never saved, without --overwrite: exit 0 at
    the last step, the weights bitwise the unbroken run's, every step logged once."""
    after = killed == "after_the_second_checkpoint"
    out = tmp_path / "run"
    job = popen_train([*TWENTY[2], "--checkpoint-every", "5" if after else "0", "--out-dir", str(out)], 2, 1)
    wait_for_path(out / "checkpoints" / "step_00000010", job) if after else wait_for_step(out, 2, job)
    os.kill(rank_pid(str(out), 1), signal.SIGKILL)
    stdout, stderr = job.communicate(timeout=300)
    assert job.returncode == 0, stdout + stderr
    said = (
        "restarted by torchrun: resuming the run from its newest checkpoint"
        if after
        else "restarted by torchrun before the run's first checkpoint: starting it over"
    )
    assert said in stdout, stdout
    assert_same_run(straight(2), out, 0)


@pytest.mark.slow
def test_a_job_that_reuses_another_s_rendezvous_id_is_not_its_restart(tmp_path):
    """Two torchrun jobs of the same --rdzv-id (a script's, "none" for static multi-node ones,
    launch.sh's default without SLURM): the second, without --resume, is refused in a directory that
    holds the first's run, and its restart (--max-restarts=1) is refused too, instead of taking the
    first's run for its own and continuing it; nothing on disk changes."""
    out = tmp_path / "run"

    def job(max_steps: int) -> subprocess.CompletedProcess:
        torchrun = ["--nnodes=1", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d", "--rdzv-id=same"]
        return subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", *torchrun, f"--rdzv-endpoint=127.0.0.1:{free_port()}",
             str(REPO / "train.py"), *RUN, "--max-steps", str(max_steps), "--out-dir", str(out)],
            cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    ok(job(2))
    before = snapshot(out)
    second = job(4)
    assert second.returncode != 0 and second.stderr.count("already holds a run") == 2, second.stdout + second.stderr
    assert snapshot(out) == before


@pytest.mark.slow
def test_an_elastic_job_that_loses_a_node_continues_alone_with_the_global_batch_kept(tmp_path):
    """Two torchrun agents (nodes) of an elastic job, --nnodes=1:2, c10d rendezvous, one rank each;
    one node lost after the run's first checkpoint (its agent and rank SIGKILLed). The other's agent
    starts its rank again in a world of one, which resumes with the profile's global batch (16 x 1 x
    2 becomes 16 x 2 x 1) and trains to the last step, every step logged once."""
    out, endpoint = tmp_path / "run", f"127.0.0.1:{free_port()}"

    def node(hosts_the_rendezvous: bool) -> subprocess.Popen:
        # The rendezvous closes 5 s after its first node joins, or once both have; a lost node is
        # dropped after two missed heartbeats of 1 s.
        conf = f"is_host={str(hosts_the_rendezvous).lower()},last_call_timeout=5"
        conf += ",keep_alive_interval=1,keep_alive_max_attempt=2"
        torchrun = ["--nnodes=1:2", "--nproc-per-node=1", "--max-restarts=1", "--rdzv-backend=c10d"]
        return subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", *torchrun, f"--rdzv-endpoint={endpoint}",
             "--rdzv-id=elastic", f"--rdzv-conf={conf}", str(REPO / "train.py"), "--profile", "cpu", *EXACT, *FAST,
             "--max-steps", "12", "--checkpoint-every", "4", "--out-dir", str(out)],
            cwd=REPO, env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip

    stays, lost = node(hosts_the_rendezvous=True), node(hosts_the_rendezvous=False)
    wait_for_path(out / "checkpoints" / "step_00000004", stays)
    for pid in [lost.pid, *ranks(lost.pid)]:
        os.kill(pid, signal.SIGKILL)
    lost.communicate()
    stdout, stderr = stays.communicate(timeout=300)
    assert stays.returncode == 0, stdout + stderr
    assert "restarted by torchrun: resuming the run from its newest checkpoint" in stdout, stdout
    assert "global batch 32 (16 x 1 x 2, as the profile lays it out) kept on 1 rank(s) as 16 x 2 x 1" in stdout
    assert "layout (world, micro-batch, accumulation) is (1, 16, 2), the checkpoint's was (2, 16, 1)" in stderr
    assert [m["step"] for m in read_metrics(out)] == list(range(1, 13))


@pytest.mark.slow
def test_sigusr1_single_process_exits_75_and_skips_the_step_s_evaluation(tmp_path):
    """Every step evaluates, but not the one that saves: the grace before SIGKILL is for saving."""
    out = tmp_path / "run"
    proc = popen_train([*RUN, "--max-steps", "200", "--eval-every", "1", "--eval-examples", "8", "--out-dir", str(out)])
    wait_for_step(out, 2, proc)
    proc.send_signal(signal.SIGUSR1)
    proc.communicate(timeout=120)
    assert proc.returncode == 75
    records = read_metrics(out)
    assert [p.name for p in list_checkpoints(out)] == [f"step_{records[-1]['step']:08d}"]
    assert all("eval_nll_wire_llama" in r for r in records[:-1]) and "eval_nll_wire_llama" not in records[-1]


# Rank 1 signals itself when it starts its `nth` call of `module.name`; each later call says so.
SIGNAL_AT_CALL = """
import os, signal, sys
sys.path.insert(0, {repo!r}); sys.argv[0] = {train!r}
import {module} as target
import train
from latentwire.harness.exits import main_guard
real, calls = target.{name}, [0]
def signalled(*args, **kwargs):
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == {nth}:
        os.kill(os.getpid(), signal.SIGTERM)
    if calls[0] > {nth}:
        print("a call after the signal", file=sys.stderr, flush=True)
    return real(*args, **kwargs)
target.{name} = signalled
main_guard(lambda: train.main(sys.argv[1:]))
"""


def popen_signalled(tmp_path, args, module, name, nth):
    script = tmp_path / "signalled_train.py"
    script.write_text(
        SIGNAL_AT_CALL.format(repo=str(REPO), train=str(REPO / "train.py"), module=module, name=name, nth=nth)
    )
    return subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script), *args],
        cwd=REPO,
        env=child_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.mark.slow
@pytest.mark.parametrize("last", [False, True], ids=["mid_run", "last_step"])
def test_a_signal_during_evaluation_drops_it_and_saves_the_step(tmp_path, last):
    """Rank 1 is signalled as it starts the first of its 8 chunks of step 2's evaluation: no rank
    starts another chunk, the step is saved without its evaluation, and the run exits 75; at the
    run's last step it is done, exits 0, and says the evaluation was dropped."""
    out = tmp_path / "run"
    args = [
        *TWENTY[2],
        "--eval-every",
        "2",
        "--eval-examples",
        "64",
        "--micro-batch-size",
        "4",
        "--out-dir",
        str(out),
        *(["--max-steps", "2"] if last else []),
    ]
    proc = popen_signalled(tmp_path, args, "latentwire.eval.evaluation", "evaluate_chunk", nth=1)
    if last:
        assert proc.returncode == 0 and "dropped step 2's evaluation; the run is done" in proc.stderr, proc.stderr
    else:
        assert "exiting with code 75" in proc.stdout and "exitcode  : 75" in proc.stderr, proc.stdout + proc.stderr
    assert "a call after the signal" not in proc.stderr
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002"]
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2] and "eval_nll_wire_llama" not in records[-1]


@pytest.mark.slow
def test_a_signal_while_loading_saves_the_start_and_resumes_exactly(tmp_path, straight):
    """Rank 1 is signalled while it reads its second LLM: the ranks agree before the first step,
    save step 0 (what --resume needs) without training, and the resumed run is the unbroken one."""
    out = tmp_path / "run"
    proc = popen_signalled(tmp_path, [*TWENTY[2], "--out-dir", str(out)], "latentwire.llm", "read_weights", nth=2)
    assert "saving step 0" in proc.stdout and "exitcode  : 75" in proc.stderr, proc.stdout + proc.stderr
    assert [p.name for p in list_checkpoints(out)] == ["step_00000000"]
    assert not (out / "metrics.jsonl").exists() or not read_metrics(out)
    ok(run_train([*TWENTY[2], "--out-dir", str(out), "--resume"], nproc=2))
    assert_same_run(straight(2), out, 0)


@pytest.mark.slow
def test_kill_9_never_leaves_a_partial_checkpoint_to_resume_from(tmp_path):
    """SIGKILL at random moments of a run that checkpoints every step (so many kills land inside a
    write): every step_* directory is complete, and --resume starts from the newest of them."""
    rng = random.Random(0)
    out = tmp_path / "run"
    args = [*RUN, "--max-steps", "60", "--checkpoint-every", "1", "--keep-checkpoints", "2", "--out-dir", str(out)]
    for trial in range(4):
        proc = popen_train(args + (["--resume"] if list_checkpoints(out) else []))
        wait_for_step(out, 1, proc)
        time.sleep(rng.uniform(0.2, 2.0))
        proc.kill()
        proc.wait()
        checkpoints = list_checkpoints(out)
        assert checkpoints, f"trial {trial}: no checkpoint"
        for path in checkpoints:
            load_checkpoint(path, rank=0)  # raises on a partial checkpoint
    newest = int(list_checkpoints(out)[-1].name.split("_")[1])
    proc = ok(run_train(args + ["--resume", "--max-steps", "60", "--stop-at-step", str(newest + 1)]))
    assert f"step {newest}," in proc.stdout  # "resumed from ... (step N, ..."


def test_a_kill_while_pruning_leaves_every_step_directory_complete(tmp_path, monkeypatch):
    """Deleting a checkpoint takes a call per file; a job killed between them (here: the delete
    stops after one file) must not leave a step_ directory with files missing, which resume would
    take for a complete checkpoint. (The kill -9 test above caught this once in CI, by chance.)"""
    import shutil
    from pathlib import Path

    from latentwire.harness import checkpoint

    files = {"meta.json", "trainable.safetensors", "train_state.pt", "rng_rank0.pt"}
    for step in (1, 2, 3):
        path = checkpoint.checkpoint_dir(tmp_path, step)
        path.mkdir(parents=True)
        for name in files:
            (path / name).write_text("x")

    def killed_midway(path, ignore_errors=False):
        path = Path(path)
        if path.exists():
            next(path.iterdir()).unlink()
            raise KeyboardInterrupt("killed")

    monkeypatch.setattr(shutil, "rmtree", killed_midway)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.prune_checkpoints(tmp_path, keep=2)
    monkeypatch.undo()
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000002", "step_00000003"]
    for path in list_checkpoints(tmp_path):
        assert {p.name for p in path.iterdir()} == files
    checkpoint.prune_checkpoints(tmp_path, keep=1)  # the next prune also clears what the kill left
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000003"]


def test_an_old_checkpoint_that_cannot_be_removed_is_a_warning(tmp_path, monkeypatch, capsys):
    """Pruning runs after a successful save: a checkpoint it cannot remove (a busy NFS file) stays,
    and the run goes on."""
    import errno
    import os

    from latentwire.harness import checkpoint

    for step in (1, 2):
        checkpoint.checkpoint_dir(tmp_path, step).mkdir(parents=True)

    def busy(src, dst):
        raise OSError(errno.EBUSY, os.strerror(errno.EBUSY))

    monkeypatch.setattr(os, "replace", busy)
    checkpoint.prune_checkpoints(tmp_path, keep=1)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000001", "step_00000002"]
    assert "warning: could not remove old checkpoint" in capsys.readouterr().err


@pytest.mark.slow
def test_corrupt_newest_checkpoint_falls_back_with_a_warning(tmp_path):
    out = tmp_path / "run"
    args = [*RUN, "--max-steps", "6", "--checkpoint-every", "2", "--out-dir", str(out)]
    ok(run_train(args + ["--stop-at-step", "4"]))
    newest = list_checkpoints(out)[-1]
    (newest / "trainable.safetensors").write_bytes(b"\0" * 100)
    proc = ok(run_train(args + ["--resume"]))
    assert "warning: skipping unreadable checkpoint" in proc.stderr and "step_00000004" in proc.stderr
    assert "resumed from" in proc.stdout and "step_00000002" in proc.stdout


def test_no_usable_checkpoint_is_a_clear_error(tmp_path, forked):
    out = tmp_path / "run"
    bad = out / "checkpoints" / "step_00000003"
    bad.mkdir(parents=True)
    (bad / "meta.json").write_text("{")
    before = sorted(p.name for p in bad.iterdir())
    proc = forked("train.py", [*RUN, "--max-steps", "6", "--out-dir", out, "--resume"])
    assert_one_line_error(proc, "no usable checkpoint to resume from", "step_00000003", "JSONDecodeError")
    assert proc.returncode == 2
    assert sorted(p.name for p in bad.iterdir()) == before


def run_with_fault(tmp_path, fault: str, args) -> subprocess.CompletedProcess:
    """train.py as `python train.py ARGS`, with `fault` (Python source, `train` imported) injected."""
    script = tmp_path / "faulty_train.py"
    script.write_text(
        "\n".join(
            [
                "import sys",
                f"sys.path.insert(0, {str(REPO)!r}); sys.argv[0] = {str(REPO / 'train.py')!r}",
                "import train",
                "from latentwire.harness.exits import main_guard",
                fault,
                "main_guard(lambda: train.main(sys.argv[1:]))",
            ]
        )
    )
    return subprocess.run(
        [sys.executable, str(script), *args], cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=300
    )


NAN_AT = """
import latentwire.recipe as recipe
real, calls = recipe.forward_loss_sums, [0]
def poisoned(*args):
    calls[0] += 1
    out = real(*args)
    return out * float("nan") if calls[0] in {bad} else out
recipe.forward_loss_sums = poisoned
"""


def run_with_nan(tmp_path, bad_calls, args):
    return run_with_fault(tmp_path, NAN_AT.format(bad=set(bad_calls)), args)


@pytest.mark.slow
def test_a_non_finite_step_is_skipped_and_counted(tmp_path):
    args = [*RUN, "--grad-accum-steps", "1", "--max-steps", "5"]
    clean, poisoned = tmp_path / "clean", tmp_path / "poisoned"
    ok(run_train([*args, "--out-dir", str(clean), "--stop-at-step", "2"]))
    ok(run_with_nan(tmp_path, {3}, [*args, "--out-dir", str(poisoned)]))  # step 3's forward
    metrics = read_metrics(poisoned)
    assert [m["skipped_steps"] for m in metrics] == [0, 0, 1, 1, 1]
    assert math.isnan(metrics[2]["grad_norm"]) and math.isnan(metrics[2]["loss"])
    # Step 3 left the weights as step 2 made them: compare with the clean run stopped at 2.
    ok(run_with_nan(tmp_path, {3}, [*args, "--out-dir", str(tmp_path / "to3"), "--stop-at-step", "3"]))
    a, b = final_weights(clean), final_weights(tmp_path / "to3")
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_non_finite_steps_in_a_row_stop_the_run_cleanly(tmp_path):
    out = tmp_path / "run"
    proc = run_with_nan(
        tmp_path,
        {2, 3, 4},
        [*RUN, "--grad-accum-steps", "1", "--max-steps", "12", "--max-nonfinite-steps", "3", "--out-dir", str(out)],
    )
    assert_one_line_error(proc, "3 non-finite steps in a row")
    assert proc.returncode == 3
    assert [p.name for p in list_checkpoints(out)] == ["step_00000004"]
    # the saved weights are step 1's: the three bad steps never touched them
    ok(
        run_train(
            [
                *RUN,
                "--grad-accum-steps",
                "1",
                "--max-steps",
                "12",
                "--stop-at-step",
                "1",
                "--out-dir",
                str(tmp_path / "one"),
            ]
        )
    )
    a, b = final_weights(out), final_weights(tmp_path / "one")
    assert all(torch.equal(a[k], b[k]) for k in a)


# The optimizer's step 3 runs with a NaN learning rate: its gradient is finite, the weights it
# leaves are not.
NAN_LR_AT_STEP_3 = """
import torch
real_step, calls = torch.optim.AdamW.step, [0]
def nan_lr_step(self, *args, **kwargs):
    calls[0] += 1
    if calls[0] == 3:
        for group in self.param_groups:
            group["lr"] = float("nan")
    return real_step(self, *args, **kwargs)
torch.optim.AdamW.step = nan_lr_step
"""


@pytest.mark.slow
def test_non_finite_weights_are_never_saved(tmp_path):
    out = tmp_path / "run"
    proc = run_with_fault(
        tmp_path,
        NAN_LR_AT_STEP_3,
        [*RUN, "--grad-accum-steps", "1", "--max-steps", "6", "--checkpoint-every", "2", "--out-dir", str(out)],
    )
    assert_one_line_error(proc, "the weights are not finite at step 4", "newest good checkpoint is step_00000002")
    assert proc.returncode == 3
    assert [p.name for p in list_checkpoints(out)] == ["step_00000002"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_00000002"]


RAISE_ON_RANK_1 = """
import os, sys
sys.path.insert(0, {repo!r}); sys.argv[0] = {train!r}
import train
import latentwire.recipe as recipe
real, calls = recipe.forward_loss_sums, [0]
def failing(*args):
    calls[0] += 1
    if os.environ["RANK"] == "1" and calls[0] == 3:
        raise RuntimeError("injected failure on rank 1")
    return real(*args)
recipe.forward_loss_sums = failing
train.main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_rank_that_raises_ends_the_whole_job(tmp_path):
    script = tmp_path / "fail_train.py"
    script.write_text(RAISE_ON_RANK_1.format(repo=str(REPO), train=str(REPO / "train.py")))
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node=2",
        str(script),
        *RUN,
        "--max-steps",
        "50",
        "--micro-batch-size",
        "2",
        "--dist-timeout-s",
        "60",
        "--out-dir",
        str(tmp_path / "run"),
    ]
    # The guard is the subprocess timeout: a hang would exceed it; torchrun stops rank 0 at once.
    proc = subprocess.run(cmd, cwd=REPO, env=child_env(), capture_output=True, text=True, timeout=240)
    assert proc.returncode != 0
    assert "injected failure on rank 1" in proc.stderr


# The first step fails; an exit hook registered then, so that it runs before torch's own (atexit
# runs the newest first), says how many of the loader's worker processes are still alive.
FAIL_FIRST_STEP = """
import atexit, multiprocessing, sys, torch
def failing(*args):
    alive = lambda: len(multiprocessing.active_children())
    atexit.register(lambda: print(f"workers at exit: {{alive()}}", file=sys.stderr))
    raise {error}
import latentwire.recipe as recipe
recipe.forward_loss_sums = failing
"""


@pytest.mark.parametrize(
    "error, code", [("RuntimeError('the step failed')", 1), ("torch.OutOfMemoryError('CUDA out of memory')", 5)]
)
def test_a_failed_run_stops_its_loader_workers_before_it_exits(tmp_path, error, code):
    """A failed run's loader workers are stopped before the interpreter exits, so no exit-time
    join can hold the exit: torch 2.11 joins each persistent, pinned-memory worker for 5 s at
    exit (three failed H100 runs took 40 s more than their traceback with 8 workers, and two were
    killed for it). The CPU has no pinned memory, so it exits at once either way; what it shows
    is the workers still alive at exit without the fix."""
    proc = run_with_fault(
        tmp_path,
        FAIL_FIRST_STEP.format(error=error),
        [*RUN, "--num-workers", "2", "--max-steps", "2", "--out-dir", str(tmp_path / "run")],
    )
    assert proc.returncode == code, proc.stderr
    assert "workers at exit: 0" in proc.stderr, proc.stderr


# --- bad input: exit code, one line, nothing on disk changed ----------------------------------


def snapshot(root):
    """Every path under root (directories as None) and every file's bytes: a refusal adds nothing either."""
    return {p: None if p.is_dir() else p.read_bytes() for p in sorted(root.rglob("*"))}


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("done") / "run"
    ok(run_train([*RUN, "--max-steps", "2", "--out-dir", str(out)]))
    return out


def test_out_dir_with_a_run_needs_resume_or_overwrite(finished_run, forked):
    before = snapshot(finished_run)
    proc = forked("train.py", [*RUN, "--max-steps", "2", "--out-dir", finished_run])
    assert_one_line_error(proc, "already holds a run", "--resume", "--overwrite")
    assert snapshot(finished_run) == before


def write(path, text):
    path.write_text(text)
    return str(path)


def model_dir(tmp_path, config: dict) -> str:
    """A model directory holding only a config.json."""
    (tmp_path / "model").mkdir()
    write(tmp_path / "model" / "config.json", json.dumps(config))
    return str(tmp_path / "model")


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (lambda t: ["--dataset", str(t / "missing.jsonl")], "does not exist"),
        (lambda t: ["--dataset", write(t / "empty.jsonl", "")], "has no examples"),
        (lambda t: ["--dataset", write(t / "bad.jsonl", '{"context": "c", "question": "q"}\n')], "'answers.text'"),
        (lambda t: ["--dataset", "imagenet"], "unknown dataset 'imagenet'"),
        (lambda t: ["--llama", str(t / "no_such_model_dir")], "does not exist"),
        (
            lambda t: ["--llama", model_dir(t, {"model_type": "no_such_architecture"})],
            "does not recognize this architecture",
        ),
        (lambda t: ["--llama", model_dir(t, {"model_type": "llama"})], "cannot load the tokenizer of model"),
        (lambda t: ["--qwen", model_dir(t, {"model_type": "qwen2"})], "has no .safetensors weights"),
        (lambda t: ["--micro-batch-size", "0"], "must be > 0"),
        (lambda t: ["--grad-accum-steps", "0"], "must be > 0"),
        (lambda t: ["--lr", "-1"], "'lr' must be > 0"),
        (lambda t: ["--precision", "int8"], "'precision' must be one of"),
        (lambda t: ["--max-steps", "3", "--resume"], "no usable checkpoint"),
        # Checked after the models load: still before --overwrite deletes anything.
        (lambda t: ["--num-examples", "4"], "dataset of 4 examples is smaller than one global batch"),
    ],
)
def test_bad_input_leaves_an_existing_run_untouched(finished_run, tmp_path, forked, flags, fragment):
    before = snapshot(finished_run)
    args = [*RUN, "--max-steps", "2", "--out-dir", str(finished_run), "--overwrite", *flags(tmp_path)]
    if "--resume" in args:
        args.remove("--overwrite")
        args[args.index(str(finished_run))] = str(tmp_path / "fresh")
    assert_one_line_error(forked("train.py", args), fragment)
    assert snapshot(finished_run) == before


@pytest.mark.parametrize(
    "flags, fragment",
    [
        (["--max-steps", "3"], "--max-steps 3 (the run's: 2)"),
        (["--max-steps", "2", "--stop-at-step", "1"], "--stop-at-step 1 is not after the resumed step 2"),
        # The checkpoint's optimizer and schedule would override these silently.
        (
            ["--max-steps", "2", "--lr", "0.5"],
            f"--lr 0.5 (the run's: {load_config(['--profile', 'cpu']).optimizer.lr})",
        ),
        (
            ["--max-steps", "2", "--weight-decay", "0.5", "--adam-beta1", "0.5"],
            "--weight-decay 0.5 (the run's: 0.01), --adam-beta1 0.5 (the run's: 0.9)",
        ),
        (["--max-steps", "2", "--num-latents", "3"], "--num-latents 3 (the run's: 16)"),
        (["--max-steps", "2", "--precision", "bf16"], "--precision bf16 (the run's: fp32)"),  # the grad scaler's state
    ],
)
def test_resume_that_cannot_continue_the_run_is_one_line(finished_run, forked, flags, fragment):
    """Refused from the checkpoint's meta.json, before the LLMs load and the teacher's targets are
    computed (minutes on a GPU profile), and nothing on disk changed."""
    before = snapshot(finished_run)
    proc = forked("train.py", [*RUN, "--out-dir", finished_run, "--resume", *flags])
    assert_one_line_error(proc, fragment)
    assert "loaded the frozen LLMs" not in proc.stdout and "distillation targets" not in proc.stdout, proc.stdout
    assert snapshot(finished_run) == before


def test_a_resume_refused_for_an_edited_profile_names_the_profile_not_a_flag(finished_run, tmp_path, forked):
    """Nobody gave --lr: the line names the profile and its file, where the value changed."""
    profiles = json.loads(DEFAULT_PROFILES.read_text())
    profiles["cpu"]["lr"] = 0.002
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(profiles))
    proc = forked("train.py", [*RUN, "--max-steps", "2", "--out-dir", finished_run, "--resume", "--hw-profiles", path])
    line = assert_one_line_error(proc, f"lr 0.002 from profile 'cpu' of {path} (the run's: 0.001)")
    assert "--lr" not in line


@pytest.mark.slow
def test_init_from_starts_a_new_run_from_a_trained_wire(finished_run, tmp_path):
    """--init-from RUN: a new run whose trainable weights are the run's newest checkpoint's (at an
    lr of 1e-30 Adam's steps round away, so its weights stay those bit for bit), with its own
    schedule, said and recorded; stopped and resumed (with the flag still given, as a requeued job
    gives it), it continues from its own checkpoint."""
    out = tmp_path / "extended"
    args = [*RUN, "--max-steps", "2", "--lr", "1e-30", "--init-from", str(finished_run), "--out-dir", str(out)]
    first = ok(run_train([*args, "--stop-at-step", "1"]))
    assert f"init: the trainable weights of {list_checkpoints(finished_run)[-1]}" in first.stdout
    meta = json.loads((list_checkpoints(out)[-1] / "meta.json").read_text())
    assert meta["init_from"] == str(list_checkpoints(finished_run)[-1]) and meta["config"]["lr"] == 1e-30
    resumed = ok(run_train([*args, "--resume"]))
    assert "init:" not in resumed.stdout and "resumed from" in resumed.stdout
    meta = json.loads((list_checkpoints(out)[-1] / "meta.json").read_text())
    assert meta["step"] == 2 and meta["init_from"] == str(list_checkpoints(finished_run)[-1])  # every checkpoint's
    a, b = final_weights(finished_run), final_weights(out)
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_a_resume_cannot_mix_datasets_unless_asked_for_a_fresh_epoch(tmp_path):
    """Stopped at step 2 on file a; resumed on file b, or on a changed in place: refused in one line
    naming both, nothing on disk changed. --new-data takes b from a fresh epoch, and says so."""
    files = {}
    for name, seed in (("a", 0), ("b", 1)):
        files[name] = tmp_path / f"{name}.jsonl"
        files[name].write_text("".join(json.dumps(ex) + "\n" for ex in synthetic_examples(256, seed)))
    out, args = tmp_path / "run", [*RUN, "--max-steps", "4", "--num-examples", "1000"]
    first = ok(run_train([*args, "--dataset", str(files["a"]), "--out-dir", str(out), "--stop-at-step", "2"]))
    assert f"held out: a seeded 10% of {files['a']} (at least one example) that training never sees" in first.stdout
    assert read_metrics(out)[0]["train_examples"] == 256 - 26
    before = snapshot(out)
    refused = run_train([*args, "--dataset", str(files["b"]), "--out-dir", str(out), "--resume"])
    line = assert_one_line_error(
        refused,
        "--resume on other training data",
        f"trained on {files['a']} (230 examples",
        f"this run loads {files['b']} (230 examples",
        "--new-data",
    )
    assert refused.returncode == 2 and snapshot(out) == before
    files["a"].write_text(files["a"].read_text().replace("Which city", "What city"))  # the same path, changed
    again = assert_one_line_error(
        run_train([*args, "--dataset", str(files["a"]), "--out-dir", str(out), "--resume"]),
        f"trained on {files['a']}",
        f"this run loads {files['a']}",
    )
    assert again != line and snapshot(out) == before
    new = [*args, "--dataset", str(files["b"]), "--out-dir", str(out), "--resume", "--new-data"]
    proc = ok(run_train([*new, "--stop-at-step", "3"]))
    assert f"(step 2, epoch 1, 0 examples into it); --new-data: a fresh epoch of {files['b']}" in proc.stdout
    # The same flags again (a requeued job's): the data is the checkpoint's now, so its position holds.
    proc = ok(run_train(new))
    assert "(step 3, epoch 1, 8 examples into it)" in proc.stdout and "a fresh epoch" not in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_mixture_resumes_bitwise_and_another_weight_or_source_is_other_data(tmp_path):
    """Two files drawn 3:1, stopped at step 2 and resumed: bitwise the unbroken run, which says in
    its first record and meta.json what each source gave and drew, and evaluates each. Resumed with
    another weight, or on one of the files alone: refused in one line, nothing on disk changed."""
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    for path, seed in ((a, 0), (b, 1)):
        path.write_text("".join(json.dumps(ex) + "\n" for ex in synthetic_examples(64, seed)))
    args = [*RUN, "--max-steps", "4", "--dataset", f"{a}:0.75,{b}:0.25", "--eval-every", "4", "--eval-examples", "4"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ok(run_train([*args, "--out-dir", str(straight)]))
    ok(run_train([*args, "--out-dir", str(split), "--stop-at-step", "2"]))
    ok(run_train([*args, "--out-dir", str(split), "--resume"]))
    assert_same_run(straight, split, 2)
    first, last = read_metrics(straight)[0], read_metrics(straight)[-1]
    sources = {  # 4 steps of 8: whole periods of 4, 3 of a and 1 of b each
        "a": {"examples": 58, "weight": 0.75, "share_of_draws": 0.75},
        "b": {"examples": 58, "weight": 0.25, "share_of_draws": 0.25},
    }
    assert first["train_sources"] == sources and first["train_examples"] == 116
    meta = json.loads((list_checkpoints(straight)[-1] / "meta.json").read_text())
    assert meta["data_sources"] == sources and [s["weight"] for s in meta["data"]["sources"]] == ["3/4", "1/4"]
    assert {"eval_em_wire_joint", "eval_a/em_wire_joint", "eval_b/em_wire_joint"} <= set(last)
    before = snapshot(split)
    for other in (f"{a}:0.5,{b}:0.5", str(a)):
        refused = run_train([*args, "--dataset", other, "--out-dir", str(split), "--resume"])
        assert_one_line_error(refused, "--resume on other training data", "116 examples")
        assert refused.returncode == 2 and snapshot(split) == before


def test_resuming_a_finished_run_changes_nothing(finished_run, forked):
    newest = list_checkpoints(finished_run)[-1]
    before, inode = snapshot(finished_run), newest.stat().st_ino
    proc = ok(forked("train.py", [*RUN, "--max-steps", "2", "--out-dir", finished_run, "--resume"]))
    assert "the run's last step (2): nothing to do" in proc.stdout
    assert snapshot(finished_run) == before and newest.stat().st_ino == inode  # not even rewritten


def test_a_hub_dataset_offline_is_one_line(finished_run, tmp_path):
    before = snapshot(finished_run)
    proc = run_train(
        [*RUN, "--max-steps", "2", "--out-dir", str(finished_run), "--overwrite", "--dataset", "squad"],
        HF_HUB_OFFLINE="1",
        HF_HOME=str(tmp_path / "empty_cache"),
    )
    assert_one_line_error(proc, "cannot load dataset squad", "Hugging Face Hub")
    assert snapshot(finished_run) == before


def test_out_dir_that_cannot_be_created(tmp_path, forked):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    proc = forked("train.py", [*RUN, "--max-steps", "2", "--out-dir", blocker / "run"])
    assert_one_line_error(proc, "cannot be created", "not a writable directory")
    assert blocker.read_text() == "not a directory"


FAIL_SECOND_SAVE = """
import errno, safetensors.torch
real, calls = safetensors.torch.save_file, [0]
def full_disk(*args, **kwargs):
    calls[0] += 1
    if calls[0] == 2:
        raise OSError(errno.ENOSPC, "No space left on device")
    return real(*args, **kwargs)
safetensors.torch.save_file = full_disk
"""


@pytest.mark.slow
def test_a_failing_checkpoint_write_is_one_line_and_keeps_earlier_checkpoints(tmp_path):
    out = tmp_path / "run"
    proc = run_with_fault(
        tmp_path, FAIL_SECOND_SAVE, [*RUN, "--max-steps", "6", "--checkpoint-every", "2", "--out-dir", str(out)]
    )
    assert_one_line_error(proc, "saving checkpoint step_00000004 failed", "No space left on device")
    assert proc.returncode == 4
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]  # no temporary left
    load_checkpoint(out / "checkpoints" / "step_00000002", rank=0)


@pytest.fixture
def small_disk(tmp_path):
    """`small_disk(bytes)`: a tmpfs of that size (tests run as root in CI; skipped where mounting
    is refused), unmounted afterwards."""
    mounts = []

    def mount(size: int):
        path = tmp_path / f"disk{len(mounts)}"
        path.mkdir()
        proc = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True
        )
        if proc.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
        mounts.append(path)
        return path

    yield mount
    for path in mounts:
        subprocess.run(["umount", str(path)], check=True)


@pytest.mark.slow
@pytest.mark.parametrize("fills_in", ["trainable.safetensors", "train_state.pt"])
def test_a_full_disk_during_a_checkpoint_exits_4_and_leaves_no_partial_write(finished_run, small_disk, fills_in):
    """A real full disk: room for one checkpoint and part of the next, which runs out of space in
    safetensors' writer (a SafetensorError) or in torch.save (a RuntimeError), not an OSError."""
    files = {p.name: p.stat().st_size for p in list_checkpoints(finished_run)[-1].iterdir()}
    order = ["rng_rank0.pt", "trainable.safetensors", "train_state.pt"]  # as save_checkpoint writes them
    room = sum(files.values()) + sum(files[name] for name in order[: order.index(fills_in)]) + files[fills_in] // 2
    out = small_disk(room + 64 * 1024) / "run"  # and the metrics and TensorBoard files
    proc = run_train([*RUN, "--max-steps", "4", "--checkpoint-every", "2", "--out-dir", str(out)])
    assert_one_line_error(
        proc, "saving checkpoint step_00000004 failed", "MiB free there", "earlier checkpoints are intact"
    )
    assert proc.returncode == 4
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]  # no temporary left
    load_checkpoint(out / "checkpoints" / "step_00000002", rank=0)


@pytest.mark.slow
def test_resume_on_another_layout_keeps_the_sample_order(tmp_path, straight):
    """1 process x mbs 4 x accum 2 stopped at 10, resumed on 2 ranks x mbs 2 x accum 2: the same
    global batches, so the same weights up to rounding, and a note that it is not bitwise."""
    args, moved = TWENTY[1], tmp_path / "moved"
    ok(run_train([*args, "--out-dir", str(moved), "--stop-at-step", "10"]))
    proc = ok(run_train([*args, "--out-dir", str(moved), "--resume", "--micro-batch-size", "2"], nproc=2))
    assert "bitwise identical to an unbroken one only for the same layout" in proc.stderr
    from conftest import max_rel_diff

    assert max_rel_diff(final_weights(straight(1)), final_weights(moved)) < 1e-4
    for a, b in zip(read_metrics(straight(1)), read_metrics(moved), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)


# --- what a scheduler or a person does that nobody expects -------------------------------------------


@pytest.mark.slow
def test_a_second_run_in_the_same_directory_is_refused_and_the_first_is_untouched(tmp_path):
    """A second run started on a directory a run is using (an sbatch sent twice, a second terminal)
    is one line and exit 2 before anything heavy loads; the first trains on, saves and resumes from
    its own checkpoints."""
    out = tmp_path / "run"
    args = [*RUN, "--max-steps", "200", "--checkpoint-every", "2", "--out-dir", str(out)]
    first = popen_train(args)
    wait_for_step(out, 2, first)
    second = run_train([*args, "--resume"])
    assert_one_line_error(second, f"{out} is in use by another run")
    assert "data:" not in second.stdout
    first.send_signal(signal.SIGTERM)
    stdout, stderr = first.communicate(timeout=120)
    assert first.returncode == 75, stdout + stderr
    logged = [m["step"] for m in read_metrics(out)]
    assert logged == list(range(1, logged[-1] + 1)) and list_checkpoints(out)[-1].name == f"step_{logged[-1]:08d}"
    ok(run_train([*args, "--stop-at-step", str(logged[-1] + 1), "--resume"]))


@pytest.fixture
def read_only_checkpoints():
    """An out_dir this user may write whose checkpoints/ it may not, and the command's prefix and
    environment: as root (who may write anywhere) the command runs as nobody, in a directory nobody
    owns below one anyone may search (pytest's own are root's alone)."""
    top = Path(tempfile.mkdtemp(prefix="latentwire-read-only-"))
    top.chmod(0o755)
    out, home = top / "run", top / "home"
    (out / "checkpoints").mkdir(parents=True)
    home.mkdir()
    prefix = []
    if os.geteuid() == 0:
        for path in (out, home):
            os.chown(path, NOBODY, NOBODY)
        prefix = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
    (out / "checkpoints").chmod(0o555)
    yield out, prefix, {"HOME": str(home)}
    (out / "checkpoints").chmod(0o755)
    shutil.rmtree(top, ignore_errors=True)


@pytest.mark.slow
def test_a_checkpoint_directory_the_run_cannot_write_is_refused_before_it_trains(read_only_checkpoints):
    """Found when the run starts (exit 2, one line), not at its first save after the training."""
    out, prefix, env = read_only_checkpoints
    proc = subprocess.run(
        [*prefix, sys.executable, str(REPO / "train.py"), *RUN, "--max-steps", "2", "--out-dir", str(out)],
        cwd=REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert_one_line_error(proc, f"the checkpoint directory {out / 'checkpoints'} cannot be created")
    assert proc.returncode == 2 and "loaded the frozen LLMs" not in proc.stdout


# The second checkpoint's temporary directory cannot be made (a mount gone read-only, a quota).
READ_ONLY_AT_SECOND_SAVE = """
import errno, pathlib
real, saves = pathlib.Path.mkdir, set()
def mkdir(self, *args, **kwargs):
    if self.name.endswith(".tmp") and self.name.startswith(".step_"):
        saves.add(self.name)
        if len(saves) == 2:
            raise OSError(errno.EROFS, "Read-only file system", str(self))
    return real(self, *args, **kwargs)
pathlib.Path.mkdir = mkdir
"""


@pytest.mark.slow
@pytest.mark.parametrize("nproc", [1, 2])
def test_a_checkpoint_write_that_fails_later_is_exit_4_on_every_rank(tmp_path, nproc):
    """The temporary directory's mkdir, on one process and under launch.sh on 2 ranks: one line,
    exit 4, the earlier checkpoint intact, no rank left waiting for rank 0."""
    out = tmp_path / "run"
    (tmp_path / "fault").mkdir()
    (tmp_path / "fault" / "sitecustomize.py").write_text(READ_ONLY_AT_SECOND_SAVE)
    args = [*RUN, "--max-steps", "6", "--checkpoint-every", "2", "--micro-batch-size", "2", "--out-dir", str(out)]
    command = [sys.executable, str(REPO / "train.py")] if nproc == 1 else [str(REPO / "launch.sh")]
    proc = subprocess.run(
        [*command, *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        env=child_env(PYTHONPATH=str(tmp_path / "fault"), PYTHON=sys.executable, NPROC_PER_NODE=str(nproc)),
    )
    assert_one_line_error(
        proc, "saving checkpoint step_00000004 failed: OSError: Read-only file system", "earlier checkpoints are intact"
    )
    assert proc.returncode == 4
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_00000002"]


@pytest.mark.slow
def test_a_signal_during_the_teacher_pass_stops_it_within_a_batch(tmp_path):
    """Rank 1 is signalled as it starts its first of 40 teacher batches: no rank starts another,
    the run saves its start (step 0) and exits 75, as a signal while loading does."""
    out = tmp_path / "run"
    proc = popen_signalled(tmp_path, [*TWENTY[2], "--out-dir", str(out)], "latentwire.distillation", "to_device", nth=1)
    assert "a call after the signal" not in proc.stderr, proc.stderr
    assert "a signal stopped the distillation teacher's pass" in proc.stdout and "exitcode  : 75" in proc.stderr
    assert [p.name for p in list_checkpoints(out)] == ["step_00000000"]
