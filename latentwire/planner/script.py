"""train.py's step read from the script beside the package, by its path (runpy), for the commands
that plan and measure it (`python -m latentwire.plan`, `find_batch`), which no run hands one. The one
load of an entry point by its path, an arrow no import statement shows: tests/test_imports.py
declares it (BY_PATH)."""

from __future__ import annotations

import runpy
from pathlib import Path

from ..harness.recipe import TrainingStep

TRAIN_PY = Path(__file__).resolve().parents[2] / "train.py"


def script_step(path: Path = TRAIN_PY) -> TrainingStep:
    """The step of the train.py beside this package. Read from the file by its path, not imported as
    `train`: from another directory that name finds another script or none."""
    script = runpy.run_path(str(path), run_name="latentwire_training_step")
    return TrainingStep(adamw=script["adamw"], train_step=script["train_step"])
