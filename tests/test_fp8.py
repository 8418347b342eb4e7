"""FP8 frozen readers (--frozen-fp8 tensorwise|rowwise, latentwire.fp8) on the CPU, whose
torch._scaled_mm emulates float8: where it is refused, what converts and what it holds, which
scales its GEMMs take, that a compiled backward runs one GEMM per frozen float8 linear, its
numerics against bf16 on the tiny readers, and train.py with it."""

import copy
import json
import math
import sys
from dataclasses import replace

import pytest
import torch

from conftest import FAST, REPO, ok, read_metrics, run_train
from latentwire.fp8 import RECIPES, fp8_refusal
from latentwire.harness.errors import UserError
from latentwire.llm import decoder_layers, held_bytes
from latentwire.parallelize import frozen_llms
from latentwire.settings import load_config

sys.path.insert(0, str(REPO / "bench"))  # the numerics bench's comparison, as the card runs it

CPU = torch.device("cpu")
# The tiny readers' linears that convert: the Llama's MLP is 344 wide, not a multiple of 16.
CONVERTED_PER_LAYER = {"llama": 4, "qwen": 7}
LAYERS = {"llama": 2, "qwen": 3}


def test_fp8_is_refused_where_it_cannot_run_or_help():
    """The choice a card makes (capability), taken on the CPU: one line each, exit 2 where raised."""
    assert fp8_refusal("cuda", (9, 0), "bf16", eager_backward=False) is None  # H100, H200
    assert fp8_refusal("cuda", (8, 9), "bf16", eager_backward=False) is None  # Ada: L4, L40S, RTX 6000 Ada
    assert "sm80" in fp8_refusal("cuda", (8, 0), "bf16", eager_backward=False)  # A100: no FP8 tensor cores
    assert "sm70" in fp8_refusal("cuda", (7, 0), "bf16", eager_backward=False)
    assert fp8_refusal("cpu", None, "bf16", eager_backward=False) is None  # emulated: numerics, no speed
    assert fp8_refusal("cuda", None, "bf16", eager_backward=False) is None  # a profile read before its card
    for precision in ("fp16", "fp32"):
        assert "--precision bf16" in fp8_refusal("cuda", (9, 0), precision, eager_backward=False)
    for card in (("cuda", (9, 0)), ("cpu", None)):
        assert "third GEMM" in fp8_refusal(*card, "bf16", eager_backward=True)
    # The profile's part is read with the configuration (train.py, the plan, find_batch alike).
    assert load_config(["--profile", "h100"]).frozen.fp8 == "none"
    with pytest.raises(UserError, match="must be one of none, tensorwise, rowwise"):
        load_config(["--profile", "h100", "--frozen-fp8", "true"])
    for recipe in RECIPES:
        assert load_config(["--profile", "h100", "--frozen-fp8", recipe]).frozen.fp8 == recipe
        load_config(["--profile", "a100-80gb", "--frozen-fp8", recipe])  # its card is checked when the run starts
        with pytest.raises(UserError, match="frozen_fp8 with frozen_sharding fsdp"):
            load_config(["--profile", "h100x4", "--frozen-fp8", recipe, "--frozen-sharding", "fsdp"])
        with pytest.raises(UserError, match="third GEMM"):
            load_config(["--profile", "h100", "--frozen-fp8", recipe, "--compile", "false"])
        with pytest.raises(UserError, match="--precision bf16"):
            load_config(["--profile", "h100", "--frozen-fp8", recipe, "--precision", "fp32"])


def test_a_torchao_older_than_the_torch_needs_is_refused(monkeypatch):
    """torchao's float8 under torch.compile on torch 2.14 (its nightlies too) needs torchao 0.18's
    codegen fix; older torches need none. Refused in one line where the run's card is checked, and
    without torchao at all."""
    import latentwire.fp8 as fp8

    assert fp8.TORCHAO_NEEDED == (("2.14.0.dev0", "0.18.0"),)
    for torch_version in ("2.11.0+cu130", "2.13.0+cpu"):
        assert fp8.torchao_refusal(torch_version, "0.17.0") is None
    for torch_version in ("2.14.0.dev20260614+cu126", "2.14.0", "2.15.1+cu130"):
        why = fp8.torchao_refusal(torch_version, "0.17.0")
        assert f"torch {torch_version} needs torchao 0.18.0 or newer (this is 0.17.0)" in why
        assert fp8.torchao_refusal(torch_version, "0.18.0") is None
        assert fp8.torchao_refusal(torch_version, "0.19.0.dev20260801") is None
    assert fp8.torchao_refusal("2.13.0", None) == "needs torchao: pip install -r requirements-fp8.txt"
    monkeypatch.setattr(torch, "__version__", "2.14.0")
    monkeypatch.setattr(fp8, "torchao_version", lambda: "0.17.0")
    with pytest.raises(UserError, match=r"^--frozen-fp8: torch 2.14.0 needs torchao 0.18.0 or newer") as e:
        fp8.check_fp8(CPU, "bf16", eager_backward=False)
    assert "\n" not in str(e.value)


