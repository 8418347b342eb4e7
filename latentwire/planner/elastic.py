"""Elastic batch: the micro-batch from the memory plan, the global batch kept.

The profile asks for a global batch (micro-batch x accumulation x world size). With
`--elastic-batch true` the micro-batch becomes the largest the plan fits that divides the
per-rank batch, and accumulation makes up the rest, so the optimisation is unchanged. When the
only exact splits would waste most of the card (the per-rank batch has no divisor near what fits,
e.g. a prime), the global batch changes by less than one micro-batch per rank, and the learning
rate follows the profile's `lr_scaling` rule.
"""

from __future__ import annotations

import dataclasses
import math

from ..harness.errors import UserError
from ..harness.layout import scaled_lr
from ..harness.recipe import TrainingStep

# An exact split may take up to this many times the fewest micro-steps per optimizer step (its
# micro-batches are then at least about half of what fits, which still keeps a large GPU busy);
# past that the global batch changes instead.
MAX_MICRO_STEP_FACTOR = 2


def elastic_batch(cfg, world_size: int, fits: int) -> tuple[int, int, float, str]:
    """(micro_batch_size, grad_accum_steps, lr, message) for a rank that fits micro-batches up to `fits`."""
    if fits < 1:
        raise UserError(
            f"elastic batch: the memory plan of profile {cfg.invocation.profile!r} fits no micro-batch "
            "on this card, not even 1"
        )
    global_batch = cfg.training.micro_batch_size * cfg.training.grad_accum_steps * world_size
    per_rank = global_batch // world_size
    fewest_steps = math.ceil(per_rank / fits)
    exact = max(d for d in range(1, min(per_rank, fits) + 1) if per_rank % d == 0)
    was = f"(profile: {cfg.training.micro_batch_size} x {cfg.training.grad_accum_steps})"
    head = f"elastic batch: the memory plan fits micro-batch <= {fits} per rank {was}; "
    if per_rank // exact <= MAX_MICRO_STEP_FACTOR * fewest_steps:
        accum = per_rank // exact
        return (
            exact,
            accum,
            cfg.optimizer.lr,
            (
                head + f"global batch {global_batch} kept as {exact} x {accum} x "
                f"{world_size} rank(s); lr {cfg.optimizer.lr:.3g} unchanged"
            ),
        )
    micro = math.ceil(per_rank / fewest_steps)
    new_global = micro * fewest_steps * world_size
    lr = scaled_lr(cfg.optimizer.lr, global_batch, new_global, cfg.training.lr_scaling)
    return (
        micro,
        fewest_steps,
        lr,
        (
            head + f"{per_rank} per rank splits exactly only into micro-batches of {exact} or less, so the global "
            f"batch changes {global_batch} -> {new_global} ({micro} x {fewest_steps} x {world_size} rank(s)) and "
            f"lr {cfg.optimizer.lr:.3g} -> {lr:.3g} by the {cfg.training.lr_scaling} rule"
        ),
    )


def apply_elastic_batch(cfg, world_size: int, step: TrainingStep):
    """The configuration with micro-batch, accumulation and lr from the memory plan of `step`
    (train.py's), and why."""
    # The tracer (MemTracker, and inductor with it) is imported only when a run asks for it.
    from .memory_plan import plan_max_micro_batch

    micro, accum, lr, message = elastic_batch(cfg, world_size, plan_max_micro_batch(cfg, world_size, step))
    training = dataclasses.replace(cfg.training, micro_batch_size=micro, grad_accum_steps=accum)
    return dataclasses.replace(cfg, training=training, optimizer=dataclasses.replace(cfg.optimizer, lr=lr)), message
