"""Float8 frozen readers (--frozen-fp8 tensorwise|rowwise): the linears of both frozen LLMs' decoder
layers run their forward and input-gradient GEMMs in float8, scaled by one of torchao's two
recipes. What converts, and how, is decided here; `prepare_frozen_llms` makes the call, after the
weights are read.

- tensorwise: one scale per tensor; e4m3 activations and weights, e5m2 for the gradient coming back.
- rowwise: one scale per row of each GEMM operand (per token of the activations and of the gradient,
  per output channel of the weight in the forward GEMM, per input channel in the input-gradient
  GEMM), e4m3 throughout, each scale rounded down to a power of two.

What converts: each nn.Linear inside a decoder layer (attention q/k/v/o, MLP gate/up/down) whose
two widths are multiples of 16, which cuBLAS's float8 GEMM needs of the inner and outer widths of
the forward and the input-gradient GEMM alike. Not the LM head (its logits are the loss's input),
not the embedding table (a lookup, no GEMM), nothing trainable.

Each frozen weight is cast once for each GEMM that reads it, after `read_weights` has filled it,
from the values it holds, with the scale torchao's per-step cast would compute every step from the
same unchanging values (tests/test_fp8.py: the same outputs and input gradients, bit for bit).

Tensorwise: torchao's Float8Linear casts a weight in every forward unless it is one already
(`tensor_already_casted_to_fp8`), and takes that one cast in the forward GEMM and, transposed, in
the input-gradient GEMM (a per-tensor scale is the same either way). So the weight is replaced by
its cast: a converted linear holds 1 byte per weight, not 2. torchao's backward computes the
weight's gradient whether it is wanted or not; for a frozen weight AOTAutograd drops it from the
compiled backward, which keeps one GEMM per linear (tests/test_fp8.py counts them).

Rowwise cannot take that path (torchao 0.18, checked on the CPU by tests/test_fp8.py):
- one per-row cast cannot serve both GEMMs: the forward scales the weight per output channel, the
  input gradient per input channel (the transposed axis), and torch._scaled_mm refuses a scale
  along the inner dimension;
- a weight cast per row and held as an nn.Parameter loses its axis (Parameter detaches it, and
  torchao's detach rebuilds the tensor without `axiswise_dim`), and the forward GEMM then fails;
- the rowwise config over today's tensorwise cast of the weight runs, but scales the weight per
  tensor: a lever that measures something other than its name.
So `RowwiseFloat8Linear` holds two casts of its weight, one per GEMM (1 byte each: the 2 bytes per
weight the bf16 weight held, and the scales), and its own autograd function: forward with one,
input gradient with the other, casting only the activations and the gradient each step, no weight
gradient at all. torchao's own linear over the bf16 weight would hold the same bytes and run the
same two GEMMs, but cast each weight twice every step (three times under recompute): about 10
bytes of memory traffic per weight per step more.

Saturation: torch's eager cast to float8 saturates only from 2.12 (on 2.11 a value past the
format's largest becomes NaN in e4m3fn, inf in e5m2). Every cast here, of the weights at conversion
and of the activations and gradients each step, is torchao's `hp_tensor_to_float8_dynamic`, whose
`to_fp8_saturated` clamps to the format's range before its one `.to`: its scale is the amax over the
format's largest, so the scaled values pass the largest only by fp32's rounding of that product, and
the clamp takes them back whatever the torch (tests/test_fp8.py watches every cast's input).

torchao's version (TORCHAO_NEEDED, `check_fp8` refusing in one line a torchao older than the run's
torch needs): from torch 2.14 (its nightlies from 2026-06-14; 2.13 was cut on 2026-06-10,
pytorch/pytorch#186934, and its inductor still emits the `tl.where` form) inductor emits min/max as
Triton's NaN-propagating `tl.minimum/maximum` (pytorch/pytorch#186933, then #190404 for its
helpers), whose PTX makes Triton miscompile a neighbouring transposed float8 store
(triton-lang/triton#11111): NaN or Inf losses in about a quarter of compiled runs. torchao 0.18.0
puts the `tl.where` form back (pytorch/ao#4652 and #4657, torchao/float8/_inductor_patch.py), from
`convert_to_float8_training`, which this module does not call: `convert_frozen_linears` applies it.

Eagerly the casts run as kernels of their own (and tensorwise's weight-gradient GEMM runs), so
`fp8_refusal` refuses --compile false for both recipes, as it refuses cards
without FP8 tensor cores and precisions but bf16.

--frozen-sharding fsdp is refused (latentwire.settings): FSDP2 shards a weight before it is read and
all-gathers plain tensors; torchao's float8 FSDP path keeps each bf16 shard and casts it again every
step, which is neither the one cast nor the halved weights that pay here.

On the CPU torch._scaled_mm emulates float8 (dequantised operands, an fp32 product): the numerics,
none of the speed.
"""

