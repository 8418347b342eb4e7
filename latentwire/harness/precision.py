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


def frozen_weight_dtype(precision: str) -> torch.dtype:
    """Frozen weights need no fp32 master copy (no gradients, no optimizer state), so they are
    stored in the autocast dtype: half the memory of fp32. It is also the dtype their matmuls and
    attention run in."""
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


# --- float8 matmuls ---------------------------------------------------------------------------

FP8_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada (sm89) and Hopper (sm90) on


def fp8_refusal(
    device_type: str, capability: tuple[int, int] | None, precision: str, eager_backward: bool
) -> str | None:
    """Why frozen linears in float8 (either of torchao's recipes) cannot run or cannot help here,
    or None where they may. `capability` None: the CPU, or a CUDA card not known yet (a profile
    checked before its run starts); `eager_backward`: the backward runs eagerly (--compile false),
    where the casts to float8 run as kernels of their own and torchao's tensorwise linear also
    computes the weight gradient a frozen weight never uses, which AOTAutograd drops from a
    compiled backward.

    On the CPU torch._scaled_mm runs as an emulation (dequantised operands, an fp32 matmul): the
    numerics of float8, none of its speed, which is what the CPU tests need."""
    if precision != "bf16":
        return (
            f"float8 matmuls replace the bf16 ones of --precision bf16 (this run: {precision}); fp32 is the "
            "reference and fp16 the cards without FP8 tensor cores"
        )
    if eager_backward:
        return (
            "eagerly (--compile false) the casts to float8 run as kernels of their own, and torchao's "
            "tensorwise linear also computes the weight gradient of every frozen weight, a third GEMM thrown "
            "away; compiled (--compile true), inductor fuses the casts and AOTAutograd drops that GEMM"
        )
    if device_type == "cuda" and capability is not None and capability < FP8_CAPABILITY:
        return (
            f"this card (sm{capability[0]}{capability[1]}) has no FP8 tensor cores (sm89 and newer: Ada, "
            "Hopper); the run would be slower, not faster"
        )
    return None
