"""Resume policy: which checkpoint a run continues from, what a resume may not change, and where
the continued run stands. The format itself (what a checkpoint holds, written whole or not at all)
is `harness.checkpoint`'s.

- The newest checkpoint that every rank loads is resumed; a partial or corrupt newer one is
  skipped with a warning (`load_newest_checkpoint`).
- A setting the checkpoint's state carries (its optimizer, schedule and grad scaler, the model's
  shape) may not change: the state would silently override the new value while meta.json recorded
  it. Refused in one line, before anything heavy loads, from the newest meta.json, and again on the
  checkpoint that loads.
- A data position means something only in the same training set: each checkpoint records its
  data's identity (`harness.data_identity`), and a resume on other data is refused unless --new-data starts
  a fresh epoch of it with the resumed weights and optimizer.
- `--init-from` starts a new run from a checkpoint's weights, refused where they were trained for
  another shape (the settings declared `weights=True`).
- A checkpoint's settings are read as this code's version of them reads them (`Schema.saved`): one
  written before a setting existed ran at the value it declares for earlier versions, and a resume
  keeps that value where the command does not give one (`config_for_resume`), not the profile's;
  a checkpoint of a newer version is refused.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from .checkpoint import META, WEIGHTS, Checkpointer, CorruptCheckpoint, TrainState, list_checkpoints, load_checkpoint
from .config import Schema, flag_and_value
from .data_identity import describe_data, same_data
from .distributed import gather_objects
from .errors import UserError
from .out_dir import started_by_this_job

# --- which checkpoint ---------------------------------------------------------------------------------


def newest_meta(out_dir: Path) -> tuple[Path, dict] | None:
    """The newest checkpoint whose meta.json reads, and what it says: what a resume can be checked
    against before anything heavy loads (the checkpoint itself is loaded later, by `resume`)."""
    for path in reversed(list_checkpoints(out_dir)):
        try:
            return path, json.loads((path / META).read_text())
        except (OSError, ValueError):
            continue
    return None


def no_checkpoint(out_dir: Path) -> UserError:
    return UserError(f"no usable checkpoint to resume from in {Path(out_dir) / 'checkpoints'}: there is none")


def load_newest_checkpoint(out_dir: Path, rank: int, warn) -> dict:
    """Collective: the newest checkpoint that every rank loads (each reads its own RNG file, so
    ranks can disagree; they must not resume from different steps). A partial or corrupt newer one
    is skipped with a warning; if none loads, one error line says why the newest did not."""
    unreadable = []
    for path in reversed(list_checkpoints(out_dir)):
        try:
            ckpt, reason = load_checkpoint(path, rank), None
        except CorruptCheckpoint as e:
            ckpt, reason = None, str(e)
        if not all(gather_objects(ckpt is not None)):  # a collective: every rank the same checkpoint
            unreadable.append(reason or f"{path}: unreadable on another rank")
            continue
        for reason in unreadable:
            warn(f"warning: skipping unreadable checkpoint {reason}")
        return ckpt
    if not unreadable:
        raise no_checkpoint(out_dir)
    where = Path(out_dir) / "checkpoints"
    older = f" (and {len(unreadable) - 1} older ones)" if len(unreadable) > 1 else ""
    raise UserError(f"no usable checkpoint to resume from in {where}: {unreadable[0]}{older}")


def resolve_checkpoint(path: Path, flag: str) -> Path:
    """A checkpoint directory, or a run directory standing for its newest complete checkpoint, as
    `flag` (the command-line flag that named it) gave it."""
    try:
        if not path.is_dir():
            raise UserError(f"{flag} {path} is not a directory")
        if (path / "checkpoints").is_dir():
            complete = list_checkpoints(path)
            if not complete:
                raise UserError(f"run {path} has no complete checkpoint")
            path = complete[-1]
        for name in (WEIGHTS, META):
            if not (path / name).is_file():
                raise UserError(f"{flag} {path} is not a complete checkpoint: it has no {name}")
    except OSError as e:  # a directory this user may not look into
        raise UserError(f"{flag} {path} cannot be read: {e.strerror}") from None
    return path


# --- what a resume may not change ---------------------------------------------------------------------


def check_restored_settings(
    config: dict, saved: dict, restored: tuple[str, ...], setting=None, new_run: str = "start a new run"
) -> None:
    """Refuse, in one line, a resume that changes one of the `restored` settings, each named as it
    was given (`setting(name, value)`: its flag, or its profile's field; by default the flag).
    `new_run`: what the line offers instead."""
    setting = setting or (lambda name, value: f"--{name.replace('_', '-')} {value}")
    changed = [
        f"{setting(name, config[name])} (the run's: {saved.get(name)})"
        for name in restored
        if config[name] != saved.get(name)
    ]
    if changed:
        raise UserError(
            f"{', '.join(changed)}: the checkpoint's state (its optimizer and schedule, or its weights' "
            f"shape) holds the run's values; resume without changing them, or {new_run}"
        )


def check_stop_at_step(stop_at_step: int | None, saved_step: int) -> None:
    if stop_at_step is not None and stop_at_step <= saved_step:
        raise UserError(f"--stop-at-step {stop_at_step} is not after the resumed step {saved_step}")


def check_same_data(path: Path, saved: dict, fresh: dict, new_data: bool) -> None:
    """Refuse a resume on other training data than the checkpoint's, unless `new_data`."""
    if not same_data(saved, fresh) and not new_data:
        raise UserError(
            f"--resume on other training data: {path.name} trained on {describe_data(saved)}, this "
            f"run loads {describe_data(fresh)}; resume with the same data, or add --new-data to "
            "train on this data from a fresh epoch with the resumed weights and optimizer"
        )


def config_for_resume(cfg, out_dir: Path):
    """`cfg` (a LoopConfig) for a resume of the run in `out_dir`, and the line that says what it took:
    each setting its newest checkpoint's settings version predates, where the command gives none, at
    the value that version ran with (the profile's newer default would be another run: another shape,
    other data). A checkpoint of a newer version is refused here, before anything loads."""
    found = newest_meta(out_dir)
    if found is None:
        return cfg, None
    path, meta = found
    schema = cfg.schema()
    saved = schema.saved(meta, str(path / META))
    flat = cfg.flat()
    predated = saved.keys() - meta["config"].keys() - set(cfg.invocation.given)
    taken = {key: saved[key] for key in schema.fields if key in predated and saved[key] != flat[key]}
    if not taken:
        return cfg, None
    values = flat | taken
    schema.rules(values, f"the settings of {path.name}")
    said = ", ".join(f"{key} {value}" for key, value in taken.items())
    return type(cfg).of(values, cfg.invocation), f"resume: {said}, as {path.name} ran (it predates these settings)"


def check_resume_settings(out_dir: Path, config: dict, schema: Schema, flags) -> None:
    """What the newest checkpoint's meta.json says of a resume, before anything heavy loads: no
    checkpoint, a changed restored setting (of `schema`), --stop-at-step not after it. `resume`
    checks the checkpoint that loads again (a newer one that does not load is skipped there).
    `flags`: the invocation's (Invocation)."""
    if not list_checkpoints(out_dir):
        raise no_checkpoint(out_dir)
    found = newest_meta(out_dir)
    if found is None:  # none reads: resume says why, once it has tried each
        return
    path, meta = found
    check_restored_settings(
        config,
        schema.saved(meta, str(path / META)),
        schema.restored(),
        flags.setting,
        new_run=f"start a new run from its weights: --init-from {out_dir} with another --out-dir",
    )
    check_stop_at_step(flags.stop_at_step, meta["step"])


def check_resume_data(out_dir: Path, fresh: dict, new_data: bool) -> None:
    """The newest meta.json's training data against this run's, before the model loads."""
    found = newest_meta(out_dir)
    if found is not None:
        check_same_data(found[0], found[1]["data"], fresh, new_data)


def check_init_from(path: Path, config: dict, schema: Schema) -> None:
    """--init-from's checkpoint, refused in one line where its weights were trained with other
    weight settings of `schema` (another shape, other frozen parts) than `config`'s, or where its
    settings are of a newer version."""
    try:
        meta = json.loads((path / META).read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise UserError(f"--init-from {path}: its {META} does not read ({type(e).__name__}: {e})") from None
    saved = schema.saved(meta, f"--init-from {path / META}")
    different = [name for name in schema.weight_fields() if saved.get(name) != config[name]]
    if different:
        trained = ", ".join(f"{name} {saved.get(name)} (this run: {config[name]})" for name in different)
        raise UserError(
            f"--init-from {path}: its weights were trained with {trained}; give this run the same shape "
            f"({' '.join(flag_and_value(name, saved.get(name)) for name in different)})"
        )


def flags_for_requeue(flags, out_dir: Path, restarted: bool):
    """A requeued job's flags (`--requeued`): it resumes where its run has a checkpoint, even if
    the command said --overwrite (its first start did that), and starts the run where it has none
    (preempted before the first save: while loading, or at a multi-node rendezvous); and the line
    that says which. A run torchrun `restarted` is continued alike where this torchrun job started
    it (out_dir names the job: an attempt refused before it started leaves the refusal standing),
    and where it has no checkpoint starts again over what its first attempt left (`restarted` in
    the flags: out_dir holds this run's own files, which its new log replaces step by step)."""
    ours = restarted and started_by_this_job(out_dir)
    if not (flags.requeued or ours) or flags.resume:
        return flags, None
    who = "requeued" if flags.requeued else "restarted by torchrun"
    if list_checkpoints(out_dir):
        return replace(flags, resume=True, overwrite=False), f"{who}: resuming the run from its newest checkpoint"
    before = f"{who} before the run's first checkpoint"
    if ours:
        return replace(flags, overwrite=False, restarted=True), f"{before}: starting it over"
    return flags, f"{before}: starting it"


# --- the continued run -------------------------------------------------------------------------------


def resume(
    checkpointer: Checkpointer,
    fresh: TrainState,
    config: dict,
    schema: Schema,
    max_steps: int,
    flags=None,
    say=print,
    warn=print,
) -> TrainState | None:
    """Collective: the newest checkpoint every rank loads, restored, and continued with this run's
    layout and data (`fresh`'s); None when the run has already finished. `config`: this run's
    settings, of which the restored ones of `schema` may not differ from the checkpoint's (as this
    version reads them); `flags`: the invocation's
    (`--stop-at-step`, `--new-data`, and how a setting was given), none by default; `say` and `warn`
    print."""
    stop_at_step, new_data = (flags.stop_at_step, flags.new_data) if flags else (None, False)
    setting = flags.setting if flags else None
    ckpt = load_newest_checkpoint(checkpointer.out_dir, checkpointer.rank, warn)
    path = ckpt["path"]
    check_restored_settings(config, schema.saved(ckpt["meta"], str(path / META)), schema.restored(), setting)
    saved = checkpointer.restore(ckpt)
    check_stop_at_step(stop_at_step, saved.step)
    check_same_data(path, saved.data, fresh.data, new_data)
    if saved.step >= max_steps:
        say(f"{path} is the run's last step ({max_steps}): nothing to do, nothing changed")
        return None
    fresh_epoch = new_data and not same_data(saved.data, fresh.data)  # the same data: its position holds
    if fresh_epoch:
        saved = replace(saved, epoch=saved.epoch + 1, examples_done=0)
    say(
        f"resumed from {path} (step {saved.step}, epoch {saved.epoch}, {saved.examples_done} examples into it)"
        + (f"; --new-data: a fresh epoch of {describe_data(fresh.data)}" if fresh_epoch else "")
    )
    if saved.layout != fresh.layout:
        warn(
            f"note: layout (world, micro-batch, accumulation) is {fresh.layout}, the checkpoint's was "
            f"{saved.layout}: the sample order is kept, but the run is bitwise identical to an unbroken one only "
            "for the same layout"
        )
    return replace(saved, layout=fresh.layout, data=fresh.data)
