"""Float8 frozen readers (--frozen-fp8): the linears of both frozen LLMs' decoder layers run their
forward and input-gradient GEMMs in float8 through torchao's float8 training linear, tensorwise
scaled (e4m3 activations and weights, e5m2 for the gradient coming back). What converts, and how,
is decided here; `prepare_frozen_llms` makes the call, after the weights are read.

What converts: each nn.Linear inside a decoder layer (attention q/k/v/o, MLP gate/up/down) whose
two widths are multiples of 16, which cuBLAS's float8 GEMM needs of the inner and outer widths of
the forward and the input-gradient GEMM alike. Not the LM head (its logits are the loss's input),
not the embedding table (a lookup, no GEMM), nothing trainable.

Each frozen weight is cast once. torchao casts a weight to float8 in every forward unless it is one
already (`tensor_already_casted_to_fp8`), and takes it as it is in the forward GEMM and, transposed,
in the input-gradient GEMM. So after `read_weights` has filled a weight it is replaced by its
float8 cast with its own tensorwise scale, the scale torchao's per-step cast would compute every
step from the same unchanging values (tests/test_fp8.py: the same outputs, bit for bit). The bf16
copy goes: a converted linear holds 1 byte per weight, not 2.

No weight-gradient GEMM. torchao's backward computes the weight's gradient whether it is wanted or
not; for a frozen weight AOTAutograd drops it from the compiled backward, which keeps one GEMM per
linear (tests/test_fp8.py counts them). Eagerly it would run, so `harness.precision.fp8_refusal`
refuses --compile false, as it refuses cards without FP8 tensor cores and precisions but bf16.

--frozen-sharding fsdp is refused (latentwire.settings): FSDP2 shards a weight before it is read and
all-gathers plain tensors; torchao's float8 FSDP path keeps each bf16 shard and casts it again every
step, which is neither the one cast nor the halved weights that pay here.

On the CPU torch._scaled_mm emulates float8 (dequantised operands, an fp32 product): the numerics,
none of the speed.
"""
from __future__ import annotations

import torch
from torch import nn

from .harness.errors import UserError
from .harness.precision import cuda_capability, fp8_refusal
from .llm import FrozenLLM, decoder_layers

FP8_ALIGNMENT = 16


def torchao_float8():
    """torchao's float8 training pieces, imported only where --frozen-fp8 asks for them (its import
    noise on a CPU build: latentwire/__init__.py)."""
    try:
        from torchao.float8 import Float8LinearConfig
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    except ImportError as e:
        raise UserError(f"--frozen-fp8 needs torchao: pip install -r requirements-fp8.txt ({e})") from None
    return Float8LinearConfig, Float8Linear, hp_tensor_to_float8_dynamic, Float8TrainingTensor, GemmInputRole


def check_fp8(device: torch.device, precision: str, eager_backward: bool) -> None:
    """--frozen-fp8 refused in one line where it cannot run or cannot help on this device (`fp8_refusal`)."""
    why = fp8_refusal(device.type, cuda_capability(device), precision, eager_backward)
    if why:
        raise UserError(f"--frozen-fp8: {why}")


def fp8_linears(llm: FrozenLLM) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of each linear of the LLM that converts."""
    return [found for layer in decoder_layers(llm) for found in convertible_linears(layer)]


def convertible_linears(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of each plain linear in `layer` whose widths are both multiples
    of FP8_ALIGNMENT."""
    return [(parent, name, child) for parent in layer.modules() for name, child in parent.named_children()
            if type(child) is nn.Linear and child.in_features % FP8_ALIGNMENT == 0
            and child.out_features % FP8_ALIGNMENT == 0]


def convert_frozen_linears(llm: FrozenLLM) -> None:
    """Each of `fp8_linears` becomes torchao's Float8Linear (the tensorwise recipe) holding its
    weight cast to float8 once, from the values it holds now: call after `read_weights` (or on the
    planner's fakes, whose cast is fake too)."""
    Float8LinearConfig, Float8Linear, to_float8, _, GemmInputRole = torchao_float8()
    config = Float8LinearConfig()
    for parent, name, linear in fp8_linears(llm):
        converted = Float8Linear.from_float(linear, config)
        with torch.no_grad():
            weight = to_float8(linear.weight, config.cast_config_weight.target_dtype, converted.linear_mm_config,
                               gemm_input_role=GemmInputRole.WEIGHT)
        converted.weight = nn.Parameter(weight, requires_grad=False)
        setattr(parent, name, converted)


def describe_fp8(llms: dict[str, FrozenLLM], device_type: str) -> str:
    """The run's opening line on float8: what converted, what it holds, and what MFU means."""
    *_, Float8TrainingTensor, _ = torchao_float8()
    counts = []
    for name, llm in llms.items():
        linears = [m for layer in decoder_layers(llm) for m in layer.modules() if isinstance(m, nn.Linear)]
        fp8 = sum(isinstance(m.weight, Float8TrainingTensor) for m in linears)
        counts.append(f"{fp8} of {name}'s {len(linears)}")
    where = ("emulated by the CPU's torch._scaled_mm: float8's numerics, none of its speed" if device_type == "cpu"
             else "on the FP8 tensor cores")
    return (f"fp8: {', '.join(counts)} decoder-layer linears in float8 (torchao, tensorwise e4m3/e5m2, weights cast "
            f"once), {where}; MFU stays counted against the bf16 peak")
