"""Numerics and kernels chosen from the profile's precision and the card.

bf16 has fp32's exponent range, so its gradients need no loss scaling; fp16 (V100, no bf16) has a
narrow range where small gradients underflow to zero, so it needs a GradScaler; fp32 is the
reference that the other two are checked against. Every choice here that only a GPU makes is a
function of plain inputs (device type, compute capability, dtype), so CPU tests take each branch.
"""
from __future__ import annotations

import functools
from contextlib import nullcontext

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}


def autocast_for(precision: str, device: torch.device):
    """A factory of fresh autocast contexts (one per forward pass)."""
    dtype = AMP_DTYPES[precision]
    return functools.partial(torch.autocast, device_type=device.type, dtype=dtype, enabled=dtype is not None)


def grad_scaler_for(precision: str, device: torch.device) -> torch.amp.GradScaler:
    """Enabled only for fp16; disabled, its scale/unscale/step calls are plain pass-throughs."""
    return torch.amp.GradScaler(device.type, enabled=precision == "fp16")


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


def enable_tf32() -> None:
    # The legacy switch, not `torch.backends.cuda.matmul.fp32_precision = "tf32"`: after the new
    # API, torch.get_float32_matmul_precision() raises ("mix of the legacy and new APIs"), and
    # inductor's GEMM autotuning (max-autotune) calls exactly that.
    torch.set_float32_matmul_precision("high")


def matmul_arithmetic(precision: str, tf32: bool) -> str:
    """What the step's matmuls run in, the peak its MFU is measured against: the autocast dtype,
    or for fp32 TF32 where it is on, else IEEE fp32 (on an H100 66.9 TFLOP/s, not TF32's 494.7)."""
    if precision != "fp32":
        return precision
    return "tf32" if tf32 else "fp32"


# --- attention kernels ------------------------------------------------------------------------

def sdpa_backends(capability: tuple[int, int], dtype: torch.dtype) -> tuple[list, str | None]:
    """The SDPA kernels CUDA may pick for this card and compute dtype, and a warning where the math
    kernel has to be among them.

    Flash and cuDNN need an sm80+ card and bf16/fp16. The memory-efficient kernel runs on any card
    and dtype, and takes the encoder's padding masks, but in torch 2.13 not grouped-query K/V,
    which is how the LLMs call SDPA (no mask, enable_gqa). Where flash cannot run, the LLMs'
    attention needs the math kernel; it is allowed last, with a warning, instead of failing with
    "no available kernel". Where flash can run, math stays out: a silent fallback to it is an error.
    """
    from torch.nn.attention import SDPBackend

    if capability >= (8, 0) and dtype in (torch.bfloat16, torch.float16):
        return [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION], None
    dtype_name = str(dtype).removeprefix("torch.")
    why = (f"attention: flash and cuDNN kernels need an sm80+ card and bf16/fp16, this is sm{capability[0]}"
           f"{capability[1]} with {dtype_name}; the LLMs' grouped-query attention runs in the math kernel "
           "(the memory-efficient one has no grouped-query support), the encoder's in the memory-efficient one")
    return [SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH], why


def sdpa_kernels(capability: tuple[int, int] | None, dtype: torch.dtype) -> tuple:
    """A factory of SDPA kernel contexts for this card (None: not CUDA) and compute dtype, and the
    warning of `sdpa_backends`. On CPU every kernel stays allowed (the CPU flash kernel where it applies)."""
    if capability is None:
        return nullcontext, None
    from torch.nn.attention import sdpa_kernel

    backends, why = sdpa_backends(capability, dtype)
    return functools.partial(sdpa_kernel, backends), why
