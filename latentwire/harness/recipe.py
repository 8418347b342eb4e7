"""The seam between train.py and the model it trains, as two Protocols: what the loop's setup asks
of the model (`Recipe`, as torchtitan's model spec and parallelize function serve its trainer) and
what its step asks about a micro-batch (`Task`). train.py names nothing of the model: to train
another one, write a recipe and a task, and name the recipe in train.py's import (docs/loop.md,
"Lifting the loop"). `tests/toy_train.py`'s RegressionTask is a Task of a few lines.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import torch
from torch import nn


class Task(Protocol):
    """What the step asks of the model about a micro-batch, as tensors on its device (no host
    sync). Every loss term is a sum over the micro-batch divided by its count in the whole global
    batch, which is what makes accumulation and DDP exact."""

    def counts(self, batch: dict) -> torch.Tensor:
        """What each loss term sums over; summed over the global batch, the term's normaliser."""

    def loss_sums(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The terms' sums, in the shape of `counts`: the forward pass."""

    def objective(self, terms: torch.Tensor) -> torch.Tensor:
        """The scalar backward starts from, from the terms over their global counts."""

    def tokens(self, batch: dict) -> torch.Tensor:
        """The positions the model reads in this micro-batch, without padding (`tokens_per_s`), a
        0-dim int64 tensor on its device."""

    def target_tokens(self, counts: torch.Tensor) -> torch.Tensor:
        """The positions the loss is taken at, from the global counts (`target_tokens_per_s`)."""

    def record(self, terms: torch.Tensor) -> dict:
        """The logged losses, from the step's terms (one read from the device)."""


class Recipe(Protocol):
    """What train.py's setup asks of the model, in the order it asks. Built by one call,
    `Recipe(cfg, di, stop)`, from the final configuration, the rank (`harness.distributed.DistInfo`)
    and `stop()` (a collective: nonzero once any rank was signalled); building it loads and checks
    the data, nothing heavy."""

    # Its LoopConfig extension: the model's fields and sections, and which of them a resume may not
    # change (RESTORED) or its trained weights depend on (WEIGHT_FIELDS, for --init-from).
    Config: type
    dataset: Sequence  # the training examples the sampler indexes
    data_identity: dict  # what a checkpoint records of them (harness.resume.data_identity)
    data_facts: dict  # for the run's first metrics record

    def build_model(self, compile_options: dict | None, checkpointing: dict | None) -> tuple[nn.Module, Task]:
        """The trainable model on the rank's device, and the task the step asks. The model's
        frozen parts, if any, are built, wrapped (its checkpointed regions in `checkpoint_wrapper`
        with `checkpointing`, compile with `compile_options`, sharding) and read here, in one
        order."""

    def compile_regions(self, model: nn.Module) -> list[nn.Module]:
        """The trainable model's regions that train.py compiles, each on its own."""

    def collator(self, visited: list[int]) -> Callable[[list], dict]:
        """The DataLoader's collate function; any work done once per example before training
        (distillation targets, say) is done here, for the examples the run draws (`visited`), in the
        step's autocast and attention kernels (train.py calls it inside them)."""

    def step_flops(self, micro_batches: list[dict]) -> float:
        """The model's FLOPs of one optimizer step over these micro-batches (MFU)."""

    def step_hardware_flops(self, micro_batches: list[dict]) -> float:
        """What the device executes for them (HFU): more where activation checkpointing recomputes."""

    def useful_flops(self, micro_batches: list[dict]) -> torch.Tensor:
        """The model's FLOPs of them without padding, a 0-dim tensor on their device, counted
        without a host sync: the loop reads it in the step's one (`mfu_useful`)."""

    def evaluate(self, model: nn.Module) -> dict | None:
        """Collective: the periodic evaluation's scalars, equal on every rank; None if a stop
        signal dropped it. Pass the bare model, not its DDP wrapper."""

    def describe(self, model: nn.Module) -> str:
        """The model, for the run's opening line."""

    def meta(self) -> dict:
        """What each checkpoint's meta.json records of the model, beside the settings."""

    def next_step(self, out_dir: Path) -> str:
        """What to run once training has finished, for the closing line."""

    @staticmethod
    def memory_advice(profile: str) -> str:
        """Where an out-of-memory line sends the user to see what fits (a profile's memory plan)."""
