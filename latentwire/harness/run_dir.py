"""The run's directory (`--out-dir`): one run at a time in it, checked before anything is written.

A directory that already holds a run (its metrics or a checkpoint) is refused unless the run is
resumed (`--resume`) or replaced (`--overwrite`), and `--overwrite` deletes the old run's files
only once every input has been checked, so a refused run never damages what is on disk.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from .checkpoint import list_checkpoints
from .config import check_can_create
from .errors import UserError

# What a run writes under its directory, and `--overwrite` removes.
RUN_FILES = ("metrics.jsonl", "tb", "checkpoints", "traces")


def check_out_dir(out_dir: Path, resume: bool, overwrite: bool) -> None:
    """Refuse to mix two runs in one directory unless asked to resume or overwrite, and refuse a
    directory that cannot be created, before anything is written."""
    check_can_create(out_dir, "out_dir")  # first: the look inside needs a directory this user may search
    holds_run = (out_dir / "metrics.jsonl").exists() or bool(list_checkpoints(out_dir))
    if holds_run and not (resume or overwrite):
        raise UserError(f"{out_dir} already holds a run; pass --resume to continue it or --overwrite to replace it")


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    """The directory made, and with `overwrite` the old run's files removed."""
    if overwrite:
        for name in RUN_FILES:
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create out_dir {out_dir}: {e.strerror}") from None
