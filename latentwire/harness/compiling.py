"""torch.compile settings that hold for any model compiled one region at a time (torchtitan's way:
each repeated block compiled on its own, in place, with `module.compile`).

Stable shapes. Batches whose padded widths change from step to step compile each region with every
input size symbolic (`dynamic=True`) and without duck sizing: duck sizing gives sizes that happen
to be equal when a region compiles one symbol, so "batch size equals sequence length" becomes a
guard and a later batch recompiles (a whole step compiled as one graph: 3 compiles for 6 shapes).
Inductor may still add a size guard of its own (CPU reductions pick a kernel by
`rows x width <= 4096`; a GPU's, 32-bit indexing while a tensor has under 2^31 elements), hence at
most one recompile per region. These settings are dynamo configuration read while a region is
traced, which is lazy (the first step that reaches it, or a recompile), so they are patched around
every call of the step (`stable_shapes`) rather than flipped for the whole process.

The compile cache. Inductor keeps what it compiled on disk, by default under /tmp, which a
requeued job on a fresh machine does not have: `inductor_cache_dir` picks a place that lasts.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from .config import setting


@dataclass(frozen=True)
class CompileConfig:
    enabled: bool = setting(False, "torch.compile the forward pass", key="compile")
    mode: Literal["default", "max-autotune-no-cudagraphs"] = setting(
        "default",
        "torch.compile mode",
        key="compile_mode",
        refused=dict.fromkeys(
            ("reduce-overhead", "max-autotune"),
            "captures CUDA graphs, which no GPU run has yet tried with this loop's dynamic shapes, "
            "per-layer compiled regions and FSDP hooks",
        ),
    )
    cache: str = setting(
        "",
        "where inductor keeps the compiled regions for the next run, a requeued or resumed job on "
        "another machine included ('': $TORCHINDUCTOR_CACHE_DIR if set, else ~/.cache/<app>/"
        "inductor; torch's own default is under /tmp)",
        key="compile_cache",
    )


def inductor_cache_dir(requested: str, app: str) -> Path:
    """Where inductor keeps what it compiled (its FX-graph, AOTAutograd and Triton caches, which the
    next compile of the same graph reads instead of compiling): `requested`, else the user's own
    TORCHINDUCTOR_CACHE_DIR, else ~/.cache/<app>/inductor (under XDG_CACHE_HOME if set).
    Torch's default is under /tmp, which a requeued or resumed job on a fresh machine does not
    have; a home directory is on every node of a cluster, and shared by the user's runs, as
    Triton's own ~/.triton cache is."""
    if requested:
        return Path(requested).expanduser()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / app / "inductor"


@contextmanager
def stable_shapes():
    """Dynamo settings for tracing the step's regions; a recipe whose regions compile calls its
    forward inside them (`stable_shapes()(forward)`, a fresh patch per call).

    - no duck sizing: each input size gets a symbol of its own (see the module docstring);
    - floats specialised: Python floats (norm eps, attention scale, dropout p) are constants of the
      graph, not symbolic inputs that dynamo traces around and then specialises anyway (without
      it, 2.4x the traced calls and 3.5x the compile time: docs/performance.md).
    """
    import torch.fx.experimental._config as fx_config

    with torch._dynamo.config.patch(specialize_float=True), fx_config.patch(use_duck_shape=False):
        yield
