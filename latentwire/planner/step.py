"""train.py's step as the planner traces it and find_batch measures it: handed in
(`harness.recipe.TrainingStep`: train.py's `adamw` and `train_step`, by a run, or read from the
script by the commands, `planner.script`) and run on one LatentWire micro-batch."""

from __future__ import annotations

from contextlib import nullcontext

import torch

from ..harness.precision import AMP_DTYPES
from ..harness.recipe import TrainingStep
from ..objectives import WireTask


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
