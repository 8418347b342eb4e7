"""A template recipe: the whole of what a model needs to be trained by train.py, for a toy
regression over rows of 1 to 6 real positions whose loss is normalised by its real positions, as
a language model's is by its tokens. Copy it and change the model, the data and the loss; name
it in train.py's recipe import (docs/loop.md, "Lifting the loop"). The harness's own tests train it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn
from torch.utils.data import default_collate

from .config import setting
from .loop_config import LoopConfig
from .recipe import Recipe, Task

ROW, FEATURES = 6, 4  # positions per row, features per position


@dataclass(frozen=True)
class RegressionSettings:
    num_examples: int = setting(256, "rows in the dataset", gt=0)
    hidden: int = setting(16, "width of the regressor's hidden layer", gt=0, restored=True, weights=True)


@dataclass(frozen=True)
class RegressionConfig(LoopConfig):
    regression: RegressionSettings


class SquaredError(Task):
    """One loss term: the squared error summed over a micro-batch's real positions, whose count is
    its normaliser."""

    def counts(self, batch: dict) -> torch.Tensor:
        return batch["mask"].sum().reshape(1)

    def loss_sums(self, model: nn.Module, batch: dict) -> torch.Tensor:
        error = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return (error * batch["mask"]).sum().reshape(1)

    def objective(self, terms: torch.Tensor) -> torch.Tensor:
        return terms.sum()


def toy_rows(n: int, seed: int) -> list[dict]:
    """Rows of 1 to ROW real positions (the rest padding), targets a fixed function of the inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, ROW, FEATURES, generator=g)
    mask = (torch.arange(ROW) < torch.randint(1, ROW + 1, (n, 1), generator=g)).float()
    return [{"x": x[i], "y": torch.sin(x[i].sum(-1)) * mask[i], "mask": mask[i]} for i in range(n)]


class Regression(Recipe):
    Config = RegressionConfig

    def __init__(self, cfg: RegressionConfig, di, stop):
        super().__init__(cfg, di, stop)
        self.dataset = toy_rows(cfg.regression.num_examples, cfg.training.seed)

    def build_model(self, compile_options, checkpointing):
        hidden = self.cfg.regression.hidden
        model = nn.Sequential(nn.Linear(FEATURES, hidden), nn.Tanh(), nn.Linear(hidden, 1))
        return model.to(self.di.device), SquaredError()

    def collator(self, visited):
        return default_collate  # stacks each key's tensors