def bf16_readers(fp8: str, compile_options: dict | None = None) -> dict:
    cfg = load_config(["--profile", "cpu"])
    return frozen_llms(replace(cfg.frozen, fp8=fp8), cfg.prompt, "bf16", CPU, compile_options=compile_options)


def held_change(recipe: str, in_features: int, out_features: int) -> int:
    """Bytes a converted linear holds beyond its bf16 weight: tensorwise, 1 byte per weight instead
    of 2 and one fp32 scale; rowwise, two casts of 1 byte per weight and an fp32 scale per row of each."""
    if recipe == "tensorwise":
        return -in_features * out_features + 4
    return 4 * (in_features + out_features)


@pytest.mark.parametrize("recipe", RECIPES)
def test_each_frozen_weight_is_cast_once_per_gemm_and_computes_as_torchao_s_recipe(torchao_site, recipe, monkeypatch):
    """The decoder layers' aligned linears convert, nothing else; each holds its weight in e4m3,
    cast once for each GEMM that reads it (tensorwise: one cast for both; rowwise: one per output
    channel, one per input channel), in the bytes and the weights the plan counts, and computes,
    forward and input gradient, bit for bit what torchao's Float8Linear computes under the same
    recipe casting the bf16 weight itself at every call. Its GEMMs take the recipe's scales: one per
    tensor, or one per row of each operand, the weight's its own per channel (a tensorwise cast
    under the rowwise config fails this)."""
    from torchao.float8 import float8_ops
    from torchao.float8.config import ScalingGranularity
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor
    from torchao.float8.float8_utils import tensor_to_scale

    from latentwire.fp8 import convert_frozen_linears, fp8_linears, parameter_count, recipe_config

    config = recipe_config(recipe)
    llms = bf16_readers(fp8="none")
    bf16_bytes = {name: held_bytes(llm.model) for name, llm in llms.items()}
    counts = {name: parameter_count(llm.model) for name, llm in llms.items()}
    first = decoder_layers(llms["qwen"])[0].self_attn.q_proj
    per_step = Float8Linear.from_float(copy.deepcopy(first), config)  # the weight cast at every call
    converted = {
        name: [(linear.in_features, linear.out_features) for _, _, linear in fp8_linears(llm)]
        for name, llm in llms.items()
    }
    for llm in llms.values():
        convert_frozen_linears(llm, recipe)
    casts_per_linear = 1 if recipe == "tensorwise" else 2
    for name, llm in llms.items():
        assert len(converted[name]) == CONVERTED_PER_LAYER[name] * LAYERS[name]
        # what the plan counts: the bytes held (held_bytes), and each weight once (parameter_count)
        assert held_bytes(llm.model) == bf16_bytes[name] + sum(held_change(recipe, *io) for io in converted[name])
        assert parameter_count(llm.model) == counts[name]
        casts = [p for p in llm.model.parameters() if isinstance(p, Float8TrainingTensor)]
        assert len(casts) == casts_per_linear * len(converted[name])
        assert all(w._data.dtype == torch.float8_e4m3fn for w in casts)
        assert type(llm.model.get_output_embeddings()) is torch.nn.Linear  # the head stays bf16

    gemms = []  # the scales each float8 GEMM applies, as torchao's scaled GEMM receives them
    scaled_gemm = float8_ops.addmm_float8_unwrapped

    def watched(a, a_scale, b, b_scale, *args, **kwargs):
        gemms.append((a_scale, b_scale))
        return scaled_gemm(a, a_scale, b, b_scale, *args, **kwargs)

    monkeypatch.setattr(float8_ops, "addmm_float8_unwrapped", watched)
    once = decoder_layers(llms["qwen"])[0].self_attn.q_proj
    x = torch.randn(8, first.in_features, dtype=torch.bfloat16, requires_grad=True)
    y_once = once(x)
    g = torch.randn_like(y_once)
    grad_once = torch.autograd.grad(y_once, x, g)[0]
    (forward_a, forward_b), (input_grad_a, input_grad_b) = gemms[:2]  # eager tensorwise: then the weight's
    if recipe == "tensorwise":
        assert all(scale.numel() == 1 for scale in (forward_a, forward_b, input_grad_a, input_grad_b))
    else:

        def per_channel(axis):  # the recipe's scale of each output (axis -1) or input (axis 0) channel
            return tensor_to_scale(
                first.weight,
                torch.float8_e4m3fn,
                scaling_granularity=ScalingGranularity.AXISWISE,
                axiswise_dim=axis,
                round_scales_to_power_of_2=True,
            )

        assert forward_a.shape == input_grad_a.shape == (8, 1)  # a scale per token, of x and of the gradient
        assert torch.equal(forward_b, per_channel(-1).t()) and torch.equal(input_grad_b, per_channel(0))
        assert forward_b.unique().numel() > 1 and input_grad_b.unique().numel() > 1
    y_each = per_step(x)
    assert torch.equal(y_once, y_each)
    assert torch.equal(grad_once, torch.autograd.grad(y_each, x, g)[0])


