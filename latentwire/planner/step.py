"""The step the planner traces and find_batch measures: train.py's own, handed in. A module of its
own, light to import: train.py needs it on every run, the tracer only with --elastic-batch."""
from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable

import torch

from ..harness.precision import AMP_DTYPES
from ..objectives import WireTask


@dataclass(frozen=True)
class TrainingStep:
    """train.py's `adamw` and `train_step`, handed in by whoever plans
    (train.py for --elastic-batch, the commands import them from it): what is planned and measured
    is what trains, and the planner never imports the script that uses it."""
    adamw: Callable
    train_step: Callable

    def run(self, cfg, model, llms: dict, optimizer, batch: dict, attention_backends: list) -> None:
        """One micro-batch through `train_step` with these SDPA kernels, then the update (no
        GradScaler: its fp16 loss scaling costs a few scalars)."""
        task = WireTask(llms, cfg.objectives, cfg.wire.num_latents)
        scaler = torch.amp.GradScaler(batch["bytes"].device.type, enabled=False)
        self.train_step(model, task, [batch], n_targets=task.counts(batch).float(),
                        amp_dtype=AMP_DTYPES[cfg.numerics.precision], attention_backends=attention_backends,
                        scaler=scaler, optimizer=optimizer, max_grad_norm=cfg.training.max_grad_norm, world_size=1,
                        no_sync=nullcontext)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
