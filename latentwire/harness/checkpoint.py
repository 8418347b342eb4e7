"""Checkpoints: `checkpoints/step_<8 digits>/` holds

- `trainable.safetensors`: the trained weights (the model's state dict), plain tensor names,
  loadable with safetensors alone;
- `train_state.pt`: optimizer, LR schedule, grad scaler, data position and step;
- `rng_rank<R>.pt`: each rank's RNG states (python, numpy, torch, CUDA);
- `meta.json`: what the caller gives (its settings under "config"), the step, library versions.

A checkpoint is written into a temporary directory, fsynced and renamed, so it is either complete
or absent: a job killed mid-save never leaves a half checkpoint under a `step_` name.

A checkpoint is data: a directory someone else wrote (a shared filesystem, a colleague's run) is
read without running anything it holds. Its pickles are loaded with `weights_only=True`, which
builds tensors and plain values only, and numpy's RNG state (a uint32 array) as the one allowed
extra; anything else makes the checkpoint unreadable, and resume falls back to an older one.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .distributed import gather_objects
from .errors import CheckpointWriteFailed, Diverged, UserError

STEP_PREFIX = "step_"
WEIGHTS = "trainable.safetensors"
TRAIN_STATE = "train_state.pt"
META = "meta.json"


class CorruptCheckpoint(Exception):
    """A checkpoint directory that does not load; resume skips it for an older one."""


def checkpoint_dir(out_dir: Path, step: int) -> Path:
    return Path(out_dir) / "checkpoints" / f"{STEP_PREFIX}{step:08d}"


def _numpy_state_globals() -> list:
    """What unpickling numpy's RNG state needs: a uint32 array. No other dtype is allowed, so no
    object array, whose elements would be pickles of their own, can be built."""
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # numpy 1
        from numpy.core.multiarray import _reconstruct
    return [np.ndarray, np.dtype, np.dtypes.UInt32DType, _reconstruct]


def rng_state() -> dict:
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def versions() -> dict:
    return {"python": sys.version.split()[0], "torch": torch.__version__, "numpy": np.__version__}


def _fsync_dir(path: Path) -> None:
    """Make a directory's entries (new files, a rename) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def on_disk(directory: Path) -> None:
    """Every file of `directory`, and its entries, on the disk before a rename names it: the rename
    can reach the disk first, and a machine that lost power then would leave the name over empty
    files."""
    for f in directory.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    _fsync_dir(directory)


def first_non_finite(weights: dict) -> str | None:
    """The name of the first tensor holding a NaN or an inf; all are checked in one host sync."""
    finite = torch.stack([torch.isfinite(t).all() for t in weights.values()]).tolist()
    return next((name for name, ok in zip(weights, finite, strict=True) if not ok), None)


def save_checkpoint(out_dir: Path, step: int, weights: dict, train_state: dict, meta: dict, rank: int) -> Path:
    """Collective: every rank calls it. Rank 0 writes the shared state, each rank its RNG, in three
    phases (the temporary directory, the files, the rename); a write that fails on any rank in any
    phase ends every rank with the same CheckpointWriteFailed (exit 4), none left waiting for it.
    Non-finite weights are never saved: resuming from them could only diverge again. (A finite
    gradient times a bad learning rate makes them so without the gradient norm noticing.)"""
    from safetensors.torch import save_file

    bad = first_non_finite(weights)
    if bad is not None:  # the weights are DDP's, the same on every rank: every rank stops here
        newest = list_checkpoints(out_dir)
        raise Diverged(
            f"the weights are not finite at step {step} ({bad}), so they were not saved; the newest "
            f"good checkpoint is {newest[-1].name if newest else 'none'}; is the learning rate sane?"
        )
    final = checkpoint_dir(out_dir, step)
    tmp = final.with_name(f".{final.name}.tmp")

    def phase(write) -> None:
        """Run this rank's part of a phase; every rank learns whether any failed (exit 4 on all)."""
        try:
            write()
            failed = None
        except torch.OutOfMemoryError:
            raise
        except Exception as e:  # noqa: BLE001 - each writer reports a full disk in its own way
            failed = str(_write_failed(tmp, final, e, rank))
        failed = _first_failure(failed)
        if failed is not None:
            raise CheckpointWriteFailed(failed)

    def make_tmp() -> None:
        if rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # left by a job killed mid-save
            tmp.mkdir(parents=True)

    def write_files() -> None:
        torch.save(rng_state(), tmp / f"rng_rank{rank}.pt")
        if rank == 0:
            save_file({k: v.detach().contiguous().cpu() for k, v in weights.items()}, str(tmp / WEIGHTS))
            torch.save(train_state, tmp / TRAIN_STATE)
            record = {**meta, "step": step, "versions": {**versions(), **meta.get("versions", {})}}
            (tmp / META).write_text(json.dumps(record, indent=2))

    def publish() -> None:
        if rank == 0:
            on_disk(tmp)
            if final.exists():  # the same step saved again
                remove_checkpoint(final)
            os.replace(tmp, final)
            _fsync_dir(final.parent)

    for part in (make_tmp, write_files, publish):
        phase(part)
    return final