def test_the_recipe_converts_the_decoder_layers_linears_and_nothing_else(torchao_site):
    """Which modules float8 takes, by name, on the whole model train.py builds (the readers and the
    wire's encoder and adapters): each decoder layer's attention projections, and its MLP where the
    widths allow (the tiny Llama's 344 does not); never a head (torchtitan's float8 filter converted
    the output head too until mid-2026), an embedding or anything of the wire. The run's opening line
    counts them over each whole LLM, so a head converted would show there. The conversion also puts
    torchao's min/max codegen fix in place, which its convert_to_float8_training would (TORCHAO_NEEDED)."""
    from torch._inductor.codegen.triton import TritonOverrides

    from latentwire.fp8 import describe_fp8, float8_modules, recipe_config, tensorwise_linear
    from latentwire.model import WireEncoder

    attention = [f"self_attn.{p}_proj" for p in "qkvo"]
    mlp = [f"mlp.{p}_proj" for p in ("gate", "up", "down")]
    per_layer = {"llama": attention, "qwen": attention + mlp}
    for recipe in RECIPES:
        llms = bf16_readers(fp8=recipe)
        wire = WireEncoder.for_llms(load_config(["--profile", "cpu"]).wire, llms)
        for name, llm in llms.items():
            expected = [f"model.layers.{i}.{p}" for i in range(LAYERS[name]) for p in per_layer[name]]
            assert float8_modules(llm.model) == expected, (recipe, name)
        assert float8_modules(wire) == [] and any(isinstance(m, torch.nn.Linear) for m in wire.modules())
        line = describe_fp8(llms, recipe, "cpu")
        assert line.startswith("fp8: 8 of llama's 14, 21 of qwen's 21 decoder-layer linears in float8 and 0 other")
    assert TritonOverrides.minimum("a", "b") == "tl.where((a < b) | (a != a), a, b)"
    llama = llms["llama"].model  # a head converted as well, as torchtitan's filter did: the line says so
    llama.lm_head = tensorwise_linear(llama.lm_head, recipe_config("tensorwise"))
    assert " and 1 other module (" in describe_fp8(llms, "rowwise", "cpu")


