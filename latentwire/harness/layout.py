"""The batch and lr policy: a profile's global batch laid out on the world that runs it.

A profile means a global batch (micro-batch x accumulation x the ranks it is laid out for,
`num_gpus`) and an lr tuned for that batch. On another number of ranks (torchrun
--nproc_per_node=4 with a one-GPU profile, plain python with a 2-rank profile) the batch is kept
where it splits, else each rank keeps the profile's micro-batch and accumulation and the lr follows
the profile's `lr_scaling` rule. A micro-batch or accumulation given as a flag is taken as given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace


def scaled_lr(lr: float, old_batch: int, new_batch: int, rule: str) -> float:
    """sqrt: the square-root rule for Adam-type optimizers (Malladi et al., 2022); linear: the
    linear rule for SGD (Goyal et al., 2017)."""
    ratio = new_batch / old_batch
    return lr * (math.sqrt(ratio) if rule == "sqrt" else ratio)


@dataclass(frozen=True)
class Layout:
    micro_batch_size: int
    grad_accum_steps: int
    lr: float
    why: str  # one line for the run's start


def layout_for_world(micro: int, accum: int, laid_out_for: int, world: int, lr: float, rule: str) -> Layout:
    """A profile's batch on the world that runs it. The profile means a global batch (micro x
    accum x the ranks it is laid out for), and its lr was tuned for that batch: another world size
    keeps it, each rank taking its share in micro-batches no larger than the profile's (so what fit
    still fits) and as large as an exact split allows. Where no exact split keeps micro-batches of
    at least half the profile's (the share is not a whole number, or has no such divisor), each rank
    keeps the profile's micro-batch and accumulation, the global batch follows the world, and the
    lr follows the profile's `rule` (scaled_lr)."""
    profile_batch = micro * accum * laid_out_for
    said = f"global batch {profile_batch} ({micro} x {accum} x {laid_out_for}, as the profile lays it out)"
    if world == laid_out_for:
        return Layout(micro, accum, lr, said)
    share = profile_batch / world
    if share.is_integer():
        share = int(share)
        split = max(d for d in range(1, min(micro, share) + 1) if share % d == 0)
        if 2 * split >= min(micro, share):
            return Layout(
                split,
                share // split,
                lr,
                f"{said} kept on {world} rank(s) as {split} x {share // split} x {world}; lr {lr:.3g} unchanged",
            )
    new_batch = micro * accum * world
    new_lr = scaled_lr(lr, profile_batch, new_batch, rule)
    return Layout(
        micro,
        accum,
        new_lr,
        f"{said} does not split well over {world} rank(s), so each keeps "
        f"{micro} x {accum}: global batch {new_batch}, lr {lr:.3g} -> {new_lr:.3g} by "
        f"the {rule} rule",
    )


def config_for_world(cfg, world: int):
    """`cfg` (a LoopConfig) with the profile's batch laid out on `world` ranks, and the line that
    says so (None where the micro-batch or accumulation was given as a flag: taken as given). An
    lr given as a flag is the user's."""
    given, training = set(cfg.invocation.given), cfg.training
    if {"micro_batch_size", "grad_accum_steps"} & given:
        return cfg, None
    layout = layout_for_world(
        training.micro_batch_size,
        training.grad_accum_steps,
        training.num_gpus,
        world,
        cfg.optimizer.lr,
        training.lr_scaling,
    )
    lr = cfg.optimizer.lr if "lr" in given else layout.lr
    cfg = replace(
        cfg,
        training=replace(training, micro_batch_size=layout.micro_batch_size, grad_accum_steps=layout.grad_accum_steps),
        optimizer=replace(cfg.optimizer, lr=lr),
    )
    return cfg, f"batch: {layout.why}" + ("; --lr as given" if lr != layout.lr else "")