def _first_failure(failed: str | None) -> str | None:
    """Collective: the first rank's failure of a phase, on every rank (also its barrier)."""
    return next((f for f in gather_objects(failed) if f is not None), None)


def _write_failed(tmp: Path, final: Path, error: Exception, rank: int) -> CheckpointWriteFailed:
    """Remove the partial write (deleting works on a full disk) and say why it failed. A full disk
    is an OSError from Python's own writes, a SafetensorError from safetensors and a RuntimeError
    ("unexpected pos", no errno) from torch.save, so the free space is reported whatever it says.
    Rank 0 owns the temporary directory: another rank's failure leaves it to the next save."""
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
    message = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
    reason = (message.splitlines() or [""])[0]
    try:
        free = f"; {shutil.disk_usage(final.parent).free / 2**20:.1f} MiB free there"
    except OSError:
        free = ""
    return CheckpointWriteFailed(
        f"saving checkpoint {final.name} failed: {type(error).__name__}: {reason}{free}; earlier checkpoints are intact"
    )


def list_checkpoints(out_dir: Path) -> list[Path]:
    """Complete checkpoints, oldest first (temporary directories are not listed)."""
    root = Path(out_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and p.name.startswith(STEP_PREFIX))


def remove_checkpoint(path: Path) -> None:
    """Renamed out of the `step_` names first, then deleted: deleting takes many calls, and a job
    killed between them must not leave a `step_` directory with some of its files gone."""
    doomed = path.with_name(f".{path.name}.removing")
    shutil.rmtree(doomed, ignore_errors=True)  # left by a job killed mid-delete
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def prune_checkpoints(out_dir: Path, keep: int) -> None:
    """Remove all but the newest `keep`. An old checkpoint that cannot be removed stays, with a
    warning: the run that has just saved goes on."""
    for leftover in (Path(out_dir) / "checkpoints").glob(f".{STEP_PREFIX}*.removing"):  # a kill mid-delete
        shutil.rmtree(leftover, ignore_errors=True)
    for old in list_checkpoints(out_dir)[:-keep]:
        try:
            remove_checkpoint(old)
        except OSError as e:
            print(f"warning: could not remove old checkpoint {old}: {e.strerror}", file=sys.stderr, flush=True)


