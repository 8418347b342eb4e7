"""The process group every command runs in (`latentwire.harness.distributed.process_group`)."""

import json
import subprocess
import sys

import pytest
import torch.distributed as dist

from conftest import REPO, RUN, child_env, free_port, ok
from latentwire.harness import exits
from latentwire.harness.distributed import leave_together, process_group
from latentwire.harness.errors import UserError

# Rank 0 is still busy (as when it writes a report) when rank 1's work is done; each rank records
# when its body ended and when it left the process group, in a file of its own (two ranks printing
# to one stdout can interleave their lines).
LEAVE = """
import json, pathlib, sys, time
sys.path.insert(0, {repo!r})
import torch.distributed as dist
from latentwire.harness.distributed import process_group
with process_group("cpu", 60) as info:
    if info.rank == 0:
        time.sleep(1.0)
    body_end = time.time()
    assert dist.is_initialized() and dist.get_world_size() == 2
pathlib.Path(f"rank{{info.rank}}.json").write_text(json.dumps(
    {{"body_end": body_end, "left": time.time(), "destroyed": not dist.is_initialized()}}))
"""


@pytest.mark.slow
def test_ranks_leave_the_group_together(tmp_path):
    """A rank that finishes early waits for the others before destroying the group: a rank that
    exits while a peer still uses the group can be aborted by gloo (seen in CI as SIGABRT)."""
    script = tmp_path / "leave.py"
    script.write_text(LEAVE.format(repo=str(REPO)))
    ok(
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", str(script)],
            cwd=tmp_path,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    ranks = [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in (0, 1)]
    assert ranks[0]["destroyed"] and ranks[1]["destroyed"]
    assert ranks[1]["left"] >= ranks[0]["body_end"]


@pytest.mark.parametrize("torchrun", [False, True], ids=["python", "torchrun"])
def test_a_world_of_one_has_no_group_whatever_started_it(monkeypatch, torchrun):
    """`torchrun --nproc_per_node=1` sets RANK, LOCAL_RANK and WORLD_SIZE=1: still no group, so no
    DDP and no collectives (train.py wraps the model in DDP only in a group)."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    if torchrun:
        monkeypatch.setenv("RANK", "0")
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "1")
    with process_group("cpu", 60) as info:
        assert (info.rank, info.world_size, info.device.type, info.joins_group) == (0, 1, "cpu", False)
        assert not info.is_distributed and not dist.is_initialized()


# A command through main_guard, with or without a process group (a world of one on gloo), that
# may fail with a bad input; an exit handler marks whether the interpreter finalized.
COMMAND = """
import atexit, pathlib, sys
import torch.distributed as dist
sys.path.insert(0, {repo!r})
from latentwire.harness.distributed import leave_together
from latentwire.harness.errors import UserError
from latentwire.harness.exits import main_guard
atexit.register(lambda: pathlib.Path("finalized").touch())
def main():
    if {group}:
        dist.init_process_group("gloo")  # train.py joins no group in a world of one; this one is made
        with leave_together():
            assert dist.is_initialized()
    print("done")
    if {bad}:
        raise UserError("bad input")
main_guard(main)
"""


@pytest.mark.parametrize("group, bad", [(True, False), (True, True), (False, False)])
def test_a_process_that_started_a_group_leaves_without_finalizing(tmp_path, group, bad):
    """gloo's worker threads may still be freeing a finished collective's tensors, which takes the
    GIL, when the interpreter finalizes: the process then aborts (pytorch#190489, 3 of 60 sharded
    evaluations under load). So such a process leaves with os._exit, its output flushed and its
    exit code kept; one without a group exits as usual."""
    script = tmp_path / "command.py"
    script.write_text(COMMAND.format(repo=str(REPO), group=group, bad=bad))
    env = child_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    proc = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == (2 if bad else 0), proc.stderr
    assert proc.stdout == "done\n" and proc.stderr == ("error: bad input\n" if bad else "")
    assert (tmp_path / "finalized").exists() == (not group)


def test_a_body_that_raises_leaves_its_group_standing(monkeypatch):
    """What keeps a failing rank from hanging on its way out (leave_together's docstring): the
    group is not destroyed after an error, so no reducer freed later can be the group's last
    holder and join gloo's threads with the GIL held. The group goes with the process."""
    monkeypatch.setattr(exits, "_in_a_process_group", False)  # the body sets it; put back after
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        with pytest.raises(UserError), leave_together():
            raise UserError("bad input")
        assert dist.is_initialized() and exits._in_a_process_group
    finally:
        dist.destroy_process_group()


# When train.py's process group is destroyed (leave_together, at the end of a run), how many DDP
# models are still alive on this rank.
DDP_AT_DESTROY = """
import gc, os, sys
sys.path.insert(0, {repo!r}); sys.argv[0] = {train!r}
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
import train
from latentwire.harness.exits import main_guard
real = dist.destroy_process_group
def destroy(*args, **kwargs):
    gc.collect()
    alive = sum(isinstance(o, DistributedDataParallel) for o in gc.get_objects())
    print(f"rank {{os.environ['RANK']}}: DDP models alive at destroy: {{alive}}", flush=True)
    return real(*args, **kwargs)
dist.destroy_process_group = destroy
main_guard(lambda: train.main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_a_run_s_ddp_model_is_gone_before_its_process_group(tmp_path):
    """DDP's reducer holds the process group: one that outlived leave_together's destroy would
    destroy the group with it, joining gloo's worker threads with the GIL held, while a worker
    finishing a collective waits for the GIL (a two-rank bench run hung so until its timeout)."""
    script = tmp_path / "ddp_at_destroy.py"
    script.write_text(DDP_AT_DESTROY.format(repo=str(REPO), train=str(REPO / "train.py")))
    proc = ok(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                str(script),
                *RUN,
                "--max-steps",
                "1",
                "--micro-batch-size",
                "2",
                "--out-dir",
                str(tmp_path / "run"),
            ],
            cwd=REPO,
            env=child_env(),
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    assert sorted(line for line in proc.stdout.splitlines() if "alive at destroy" in line) == [
        "rank 0: DDP models alive at destroy: 0",
        "rank 1: DDP models alive at destroy: 0",
    ], proc.stdout
