"""Numerics chosen from the profile's precision and the device.

bf16 has fp32's exponent range, so its gradients need no loss scaling; fp16 (V100, no bf16) has a
narrow range where small gradients underflow to zero, so it needs a GradScaler; fp32 is the
reference that the other two are checked against.
"""
from __future__ import annotations

import functools

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
    stored in the autocast dtype: half the memory of fp32."""
    return AMP_DTYPES[precision] or torch.float32


def use_tf32(precision: str, device: torch.device) -> bool:
    """TF32 tensor cores for fp32 matmuls left outside autocast, on CUDA; not for the fp32 reference."""
    return device.type == "cuda" and precision != "fp32"


def enable_tf32() -> None:
    torch.backends.cuda.matmul.fp32_precision = "tf32"
    torch.backends.cudnn.conv.fp32_precision = "tf32"