def test_every_cast_to_float8_gets_values_within_its_format_s_range(torchao_site):
    """Torch 2.11's eager cast to float8 does not saturate: each cast of the path (a weight cast once,
    the activations and gradients each step, by either recipe) must get values already clamped to
    the format's range, whatever the torch. A weight, an activation and a gradient past the formats'
    largest, chosen so that tensorwise's scale takes them past it by fp32's rounding (620 x 448/620
    and 79,360 x 57,344/79,360 round above 448 and 57,344): every `.to(float8)` on the path is watched,
    its input within the range and the clamp's bound reached, and the weight's bytes are the clamped
    reference's."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torchao.float8.float8_utils import tensor_to_scale

    from latentwire.fp8 import RowwiseFloat8Linear, recipe_config, tensorwise_linear

    e4m3, e5m2 = float8 = (torch.float8_e4m3fn, torch.float8_e5m2)
    formats = {  # the weight, then x, then g; tensorwise's eager weight gradient casts g and x again
        "tensorwise": [e4m3, e4m3, e5m2, e5m2, e4m3],
        "rowwise": [e4m3, e4m3, e4m3, e4m3],  # the weight per output channel, per input channel
    }

    class WatchCasts(TorchDispatchMode):  # at aten's level, where the backward's casts are seen too
        def __init__(self):
            super().__init__()
            self.casts = []  # (format, the largest magnitude handed to it)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is torch.ops.aten._to_copy.default and kwargs.get("dtype") in float8:
                self.casts.append((kwargs["dtype"], args[0].abs().max().item()))
            return func(*args, **kwargs)

    generator = torch.Generator().manual_seed(0)
    linear = torch.nn.Linear(32, 48, bias=False).to(torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(generator=generator)[3, 5] = 620.0
    x = torch.randn(8, 32, generator=generator).to(torch.bfloat16)
    x[2, 7] = 620.0
    g = torch.randn(8, 48, generator=generator).to(torch.bfloat16)
    g[1, 1] = 79360.0
    for recipe in RECIPES:
        config = recipe_config(recipe)
        with WatchCasts() as watch:
            converted = (tensorwise_linear if recipe == "tensorwise" else RowwiseFloat8Linear)(linear, config)
            xr = x.clone().requires_grad_(True)
            converted(xr).backward(g)
        assert [dtype for dtype, _ in watch.casts] == formats[recipe], watch.casts
        assert all(largest <= torch.finfo(dtype).max for dtype, largest in watch.casts), (recipe, watch.casts)
        assert torch.isfinite(xr.grad).all()
        if recipe == "tensorwise":  # the product the clamp takes back, at the weight's, x's and g's casts
            assert all(largest == torch.finfo(dtype).max for dtype, largest in watch.casts), watch.casts
            scale = tensor_to_scale(linear.weight, torch.float8_e4m3fn)
            clamped = (linear.weight.float() * scale).clamp(-448, 448).to(torch.float8_e4m3fn)
            assert (linear.weight.float() * scale).abs().max() > 448  # past the range before the clamp
            assert torch.equal(converted.weight._data.view(torch.uint8), clamped.view(torch.uint8))


def count_gemms(graphs) -> tuple[int, int]:
    """(float8 GEMMs, other GEMMs) in FX graphs."""
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    return (
        sum(t == "aten._scaled_mm.default" for t in targets),
        sum(t in ("aten.mm.default", "aten.bmm.default", "aten.addmm.default") for t in targets),
    )


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("recipe", RECIPES)
def test_a_compiled_backward_runs_one_gemm_per_frozen_float8_linear(torchao_site, fresh_dynamo, recipe):
    """The backward graph of a decoder layer (compiled as train.py compiles it, AOTAutograd's graphs
    captured) holds one float8 GEMM per converted linear, the input gradient's, as its forward
    holds one. torchao's tensorwise backward computes the weight's gradient whether wanted or not,
    which AOTAutograd drops for a frozen weight: eagerly it runs two GEMMs per linear (one reason
    --compile false is refused); the rowwise linear computes the input gradient alone."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch.utils._python_dispatch import TorchDispatchMode

    captured = {"forward": [], "backward": []}

    def keep(kind):
        def compiler(graph, inputs):
            captured[kind].append(graph)
            return make_boxed_func(graph.forward)

        return compiler

    backend = aot_autograd(fw_compiler=keep("forward"), bw_compiler=keep("backward"))
    llms = bf16_readers(fp8=recipe, compile_options={"backend": backend, "dynamic": True})
    for name, llm in llms.items():
        captured["forward"].clear(), captured["backward"].clear()
        embeds = torch.randn(2, 8, llm.hidden_size, dtype=torch.bfloat16, requires_grad=True)
        llm.model(inputs_embeds=embeds, use_cache=False).logits.float().sum().backward()
        forward, backward = count_gemms(captured["forward"]), count_gemms(captured["backward"])
        assert len(captured["backward"]) == 1  # every layer of an LLM runs the one compiled graph
        assert forward[0] == backward[0] == CONVERTED_PER_LAYER[name], (name, forward, backward)
        assert embeds.grad is not None and torch.isfinite(embeds.grad).all()

    class CountMatmuls(TorchDispatchMode):  # above torchao's tensor: its matmuls are still aten.mm
        calls = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            CountMatmuls.calls += func in (torch.ops.aten.mm.default, torch.ops.aten._scaled_mm.default)
            return func(*args, **(kwargs or {}))

    layer = decoder_layers(llms["qwen"])[0].mlp.down_proj  # converted, and alone: one linear
    x = torch.randn(4, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    with CountMatmuls():
        y.sum().backward()
    assert CountMatmuls.calls == {"tensorwise": 2, "rowwise": 1}[recipe]


@pytest.mark.parametrize("recipe", RECIPES)
def test_fp8_against_bf16_on_the_tiny_readers(torchao_site, recipe):
    """The wire's loss and gradients with the readers' linears in float8 by each recipe against
    bf16, on the same weights and batch, within the bounds bench/fp8_numerics.py derives from the
    recipe's formats (e4m3's and e5m2's rounding): each float8 GEMM's error, forward and input
    gradient (what the wire's gradient comes back through), against its own bound (too small as well
    as too large: a float8 that did not run is caught); the loss and the gradient the readers send
    back to the trainable parameters: the loss within the random-walk estimate over the GEMMs in
    series, and neither equal to bf16's. The gradient is not held to that estimate: the tiny
    Llama's peaked attention moves it past it in seven of fourteen draws (bench/fp8_numerics.py)."""
    from fp8_numerics import Bounds, compare

    cfg = load_config(["--profile", "cpu", "--precision", "bf16", "--dropout", "0", "--kd-weight", "0"])
    result = compare(cfg, CPU, recipe)
    assert (
        len(result.forward_errors)
        == len(result.input_grad_errors)
        == sum(CONVERTED_PER_LAYER[n] * min(LAYERS[n], 2) for n in LAYERS)
    )
    for errors, eps in (
        (result.forward_errors, result.bounds.forward),
        (result.input_grad_errors, result.bounds.backward),
    ):
        low, high = Bounds.gemm_range(eps)
        assert all(low <= error <= high for error in errors.values()), (eps, errors)
    assert result.gemms_in_series == {"llama": 2 * 2, "qwen": 3 * 4}  # the Llama's MLP stays bf16
    assert 0 < result.loss_rel_diff <= result.loss_bound, result.line()
    assert 0 < result.grad_rel_diff and math.isfinite(result.grad_rel_diff) and result.grad_cosine < 1, result.line()


@pytest.mark.slow
def test_train_py_runs_compiled_with_fp8_readers(tmp_path, torchao_site):
    """Two compiled steps (inductor) with the readers in float8 by the rowwise recipe, the one of
    its own autograd function (the CPU's emulation), torchao's compiled extensions not loaded (as
    the levers' FP8 parts run it; its import noise kept off stderr), an evaluation after them
    (eager, no_grad, a KV cache, through the same float8 linears), the opening line saying what
    converted and that MFU stays against the bf16 peak, and meta.json recording it."""
    out = tmp_path / "fp8"
    proc = ok(
        run_train(
            [
                "--profile",
                "cpu",
                *FAST,
                "--precision",
                "bf16",
                "--compile",
                "true",
                "--frozen-fp8",
                "rowwise",
                "--max-steps",
                "2",
                "--micro-batch-size",
                "4",
                "--eval-every",
                "2",
                "--eval-examples",
                "8",
                "--max-new-tokens",
                "4",
                "--compile-cache",
                str(tmp_path / "cache"),
                "--out-dir",
                str(out),
            ],
            PYTHONPATH=torchao_site,
            TORCHAO_FORCE_SKIP_LOADING_SO_FILES="1",
        )
    )
    assert (
        "fp8: 8 of llama's 14, 21 of qwen's 21 decoder-layer linears in float8 and 0 other modules (torchao "
        in proc.stdout
        and ", rowwise: e4m3" in proc.stdout
        and "emulated by the CPU" in proc.stdout
        and "MFU stays counted against the bf16 peak" in proc.stdout
    )
    assert not any(noise in proc.stderr for noise in ("Failed to load", "Skipping import", "Enum subclass"))
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert "eval_nll_wire_llama" in metrics[-1]
    meta = json.loads(next((out / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["config"]["frozen_fp8"] == "rowwise"