from __future__ import annotations

import functools
import importlib.metadata
from types import SimpleNamespace

import torch
from torch import nn
from torch.torch_version import TorchVersion

from .harness.errors import UserError
from .harness.precision import cuda_capability
from .llm import FrozenLLM, decoder_layers

FP8_ALIGNMENT = 16
RECIPES = ("tensorwise", "rowwise")  # torchao's Float8LinearRecipeName values
# The torchao a torch needs for float8 under torch.compile, (from this torch on, this torchao or
# newer): the module's docstring says why.
TORCHAO_NEEDED = (("2.14.0.dev0", "0.18.0"),)


@functools.cache
def torchao_float8() -> SimpleNamespace:
    """torchao's float8 training pieces, imported only where --frozen-fp8 asks for them (its import
    noise on a CPU build: latentwire/__init__.py)."""
    try:
        from torchao.float8 import Float8LinearConfig, float8_ops
        from torchao.float8.config import ScalingGranularity
        from torchao.float8.float8_linear import Float8Linear
        from torchao.float8.float8_scaling_utils import hp_tensor_to_float8_dynamic
        from torchao.float8.float8_training_tensor import Float8TrainingTensor, GemmInputRole
    except ImportError as e:
        raise UserError(f"--frozen-fp8 needs torchao: pip install -r requirements-fp8.txt ({e})") from None
    try:
        from torchao.float8._inductor_patch import _patch_inductor_min_max_codegen as patch_inductor
    except ImportError:  # before torchao 0.18: allowed only on a torch that needs no patch (TORCHAO_NEEDED)
        patch_inductor = None
    return SimpleNamespace(
        patch_inductor=patch_inductor,
        Config=Float8LinearConfig,
        Linear=Float8Linear,
        to_float8=hp_tensor_to_float8_dynamic,
        Tensor=Float8TrainingTensor,
        Role=GemmInputRole,
        AXISWISE=ScalingGranularity.AXISWISE,
        ops=float8_ops,
    )


def recipe_config(recipe: str):
    """torchao's Float8LinearConfig of the recipe: which float8 format and scale each operand takes."""
    return torchao_float8().Config.from_recipe_name(recipe)


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


def check_fp8(device: torch.device, precision: str, eager_backward: bool) -> None:
    """--frozen-fp8 refused in one line where it cannot run or cannot help on this device
    (`fp8_refusal`), or where torchao is missing or older than this torch needs (`torchao_refusal`)."""
    why = fp8_refusal(device.type, cuda_capability(device), precision, eager_backward)
    why = why or torchao_refusal(torch.__version__, torchao_version())
    if why:
        raise UserError(f"--frozen-fp8: {why}")


def torchao_version() -> str | None:
    """The torchao this interpreter would import, from its distribution's metadata (not imported:
    transformers' import of it is noisy, latentwire/__init__.py), or None where there is none."""
    try:
        return importlib.metadata.version("torchao")
    except importlib.metadata.PackageNotFoundError:
        return None


