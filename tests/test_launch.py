"""launch.sh: the CPU run, the SLURM path (with stand-ins for srun and scontrol), two nodes without
SLURM (on this machine, and across a network namespace), bad input, the run's own exit code,
preemption."""

import json
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
from contextlib import contextmanager

import pytest

from conftest import (
    FAST,
    REPO,
    TWENTY,
    assert_one_line_error,
    assert_same_run,
    child_env,
    exit_and_leftovers,
    free_port,
    ok,
    processes_mentioning,
    rank_pid,
    read_metrics,
    wait_for_step,
)
from latentwire.harness.checkpoint import list_checkpoints


def launch(args, tmp_path, **env):
    return subprocess.run(
        [str(REPO / "launch.sh"), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=600,
        env=child_env(PYTHON=sys.executable, **env),
    )


def popen_launch(args, tmp_path, **env):
    return subprocess.Popen(
        [str(REPO / "launch.sh"), *args],
        cwd=tmp_path,
        env=child_env(PYTHON=sys.executable, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def fake_slurm_bin(tmp_path):
    """srun that runs its command here (one node) and records its arguments; scontrol that
    names this machine as the allocation's first node."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "srun").write_text(
        '#!/usr/bin/env bash\necho "$@" > "$(dirname "$0")/srun.args"\n'
        'while [[ "$1" == --* ]]; do shift; done\nexec "$@"\n'
    )
    (bin_dir / "scontrol").write_text("#!/usr/bin/env bash\necho 127.0.0.1\n")
    for tool in ("srun", "scontrol"):
        (bin_dir / tool).chmod(0o755)
    return bin_dir


@pytest.mark.slow
def test_cpu_launch_runs_two_gloo_processes(tmp_path):
    out = tmp_path / "run"
    proc = ok(
        launch(
            ["--profile", "cpu", *FAST, "--max-steps", "2", "--micro-batch-size", "2", "--out-dir", str(out)], tmp_path
        )
    )
    assert "1 node x 2 process(es) (cpu)" in proc.stdout
    assert "2 x cpu" in proc.stdout  # train.py saw a world of two
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_slurm_path_runs_one_torchrun_per_node_with_c10d_rendezvous(tmp_path):
    bin_dir = fake_slurm_bin(tmp_path)
    out = tmp_path / "run"
    proc = ok(
        launch(
            ["--profile", "cpu", *FAST, "--max-steps", "1", "--micro-batch-size", "2", "--out-dir", str(out)],
            tmp_path,
            PATH=f"{bin_dir}:{os.environ['PATH']}",
            SLURM_JOB_ID="4242",
            SLURM_NNODES="1",
            SLURM_JOB_NODELIST="node[1-2]",
            MASTER_PORT="29731",
        )
    )
    srun_args = (bin_dir / "srun.args").read_text()
    assert "--ntasks-per-node=1" in srun_args and "--rdzv_backend=c10d" in srun_args
    assert "--rdzv_endpoint=127.0.0.1:29731" in srun_args and "--rdzv_id=4242" in srun_args
    assert "--nnodes=1 --nproc_per_node=2 --max-restarts=3" in srun_args
    assert "SLURM job 4242" in proc.stdout and [m["step"] for m in read_metrics(out)] == [1]


def test_missing_or_unknown_profile_is_one_line(tmp_path):
    for args, fragment in (([], "needs --profile"), (["--profile", "nope"], "unknown profile 'nope'")):
        proc = launch(args, tmp_path)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and fragment in proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


def test_help_prints_the_usage_and_exits_0(tmp_path):
    for args in (["--help"], ["--profile", "cpu", "-h"]):
        proc = launch(args, tmp_path)
        assert proc.returncode == 0 and proc.stderr == "", proc.stderr
        assert proc.stdout.startswith("Launch train.py with torchrun.") and "sbatch" in proc.stdout
        assert "75 preempted" in proc.stdout and "#" not in proc.stdout.splitlines()[0]


def test_gpu_profile_without_gpu_is_one_line(tmp_path):
    proc = launch(["--profile", "h100"], tmp_path, CUDA_VISIBLE_DEVICES="")
    assert proc.returncode == 2 and "needs a GPU" in proc.stderr


# Each rank's checkpoint save takes 3 s longer (a large checkpoint on a slow filesystem).
SLOW_SAVE = """
import os
if "RANK" in os.environ:
    import time
    from latentwire.harness.checkpoint import Checkpointer
    real = Checkpointer.save
    def slow_save(self, state):
        time.sleep(3)
        return real(self, state)
    Checkpointer.save = slow_save
"""


@pytest.mark.slow
def test_slurm_preemption_saves_requeues_and_the_requeued_job_resumes(tmp_path):
    """srun passes the signal to each node's launcher, which must pass it to the ranks itself: a
    signalled torchrun kills ranks still saving after its shutdown timeout (30 s, fixed before torch
    2.13; here 1 s, shorter than the slowed save)."""
    bin_dir = fake_slurm_bin(tmp_path)
    (bin_dir / "scontrol").write_text(
        '#!/usr/bin/env bash\nif [[ "$1" == requeue ]]; then echo "$@" > '
        '"$(dirname "$0")/requeued"; else echo 127.0.0.1; fi\n'
    )
    (tmp_path / "slow").mkdir()
    (tmp_path / "slow" / "sitecustomize.py").write_text(SLOW_SAVE)
    out = tmp_path / "run"
    args = ["--profile", "cpu", *FAST, "--max-steps", "40", "--micro-batch-size", "2", "--out-dir", str(out)]
    env = dict(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="77",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="node1",
        MASTER_PORT="29732",
    )
    job = popen_launch(args, tmp_path, PYTHONPATH=str(tmp_path / "slow"), TORCH_ELASTIC_SHUTDOWN_TIMEOUT="1", **env)
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
def test_a_job_requeued_before_its_first_save_starts_the_run(tmp_path):
    """Preempted before it saved anything (while its LLMs loaded, at a rendezvous), the requeued
    job has no checkpoint to resume from: it starts the run, and says so (it was refused, exit 2)."""
    bin_dir, out = fake_slurm_bin(tmp_path), tmp_path / "run"
    env = dict(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        SLURM_JOB_ID="78",
        SLURM_NNODES="1",
        SLURM_JOB_NODELIST="node1",
        MASTER_PORT=str(free_port()),
        SLURM_RESTART_COUNT="1",
    )
    proc = ok(
        launch(
            ["--profile", "cpu", *FAST, "--max-steps", "2", "--micro-batch-size", "2", "--out-dir", str(out)],
            tmp_path,
            **env,
        )
    )
    assert "requeued before the run's first checkpoint: starting it" in proc.stdout
    assert [m["step"] for m in read_metrics(out)] == [1, 2]


@pytest.mark.slow
def test_sigterm_to_launch_sh_with_loader_workers_saves_the_step_and_resumes_exactly(tmp_path, straight):
    """2 ranks with 2 loader workers each: the run's own code 75 (plain torchrun exits 1), the
    step that was running saved, and the resumed run bitwise the unbroken one."""
    args, out = [*TWENTY[2], "--checkpoint-every", "100", "--num-workers", "2"], tmp_path / "cut"
    job = popen_launch([*args, "--out-dir", str(out)], tmp_path)
    wait_for_step(out, 4, job)
    job.send_signal(signal.SIGTERM)
    stdout, stderr, left = exit_and_leftovers(job, str(out))
    assert job.returncode == 75 and "Traceback" not in stderr, stdout + stderr
    assert left == []  # the loader workers stopped with their ranks
    logged = max(m["step"] for m in read_metrics(out))
    assert [p.name for p in list_checkpoints(out)] == [f"step_{logged:08d}"]
    ok(launch([*args, "--out-dir", str(out), "--resume"], tmp_path))
    assert_same_run(straight(2), out, logged)


def interactive(command: list[str], tmp_path, **env) -> subprocess.Popen:
    """A command as a terminal runs it: the foreground process group of its own, which Ctrl-C
    signals whole (`os.killpg(job.pid, signal.SIGINT)`)."""
    return subprocess.Popen(
        command,
        cwd=tmp_path,
        env=child_env(PYTHON=sys.executable, **env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


@pytest.mark.slow
def test_ctrl_c_to_launch_sh_saves_the_step_exits_130_and_resumes_exactly(tmp_path, straight):
    """Ctrl-C, as a terminal sends it to launch.sh's process group: the ranks finish the step, save
    it, say so and exit 130 (not 75: nothing to requeue), with no traceback anywhere; the resumed
    run is bitwise the unbroken one."""
    args, out = [*TWENTY[2], "--checkpoint-every", "100"], tmp_path / "cut"
    job = interactive([str(REPO / "launch.sh"), *args, "--out-dir", str(out)], tmp_path)
    wait_for_step(out, 4, job)
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr, left = exit_and_leftovers(job, str(out))
    assert job.returncode == 130 and "Traceback" not in stdout + stderr, stdout + stderr
    assert "interrupted: the run saves at the end of this step" in stderr and left == []
    logged = max(m["step"] for m in read_metrics(out))
    assert f"interrupted (Ctrl-C): saving step {logged}; exiting with code 130" in stdout
    assert [p.name for p in list_checkpoints(out)] == [f"step_{logged:08d}"]
    ok(launch([*args, "--out-dir", str(out), "--resume"], tmp_path))
    assert_same_run(straight(2), out, logged)


@pytest.mark.slow
def test_ctrl_c_to_plain_torchrun_still_saves_the_step(tmp_path):
    """Plain torchrun passes Ctrl-C on to its ranks and exits 1 with its own traceback whatever
    they did; the ranks still save the step and say so, without a KeyboardInterrupt."""
    out = tmp_path / "run"
    job = interactive(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(REPO / "train.py"),
            *TWENTY[2],
            "--out-dir",
            str(out),
        ],
        tmp_path,
    )
    wait_for_step(out, 2, job)
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr, left = exit_and_leftovers(job, str(out))
    logged = max(m["step"] for m in read_metrics(out))
    assert f"interrupted (Ctrl-C): saving step {logged}" in stdout and "KeyboardInterrupt" not in stderr, stderr
    assert [p.name for p in list_checkpoints(out)] == [f"step_{logged:08d}"] and left == []


# Rank 1, at its first batch of the distillation teacher's pass, says so and waits until it hears a
# stop signal; a batch after that one says so too.
IN_THE_TEACHER_PASS = """
import os
if os.environ.get("RANK") == "1":
    import sys, threading
    import latentwire.distillation as distillation
    from latentwire.harness.preemption import StopFlag
    heard, handle, to_device, calls = threading.Event(), StopFlag._handle, distillation.to_device, [0]
    def heard_it(self, signum, frame):
        handle(self, signum, frame)
        heard.set()
    def waiting(*args, **kwargs):
        calls[0] += 1
        print("waiting in the teacher pass" if calls[0] == 1 else "a batch after the signal", file=sys.stderr,
              flush=True)
        heard.wait(timeout=300)
        return to_device(*args, **kwargs)
    StopFlag._handle, distillation.to_device = heard_it, waiting
"""


class Terminal:
    """A pseudo-terminal for a command's stdout and stderr, read as it prints (a full one would stop
    it); `hang_up()` closes it as a dropped ssh connection does: every write to it fails from then on."""

    def __init__(self):
        self.master, self.line = os.openpty()
        self.closing = threading.Event()
        self.reader = threading.Thread(target=self.read)
        self.reader.start()

    def read(self) -> None:
        while not self.closing.is_set():
            if select.select([self.master], [], [], 0.1)[0]:
                try:
                    os.read(self.master, 65536)
                except OSError:  # EIO: no process holds the line any more
                    return

    def hang_up(self) -> None:
        self.closing.set()
        self.reader.join()
        os.close(self.master)


@pytest.mark.slow
def test_a_hangup_saves_the_teacher_pass_and_a_step_and_the_run_resumes_exactly(tmp_path, straight):
    """SIGHUP to launch.sh's process group on 2 ranks, as a terminal's shell hangs up its job. In the
    distillation teacher's pass, no rank starts another batch, step 0 is saved, the closing line
    names --resume, exit 75. The resumed run, on a terminal that hangs up (writes to it fail: what the
    ranks print must not end them) and hung up twice (the login shell's and the kernel's, as a
    dropped connection can send them), saves the step it is in and exits 75, and the run resumed
    again ends bitwise the unbroken one."""
    args, out, hook = [*TWENTY[2], "--checkpoint-every", "100"], tmp_path / "cut", tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(IN_THE_TEACHER_PASS)
    job = interactive([str(REPO / "launch.sh"), *args, "--out-dir", str(out)], tmp_path, PYTHONPATH=str(hook))
    assert any(line.startswith("waiting in the teacher pass") for line in job.stderr), job.communicate()
    os.killpg(job.pid, signal.SIGHUP)
    stdout, stderr, left = exit_and_leftovers(job, str(out))
    assert job.returncode == 75 and "Traceback" not in stdout + stderr, stdout + stderr
    assert "a signal stopped the distillation teacher's pass" in stdout and "a batch after" not in stderr, stderr
    assert "preempted (SIGHUP): saving step 0; exiting with code 75, continue with --resume" in stdout
    assert [p.name for p in list_checkpoints(out)] == ["step_00000000"] and left == []

    terminal = Terminal()
    job = subprocess.Popen(
        [str(REPO / "launch.sh"), *args, "--out-dir", str(out), "--resume"],
        cwd=tmp_path,
        env=child_env(PYTHON=sys.executable),
        stdin=subprocess.DEVNULL,
        stdout=terminal.line,
        stderr=terminal.line,
        start_new_session=True,
    )
    os.close(terminal.line)
    try:
        wait_for_step(out, 4, job)
    finally:
        terminal.hang_up()
    for _ in range(2):
        os.killpg(job.pid, signal.SIGHUP)
    assert job.wait(timeout=120) == 75 and processes_mentioning(str(out)) == []
    logged = max(m["step"] for m in read_metrics(out))
    assert list_checkpoints(out)[-1].name == f"step_{logged:08d}"
    ok(launch([*args, "--out-dir", str(out), "--resume"], tmp_path))
    assert_same_run(straight(2), out, logged)


def interrupted_in_a_long_step(out, tmp_path) -> subprocess.Popen:
    """launch.sh on 2 ranks after its first Ctrl-C, which rank 0 has heard, in a long step (1024
    examples a rank)."""
    job = interactive(
        [
            str(REPO / "launch.sh"),
            "--profile",
            "cpu",
            *FAST,
            "--kd-weight",
            "0",
            "--num-examples",
            "4096",
            "--micro-batch-size",
            "32",
            "--grad-accum-steps",
            "32",
            "--out-dir",
            str(out),
        ],
        tmp_path,
    )
    wait_for_step(out, 1, job)
    os.killpg(job.pid, signal.SIGINT)
    for line in job.stderr:
        if line.startswith("interrupted:"):
            return job
    raise AssertionError("the run ended without hearing the Ctrl-C")


@pytest.mark.slow
def test_a_second_ctrl_c_stops_at_once_without_saving(tmp_path):
    """The second Ctrl-C comes while the ranks finish a long step (1024 examples a rank): they stop
    at once, exit 130, and leave no checkpoint of that step, whole or partial."""
    out = tmp_path / "run"
    job = interrupted_in_a_long_step(out, tmp_path)
    os.killpg(job.pid, signal.SIGINT)
    stdout, stderr, left = exit_and_leftovers(job, str(out))
    assert job.returncode == 130 and "Traceback" not in stdout + stderr, stdout + stderr
    assert "interrupted again: stopping now, without saving this step" in stderr and left == []
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


@pytest.mark.slow
def test_a_rank_whose_peer_stopped_at_once_exits_130_quietly(tmp_path):
    """The second Ctrl-C as it can reach the ranks under load: rank 0 has it and is gone before
    rank 1 does, whose collectives then fail for want of rank 0. Rank 1 ends as an interrupted
    rank, not with a traceback (the test above printed rank 1's "Connection closed by peer" in a
    suite run on two busy cores). Here rank 1 never gets the second Ctrl-C at all."""
    out = tmp_path / "run"
    job = interrupted_in_a_long_step(out, tmp_path)
    os.kill(rank_pid(str(out), 0), signal.SIGINT)
    stdout, stderr, left = exit_and_leftovers(job, str(out))
    assert job.returncode == 130 and "Traceback" not in stdout + stderr, stdout + stderr
    assert "interrupted again: stopping now, without saving this step" in stderr and left == []


@pytest.mark.parametrize("nproc", ["1", "2"])
def test_bad_input_is_one_line_with_the_run_s_exit_code(tmp_path, nproc):
    """Each rank refuses it; launch.sh prints the line once and exits 2, not torchrun's 1."""
    proc = launch(["--profile", "cpu", "--lr", "-1"], tmp_path, NPROC_PER_NODE=nproc)
    assert_one_line_error(proc, "--lr: field 'lr' must be > 0")
    assert proc.returncode == 2


def test_a_profile_from_another_file(tmp_path):
    """--hw-profiles FILE names the profile launch.sh looks up, as it does train.py's."""
    profiles = tmp_path / "mine.json"
    profiles.write_text(
        json.dumps(
            {**json.loads((REPO / "hw_profiles.json").read_text()), "mycpu": {"extends": "cpu", "description": "mine"}}
        )
    )
    proc = launch(["--profile", "mycpu", "--hw-profiles", str(profiles), "--lr", "-1"], tmp_path, NPROC_PER_NODE="1")
    assert_one_line_error(proc, "--lr: field 'lr' must be > 0")  # train.py found mycpu in the file too


# --- two nodes without SLURM -------------------------------------------------------------------


def run_two_nodes(args, tmp_path, node_env: list[dict], prefix: list[list[str]]) -> list[subprocess.CompletedProcess]:
    """Node 0 and node 1 as two launch.sh processes (one rank each), started together; `prefix`
    runs a node's launch.sh inside something (a network namespace). Each node's output goes to a
    file (two pipes read one after the other could fill and stall the other node), and each node is
    its own process group, killed whole if it outlives the test (torchrun and its rank with it)."""
    port = str(free_port())
    nodes, logs = [], []
    try:
        for r in (0, 1):
            logs.append((open(tmp_path / f"node{r}.out", "w+"), open(tmp_path / f"node{r}.err", "w+")))
            nodes.append(
                subprocess.Popen(
                    [*prefix[r], str(REPO / "launch.sh"), *args],
                    cwd=tmp_path,
                    text=True,
                    stdout=logs[r][0],
                    stderr=logs[r][1],
                    start_new_session=True,
                    env=child_env(
                        PYTHON=sys.executable,
                        NNODES="2",
                        NODE_RANK=str(r),
                        NPROC_PER_NODE="1",
                        MASTER_PORT=port,
                        RDZV_ID=f"two-nodes-{port}",
                        **node_env[r],
                    ),
                )
            )
        for node in nodes:
            node.wait(timeout=600)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
                node.wait()
    outputs = []
    for node, files in zip(nodes, logs, strict=True):
        texts = []
        for f in files:
            f.seek(0)
            texts.append(f.read())
            f.close()
        outputs.append(subprocess.CompletedProcess(node.args, node.returncode, *texts))
    return outputs


@pytest.mark.slow
def test_two_nodes_train_as_one_node_with_two_processes(tmp_path, straight):
    """NNODES=2 on one machine: c10d rendezvous on node 0, gloo between the nodes' ranks; the run is
    bitwise the one-node run with 2 processes (shared out_dir, as on a shared filesystem)."""
    out = tmp_path / "run"
    env = {"MASTER_ADDR": "127.0.0.1"}
    procs = [ok(p) for p in run_two_nodes([*TWENTY[2], "--out-dir", str(out)], tmp_path, [env, env], [[], []])]
    assert "node 0 of 2 x 1 process(es)" in procs[0].stdout and "node 1 of 2" in procs[1].stdout
    assert_same_run(straight(2), out, 0)


@contextmanager
def second_host():
    """A network namespace joined to this one by a veth pair, as a second host on a link: yields
    (the command prefix that runs in it, this side's address and interface, its address and
    interface). Needs root and iproute2; skips otherwise. Removed in every outcome."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("a network namespace needs root and iproute2")
    tag = str(os.getpid())[-6:]
    ns, here, there = f"lw{tag}", f"lwa{tag}", f"lwb{tag}"
    subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
    setup = [
        ["ip", "netns", "add", ns],
        ["ip", "link", "add", here, "type", "veth", "peer", "name", there],
        ["ip", "link", "set", there, "netns", ns],
        ["ip", "addr", "add", f"{subnet}.1/30", "dev", here],
        ["ip", "link", "set", here, "up"],
        ["ip", "-n", ns, "addr", "add", f"{subnet}.2/30", "dev", there],
        ["ip", "-n", ns, "link", "set", there, "up"],
        ["ip", "-n", ns, "link", "set", "lo", "up"],
    ]
    try:
        for cmd in setup:
            made = subprocess.run(cmd, capture_output=True, text=True)
            if made.returncode != 0:
                pytest.skip(f"cannot make a network namespace here: {' '.join(cmd)}: {made.stderr.strip()}")
        yield ["ip", "netns", "exec", ns], (f"{subnet}.1", here), (f"{subnet}.2", there)
    finally:
        subprocess.run(["ip", "link", "del", here], capture_output=True)  # both ends of the pair
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


@pytest.mark.slow
def test_two_nodes_across_a_network_interface(tmp_path, straight):
    """Node 1 in its own network namespace: the rendezvous and gloo cross a veth link as between two
    hosts (each node's LOCAL_ADDR and GLOO_SOCKET_IFNAME, as the README says for real hosts)."""
    out = tmp_path / "run"
    with second_host() as (inside, (addr0, if0), (addr1, if1)):
        env = [
            {"MASTER_ADDR": addr0, "LOCAL_ADDR": addr0, "GLOO_SOCKET_IFNAME": if0},
            {"MASTER_ADDR": addr0, "LOCAL_ADDR": addr1, "GLOO_SOCKET_IFNAME": if1},
        ]
        [ok(p) for p in run_two_nodes([*TWENTY[2], "--out-dir", str(out)], tmp_path, env, [[], inside])]
    assert_same_run(straight(2), out, 0)


def test_several_nodes_need_their_rank_and_node_0_s_address(tmp_path):
    for env, fragment in (
        ({"NNODES": "2", "MASTER_ADDR": "10.0.0.1"}, "NODE_RANK must be 0 to 1"),
        ({"NNODES": "2", "NODE_RANK": "2", "MASTER_ADDR": "10.0.0.1"}, "NODE_RANK must be 0 to 1"),
        ({"NNODES": "2", "NODE_RANK": "0"}, "MASTER_ADDR must name node 0"),
        ({"NNODES": "two"}, "NNODES must be a positive integer"),
    ):
        proc = launch(["--profile", "cpu"], tmp_path, **env)
        assert proc.returncode == 2 and proc.stderr.strip().startswith("error: ") and fragment in proc.stderr, env
        assert len(proc.stderr.strip().splitlines()) == 1


def test_max_restarts_is_a_whole_number(tmp_path):
    proc = launch(["--profile", "cpu"], tmp_path, MAX_RESTARTS="always")
    assert_one_line_error(proc, "MAX_RESTARTS must be a whole number, got 'always'")
    assert proc.returncode == 2


# --- every command also works under torchrun ---------------------------------------------------


def torchrun_passes_on(script: list[str], args: list[str]) -> list[str]:
    """What torchrun hands the script of `torchrun --standalone --nproc_per_node=2 SCRIPT ARGS`. Its
    parser matches abbreviations of its own flags even among the script's: `--n` is refused as
    ambiguous (--nnodes, --nproc-per-node, ...) before the script sees it."""
    from torch.distributed.run import get_args_parser

    parser = get_args_parser()
    parser.exit_on_error = False
    parser.error = lambda message: pytest.fail(f"torchrun refuses {' '.join(args)!r}: {message}")
    return parser.parse_args(["--standalone", "--nproc_per_node=2", *script, *args]).training_script_args


def test_every_flag_of_every_command_passes_through_torchrun():
    from latentwire import evaluate, find_batch, plan, settings

    for script, parser in (
        (["train.py"], settings.build_parser()),
        (["-m", "latentwire.evaluate"], evaluate.build_parser()),
        (["-m", "latentwire.plan"], plan.build_parser()),
        (["-m", "latentwire.find_batch"], find_batch.build_parser()),
    ):
        flags = [s for action in parser._actions for s in action.option_strings]
        assert len(flags) > 3
        for flag in flags:
            assert torchrun_passes_on(script, [flag, "1"]) == [flag, "1"], (script, flag)


def documented_commands() -> list[tuple[str, list[str], list[str]]]:
    """(file, script, args) of each `train.py ...` or `-m latentwire.X ...` command line in the
    README and docs/, in code blocks and inline code."""
    import re
    import shlex

    found = []
    for path in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]:
        text = path.read_text().replace("\\\n", " ")
        for line in re.findall(r"```[a-z]*\n(.*?)```", text, re.S) + re.findall(r"`([^`\n]+)`", text):
            for command in line.splitlines():
                try:
                    words = shlex.split(command, comments=True)
                except ValueError:
                    continue
                for i, word in enumerate(words):
                    if word.endswith("train.py"):
                        script, rest = [word], words[i + 1 :]
                    elif word == "-m" and re.fullmatch(r"latentwire\.\w+", " ".join(words[i + 1 : i + 2])):
                        script, rest = words[i : i + 2], words[i + 2 :]
                    else:
                        continue
                    rest = rest[: next((j for j, w in enumerate(rest) if w in ("|", "&&", ";", ">")), len(rest))]
                    if not rest or rest[0].startswith(("-", "$")):  # a command, not a sentence about one
                        found.append((path.name, script, rest))
                    break
    return found


def test_every_documented_command_passes_through_torchrun():
    commands = documented_commands()
    assert len(commands) > 20 and any(s == ["-m", "latentwire.evaluate"] and a for _, s, a in commands)
    for where, script, args in commands:
        assert torchrun_passes_on(script, args) == args, where
