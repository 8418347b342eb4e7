"""The seam between train.py and the model it trains (torchtitan's model spec and parallelize
function, lingua's app on its library): what the loop's setup asks of the model (`Recipe`) and what
its step asks about a micro-batch (`Task`). train.py names nothing of the model but its recipe.

A new model writes a small required core: a `Config` (the loop's, `harness.loop_config.LoopConfig`,
extended by the model's sections), `__init__` setting `dataset`, `build_model` and `collator`; and
a task's `counts`, `loss_sums` and `objective`. Everything else has a default here, for a model
with no FLOP count (no MFU), no evaluation and no memory planner. `harness.template` is the whole
of a recipe for a toy regression (docs/loop.md, "Lifting the loop").
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from .data import Mixture
from .distributed import DistInfo
from .loop_config import LoopConfig


class Task:
    """What the step asks of the model about a micro-batch, as tensors on its device (no host
    sync). Every loss term is a sum over the micro-batch divided by its count in the whole global
    batch, which is what makes accumulation and DDP exact."""

    def counts(self, batch: dict) -> torch.Tensor:
        """What each loss term sums over; summed over the global batch, the term's normaliser."""
        raise NotImplementedError

    def loss_sums(self, model: nn.Module, batch: dict) -> torch.Tensor:
        """The terms' sums, in the shape of `counts`: the forward pass."""
        raise NotImplementedError

    def objective(self, terms: torch.Tensor) -> torch.Tensor:
        """The scalar backward starts from, from the terms over their global counts."""
        raise NotImplementedError

    def tokens(self, batch: dict) -> torch.Tensor:
        """The positions the model reads in this micro-batch, without padding (`tokens_per_s`), a
        0-dim int64 tensor on its device. Default: the first term's count (a language model reads
        about as many positions as it predicts)."""
        return self.counts(batch).flatten()[0].long()

    def target_tokens(self, counts: torch.Tensor) -> torch.Tensor:
        """The positions the loss is taken at, from the global counts (`target_tokens_per_s`).
        Default: the first term's count."""
        return counts.flatten()[0].long()

    def record(self, terms: torch.Tensor) -> dict:
        """The logged losses, from the step's terms (one read from the device)."""
        return {"loss": self.objective(terms).item()}


class StepFlops:
    """A model's FLOP count of an optimizer step, for MFU; a recipe without one logs no MFU."""

    def step_flops(self, micro_batches: list[dict]) -> float:
        """The model's FLOPs of one optimizer step over these micro-batches, padding included."""
        raise NotImplementedError

    def step_hardware_flops(self, micro_batches: list[dict]) -> float:
        """What the device executes for them (HFU): more where activation checkpointing recomputes."""
        return self.step_flops(micro_batches)

    def useful_flops(self, micro_batches: list[dict]) -> torch.Tensor | None:
        """The FLOPs without padding, a 0-dim tensor on their device, counted without a host sync:
        the loop reads it in the step's one (`mfu_useful`); None where not counted."""
        return None


@dataclass(frozen=True)
class TrainingStep:
    """train.py's optimizer and step, handed to whatever plans or measures them (a recipe's memory
    planner), so what is planned is what trains and nothing imports the script."""

    adamw: Callable  # (model, OptimizerConfig, device_type) -> the optimizer
    train_step: Callable  # train.py's train_step


class Recipe:
    """What train.py's setup asks of the model, in the order it asks. Built by one call,
    `Recipe(cfg, di, stop)`, from the final configuration, the rank (`harness.distributed.DistInfo`)
    and `stop()` (a collective: nonzero once any rank was signalled); building it loads and checks
    the data, nothing heavy. Subclasses set `dataset` and write `build_model` and `collator`."""

    Config: type = LoopConfig  # the model's extension of the loop's settings
    dataset: Sequence  # the training examples the sampler indexes
    flops: StepFlops | None = None  # the model's FLOP count, once `build_model` has built it; None: no MFU

    def __init__(self, cfg: LoopConfig, di: DistInfo, stop: Callable[[], int]):
        self.cfg, self.di, self.stop = cfg, di, stop

    def build_model(self, compile_options: dict | None, checkpointing: dict | None) -> tuple[nn.Module, Task]:
        """The trainable model on the rank's device, and the task the step asks. The model's
        frozen parts, if any, are built, wrapped (its checkpointed regions in `checkpoint_wrapper`
        with `checkpointing`, compile with `compile_options`, sharding) and read here, in one
        order."""
        raise NotImplementedError

    def collator(self, visited: list[int]) -> Callable[[list], dict]:
        """The DataLoader's collate function; any work done once per example before training
        (distillation targets, say) is done here, for the examples the run draws (`visited`), in the
        step's autocast and attention kernels (train.py calls it inside them)."""
        raise NotImplementedError

    # --- with defaults -------------------------------------------------------------------------

    @classmethod
    def config_for_memory(cls, cfg: LoopConfig, world_size: int, step: TrainingStep) -> tuple[LoopConfig, str | None]:
        """The configuration with its micro-batch sized to the card by the model's own memory plan
        of `step`, the global batch kept, and why; unchanged where the model has no planner."""
        return cfg, None

    def draws(self, seed: int) -> Mixture:
        """How the sampler draws `dataset`'s examples (harness.data.Mixture). Default: all of it as
        one source."""
        return Mixture.single(len(self.dataset), seed)

    @functools.cached_property
    def data_identity(self) -> dict:
        """What a checkpoint records of the data, to refuse resuming on other data. Default: its
        length alone; `harness.data_identity.fingerprint` hashes examples that are plain values."""
        return {"dataset": type(self).__name__, "examples": len(self.dataset), "fingerprint": "not computed"}

    @functools.cached_property
    def data_facts(self) -> dict:
        """Facts of the data for the run's first metrics record."""
        return {"train_examples": len(self.dataset)}

    def compile_regions(self, model: nn.Module) -> list[nn.Module]:
        """The trainable model's regions that train.py compiles, each on its own."""
        return [model]

    def evaluate(self, model: nn.Module) -> dict | None:
        """Collective: the periodic evaluation's scalars, equal on every rank; None if a stop
        signal dropped it. Passed the bare model, not its DDP wrapper."""
        return {}

    def describe(self, model: nn.Module) -> str:
        """The model, for the run's opening line."""
        return f"{sum(p.numel() for p in model.parameters() if p.requires_grad):,} trainable parameters"

    def meta(self) -> dict:
        """What each checkpoint's meta.json records of the model, beside the settings."""
        return {}

    def next_step(self, out_dir: Path) -> str:
        """What to run once training has finished, for the closing line."""
        return f"the trained weights are in {out_dir / 'checkpoints'}"

    @staticmethod
    def memory_advice(profile: str) -> str:
        """Where an out-of-memory line sends the user to see what fits."""
        return f"lower --micro-batch-size (and raise --grad-accum-steps to keep the global batch) in profile {profile}"
