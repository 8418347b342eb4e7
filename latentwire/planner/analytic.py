"""The quick calculator: the memory that does not depend on the batch, from parameter counts.

Bytes per parameter, by role:
- frozen weights: the autocast dtype's bytes (bf16 and fp16: 2, fp32: 4), and nothing else: no
  gradient, no optimizer state, no fp32 master copy. Llama-3.1-8B's 8,030,261,248 bf16 weights
  take 16.06 GB (1e9 bytes) = 14.96 GiB, not the "14 GB" of a 7B model. Card memory is GiB (an
  "80GB" H100 has 79.6 GiB), so the plan compares in GiB.
- trainable weights: fp32 (autocast keeps fp32 master weights and casts per op), 4 bytes, plus
  fp32 gradients, 4 bytes, plus the optimizer's state (`OPTIMIZERS`).
- under DDP every GPU holds all of the above (it is replicated, not sharded: more GPUs do not
  divide it), plus DDP's gradient buckets, 4 bytes per trainable parameter, which
  `latentwire.planner.budget` reserves with NCCL's buffers. train.py keeps the gradients inside those
  buckets (gradient_as_bucket_view), so under DDP this static count holds them twice: it errs
  high by 4 bytes per trainable parameter (0.37 GiB for 100M).
Activations are not here: they depend on the batch, and `latentwire.plan` traces them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..harness.precision import AMP_DTYPES
from .budget import GIB, GRAD_BYTES

GB = 10**9
STEP_BYTES = 4  # torch keeps an optimizer step count per tensor as an fp32 scalar tensor
# bitsandbytes' 8-bit optimizers: one absmax (fp32) per 256-element block per moment, and fp32
# moments for tensors smaller than min_8bit_size.
BNB_BLOCK = 256
BNB_MIN_8BIT_SIZE = 4096

OPTIMIZERS = {
    "sgd": "SGD: no state",
    "sgd-momentum": "SGD with momentum: an fp32 momentum buffer, 4 bytes/param",
    "adamw": "AdamW: two fp32 moments, 8 bytes/param, + a 4-byte step per tensor",
    "adafactor": "Adafactor: an fp32 row and column second moment per matrix (4 x (rows + cols) bytes), "
    "4 bytes/param for vectors, + a 4-byte step per tensor; no first moment",
    "adamw-8bit": "8-bit AdamW (bitsandbytes): two uint8 moments, 2 bytes/param, + 8 bytes per 256-element "
    "block; tensors under 4096 elements keep fp32 moments",
}


def frozen_bytes_per_param(precision: str) -> int:
    dtype = AMP_DTYPES[precision]
    return 4 if dtype is None else dtype.itemsize


def _tensor_state_bytes(optimizer: str, shape: tuple[int, ...]) -> int:
    n = math.prod(shape)
    if optimizer == "sgd":
        return 0
    if optimizer == "sgd-momentum":
        return 4 * n
    if optimizer == "adamw":
        return 8 * n + STEP_BYTES
    if optimizer == "adafactor":
        if len(shape) >= 2:
            return 4 * (math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1]) + STEP_BYTES
        return 4 * n + STEP_BYTES
    if optimizer == "adamw-8bit":
        if n < BNB_MIN_8BIT_SIZE:
            return 8 * n
        return 2 * n + 2 * 4 * math.ceil(n / BNB_BLOCK)
    raise ValueError(f"unknown optimizer {optimizer!r}")


def optimizer_state_bytes(optimizer: str, shapes: list[tuple[int, ...]]) -> int:
    """Exact state bytes for trainable tensors of these shapes."""
    return sum(_tensor_state_bytes(optimizer, tuple(shape)) for shape in shapes)


@dataclass(frozen=True)
class StaticMemory:
    """Per GPU, in bytes."""

    frozen_params: int
    trainable_params: int
    precision: str
    optimizer: str
    frozen: int
    trainable: int
    gradients: int
    optimizer_state: int
    shapes_known: bool  # False: the trainable parameters were given as a count, not as tensors

    @property
    def total(self) -> int:
        return self.frozen + self.trainable + self.gradients + self.optimizer_state

    def to_json(self) -> dict:
        return {
            "params_frozen": self.frozen_params,
            "params_trainable": self.trainable_params,
            "precision": self.precision,
            "optimizer": self.optimizer,
            "params_frozen_bytes": self.frozen,
            "params_trainable_bytes": self.trainable,
            "grads_bytes": self.gradients,
            "optimizer_bytes": self.optimizer_state,
            "static_bytes": self.total,
        }


def static_memory(
    frozen_params: int, trainable: list[tuple[int, ...]] | int, precision: str, optimizer: str
) -> StaticMemory:
    """`trainable` is the trainable tensors' shapes (exact optimizer state) or a parameter count,
    taken as one flat tensor (exact for all but Adafactor, whose state depends on the shapes)."""
    if isinstance(trainable, int):
        shapes = [(trainable,)] if trainable else []
    else:
        shapes = [tuple(s) for s in trainable]
    n_trainable = sum(math.prod(s) for s in shapes)
    return StaticMemory(
        frozen_params=frozen_params,
        trainable_params=n_trainable,
        precision=precision,
        optimizer=optimizer,
        frozen=frozen_params * frozen_bytes_per_param(precision),
        trainable=GRAD_BYTES * n_trainable,
        gradients=GRAD_BYTES * n_trainable,
        optimizer_state=optimizer_state_bytes(optimizer, shapes),
        shapes_known=not isinstance(trainable, int),
    )


def format_static(m: StaticMemory) -> list[str]:
    def row(name: str, n: int, nbytes: int) -> str:
        per_param = f"{nbytes / n:.2f}" if n else "-"
        return f"  {name:<34}{n:>16,}{per_param:>8}{nbytes / GB:>10.2f}{nbytes / GIB:>10.2f}"

    lines = [
        f"  {'':<34}{'parameters':>16}{'B/param':>8}{'GB':>10}{'GiB':>10}",
        row(f"frozen weights ({m.precision})", m.frozen_params, m.frozen),
        row("trainable weights (fp32)", m.trainable_params, m.trainable),
        row("gradients (trainable only)", m.trainable_params, m.gradients),
        row(f"optimizer state ({m.optimizer})", m.trainable_params, m.optimizer_state),
    ]
    lines.append(f"  {'static total per GPU':<34}{'':>24}{m.total / GB:>10.2f}{m.total / GIB:>10.2f}")
    lines.append(f"  optimizer: {OPTIMIZERS[m.optimizer]}")
    if m.optimizer == "adafactor" and not m.shapes_known:
        lines.append(
            "  (a bare parameter count is taken as one vector: Adafactor's factored state for matrices is far smaller)"
        )
    return lines
