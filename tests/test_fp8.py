"""FP8 frozen readers (--frozen-fp8, latentwire.fp8) on the CPU, whose torch._scaled_mm emulates
float8: where it is refused, what converts and what it holds, that a compiled backward runs one
GEMM per frozen float8 linear, its numerics against bf16 on the tiny readers, and train.py with it."""
import copy
import json
import sys

import pytest
import torch

from conftest import FAST, REPO, ok, read_metrics, run_train
from latentwire.harness.errors import UserError
from latentwire.harness.precision import fp8_refusal
from latentwire.llm import build_frozen_llms, decoder_layers, held_bytes
from latentwire.parallelize import prepare_frozen_llms
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
    assert load_config(["--profile", "h100", "--frozen-fp8", "true"]).frozen.fp8
    assert not load_config(["--profile", "h100"]).frozen.fp8
    load_config(["--profile", "a100-80gb", "--frozen-fp8", "true"])  # its card is checked when the run starts
    with pytest.raises(UserError, match="frozen_fp8 with frozen_sharding fsdp"):
        load_config(["--profile", "h100x4", "--frozen-fp8", "true", "--frozen-sharding", "fsdp"])
    with pytest.raises(UserError, match="third GEMM"):
        load_config(["--profile", "h100", "--frozen-fp8", "true", "--compile", "false"])


def tiny_readers(fp8: bool, compile_options: dict | None = None) -> dict:
    cfg = load_config(["--profile", "cpu"])
    with torch.device("meta"):
        llms = build_frozen_llms(cfg.frozen, cfg.prompt, torch.bfloat16)
    prepare_frozen_llms(llms, checkpointing=None, compile_options=compile_options, mesh=None, device=CPU,
                              fp8=fp8)
    return llms


def test_each_frozen_weight_is_cast_once_to_one_byte_and_computes_as_torchao_s_own_cast(torchao_site):
    """The decoder layers' aligned linears convert, nothing else; each holds its weight as e4m3 and
    one fp32 scale: the bf16 bytes less one byte per weight, plus four. A converted linear computes,
    forward and input gradient, bit for bit what torchao's Float8Linear computes casting the bf16
    weight itself at every step."""
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_training_tensor import Float8TrainingTensor

    from latentwire.fp8 import convert_frozen_linears, fp8_linears

    llms = tiny_readers(fp8=False)
    bf16_bytes = {name: held_bytes(llm.model) for name, llm in llms.items()}
    first = decoder_layers(llms["qwen"])[0].self_attn.q_proj
    per_step = Float8Linear.from_float(copy.deepcopy(first))  # torchao's default: the weight cast each call
    converted = {name: [linear.weight.numel() for _, _, linear in fp8_linears(llm)] for name, llm in llms.items()}
    for llm in llms.values():
        convert_frozen_linears(llm)
    for name, llm in llms.items():
        assert len(converted[name]) == CONVERTED_PER_LAYER[name] * LAYERS[name]
        assert held_bytes(llm.model) == bf16_bytes[name] - sum(converted[name]) + 4 * len(converted[name])
        weights = [m.weight for m in llm.model.modules() if isinstance(m, Float8Linear)]
        assert len(weights) == len(converted[name])
        assert all(isinstance(w, Float8TrainingTensor) and w._data.dtype == torch.float8_e4m3fn for w in weights)
        assert type(llm.model.get_output_embeddings()) is torch.nn.Linear  # the head stays bf16
    once = decoder_layers(llms["qwen"])[0].self_attn.q_proj
    x = torch.randn(8, first.in_features, dtype=torch.bfloat16, requires_grad=True)
    y_once, y_each = once(x), per_step(x)
    assert torch.equal(y_once, y_each)
    g = torch.randn_like(y_once)
    assert torch.equal(*(torch.autograd.grad(y, x, g)[0] for y in (y_once, y_each)))


