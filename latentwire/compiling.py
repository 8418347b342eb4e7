"""torch.compile for the training step, one repeated region at a time.

Regional compilation (torchtitan compiles each TransformerBlock the same way): each frozen decoder
layer, inside its activation-checkpointing wrapper, each byte-encoder block and the latent pooler
are compiled on their own, in place (`module.compile`). Dynamo guards on a layer's structure, not
on which layer it is, so the layers of one LLM share one compiled graph: two graphs for the 32
Llama and 28 Qwen layers instead of one graph with all 60 unrolled, and compile time no longer
grows with depth. What lies between the regions (embedding lookup, rotary tables, final norm,
head, loss) runs eagerly: a few kernels per LLM call.

Stable shapes. Prompt widths (multiples of pad_multiple) and answer widths (multiples of 8) change
from batch to batch. Each region is compiled with every input size symbolic (`dynamic=True`) and
without duck sizing: duck sizing gives sizes that happen to be equal when a region compiles one
symbol, so "batch size equals sequence length" becomes a guard and a later batch recompiles (the
whole step: 3 compiles for 6 shapes, each of them minutes for two 8B models under max-autotune, on
one rank while the others wait in NCCL). Inductor may still add a size guard of its own (CPU
reductions pick a kernel by `rows x width <= 4096`; a GPU's, 32-bit indexing while a tensor has
under 2^31 elements), hence at most one recompile per region.

Recompile limit. Dynamo keeps one cache of compiled variants per code object, and every decoder
layer of both LLMs enters it through the same one, `CheckpointWrapper.forward`; a variant past
`recompile_limit` entries runs eagerly, with only a log line. See `DECODER_LAYER_VARIANTS`.

These settings are dynamo configuration read while a region is traced, which is lazy: in the first
step that reaches it, or a recompile. So they are patched around
every call of the step (`stable_shapes`) rather than flipped for the whole process. train.py does
the compiling itself: `region.compile(mode=..., dynamic=True)` for each decoder layer and each of
`wire_regions`; `step_regions` lists them all (tests and bench/compile.py compile them at once).

Compiled regions serve training calls only. Evaluation (eval mode, no_grad, padded attention, a
KV cache) would recompile every region, so it runs under torch.compiler.set_stance("force_eager").
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import torch
from torch import nn

from .llm import decoder_layers


@dataclass(frozen=True)
class CompileConfig:
    enabled: bool  # torch.compile the regions
    mode: str  # torch.compile's mode
    cache: str  # inductor's cache directory, '' for inductor_cache_dir's choice
    FLAT_NAMES: ClassVar[dict] = {"enabled": "compile", "mode": "compile_mode", "cache": "compile_cache"}


def inductor_cache_dir(requested: str) -> Path:
    """Where inductor keeps what it compiled (its FX-graph, AOTAutograd and Triton caches, which the
    next compile of the same graph reads instead of compiling): `requested`, else the user's own
    TORCHINDUCTOR_CACHE_DIR, else ~/.cache/latentwire/inductor (under XDG_CACHE_HOME if set).
    Torch's default is under /tmp, which a requeued or resumed job on a fresh machine does not
    have; a home directory is on every node of a cluster, and shared by the user's runs, as
    Triton's own ~/.triton cache is."""
    if requested:
        return Path(requested).expanduser()
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "latentwire" / "inductor"


# Variants of CheckpointWrapper.forward the step compiles: 2 LLMs (layer classes and widths differ)
# x 2 (the one recompile an inductor size guard may cost) = 4, half dynamo's default recompile
# limit of 8, past which a variant silently runs every layer of an LLM eagerly: room for one nobody
# planned (TORCH_LOGS=recompiles names it). The LLMs' other calls (distillation's teacher before the
# first step, evaluation) run under force_eager and compile nothing.
DECODER_LAYER_VARIANTS = 2 * 2


@contextmanager
def stable_shapes():
    """Dynamo settings for tracing the step's regions; train.py calls its step inside them
    (`stable_shapes()(forward_loss_sums)`, a fresh patch per call).

    - no duck sizing: each input size gets a symbol of its own (see the module docstring);
    - floats specialised: Python floats (norm eps, attention scale, dropout p) are constants of the
      graph, not symbolic inputs that dynamo traces around and then specialises anyway (without
      it, 2.4x the traced calls and 3.5x the compile time: docs/performance.md).
    """
    import torch.fx.experimental._config as fx_config

    with torch._dynamo.config.patch(specialize_float=True), fx_config.patch(use_duck_shape=False):
        yield


def wire_regions(wire_encoder: nn.Module) -> list[nn.Module]:
    """The trainable model's regions: each byte-encoder block and the latent pooler (two small
    rounds, one graph). In-place compilation keeps parameter names (no `_orig_mod.`), so
    checkpoints do not notice."""
    return [*wire_encoder.encoder.blocks, wire_encoder.pooler]


def step_regions(wire_encoder: nn.Module, llms: dict) -> list[nn.Module]:
    """Every region train.py compiles, each on its own and in place (`module.compile`): the wire's
    and each decoder layer of each frozen LLM, which activation checkpointing must have wrapped
    first, so the recompute is planned inside the graph."""
    return [*wire_regions(wire_encoder), *(layer for llm in llms.values() for layer in decoder_layers(llm))]
