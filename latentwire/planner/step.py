"""train.py's step as the planner traces it and find_batch measures it: handed in
(`harness.recipe.TrainingStep`: train.py's `adamw` and `train_step`) and run on one LatentWire
micro-batch. A module of its own, light to import: train.py's recipe needs it on every run, the
tracer only with --elastic-batch."""

from __future__ import annotations

import runpy
from contextlib import nullcontext
from pathlib import Path

import torch

from ..harness.precision import AMP_DTYPES
from ..harness.recipe import TrainingStep
from ..objectives import WireTask

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"


def run_step(step: TrainingStep, cfg, model, llms: dict, optimizer, batch: dict, attention_backends: list) -> None:
    """One micro-batch through `step.train_step` with these SDPA kernels, then the update (no
    GradScaler: its fp16 loss scaling costs a few scalars)."""
    task = WireTask(llms, cfg.objectives, cfg.wire.num_latents)
    scaler = torch.amp.GradScaler(batch["bytes"].device.type, enabled=False)
    step.train_step(
        model,
        task,
        [batch],
        n_targets=task.counts(batch).float(),
        amp_dtype=AMP_DTYPES[cfg.numerics.precision],
        attention_backends=attention_backends,
        scaler=scaler,
        optimizer=optimizer,
        max_grad_norm=cfg.training.max_grad_norm,
        world_size=1,
        no_sync=nullcontext,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def script_step(path: Path = TRAIN_PY) -> TrainingStep:
    """The step of the train.py beside this package, for the commands that plan and measure it
    (`python -m latentwire.plan`, `find_batch`), which no run hands one. Read from the file by its
    path, not imported as `train`: from another directory that name finds another script or none."""
    script = runpy.run_path(str(path), run_name="latentwire_training_step")
    return TrainingStep(adamw=script["adamw"], train_step=script["train_step"])