def count_gemms(graphs) -> tuple[int, int]:
    """(float8 GEMMs, other GEMMs) in FX graphs."""
    targets = [str(n.target) for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    return (sum(t == "aten._scaled_mm.default" for t in targets),
            sum(t in ("aten.mm.default", "aten.bmm.default", "aten.addmm.default") for t in targets))


@pytest.fixture
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def test_a_compiled_backward_runs_one_gemm_per_frozen_float8_linear(torchao_site, fresh_dynamo):
    """torchao's backward computes the weight's gradient whether wanted or not; for a frozen weight
    AOTAutograd drops it: the backward graph of a decoder layer (compiled as train.py compiles it,
    AOTAutograd's graphs captured) holds one float8 GEMM per converted linear, the input
    gradient's, as its forward holds one. Eagerly the same backward runs two per linear, which is
    why --compile false is refused."""
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
    llms = tiny_readers(fp8=True, compile_options={"backend": backend, "dynamic": True})
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
            CountMatmuls.calls += func is torch.ops.aten.mm.default
            return func(*args, **(kwargs or {}))

    layer = decoder_layers(llms["qwen"])[0].mlp.down_proj  # converted, and alone: one linear
    x = torch.randn(4, layer.in_features, dtype=torch.bfloat16, requires_grad=True)
    y = layer(x)
    with CountMatmuls():
        y.sum().backward()
    assert CountMatmuls.calls == 2


def test_fp8_against_bf16_on_the_tiny_readers(torchao_site):
    """The wire's loss and gradient with the readers' linears in float8 against bf16, on the same
    weights and batch, within the bounds bench/fp8_numerics.py derives from e4m3's and e5m2's
    rounding: each float8 GEMM's error against its own bound (too small as well as too large: a
    float8 that did not run is caught), the loss and the gradient against the random-walk estimate
    over the GEMMs in series, and neither equal to bf16's."""
    from fp8_numerics import GEMM_ERROR_RANGE, compare

    cfg = load_config(["--profile", "cpu", "--precision", "bf16", "--dropout", "0", "--kd-weight", "0"])
    result = compare(cfg, CPU)
    assert len(result.gemm_errors) == sum(CONVERTED_PER_LAYER[n] * min(LAYERS[n], 2) for n in LAYERS)
    low, high = GEMM_ERROR_RANGE
    assert all(low <= error <= high for error in result.gemm_errors.values()), result.gemm_errors
    assert result.gemms_in_series == {"llama": 2 * 2, "qwen": 3 * 4}  # the Llama's MLP stays bf16
    assert 0 < result.loss_rel_diff <= result.loss_bound, result.line()
    assert result.cosine_bound <= result.grad_cosine < 1, result.line()


@pytest.mark.slow
def test_train_py_runs_compiled_with_fp8_readers(tmp_path, torchao_site):
    """Two compiled steps with the readers in float8 (the CPU's emulation), an evaluation after
    them (eager, no_grad, a KV cache, through the same float8 linears), the opening line saying what
    converted and that MFU stays against the bf16 peak, and meta.json recording it."""
    out = tmp_path / "fp8"
    proc = ok(run_train(["--profile", "cpu", *FAST, "--precision", "bf16", "--compile", "true", "--frozen-fp8", "true",
                         "--max-steps", "2", "--micro-batch-size", "4", "--eval-every", "2", "--eval-examples", "8",
                         "--max-new-tokens", "4", "--compile-cache", str(tmp_path / "cache"), "--out-dir", str(out)],
                        PYTHONPATH=torchao_site))
    assert ("fp8: 8 of llama's 14, 21 of qwen's 21 decoder-layer linears in float8" in proc.stdout
            and "emulated by the CPU" in proc.stdout and "MFU stays counted against the bf16 peak" in proc.stdout)
    assert "Failed to load" not in proc.stderr and "Enum subclass" not in proc.stderr  # torchao's import noise
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics] == [1, 2] and all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics)
    assert "eval_nll_wire_llama" in metrics[-1]
    meta = json.loads(next((out / "checkpoints").glob("step_*/meta.json")).read_text())
    assert meta["config"]["frozen_fp8"] is True