def torchao_refusal(torch_version: str, torchao_version: str | None) -> str | None:
    """Why this torchao cannot run float8 under this torch (TORCHAO_NEEDED), or None where it can."""
    if torchao_version is None:
        return "needs torchao: pip install -r requirements-fp8.txt"
    for from_torch, needed in TORCHAO_NEEDED:
        if TorchVersion(torch_version) >= from_torch and TorchVersion(torchao_version) < needed:
            return (
                f"torch {torch_version} needs torchao {needed} or newer (this is {torchao_version}): its compiled "
                "float8 kernels otherwise write NaN or Inf in about a quarter of runs (pytorch/ao#4652)"
            )
    return None


def fp8_linears(llm: FrozenLLM) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of each linear of the LLM that converts."""
    return [found for layer in decoder_layers(llm) for found in convertible_linears(layer)]


def convertible_linears(layer: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, linear) of each plain linear in `layer` whose widths are both multiples
    of FP8_ALIGNMENT."""
    return [
        (parent, name, child)
        for parent in layer.modules()
        for name, child in parent.named_children()
        if type(child) is nn.Linear
        and child.in_features % FP8_ALIGNMENT == 0
        and child.out_features % FP8_ALIGNMENT == 0
    ]


def convert_frozen_linears(llm: FrozenLLM, recipe: str) -> None:
    """Each of `fp8_linears` becomes a float8 linear of `recipe` holding its weight cast once per
    GEMM, from the values it holds now: call after `read_weights` (or on the planner's fakes, whose
    casts are fake too)."""
    config = recipe_config(recipe)
    if torchao_float8().patch_inductor is not None:  # before anything compiles (TORCHAO_NEEDED)
        torchao_float8().patch_inductor()
    for parent, name, linear in fp8_linears(llm):
        converted = tensorwise_linear(linear, config) if recipe == "tensorwise" else RowwiseFloat8Linear(linear, config)
        setattr(parent, name, converted)


def frozen(tensor: torch.Tensor) -> nn.Parameter:
    return nn.Parameter(tensor, requires_grad=False)


def tensorwise_linear(linear: nn.Linear, config) -> nn.Linear:
    """torchao's Float8Linear holding its weight's one tensorwise cast."""
    ao = torchao_float8()
    converted = ao.Linear.from_float(linear, config)
    with torch.no_grad():
        converted.weight = frozen(
            ao.to_float8(
                linear.weight,
                config.cast_config_weight.target_dtype,
                converted.linear_mm_config,
                gemm_input_role=ao.Role.WEIGHT,
            )
        )
    return converted


def rowwise_cast(tensor: torch.Tensor, cast, config):
    """`tensor` (2-D) in float8 with one scale per row (its last axis reduced), as torchao's recipe
    casts each operand of a rowwise GEMM."""
    ao = torchao_float8()
    return ao.to_float8(
        tensor,
        cast.target_dtype,
        None,
        scaling_granularity=ao.AXISWISE,
        axiswise_dim=-1,
        round_scales_to_power_of_2=config.round_scales_to_power_of_2,
    )


class RowwiseFloat8Linear(nn.Linear):
    """A frozen linear whose weight W [out, in] is held as two rowwise casts: `weight`, W scaled per
    output channel for the forward GEMM, and `weight_for_grad_input`, W^T scaled per input channel
    for the input-gradient GEMM, each laid out as torch._scaled_mm takes it (see the module's
    docstring for why two)."""

    def __init__(self, linear: nn.Linear, config):
        with torch.device("meta"):
            super().__init__(linear.in_features, linear.out_features, bias=False)
        self.config = config
        with torch.no_grad():
            self.weight = frozen(rowwise_cast(linear.weight, config.cast_config_weight, config))
            self.weight_for_grad_input = frozen(
                rowwise_cast(linear.weight.t().contiguous(), config.cast_config_weight_for_grad_input, config)
            )
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = RowwiseFrozenMatmul.apply(x, self.weight, self.weight_for_grad_input, self.config)
        return y if self.bias is None else y + self.bias.to(y.dtype)


