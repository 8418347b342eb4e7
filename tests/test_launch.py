"""launch.sh: the CPU run, the SLURM path (with stand-ins for srun and scontrol), bad input, the
run's own exit code, preemption."""
import json
import os
import signal
import subprocess
import sys

import pytest

from conftest import (FAST, REPO, TWENTY, assert_one_line_error, assert_same_run, child_env, ok, read_metrics,
                      wait_for_step)
from latentwire.checkpoint import list_checkpoints


def launch(args, tmp_path, **env):
    return subprocess.run([str(REPO / "launch.sh"), *args], cwd=tmp_path, capture_output=True, text=True,
                          timeout=600, env=child_env(PYTHON=sys.executable, **env))


def popen_launch(args, tmp_path, **env):
    return subprocess.Popen([str(REPO / "launch.sh"), *args], cwd=tmp_path, env=child_env(PYTHON=sys.executable, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def fake_slurm_bin(tmp_path):
    """srun that runs its command here (one node) and records its arguments; scontrol that
    names this machine as the allocation's first node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text('#!/usr/bin/env bash\necho "$@" > "$(dirname "$0")/srun.args"\n'
                                  'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n')
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


@pytest.mark.slow
def test_cpu_launch_runs_two_gloo_processes(tmp_path):
    out = tmp_path / "run"
    proc = ok(launch(["--profile", "cpu", *FAST, "--max-steps", "2", "--micro-batch-size", "2",
                      "--out-dir", str(out)], tmp_path))
    assert "1 node x 2 process(es) (cpu)" in proc.stdout
    assert "2 x cpu" in proc.stdout  # train.py saw a world of two
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_slurm_path_runs_one_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    out = tmp_path / "run"
    proc = ok(launch(["--profile", "cpu", *FAST, "--max-steps", "1", "--micro-batch-size", "2",
                      "--out-dir", str(out)], tmp_path, PATH=f"{bin_dir}:{os.environ['PATH']}",
                     SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_JOB_NODELIST="node[1-2]", MASTER_PORT="29731"))
    srun_args = (bin_dir / "srun.args").read_text()
    assert "--ntasks-per-node=1" in srun_args and "--rdzv_backend=c10d" in srun_args
    assert "--rdzv_endpoint=127.0.0.1:29731" in srun_args and "--rdzv_id=4242" in srun_args
    assert "--nnodes=1 --nproc_per_node=2" in srun_args
    assert "SLURM job 4242" in proc.stdout and [m["step"] for m in read_metrics(out)] == [1]


def test_missing_or_unknown_profile_is_one_line(tmp_path):
    for args, fragment in (([], "needs --profile"), (["--profile", "nope"], "unknown profile 'nope'")):
        proc = launch(args, tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and fragment in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_gpu_profile_without_gpu_is_one_line(tmp_path):
    proc = launch(["--profile", "h100"], tmp_path, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr


@pytest.mark.slow
def test_slurm_preemption_saves_requeues_and_the_requeued_job_resumes(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    (bin_dir / "scontrol").write_text('#!/usr/bin/env bash\nif [[ "$1" == requeue ]]; then echo "$@" > '
                                      '"$(dirname "$0")/requeued"; else echo 127.0.0.1; fi\n')
    out = tmp_path / "run"
    args = ["--profile", "cpu", *FAST, "--max-steps", "40", "--micro-batch-size", "2", "--out-dir", str(out)]
    env = dict(PATH=f"{bin_dir}:{os.environ['PATH']}", SLURM_JOB_ID="77", SLURM_NNODES="1",
               SLURM_JOB_NODELIST="node1", MASTER_PORT="29732")
    job = popen_launch(args, tmp_path, **env)
    wait_for_step(out, 3, job)
    job.send_signal(signal.SIGUSR1)  # SLURM's warning before the time limit (--signal=B:USR1@120)
    stdout, stderr = job.communicate(timeout=120)
    assert "exiting with code 75" in stdout and "requeueing job 77" in stdout, stdout + stderr
    assert job.returncode == 75 and "Traceback" not in stderr, stderr
    assert (bin_dir / "requeued").read_text().split() == ["requeue", "77"]
    saved = int(sorted((out / "checkpoints").iterdir())[-1].name.split("_")[1])
    # The requeued job: same command, SLURM_RESTART_COUNT set; it adds --resume itself.
    proc = ok(launch(args, tmp_path, SLURM_RESTART_COUNT="1", **env))
    assert f"(step {saved}," in proc.stdout
    assert [m["step"] for m in read_metrics(out)][-1] == 40


@pytest.mark.slow
def test_sigterm_to_launch_sh_with_loader_workers_saves_the_step_and_resumes_exactly(tmp_path, straight):
    """2 ranks with 2 loader workers each: the run's own code 75 (plain torchrun exits 1), the
    step that was running saved, and the resumed run bitwise the unbroken one."""
    args, out = [*TWENTY[2], "--checkpoint-every", "100", "--num-workers", "2"], tmp_path / "cut"
    job = popen_launch([*args, "--out-dir", str(out)], tmp_path)
    wait_for_step(out, 4, job)
    job.send_signal(signal.SIGTERM)
    stdout, stderr = job.communicate(timeout=120)
    assert job.returncode == 75 and "Traceback" not in stderr, stdout + stderr
    logged = max(m["step"] for m in read_metrics(out))
    assert [p.name for p in list_checkpoints(out)] == [f"step_{logged:08d}"]
    ok(launch([*args, "--out-dir", str(out), "--resume"], tmp_path))
    assert_same_run(straight(2), out, logged)


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_bad_input_is_one_line_with_the_run_s_exit_code(tmp_path, nproc):
    """Each rank refuses it; launch.sh prints the line once and exits 2, not torchrun's 1."""
    proc = launch(["--profile", "cpu", "--lr", "-1"], tmp_path, NPROC_PER_NODE=nproc)
    assert_one_line_error(proc, "--lr: field 'lr' must be > 0")
    assert proc.returncode == 2


def test_a_profile_from_another_file(tmp_path):
    """--hw-profiles FILE names the profile launch.sh looks up, as it does train.py's."""
    profiles = tmp_path / "mine.json"
    profiles.write_text(json.dumps({**json.loads((REPO / "hw_profiles.json").read_text()),
                                    "mycpu": {"extends": "cpu", "description": "mine"}}))
    proc = launch(["--profile", "mycpu", "--hw-profiles", str(profiles), "--lr", "-1"], tmp_path, NPROC_PER_NODE="1")
    assert_one_line_error(proc, "--lr: field 'lr' must be > 0")  # train.py found mycpu in the file too

