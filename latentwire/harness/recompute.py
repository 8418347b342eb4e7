"""Activation checkpointing: what backward recomputes of a model's checkpointed regions (each a
module the recipe wraps in torch's non-reentrant `checkpoint_wrapper`), by the profile's policy.

- none: nothing is wrapped; every activation a region's backward needs is kept from forward.
- full: a region keeps only its input, and backward runs its forward again, up to the last tensor
  its backward needs (torch.utils.checkpoint stops there).
- selective: torchtitan's per-operator policy (torch.utils.checkpoint's
  `create_selective_checkpoint_contexts`): a region keeps the outputs of its attention kernels and of
  every second matmul, counted in the order they run, and recomputes the rest: the other matmuls
  and the cheap operations (norms, rotary, activations, casts), each from what was kept. A kept
  output is not computed again, so the recompute runs every other matmul (`recomputed_matmuls`)
  and no attention.

Why every second matmul, not all: keeping all of them recomputes no matmul, but keeps each
layer's seven matmul outputs, the MLP's two widest among them, which the plans put past what fits
the h100 profile's micro-batch on its card, where every second fits it (docs/memory.md,
"Activation checkpointing policies").

Compiled, the policy is applied when AOTAutograd traces a region, and AOTAutograd's cache keys a
graph with such a policy by its context function's `cache_hash` attribute, skipping the cache
where there is none (torch 2.11 on); the hash here is of this module's source, which holds the whole
policy. Dynamo takes a context function that is a plain function (or a functools.partial), so it
is one.
"""

from __future__ import annotations

import hashlib
import inspect
import sys
from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from .config import setting

Policy = Literal["none", "selective", "full"]


@dataclass(frozen=True)
class Recompute:
    policy: Policy = setting(
        "none",
        "what backward recomputes of the model's checkpointed regions: none (every activation kept), "
        "selective (attention's and every second matmul's outputs kept, the rest recomputed), full (each "
        "region's forward run again)",
        key="activation_checkpointing",
        since=3,
        carried={False: "none", True: "full"},  # a boolean before: recompute every layer, or none
    )


def checkpoint_options(policy: str) -> dict | None:
    """`checkpoint_wrapper`'s keyword arguments for `policy`: None where nothing is wrapped."""
    return {"none": None, "full": {}, "selective": {"context_fn": selective_context}}[policy]


def keeps_matmul(index: int) -> bool:
    """Whether the selective policy keeps the output of a region's `index`-th matmul (from 0, in
    the order they run): every second, the first among them, as torchtitan's."""
    return index % 2 == 0


def recomputed_matmuls(matmul_sizes: list[int]) -> int:
    """What the selective policy's recompute runs of a region's matmuls, given each one's size
    (weights, say) in the order they run: the sum of those whose output it did not keep."""
    return sum(size for i, size in enumerate(matmul_sizes) if not keeps_matmul(i))


def _ops(*names: str) -> frozenset:
    """The aten overloads of these names that this torch has."""
    return frozenset(getattr(torch.ops.aten, name).default for name in names if hasattr(torch.ops.aten, name))


# A linear's matmul: mm without a bias, addmm with one, _scaled_mm in float8.
MATMULS = _ops("mm", "addmm", "_scaled_mm")
# Attention's fused kernels: their outputs are kept, so the recompute never runs attention.
ATTENTION = _ops(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
)


def selective_policy():
    """A fresh policy for one run of a region: its own count of matmuls, one for the forward and
    one for the recompute, so both decide alike."""
    counts = {False: 0, True: 0}

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        if op in ATTENTION:
            return CheckpointPolicy.MUST_SAVE
        if op in MATMULS:
            index = counts[ctx.is_recompute]
            counts[ctx.is_recompute] += 1
            return CheckpointPolicy.MUST_SAVE if keeps_matmul(index) else CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def selective_context():
    """The selective policy's context managers for one run of a region (`context_fn`)."""
    return create_selective_checkpoint_contexts(selective_policy())


selective_context.cache_hash = hashlib.sha256(inspect.getsource(sys.modules[__name__]).encode()).hexdigest()
