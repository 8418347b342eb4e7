"""The run's directory (`--out-dir`): one run at a time in it, checked before anything is written.

- One run at a time: rank 0 holds an exclusive lock (`flock`) on the directory itself for the run's
  life. A second run started on the same directory (an `sbatch` sent twice, a second terminal) is
  refused in one line before anything heavy loads, and the first is untouched: two runs in one
  directory would each overwrite the other's checkpoints and metrics. The kernel drops the lock
  when the holder exits, however it exits, so a killed run never leaves it stuck, and the lock is
  no file: a refused run leaves the directory as it found it (one it made for the lock, removed).
- A directory that already holds a run (its metrics or a checkpoint) is refused unless the run is
  resumed (`--resume`) or replaced (`--overwrite`), and `--overwrite` deletes the old run's files
  only once every input has been checked, so a refused run never damages what is on disk.
- The run must be able to write where it writes (the directory and its `checkpoints/`): checked
  before anything heavy loads, not found at the first save after hours of training.
- A run started by torchrun names its job there (`TORCHRUN_JOB`): when torchrun restarts the job,
  the directory is known to hold the job's own run (harness.resume.flags_for_requeue).
"""

from __future__ import annotations

import fcntl
import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from .checkpoint import list_checkpoints
from .config import check_can_create
from .distributed import DistInfo, broadcast_from_main, torchrun_job
from .errors import UserError

TORCHRUN_JOB = "torchrun_job"  # the torchrun job that started the run here (harness.distributed.torchrun_job)
# What a run writes under its directory, and `--overwrite` removes.
RUN_FILES = ("metrics.jsonl", "tb", "checkpoints", "traces", TORCHRUN_JOB)


@contextmanager
def one_run_at_a_time(out_dir: Path, di: DistInfo) -> Iterator[None]:
    """Collective: the body runs while this run holds `out_dir`'s lock, or every rank raises a
    UserError naming it if another run holds it. The directories made here for the lock are removed
    again if the body refuses the run (UserError) before writing anything else into them."""
    made, fd, refusal = [], None, None
    if di.is_main:
        try:
            check_can_create(out_dir, "out_dir")  # first: a directory this user may not look into
            fd, made = _take_lock(out_dir)
        except UserError as e:
            refusal = str(e)
        if fd is None and refusal is None:
            refusal = (
                f"{out_dir} is in use by another run, which holds its lock; wait for it to end, or give this "
                "run another --out-dir"
            )
    refusal = broadcast_from_main(refusal)
    if refusal is not None:
        raise UserError(refusal)
    try:
        yield
    except UserError:
        if fd is not None:
            for path in made:  # deepest first, while the lock is held: see _take_lock
                _remove_if_empty(path)
            os.close(fd)
        raise


def _take_lock(out_dir: Path) -> tuple[int | None, list[Path]]:
    """The directory's file descriptor, locked and held open for the process's life (None if another
    process holds the lock), and the directories made for it, deepest first. A filesystem without
    locks holds none and refuses none."""
    while True:
        made = _make_dirs(out_dir)
        try:
            fd = os.open(out_dir, os.O_RDONLY | os.O_DIRECTORY)
        except FileNotFoundError:  # removed meanwhile by a refused run that had made it
            continue
        except OSError as e:
            raise UserError(f"cannot create out_dir {out_dir}: {e.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return None, made
        except OSError:
            return fd, made
        # A refused run that made the directory removes it before it lets the lock go: a lock taken
        # then is on a directory no longer there, and the one there now (if any) is locked instead.
        if _same_file(fd, out_dir):
            return fd, made
        os.close(fd)


def _make_dirs(path: Path) -> list[Path]:
    """`path` made with its missing parents; those this call made, deepest first."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    made = []
    for directory in reversed(missing):
        try:
            directory.mkdir()
            made.append(directory)
        except FileExistsError:  # made meanwhile by another run: not this one's to remove
            pass
        except OSError as e:
            raise UserError(f"cannot create out_dir {missing[0]}: {e.strerror}") from None
    return made[::-1]


def _same_file(fd: int, path: Path) -> bool:
    try:
        here = path.stat()
    except FileNotFoundError:
        return False
    held = os.fstat(fd)
    return (held.st_dev, held.st_ino) == (here.st_dev, here.st_ino)


def _remove_if_empty(path: Path) -> None:
    try:
        path.rmdir()
    except OSError:
        pass


def check_out_dir(out_dir: Path, continues: bool, overwrite: bool) -> None:
    """Refuse to mix two runs in one directory unless the run there is continued (--resume, or a
    torchrun restart of the job that started it) or overwritten, and refuse a run that could not
    write its metrics or checkpoints there, before anything is written."""
    check_can_create(out_dir, "out_dir")  # first: the look inside needs a directory this user may search
    check_can_create(out_dir / "checkpoints", "the checkpoint directory")
    holds_run = (out_dir / "metrics.jsonl").exists() or bool(list_checkpoints(out_dir))
    if holds_run and not (continues or overwrite):
        raise UserError(f"{out_dir} already holds a run; pass --resume to continue it or --overwrite to replace it")


def prepare_out_dir(out_dir: Path, overwrite: bool) -> None:
    """The directory made, and with `overwrite` the old run's files removed; the torchrun job that
    runs it named there."""
    if overwrite:
        for name in RUN_FILES:
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        if torchrun_job() is not None:
            (out_dir / TORCHRUN_JOB).write_text(torchrun_job())
    except OSError as e:
        raise UserError(f"cannot create out_dir {out_dir}: {e.strerror}") from None


def started_by_this_job(out_dir: Path) -> bool:
    """Whether this torchrun job started the run in `out_dir` (an earlier attempt of it did)."""
    try:
        return torchrun_job() is not None and (out_dir / TORCHRUN_JOB).read_text() == torchrun_job()
    except OSError:
        return False