def rowwise_gemm(x: torch.Tensor, weight, cast, config, fast_accum: bool) -> torch.Tensor:
    """x [..., K] cast per row, times `weight` [N, K] (cast per row): [..., N] in x's dtype,
    through torchao's scaled GEMM (looked up on its module, where tests/test_fp8.py watches it)."""
    rows = rowwise_cast(x.reshape(-1, x.shape[-1]), cast, config)
    y = torchao_float8().ops.addmm_float8_unwrapped(
        rows._data, rows._scale, weight._data.t(), weight._scale.t(), x.dtype, use_fast_accum=fast_accum
    )
    return y.reshape(*x.shape[:-1], y.shape[-1])


@torch._dynamo.allow_in_graph
class RowwiseFrozenMatmul(torch.autograd.Function):
    """x W^T for RowwiseFloat8Linear: each GEMM with its own cast of the frozen weight, and the input
    gradient the only gradient."""

    @staticmethod
    def forward(ctx, x, weight, weight_for_grad_input, config):
        ctx.save_for_backward(weight_for_grad_input)
        ctx.config = config
        return rowwise_gemm(x, weight, config.cast_config_input, config, config.gemm_config_output.use_fast_accum)

    @staticmethod
    def backward(ctx, grad):
        (weight_for_grad_input,) = ctx.saved_tensors
        c = ctx.config
        return (
            rowwise_gemm(
                grad, weight_for_grad_input, c.cast_config_grad_output, c, c.gemm_config_grad_input.use_fast_accum
            ),
            None,
            None,
            None,
        )


def parameter_count(model: nn.Module) -> int:
    """The model's parameters, each weight counted once (a rowwise linear holds two casts of one)."""
    return sum(p.numel() for p in model.parameters()) - sum(
        m.weight_for_grad_input.numel() for m in model.modules() if isinstance(m, RowwiseFloat8Linear)
    )


RECIPE_NOTES = {
    "tensorwise": "tensorwise: e4m3 activations and weights, e5m2 gradients, a scale per tensor; each weight "
    "cast once, 1 byte",
    "rowwise": "rowwise: e4m3, a power-of-two scale per row; each weight cast once per GEMM (per output "
    "channel, per input channel), 2 bytes",
}


def float8_modules(model: nn.Module) -> list[str]:
    """The qualified names of `model`'s modules that hold a float8 weight."""
    cast = torchao_float8().Tensor
    return [name for name, module in model.named_modules() if isinstance(getattr(module, "weight", None), cast)]


def describe_fp8(llms: dict[str, FrozenLLM], recipe: str, device_type: str) -> str:
    """The run's opening line on float8: what converted (counted over each whole LLM, so that a head
    converted too would show), what it holds, and what MFU means."""
    counts, outside = [], 0
    for name, llm in llms.items():
        linears = [m for layer in decoder_layers(llm) for m in layer.modules() if isinstance(m, nn.Linear)]
        fp8 = sum(isinstance(m.weight, torchao_float8().Tensor) for m in linears)
        outside += len(float8_modules(llm.model)) - fp8
        counts.append(f"{fp8} of {name}'s {len(linears)}")
    where = (
        "emulated by the CPU's torch._scaled_mm: float8's numerics, none of its speed"
        if device_type == "cpu"
        else "on the FP8 tensor cores"
    )
    return (
        f"fp8: {', '.join(counts)} decoder-layer linears in float8 and {outside} other module{'s' * (outside != 1)} "
        f"(torchao {torchao_version()}, {RECIPE_NOTES[recipe]}), {where}; MFU stays counted against the bf16 peak"
    )
