"""The harness's guarantees on a model that is not the project's (toy_train.py): what a copier of
the harness most wants to take along. Each run is a real process (torchrun's, on gloo, for ranks).

    python -m pytest harness/tests        # from the folder that holds harness/
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

TOY = Path(__file__).with_name("toy_train.py")
HOME = TOY.parents[2]  # the folder that holds harness/: `python -m harness.launch` runs from there
sys.path[:0] = [str(HOME), str(TOY.parent)]  # `harness` and the toy, imported as the toy imports them
STEPS = 6


def env() -> dict:
    """A child's environment: one thread, unbuffered, no torchrun variables inherited."""
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
    }
    return {**clean, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def command(nproc: int) -> list[str]:
    """The toy in one process, or under harness.launch (torchrun, ending with the run's own code)."""
    if nproc == 1:
        return [sys.executable, str(TOY)]
    return [sys.executable, "-m", "harness.launch", "--standalone", f"--nproc_per_node={nproc}", str(TOY)]


def toy(out: Path, *flags: str, nproc: int = 1, code: int = 0) -> Path:
    run_toy(out, *flags, nproc=nproc, code=code)
    return out


def run_toy(out: Path, *flags: str, nproc: int = 1, code: int = 0) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [*command(nproc), "--profile", "toy", "--out-dir", str(out), *flags],
        env=env(),
        cwd=HOME,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == code, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc


def weights(out: Path) -> dict:
    newest = sorted((out / "checkpoints").iterdir())[-1]
    return load_file(str(newest / "trainable.safetensors"))


def losses(out: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def unbroken(tmp_path_factory) -> Path:
    """STEPS steps of the toy profile, one process, 8 x 1, saved at step 3 too."""
    return toy(tmp_path_factory.mktemp("unbroken") / "run", "--checkpoint-every", "3")


@pytest.mark.parametrize("nproc, micro, accum", [(1, 2, 4), (2, 2, 2)], ids=["2x4", "2x2x2ranks"])
def test_accumulation_is_exact_over_micro_batches_and_ranks(unbroken, tmp_path, nproc, micro, accum):
    """The same global batch of 8 rows split into micro-batches and ranks trains the same weights:
    each step's loss is its sum over the real positions of the whole global batch. In fp32 the
    splits differ only in summation order (rounding of 1e-7 relative per gradient, on a handful of
    SGD steps), far inside 1e-5 of the largest weight and of each logged loss."""
    split = toy(tmp_path / "run", "--micro-batch-size", str(micro), "--grad-accum-steps", str(accum), nproc=nproc)
    reference, other = weights(unbroken), weights(split)
    for name, tensor in reference.items():
        assert (other[name] - tensor).abs().max() <= 1e-5 * tensor.abs().max(), name
    assert losses(split) == pytest.approx(losses(unbroken), rel=1e-5)


# fp32's unit roundoff, and how many roundings a gradient element of the toy gathers: a sum over the
# global batch's real positions (at most 8 rows x 6), each term a product of a dozen or so (two dot
# products of 4 and 16, tanh, the residual): within n x U of the terms' magnitudes, in any order.
U, ROUNDINGS = 2.0**-24, 48 + 32


def toy_recipe():
    """The toy profile's recipe, built in this process as its runs build it."""
    import toy_train

    from harness.distributed import DistInfo

    cfg = toy_train.load_config(toy_train.ToyConfig, ["--profile", "toy"], toy_train.PROFILES)
    return toy_train.Regression(cfg, DistInfo(0, 0, 1, torch.device("cpu"), joins_group=False), stop=lambda: 0)


def full_batch_reference(recipe, weights: dict, batch: dict) -> tuple[float, dict, float, dict]:
    """The template's loss and gradient on the whole global `batch` at `weights`, in float64 (exact
    beside fp32's rounding), and the magnitudes that bound fp32's rounding of each: the residual
    y_hat - y rounds relative to |y_hat| + |y|, not to itself, so every position's term is bounded
    by its derivative times that."""
    model, task = recipe.build_model(compile_options=None, checkpointing=None)
    model = model.double()
    model.load_state_dict({name: w.double() for name, w in weights.items()})
    batch = {k: v.double() for k, v in batch.items()}
    names, parameters = zip(*model.named_parameters(), strict=True)
    loss = task.objective(task.loss_sums(model, batch) / task.counts(batch))
    gradient = dict(zip(names, torch.autograd.grad(loss, parameters), strict=True))
    count, loss_scale = task.counts(batch), 0.0
    gradient_scale = {name: torch.zeros_like(g) for name, g in gradient.items()}
    for row, position in batch["mask"].nonzero().tolist():
        y_hat, y = model(batch["x"][row, position]).squeeze(), batch["y"][row, position]
        size = (y_hat.abs() + y.abs()).item()
        loss_scale += size**2 / count.item()
        for name, d in zip(names, torch.autograd.grad(y_hat, parameters), strict=True):
            gradient_scale[name] += d.abs() * 2 * size / count
    return loss.item(), gradient, loss_scale, gradient_scale


@pytest.mark.parametrize("nproc, micro, accum", [(1, 2, 4), (2, 2, 2)], ids=["2x4", "2x2x2ranks"])
def test_each_steps_gradient_and_loss_are_the_full_batchs_under_adamw(tmp_path, nproc, micro, accum):
    """What the harness guarantees for any model and optimizer: each step's gradient and logged loss
    are the whole global batch's at the step's weights, to fp32's rounding, however it is split into
    micro-batches and ranks. Under AdamW (which, unlike SGD, may take the splits' weights apart: a
    gradient zero in exact arithmetic is rounding, and Adam steps on it), each step of each split is
    compared at its own weights with the global batch of 8 rows taken whole, in float64."""
    from torch.utils.data import DataLoader, default_collate

    from harness.data import ShardSampler, global_batches

    out = toy(
        tmp_path / "run",
        *("--optimizer", "adamw", "--lr", "0.01", "--save-gradients", "true"),
        *("--micro-batch-size", str(micro), "--grad-accum-steps", str(accum)),
        nproc=nproc,
    )
    recipe = toy_recipe()
    sampler = ShardSampler(recipe.draws(recipe.cfg.training.seed), num_replicas=1, rank=0)
    loader = DataLoader(recipe.dataset, 8, sampler=sampler, collate_fn=default_collate)
    whole = global_batches(loader, sampler, 1, 0, 0, 8)
    assert len(losses(out)) == STEPS
    for step, logged in enumerate(losses(out), 1):
        saved = load_file(str(out / "gradients" / f"step_{step:08d}.safetensors"))
        start = {k.removeprefix("weight."): t for k, t in saved.items() if k.startswith("weight.")}
        loss, gradient, loss_scale, gradient_scale = full_batch_reference(recipe, start, next(whole)[2][0])
        assert abs(logged - loss) <= ROUNDINGS * U * loss_scale, step
        for name, exact in gradient.items():
            error = (saved[f"grad.{name}"].double() - exact).abs()
            assert (error <= ROUNDINGS * U * gradient_scale[name]).all(), (step, name)


def test_resume_is_bitwise(unbroken, tmp_path):
    """Stopping after step 3 and resuming gives the very weights and losses of the unbroken run:
    the checkpoint holds the optimizer, the schedule, every RNG and the data position."""
    out = tmp_path / "run"
    toy(out, "--stop-at-step", "3")
    toy(out, "--resume")
    assert all(torch.equal(weights(out)[name], tensor) for name, tensor in weights(unbroken).items())
    assert losses(out) == losses(unbroken)


@pytest.mark.parametrize("torn", ["last", "middle"])
def test_a_torn_log_line_never_stops_a_resume(unbroken, tmp_path, torn):
    """The unbroken run as a run killed after it logged its last step and before it saved it leaves
    it (its newest checkpoint step 3's), with a torn log line. Torn last (a kill while the record was
    appended: here step 6's), it is said in a note and dropped; torn elsewhere (here step 5's), it is
    damage: said in a warning, the file kept beside the log as it was. Either way the resumed run
    trains to the end and logs every step once (those before its checkpoint kept, the rest logged
    again), in metrics.jsonl and in TensorBoard, whose event file is torn too. (It was a
    JSONDecodeError before the first step.)"""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = Path(shutil.copytree(unbroken, tmp_path / "run"))
    shutil.rmtree(out / "checkpoints" / f"step_{STEPS:08d}")
    lines = (out / "metrics.jsonl").read_bytes().splitlines(keepends=True)
    cut = STEPS - 1 if torn == "last" else STEPS - 2
    lines[cut] = lines[cut][: len(lines[cut]) // 2] + (b"" if torn == "last" else b"\n")
    (out / "metrics.jsonl").write_bytes(b"".join(lines))
    [events] = (out / "tb").iterdir()
    events.write_bytes(events.read_bytes()[:-9])  # its last record's data cut short
    proc = run_toy(out, "--resume")
    said = [line for line in proc.stderr.splitlines() if "metrics.jsonl" in line]
    aside = sorted(out.glob("metrics.jsonl.damaged-*"))
    if torn == "last":
        assert (
            said
            == [f"note: dropped the torn last line of {out / 'metrics.jsonl'} (its run was stopped while writing it)"]
            and aside == []
        )
    else:
        assert said == [
            f"warning: {out / 'metrics.jsonl'} has 1 damaged line(s), left out; the file as it was is "
            f"kept as {aside[0]}"
        ] and aside[0].read_bytes() == b"".join(lines)
    assert all(torch.equal(weights(out)[name], tensor) for name, tensor in weights(unbroken).items())
    assert losses(out) == losses(unbroken)
    board = EventAccumulator(str(out / "tb"))
    board.Reload()
    assert [e.step for e in board.Scalars("loss")] == list(range(1, STEPS + 1))
    assert [e.value for e in board.Scalars("loss")] == pytest.approx(losses(out), rel=2**-24)  # float32's rounding


@pytest.mark.parametrize(
    "log, kept, says",
    [
        (b'{"step": 1}\n{"step": 2}\n{"step": 3, "lo', b'{"step": 1}\n{"step": 2}\n', "note: dropped the torn last"),
        (b'{"step": 1}\n{"step": 2}\n\0\0\0\0', b'{"step": 1}\n{"step": 2}\n', "note: dropped the torn last"),
        (
            b'{"step": 1}\n\xff\xfe\n42\n{"nostep": 1}\n{"step": 2}',
            b'{"step": 1}\n{"step": 2}\n',
            "has 3 damaged line(s)",
        ),
        (
            b'{"step": 1}\n{"step": 2, "l\n{"step": 3}\n{"step": 4}\n',
            b'{"step": 1}\n{"step": 3}\n',
            "has 1 damaged line(s)",
        ),
    ],
    ids=["torn", "zeros", "garbage", "torn_in_the_middle"],
)
def test_a_resumed_log_keeps_every_whole_record_before_its_step(tmp_path, capsys, log, kept, says):
    """Whatever else the file holds (a torn last line, a tail of zeros a crash left, bytes that
    are not text, JSON that is no record), the whole records before the resumed step (4) stay, one
    line says what was dropped, and a file with more than a torn last line is kept aside as it was."""
    from harness.metrics import keep_log_before

    path = tmp_path / "metrics.jsonl"
    path.write_bytes(log)
    keep_log_before(path, first_step=4)
    assert path.read_bytes() == kept
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and says in err[0], err
    aside = sorted(tmp_path.glob("metrics.jsonl.damaged-*"))
    assert [p.read_bytes() for p in aside] == ([] if says.startswith("note") else [log])
    assert [p.name for p in tmp_path.iterdir()] == ["metrics.jsonl", *(p.name for p in aside)]


# stdout is a terminal that hangs up, stderr a pipe whose other end closes with it (`| tee log`); the
# process, hung up, prints to both and says what it heard in a file.
A_HANGUP = """
import os, signal, sys, torch
from harness.preemption import StopFlag
stop = StopFlag(announce=False)
terminal, line = os.openpty()
read_end, write_end = os.pipe()
os.dup2(line, 1)
os.dup2(write_end, 2)
os.close(terminal)
os.close(read_end)
os.kill(os.getpid(), signal.SIGHUP)
print("to the terminal", flush=True)
print("to the pipe", file=sys.stderr, flush=True)
with open(sys.argv[1], "w") as f:
    f.write(f"{stop.signal_name} {stop.flags(torch.device('cpu')).tolist()}")
"""


def test_a_hangup_is_a_stop_signal_and_what_it_took_away_ends_no_print(tmp_path):
    """SIGHUP sets the flag as SIGTERM does (exit 75 once the step is saved), and stdout and stderr
    that no one reads any more go to /dev/null: a print there (EIO, EPIPE) would end the run unsaved."""
    heard = tmp_path / "heard"
    proc = subprocess.run([sys.executable, "-c", A_HANGUP, str(heard)], cwd=HOME, env=env(), timeout=60)
    assert proc.returncode == 0 and heard.read_text() == "SIGHUP [1, 0]"


def test_one_host_sync_per_step(tmp_path):
    """Runs of 2 and 5 steps log and save alike (at their last step), so the difference is what 3
    steps in the middle read on the host: one sync each."""
    import toy_train

    from harness.host_syncs import HostReads

    def reads(steps: int) -> int:
        with HostReads() as counter:
            toy_train.main(
                [
                    "--profile",
                    "toy",
                    "--out-dir",
                    str(tmp_path / str(steps)),
                    "--max-steps",
                    str(steps),
                    "--log-every",
                    "1000",
                ]
            )
        return counter.count

    assert (reads(5) - reads(2)) / 3 == 1


def test_a_stop_signal_saves_the_step_and_exits_75(tmp_path):
    """SIGTERM (a scheduler's preemption) mid-run: the ranks agree at the end of the step, save it
    and exit 75; the run resumes from that step."""
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [*command(2), "--profile", "toy", "--out-dir", str(out), "--max-steps", "100000"],
        env=env(),
        cwd=HOME,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        for line in proc.stdout:  # the run is under way once it has logged a step
            if line.startswith("step"):
                break
        os.killpg(proc.pid, signal.SIGTERM)  # as torchrun's own shutdown or a scheduler sends it
        assert proc.wait(timeout=120) == 75, proc.stderr.read()[-4000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    saved = int(sorted((out / "checkpoints").iterdir())[-1].name.split("_")[1])
    assert saved >= 1
    toy(out, "--resume", "--max-steps", "100000", "--stop-at-step", str(saved + 2), nproc=2)
    assert json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])["step"] == saved + 2


LOADING = """
import os, signal, sys
from pathlib import Path
from harness.exits import main_guard

here, attempt = Path(sys.argv[1]), os.environ["TORCHELASTIC_RESTART_COUNT"]
(here / f"attempt{attempt}").touch()
if attempt == "0":  # a rank still importing: no handler of its own yet, so a SIGTERM ends it
    print("loading", flush=True)
    signal.pause()
main_guard(lambda: (here / "ran").touch())
"""


def test_a_stop_that_ends_ranks_still_loading_ends_the_run_torchrun_would_restart(tmp_path):
    """SIGTERM to the launcher while its ranks load (before they hear signals) kills them, and
    torchrun starts them again: the new ranks end the run with 75 instead of running it (a
    preempted job that then ran on until its scheduler killed it)."""
    script = tmp_path / "loading.py"
    script.write_text(LOADING)
    launcher = [sys.executable, "-m", "harness.launch", "--standalone", "--nproc_per_node=1", "--max-restarts=1"]
    proc = subprocess.Popen(
        [*launcher, str(script), str(tmp_path)],
        env={**env(), "PYTHONPATH": str(HOME)},  # the script is not beside harness/, as toy_train.py is
        cwd=HOME,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "loading\n"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 75
    finally:
        proc.kill()
    assert (tmp_path / "attempt1").exists() and not (tmp_path / "ran").exists()


@pytest.mark.parametrize("sig, code", [(signal.SIGTERM, 75), (signal.SIGINT, 130)])
def test_a_stop_while_no_rank_runs_is_the_run_s_stop(tmp_path, sig, code):
    """A stop at a multi-node rendezvous (here the first of two nodes, waiting for the second, whose
    store is listening), where no rank runs yet: the preemption's 75 (Ctrl-C's 130) and one line,
    not torchrun's failure (1)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    rendezvous = ["--nnodes=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=stop"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness.launch", *rendezvous, "--nproc_per_node=1", str(TOY)],
        env=env(),
        cwd=HOME,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        waiting = time.monotonic() + 120
        while not store_listens(port) and proc.poll() is None and time.monotonic() < waiting:
            time.sleep(0.1)
        proc.send_signal(sig)
        assert proc.wait(timeout=120) == code
        assert proc.stderr.read().strip().endswith("while no rank was running: nothing to save")
    finally:
        proc.kill()


def store_listens(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
        return True
    except OSError:
        return False


class Planted:
    """What a hostile checkpoint's pickle can hold: unpickling it calls open(path, "w")."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        return open, (str(self.path), "w")


def test_a_checkpoint_is_read_as_data_and_runs_nothing_it_holds(tmp_path):
    """A newest checkpoint whose training state pickles a callable is not run, only refused (its
    one line says why), and resume falls back to the older intact one."""
    from harness.checkpoint import Checkpointer, TrainState
    from harness.config import Field, Schema
    from harness.resume import resume

    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    checkpointer = Checkpointer(
        tmp_path,
        rank=0,
        keep=2,
        meta={"config": {"lr": 0.1}},
        model=model,
        optimizer=optimizer,
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        scheduler=torch.optim.lr_scheduler.LinearLR(optimizer, total_iters=4),
    )
    data = {"dataset": "rows", "examples": 16, "fingerprint": "0"}
    for step in (1, 2):
        newest = checkpointer.save(TrainState(step, 0, 8 * step, layout=(1, 8, 1), data=data))
    marker = tmp_path / "ran"
    state = torch.load(newest / "train_state.pt", weights_only=True)
    torch.save({**state, "planted": Planted(marker)}, newest / "train_state.pt")
    warnings, said = [], []
    resumed = resume(
        checkpointer,
        TrainState(0, 0, 0, layout=(1, 8, 1), data=data),
        {"lr": 0.1},
        Schema([Field(key="lr", section="optimizer", name="lr", kind=float, help="", default=0.1, restored=True)]),
        4,
        say=said.append,
        warn=warnings.append,
    )
    assert not marker.exists()
    assert resumed.step == 1 and "step_00000001" in said[0], said
    assert len(warnings) == 1 and "more than tensors and plain values" in warnings[0], warnings


@pytest.mark.parametrize("epoch, done, steps", [(0, 0, 3), (1, 12, 5), (0, 24, 1), (2, 0, 20)])
def test_the_examples_a_run_draws_are_known_in_advance(epoch, done, steps):
    """examples_visited names exactly what the sampler and global_batches deal every rank over the
    next steps, from any position, across epochs (a cache computed for them covers every draw)."""
    from harness.data import Mixture, ShardSampler, examples_visited, global_batches

    n, seed, world, micro, accum = 50, 3, 2, 2, 3
    draws = Mixture.single(n, seed)
    drawn = set()
    for rank in range(world):
        sampler = ShardSampler(draws, num_replicas=world, rank=rank)
        loader = torch.utils.data.DataLoader(range(n), batch_size=micro, sampler=sampler, drop_last=True)
        batches = global_batches(loader, sampler, accum, epoch, done, micro * accum * world)
        for _ in range(steps):
            drawn.update(i for batch in next(batches)[2] for i in batch.tolist())
    visited = examples_visited(
        draws, world=world, micro=micro, accum=accum, epoch=epoch, examples_done=done, steps=steps
    )
    assert visited.tolist() == sorted(drawn)


def test_one_source_draws_what_distributed_sampler_always_drew():
    """A run on one source deals every rank what torch's DistributedSampler dealt it, from any
    position: a checkpoint written before mixtures resumes on the same order."""
    from harness.data import Mixture, ShardSampler

    for n, world, seed in ((50, 2, 3), (101, 3, 0)):
        for rank in range(world):
            for epoch in range(3):
                ours = ShardSampler(Mixture.single(n, seed), num_replicas=world, rank=rank)
                ours.start_epoch(epoch, 2 * world)
                torch_s = torch.utils.data.DistributedSampler(
                    range(n), world, rank, shuffle=True, seed=seed, drop_last=True
                )
                torch_s.set_epoch(epoch)
                assert list(ours) == list(torch_s)[2:]


def test_a_mixture_draws_each_source_by_its_quota_of_every_period_and_each_source_whole():
    """Weights 3:1:1 make every 5 consecutive draws 3, 1 and 1 of the sources (the counts say so
    without drawing), and each source goes through all of its examples before one repeats."""
    from harness.data import Mixture, draws_per_source

    sizes = (40, 7, 12)
    draws = Mixture(sizes, (3, 1, 1), seed=4)
    assert (draws.period, draws.quotas, draws.epoch_length) == (5, (3, 1, 1), 60)
    order = torch.cat([draws.order(epoch) for epoch in range(3)])
    source = torch.bucketize(order, torch.tensor(draws.offsets[1:]), right=True)
    assert (source.view(-1, 5).sort(dim=1).values == torch.tensor([0, 0, 0, 1, 2])).all()
    for i, n in enumerate(sizes):
        mine = order[source == i] - draws.offsets[i]
        passes = mine[: len(mine) // n * n].view(-1, n)
        assert (passes.sort(dim=1).values == torch.arange(n)).all()
    assert draws.counts(1, 23) == [(source[60:83] == i).sum().item() for i in range(3)]
    # 2 steps of 25 per epoch (the last 10 of each dropped), over 3 epochs
    assert draws_per_source(draws, world=1, micro=5, accum=5, steps=6) == [90, 30, 30]


# Two Ctrl-Cs delivered while the main thread is inside one call that does not return to the
# interpreter (here a lock wait with SIGINT blocked in that thread; in a run, a step's backward):
# the interpreter runs the Python handler once, after both.
TWO_CTRL_CS_IN_ONE_CALL = """
import os, signal, threading
from harness.preemption import StopFlag
stop = StopFlag(announce=True)
pressed = threading.Event()
def press_twice():
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})  # delivered here, not in the main thread
    os.kill(os.getpid(), signal.SIGINT)
    os.kill(os.getpid(), signal.SIGINT)
    pressed.set()
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
threading.Thread(target=press_twice).start()
pressed.wait()
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
print("went on after", "one Ctrl-C" if stop.interrupted else "none", flush=True)
"""


def test_the_launcher_reads_the_outcomes_of_the_last_attempt_s_ranks(tmp_path, monkeypatch):
    """torchrun restarts ranks whose files of outcomes keep their names: each names the process that
    left it, and the launcher reads those of the ranks torchrun last ran (or stopped)."""
    from harness.launch import run_outcome
    from harness.outcomes import OUTCOME_DIR, record_outcome

    monkeypatch.setenv(OUTCOME_DIR, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    assert record_outcome(2, "a refusal of this process")
    assert run_outcome(tmp_path, {os.getpid()}) == {
        "rank": 1,
        "pid": os.getpid(),
        "code": 2,
        "error": "a refusal of this process",
    }
    assert run_outcome(tmp_path, {os.getpid() + 1}) is None  # an earlier attempt's: not the run's


def test_two_ctrl_cs_within_one_call_stop_at_once():
    """They are a second Ctrl-C, as when they come apart: the process stops at once with 130 (before,
    its handler saw one, and the rank went on to save the step while its peers had stopped)."""
    proc = subprocess.run(
        [sys.executable, "-c", TWO_CTRL_CS_IN_ONE_CALL], cwd=HOME, env=env(), capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 130 and "went on" not in proc.stdout, proc.stdout + proc.stderr
    assert "interrupted again: stopping now, without saving this step" in proc.stderr


def test_a_snapshot_is_replayed_to_its_peak_and_read_without_running_code(tmp_path):
    """live_at_peak counts as max_memory_allocated does (a block freed is gone at free_requested,
    one allocated before the history began is not counted), by_site groups the live blocks by size
    and by the lines outside torch that allocated them, and read_snapshot refuses a pickle that
    names a function rather than calling it."""
    import pickle

    from harness.recordings import by_site, live_at_peak, read_snapshot

    def at(*names):
        return [
            {"filename": "/venv/lib/python3.12/site-packages/torch/nn/functional.py", "line": 1, "name": "linear"},
            *({"filename": "/repo/model.py", "line": line, "name": name} for line, name in names),
        ]

    a, b, c = at((10, "forward"), (20, "step")), at((30, "loss"), (20, "step")), at((40, "backward"))
    trace = [
        {"action": "free_requested", "addr": 99, "size": 7},  # allocated before recording
        {"action": "alloc", "addr": 1, "size": 100, "frames": a},
        {"action": "alloc", "addr": 2, "size": 100, "frames": a},
        {"action": "alloc", "addr": 3, "size": 50, "frames": b},
        {"action": "free_requested", "addr": 3, "size": 50},
        {"action": "free_completed", "addr": 3, "size": 50},
        {"action": "alloc", "addr": 4, "size": 120, "frames": c},  # the peak: 320
        {"action": "free_requested", "addr": 1, "size": 100},
        {"action": "alloc", "addr": 5, "size": 60, "frames": b},
    ]  # 280
    peak, live = live_at_peak(trace)
    assert peak == 320 and sorted(e["addr"] for e in live) == [1, 2, 4]
    sites = by_site(live, depth=2)
    assert [(s.block_bytes, s.blocks, s.frames) for s in sites] == [
        (100, 2, ("/repo/model.py:10 forward", "/repo/model.py:20 step")),
        (120, 1, ("/repo/model.py:40 backward",)),
    ]

    (tmp_path / "snapshot.pickle").write_bytes(pickle.dumps({"segments": [], "device_traces": [trace]}))
    assert read_snapshot(tmp_path / "snapshot.pickle")["device_traces"] == [trace]
    (tmp_path / "evil.pickle").write_bytes(pickle.dumps({"device_traces": [], "x": os.getcwd}))
    with pytest.raises(pickle.UnpicklingError, match="names posix.getcwd"):
        read_snapshot(tmp_path / "evil.pickle")


HOLD_THE_DIRECTORY = """
import sys, time
from pathlib import Path
sys.path.insert(0, {home!r})
import torch
from harness.distributed import DistInfo
from harness.out_dir import one_run_at_a_time
with one_run_at_a_time(Path({out!r}), DistInfo(0, 0, 1, torch.device("cpu"), joins_group=False)):
    print("holding", flush=True)
    time.sleep(600)
"""


def test_a_run_directory_holds_one_run_and_a_killed_run_leaves_it_free(tmp_path):
    """A second run is refused while the first holds the directory; SIGKILLed, the first leaves
    no lock behind (the kernel drops it). A refused run changes nothing on disk: no lock file in a
    directory that was there, no directory it made (nor their parents)."""
    from harness.distributed import DistInfo
    from harness.errors import UserError
    from harness.out_dir import one_run_at_a_time

    def listing() -> list[str]:
        return sorted(str(p.relative_to(tmp_path)) for p in tmp_path.rglob("*"))

    out, di = tmp_path / "run", DistInfo(0, 0, 1, torch.device("cpu"), joins_group=False)
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_DIRECTORY.format(home=str(HOME), out=str(out))],
        env=env(),
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline() == "holding\n"
        assert listing() == ["run"]
        with pytest.raises(UserError, match="is in use by another run"), one_run_at_a_time(out, di):
            pass
        assert listing() == ["run"]
    finally:
        holder.kill()
        holder.wait()
    with one_run_at_a_time(out, di):
        pass
    (tmp_path / "empty").mkdir()
    for refused in (tmp_path / "empty", tmp_path / "new" / "deeper"):
        before = listing()
        with pytest.raises(UserError, match="bad input"), one_run_at_a_time(refused, di):
            raise UserError("bad input")
        assert listing() == before, refused