def restore_rng(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def load_checkpoint(path: Path, rank: int) -> dict:
    """Everything a resume needs, read and checked; raises CorruptCheckpoint if anything is off."""
    from safetensors.torch import load_file

    try:
        meta = json.loads((path / META).read_text())
        weights = load_file(str(path / WEIGHTS))
        train_state = torch.load(path / TRAIN_STATE, map_location="cpu", weights_only=True)
        rng_file = path / f"rng_rank{rank}.pt"
        # A rank beyond the saving world (resume with more ranks) starts its RNG from rank 0's.
        with torch.serialization.safe_globals(_numpy_state_globals()):
            rng = torch.load(rng_file if rng_file.exists() else path / "rng_rank0.pt", weights_only=True)
    except pickle.UnpicklingError as e:  # weights_only refused a global: the pickle holds more than data
        refused = next((line for line in str(e).splitlines() if "but got" in line or "GLOBAL" in line), "")
        raise CorruptCheckpoint(
            f"{path}: a pickle holds more than tensors and plain values, so it is not read "
            f"(reading it could run code){': ' + refused.strip() if refused else ''}"
        ) from None
    except Exception as e:  # safetensors, pickle and json each raise their own types for a bad file
        raise CorruptCheckpoint(f"{path}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}") from None
    if train_state.get("step") != meta.get("step"):
        raise CorruptCheckpoint(f"{path}: meta.json and {TRAIN_STATE} disagree on the step")
    return {"path": path, "meta": meta, "weights": weights, "train_state": train_state, "rng": rng}


def load_weights(ckpt: Path, model, what: str) -> None:
    """A checkpoint's trained weights into `model` (`what` names it in an error), checked first."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = ckpt / WEIGHTS
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    check_weights(state, model.state_dict(), path, what)
    model.load_state_dict(state)


def check_weights(state: dict, expected: dict, path: Path, model: str) -> None:
    """Names and shapes must match `model` (what the caller builds): a one-line error, not a dump."""
    missing, unexpected = sorted(expected.keys() - state.keys()), sorted(state.keys() - expected.keys())
    if missing or unexpected:
        what = f"lacks tensor {missing[0]!r}" if missing else f"has unknown tensor {unexpected[0]!r}"
        raise UserError(f"{path} does not fit {model}: it {what}")
    for name, tensor in expected.items():
        if state[name].shape != tensor.shape:
            raise UserError(
                f"{path} does not fit {model}: tensor {name!r} has shape "
                f"{tuple(state[name].shape)}, expected {tuple(tensor.shape)}"
            )


@dataclass
class TrainState:
    """Where a run is, besides its weights and optimizer: the last finished optimizer step, and
    the data position after it (the epoch and how many of its examples the steps used) under a
    layout (world size, micro-batch, accumulation) that gives that position its meaning, in the
    training set `data` names (harness.resume.data_identity)."""

    step: int
    epoch: int
    examples_done: int
    layout: tuple[int, int, int]
    data: dict


class Checkpointer:
    """One run's checkpoints: the format written and read in one place. It holds the stateful
    objects, saves them with a TrainState (`save`, collective: every rank calls it), and puts a
    loaded checkpoint back into the same objects (`restore`). Which checkpoint a run resumes from
    is `harness.resume`'s."""

    def __init__(self, out_dir: Path, *, rank: int, keep: int, meta: dict, model, optimizer, scheduler, scaler):
        """`meta` goes into meta.json: the run's settings (flat name -> value) under "config", and
        whatever else the caller records (versions of its own libraries under "versions"); `keep`
        is how many of the newest checkpoints stay on disk."""
        self.out_dir, self.rank, self.keep, self.meta = Path(out_dir), rank, keep, meta
        self.model, self.optimizer, self.scheduler, self.scaler = model, optimizer, scheduler, scaler

    def save(self, state: TrainState) -> Path:
        train_state = {
            "step": state.step,
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "data": {
                "epoch": state.epoch,
                "examples_done": state.examples_done,
                "layout": list(state.layout),
                "identity": state.data,
            },
        }
        path = save_checkpoint(self.out_dir, state.step, self.model.state_dict(), train_state, self.meta, self.rank)
        if self.rank == 0:
            prune_checkpoints(self.out_dir, self.keep)
        return path

    def restore(self, ckpt: dict) -> TrainState:
        """A loaded checkpoint (load_checkpoint's) back into the weights, optimizer, schedule, grad
        scaler and this process's RNGs, and where the run's weights began (`init_from`, which every
        later checkpoint records too); the TrainState is the saved one, layout included."""
        check_weights(ckpt["weights"], self.model.state_dict(), ckpt["path"] / WEIGHTS, "the configured model")
        self.model.load_state_dict(ckpt["weights"])
        state = ckpt["train_state"]
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        restore_rng(ckpt["rng"])
        self.meta = {**self.meta, "init_from": ckpt["meta"].get("init_from")}
        data = state["data"]
        return TrainState(state["step"], data["epoch"], data["examples_done"], tuple(data["layout"]), data["identity"])
