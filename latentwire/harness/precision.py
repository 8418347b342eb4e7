"""Numerics and attention kernels, chosen from the profile's precision and the card.

train.py makes the calls itself (torch.autocast, the GradScaler, the TF32 switch, the SDPA kernel
context); what it decides them with lives here. Every choice that only a GPU makes is a function
of plain inputs (compute capability, dtype), so CPU tests take each branch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .config import setting


@dataclass(frozen=True)
class Card:
    """The profile's device: what it is, its memory, and the peaks MFU is measured against (null:
    unknown, no MFU)."""

    description: str = setting(help="what this profile is for")
    device: Literal["cuda", "cpu"] = setting(help="cuda or cpu")
    memory_gb: float = setting(help="memory of one device in GB (GiB for CUDA cards)", gt=0)
    cap_memory: bool = setting(
        True,
        "hold a run on a card with more memory than memory_gb to memory_gb (harness.memory_cap)",
        since=3,
        before=False,
    )
    supports_bf16: bool = setting(False, "whether the card has bf16 tensor cores (sm80 and newer)")
    peak_tflops_bf16: float | None = setting(None, "dense bf16 peak TFLOP/s of one device", gt=0)
    peak_tflops_fp16: float | None = setting(None, "dense fp16 peak TFLOP/s of one device", gt=0)
    peak_tflops_tf32: float | None = setting(None, "dense TF32 tensor-core peak TFLOP/s (Ampere and newer)", gt=0)
    peak_tflops_fp32: float | None = setting(None, "dense IEEE fp32 peak TFLOP/s (no tensor cores)", gt=0)


@dataclass(frozen=True)
class Numerics:
    precision: Literal["bf16", "fp16", "fp32"] = setting("fp32", "autocast dtype", restored=True)
    tf32: bool = setting(
        False,
        "TF32 tensor cores for fp32 matmuls on Ampere and newer (--precision fp32 --tf32 "
        "false: the IEEE fp32 reference)",
    )


# The autocast dtype of each --precision; fp32 runs without autocast.
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def compute_dtype(precision: str) -> torch.dtype:
    """What the step's matmuls and attention compute in: the autocast dtype, fp32 without autocast."""
    return AMP_DTYPES[precision] or torch.float32


def cuda_capability(device: torch.device) -> tuple[int, int] | None:
    """The card's compute capability, (9, 0) for an H100; None off CUDA."""
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def use_tf32(tf32: bool, capability: tuple[int, int] | None) -> bool:
    """TF32 tensor cores for fp32 matmuls (all of them with --precision fp32, those left outside
    autocast otherwise) where the profile asks for it and the card has them (Ampere, sm80, on)."""
    return tf32 and capability is not None and capability >= (8, 0)


def matmul_arithmetic(precision: str, tf32: bool) -> str:
    """What the step's matmuls run in, the peak its MFU is measured against: the autocast dtype,
    or for fp32 TF32 where it is on, else IEEE fp32 (on an H100 66.9 TFLOP/s, not TF32's 494.7)."""
    if precision != "fp32":
        return precision
    return "tf32" if tf32 else "fp32"


# --- attention kernels ------------------------------------------------------------------------


def sdpa_backends(capability: tuple[int, int] | None, dtype: torch.dtype) -> tuple[list, str | None]:
    """The SDPA kernels this card (None: not CUDA) may pick for this compute dtype, for
    `torch.nn.attention.sdpa_kernel`, and a warning where the math kernel has to be among them.

    On CPU every kernel stays allowed (the CPU flash kernel where it applies). On CUDA, flash needs
    an sm80+ card and bf16/fp16 and takes no mask: a decoder's causal attention. The memory-efficient
    kernel runs on any card and dtype, and takes padding masks, but in torch 2.13 not grouped-query
    K/V, which is how transformers' decoders call SDPA (no mask, enable_gqa). Where flash cannot
    run, grouped-query attention needs the math kernel; it is allowed last, with a warning, instead
    of failing with "no available kernel". Where flash can run, math stays out: a silent fallback
    to it is an error. cuDNN stays out everywhere on CUDA: torch tries it first on sm90, and it has
    returned NaN gradients for masked attention (pytorch#196678).
    """
    from torch.nn.attention import SDPBackend

    if capability is None:
        return [b for b in SDPBackend.__members__.values() if b != SDPBackend.ERROR], None
    if capability >= (8, 0) and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], None
    dtype_name = str(dtype).removeprefix("torch.")
    why = (
        f"attention: flash and cuDNN kernels need an sm80+ card and bf16/fp16, this is sm{capability[0]}"
        f"{capability[1]} with {dtype_name}; grouped-query attention runs in the math kernel (the "
        "memory-efficient one has no grouped-query support), masked attention in the memory-efficient one"
    )
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], why
