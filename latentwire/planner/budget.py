"""How much of a card the tensors of a training step may use.

The profile's `target_util` is the share of the card the plan may fill. Out of it come the
memory that lives outside PyTorch's tensors (CUDA context, NCCL), DDP's gradient buckets, and the
caching allocator's fragmentation. The numbers, and why:

- CUDA context, 1 GiB: the driver's context holds the kernels it has loaded, 0.3-0.5 GiB with
  lazy module loading (the default since CUDA 11.7), plus cuBLAS and cuDNN handles and
  workspaces and the kernels torch.compile loads.
- NCCL, 1 GiB, only with more than one rank: a ring all-reduce keeps, per channel, a send and a
  receive connection with buffers for NCCL's Simple (4 MiB), LL128 (4.7 MiB) and LL (0.5 MiB)
  protocols, and uses up to 32 channels on H100 NVLink: a few hundred MiB, more with NVLS.
- DDP gradient buckets, only with more than one rank: DDP all-reduces flat buckets, and with
  gradient_as_bucket_view (train.py) the gradients are views into them, allocated once for the
  whole run: 4 bytes per trainable parameter. The traced peak falls in backward, before most
  gradients exist, so the buckets are reserved here.
- Fragmentation, 10% of the memory that is not weights: the caching allocator carves requests
  out of 2 MiB and 20 MiB segments and keeps freed blocks cached, so reserved memory runs above
  allocated memory, more when shapes vary. Weights are allocated once, whole. `find_batch`
  measures the real reserved / allocated ratio on the card.

On a CPU there is no CUDA context and gloo needs no device buffers; fragmentation stays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

GIB = 2**30
CUDA_CONTEXT_BYTES = 1 * GIB
NCCL_BYTES = 1 * GIB
FRAGMENTATION = 0.10
GRAD_BYTES = 4  # trainable parameters and their gradients are fp32 (autocast keeps master weights)


@dataclass(frozen=True)
class Budget:
    card_bytes: int
    target_util: float
    cuda_context: int
    nccl: int
    ddp_buckets: int
    fragmentation: float

    @property
    def target_bytes(self) -> float:
        return self.target_util * self.card_bytes

    @property
    def fixed_reserve(self) -> int:
        return self.cuda_context + self.nccl + self.ddp_buckets

    def needed(self, peak: float, weight_bytes: int) -> float:
        """Card memory a step with this tensor peak occupies."""
        return peak + self.fragmentation * max(peak - weight_bytes, 0) + self.fixed_reserve

    def allowed_peak(self, weight_bytes: int) -> float:
        """The largest tensor peak whose `needed` stays within the target."""
        return (self.target_bytes - self.fixed_reserve + self.fragmentation * weight_bytes) / (1 + self.fragmentation)

    def lines(self) -> list[str]:
        def gib(n: float) -> str:
            return f"{n / GIB:.2f} GiB"

        return [
            f"card {gib(self.card_bytes)} x target_util {self.target_util:g} = {gib(self.target_bytes)}, "
            "of which reserved:",
            f"  CUDA context, cuBLAS/cuDNN workspaces, loaded kernels  {gib(self.cuda_context)}",
            f"  NCCL buffers (more than one rank)                      {gib(self.nccl)}",
            f"  DDP gradient buckets (more than one rank)              {gib(self.ddp_buckets)}",
            f"  allocator fragmentation: {100 * self.fragmentation:g}% of the memory that is not weights",
        ]


def budget_for(device: str, memory_gb: float, target_util: float, world_size: int, trainable_params: int) -> Budget:
    """`memory_gb` is the card's memory in GiB, as hw_profiles.json gives it."""
    cuda = device == "cuda"
    distributed = world_size > 1
    return Budget(
        card_bytes=round(memory_gb * GIB),
        target_util=target_util,
        cuda_context=CUDA_CONTEXT_BYTES if cuda else 0,
        nccl=NCCL_BYTES if cuda and distributed else 0,
        ddp_buckets=GRAD_BYTES * trainable_params if distributed else 0,
        fragmentation=FRAGMENTATION,
    )


@dataclass(frozen=True)
class Fit:
    """peak = fixed + per_sample x micro-batch, least squares."""

    fixed: float
    per_sample: float
    r2: float

    def __call__(self, micro_batch: float) -> float:
        return self.fixed + self.per_sample * micro_batch


def fit_line(points: dict[int, float]) -> Fit:
    if len(points) < 2:
        raise ValueError("a line needs two micro-batch sizes")
    xs, ys = list(points), list(points.values())
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    fixed = my - slope * mx
    ss_tot = sum((y - my) ** 2 for y in ys)
    ss_res = sum((y - fixed - slope * x) ** 2 for x, y in zip(xs, ys, strict=True))
    return Fit(fixed, slope, 1.0 if ss_tot == 0 else 1 - ss_res / ss_tot)


def largest_fitting(fit: Fit, budget: Budget, weight_bytes: int) -> int:
    """The largest micro-batch whose fitted peak fits the budget; 0 when not even one does."""
    if fit.per_sample <= 0:
        raise ValueError("peak memory does not grow with the micro-batch")
    room = budget.allowed_peak(weight_bytes) - fit.fixed
    return max(math.floor(room / fit.per_sample), 0)
