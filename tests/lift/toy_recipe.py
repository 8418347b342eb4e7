"""A recipe that is not LatentWire, for a copy of train.py (tests/test_lift.py): the harness's toy
regression (harness/tests/toy_train.py), rows of 1 to 6 real positions whose loss is normalised by
its real positions, as a language model's is by its tokens. What a copier writes, beside the
profile: a Config that extends the loop's with its own section, and the Recipe's few methods."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import nn

from harness.config import Field, Schema
from harness.loop_config import LoopConfig, model_schema
from harness.tests.toy_train import FEATURES, RegressionTask, collate, toy_rows


@dataclass(frozen=True)
class ToyModel:
    num_examples: int
    hidden: int


@dataclass(frozen=True)
class Config(LoopConfig):
    toy: ToyModel
    SCHEMA: ClassVar[Schema] = model_schema({
        "num_examples": Field(int, "rows in the dataset", positive=True),
        "hidden": Field(int, "width of the regressor's hidden layer", positive=True),
    }, rules=lambda values, where: None)


class Toy:
    Config = Config

    def __init__(self, cfg: Config, di, stop):
        self.cfg, self.di = cfg, di
        self.dataset = toy_rows(cfg.toy.num_examples, cfg.training.seed)
        self.data_identity = {"dataset": "toy", "examples": len(self.dataset), "fingerprint": f"{cfg.training.seed}"}
        self.data_facts = {"train_examples": len(self.dataset)}

    def build_model(self, compile_options, checkpointing):
        model = nn.Sequential(nn.Linear(FEATURES, self.cfg.toy.hidden), nn.Tanh(), nn.Linear(self.cfg.toy.hidden, 1))
        return model.to(self.di.device), RegressionTask()

    def compile_regions(self, model):
        return [model]

    def collator(self, visited):
        return collate

    def step_flops(self, micro_batches):
        return 0.0

    def step_hardware_flops(self, micro_batches):
        return 0.0

    def useful_flops(self, micro_batches):
        return torch.zeros((), dtype=torch.int64, device=self.di.device)

    def evaluate(self, model):
        return {}

    def describe(self, model):
        return f"a regressor of {sum(p.numel() for p in model.parameters())} parameters"

    def meta(self):
        return {}

    def next_step(self, out_dir):
        return "done"

    @staticmethod
    def memory_advice(profile):
        return f"profile {profile}'s micro-batch is too large"
