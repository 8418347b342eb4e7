"""FP8 frozen readers (--frozen-fp8) against bf16, on the same weights and the same batch, for one
of torchao's recipes (`--recipe`): the error of each float8 GEMM of the first and last decoder
layers, forward and input gradient (the GEMMs the wire's gradient comes back through), the loss,
and the gradient the readers send back (every trainable parameter's, and each reader's to its soft
tokens), with the bounds the arithmetic gives them.

    python bench/fp8_numerics.py [--recipe rowwise]      # the cpu profile's tiny readers, on the CPU
    python bench/fp8_numerics.py --recipe rowwise --profile h100 --llama random:meta-llama/Llama-3.1-8B \\
        --qwen random:Qwen/Qwen2.5-7B --dataset synthetic --micro-batch-size 4   # on a card

Any train.py flag after the script's own picks the configuration (bf16, dropout 0 and no
distillation are forced: the same forward twice, no teacher pass). The readers are built and read
as train.py builds them, stepped once in bf16 through train.py's own micro-step, converted in place
by latentwire.fp8 (each weight cast once, from the same values) and stepped again. Both steps run
eagerly: compile changes which GEMMs run (tests/test_fp8.py), not what any of them computes.

The bounds (docs/performance.md, "FP8 frozen readers"). Round-to-nearest leaves a relative error
of at most u per element, half the format's spacing at 1: u = 2^-4 in e4m3 (3 mantissa bits),
2^-3 in e5m2 (2 bits), whatever the scale (a scale per tensor or per row, a power of two or not,
only moves where the elements sit in the format). Each operand's format is the recipe's
(torchao's config): tensorwise casts activations and weights to e4m3 and the gradient coming back
to e5m2, rowwise all three to e4m3. A GEMM output e = sum_k a_k b_k (d_a + d_b) with independent
zero-mean errors of variance u^2 / 3 (uniform on [-u, u], the high side: a value uniform within a
binade has u^2 / 6) has E[e^2] = (u_a^2 + u_b^2) / 3 * sum_k (a_k b_k)^2: relative to the
incoherent norm D = sqrt(sum_k (a_k b_k)^2), whatever the cancellation in the sum, the error is
    forward (e4m3 x e4m3)                    eps_f = sqrt(2/3) 2^-4 = 5.1%
    input gradient, tensorwise (e5m2 x e4m3) eps_b = sqrt((2^-6 + 2^-8) / 3) = 8.1%
    input gradient, rowwise (e4m3 x e4m3)    eps_b = eps_f = 5.1%.
Each GEMM's error is checked against its eps directly (eps_f forward, eps_b input gradient): at
most 1.5 eps (the uniform variance is the high side already), at least eps / 4, over three times
what bf16's own rounding leaves (sqrt(2/3) 2^-8 = 0.32% for the operands, and the output's 2^-9),
so a float8 that did not run fails it. Through the network, an estimate as for bf16 in
tests/test_train.py: the errors of the n converted GEMMs in series on a reader's deepest path (per
decoder layer: a query/key/value projection, the output projection, the gate or up projection,
the down projection) add like a random walk, so the loss moves by about sqrt(n) eps_f of itself,
and the gradient the readers send back, which each forward error and each backward one reaches,
by r = sqrt(n (eps_f^2 + eps_b^2)) of its norm: a cosine of at least sqrt(1 - r^2), where the
network passes a relative error on at its own size. The tiny readers do not: an error in a query or
key moves an attention logit by itself times the logit's size, which the softmax passes on, and the
tiny Llama's attention is peaked. Over fourteen draws of the trainable model's weights and the two
recipes its gradient at the trainable parameters moved past r in seven (docs/performance.md), so
the loss is held to its estimate and the gradients, the trainable parameters' and each reader's
at its soft tokens, are reported, not bounded. Past r = 1 (over about 100 GEMMs in series, the 8B
readers) the estimate says nothing and the per-GEMM bounds are the check; the residual stream, to
which each branch adds a part, makes the real error smaller.

Ends with `ratio=<fp8 loss / bf16 loss>`.
"""

from __future__ import annotations

import argparse
import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from common import summary

# isort: split
import train  # found through the repository path that common puts on sys.path
from latentwire.dataset import Collator, DataSources, PromptDataset
from latentwire.fp8 import RECIPES, convert_frozen_linears, convertible_linears, fp8_linears, recipe_config
from latentwire.harness.data import to_device
from latentwire.harness.precision import cuda_capability, sdpa_backends
from latentwire.harness.recompute import checkpoint_options
from latentwire.llm import decoder_layers
from latentwire.model import WireEncoder
from latentwire.objectives import WireTask
from latentwire.parallelize import frozen_llms
from latentwire.settings import load_config

FORCED = ["--precision", "bf16", "--dropout", "0", "--kd-weight", "0"]
PATH_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def unit_roundoff(dtype: torch.dtype) -> float:
    """u: round-to-nearest's largest relative error in a float format, half its spacing at 1."""
    return torch.finfo(dtype).eps / 2


@dataclass(frozen=True)
class Bounds:
    """A recipe's per-GEMM errors relative to D, from the formats its config casts each operand to."""

    forward: float  # eps_f: input x weight
    backward: float  # eps_b: the gradient coming back x weight

    @classmethod
    def of(cls, recipe: str) -> Bounds:
        c = recipe_config(recipe)

        def eps(*casts) -> float:
            return math.sqrt(sum(unit_roundoff(cast.target_dtype) ** 2 for cast in casts) / 3)

        return cls(
            eps(c.cast_config_input, c.cast_config_weight),
            eps(c.cast_config_grad_output, c.cast_config_weight_for_grad_input),
        )

    @staticmethod
    def gemm_range(eps: float) -> tuple[float, float]:
        """What one GEMM's error / D may be: at most 1.5 eps, at least eps / 4 (float8 ran)."""
        return eps / 4, 1.5 * eps

    def through(self, n: int) -> float:
        """r, the gradient's relative error through n float8 GEMMs in series."""
        return math.sqrt(n * (self.forward**2 + self.backward**2))


@dataclass(frozen=True)
class Comparison:
    recipe: str
    bounds: Bounds
    loss_bf16: float
    loss_fp8: float
    grad_cosine: float  # the trainable parameters' gradient, fp8 against bf16
    grad_rel_diff: float  # |g_fp8 - g_bf16| / |g_bf16|
    wire_cosine: dict[str, float]  # per reader: the gradient at its soft tokens
    wire_rel_diff: dict[str, float]
    forward_errors: dict[str, float]  # per checked float8 linear: its forward GEMM's error / D
    input_grad_errors: dict[str, float]  # and its input-gradient GEMM's
    gemms_in_series: dict[str, int]  # per reader: the n of the estimate

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss_fp8 - self.loss_bf16) / abs(self.loss_bf16)

    @property
    def loss_bound(self) -> float:
        """sqrt(n) eps_f of the reader with the most GEMMs in series: the objective averages both
        readers' positive losses, so it moves by at most the larger relative change."""
        return math.sqrt(max(self.gemms_in_series.values())) * self.bounds.forward

    @property
    def grad_rel_bound(self) -> float:
        return self.bounds.through(max(self.gemms_in_series.values()))

    @property
    def cosine_bound(self) -> float:
        return math.sqrt(1 - min(self.grad_rel_bound, 1.0) ** 2)

    def line(self) -> str:
        def gemms(errors: dict, eps: float) -> str:
            low, high = Bounds.gemm_range(eps)
            return (
                f"{min(errors.values()):.2%} to {max(errors.values()):.2%} of their incoherent norm (bound "
                f"{low:.2%} to {high:.2%})"
            )

        wire = ", ".join(
            f"{name} cosine {cosine:.4f}, relative difference {self.wire_rel_diff[name]:.1%}"
            for name, cosine in self.wire_cosine.items()
        )
        return (
            f"{self.recipe}: {len(self.forward_errors)} float8 linears, forward error "
            f"{gemms(self.forward_errors, self.bounds.forward)}, input-gradient error "
            f"{gemms(self.input_grad_errors, self.bounds.backward)}; loss bf16 {self.loss_bf16:.5f} fp8 "
            f"{self.loss_fp8:.5f} (relative difference {self.loss_rel_diff:.2%}, estimate {self.loss_bound:.1%}); "
            f"trainable gradient cosine {self.grad_cosine:.4f} (estimate >= {self.cosine_bound:.3f}), relative "
            f"difference {self.grad_rel_diff:.1%} (estimate {self.grad_rel_bound:.1%}); at the soft tokens: {wire}"
        )


def gemms_in_series(llm) -> int:
    """The n of the estimate: the linears that convert on each decoder layer's deepest path, summed
    over the layers (before the conversion)."""
    converted = {id(linear) for _, _, linear in fp8_linears(llm)}
    return sum(
        any(id(getattr(module, name, None)) in converted for module in layer.modules() for name in group)
        for layer in decoder_layers(llm)
        for group in PATH_GROUPS
    )


def loss_and_gradients(model, llms: dict, batch: dict, cfg, backends) -> tuple[float, torch.Tensor, dict]:
    """train.py's micro-step on one batch: the objective, the trainable parameters' gradient, and
    the gradient at each reader's soft tokens (the wire's output to it)."""
    task = WireTask(llms, cfg.objectives, cfg.wire.num_latents)
    scaler = torch.amp.GradScaler(batch["bytes"].device.type, enabled=False)
    wire = {}

    def keep(module, args, soft):
        for tokens in soft.values():
            tokens.retain_grad()
        wire.update(soft)

    handle = model.register_forward_hook(keep)
    with sdpa_kernel(backends):
        terms = train.micro_step(
            model,
            task,
            batch,
            n_targets=task.counts(batch).float(),
            amp_dtype=torch.bfloat16,
            scaler=scaler,
            world_size=1,
        )
    handle.remove()
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()
    model.zero_grad(set_to_none=True)
    return task.objective(terms).item(), grad, {name: tokens.grad.double().flatten() for name, tokens in wire.items()}


def checked_linears(llms: dict) -> dict[str, tuple]:
    """(parent, attribute, a copy of the bf16 weight) of each linear that converts in each reader's
    first and last decoder layer, by name, taken before the conversion."""
    chosen = {}
    for name, llm in llms.items():
        layers = decoder_layers(llm)
        for index in sorted({0, len(layers) - 1}):
            for parent, attr, linear in convertible_linears(layers[index]):
                chosen[f"{name}.layer{index}.{attr}"] = (parent, attr, linear.weight.detach().clone())
    return chosen


def gemm_error(actual: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> float:
    """|actual - a b| / D, D = sqrt(sum_ij sum_k (a_ik b_kj)^2): a float8 GEMM's output against the
    bf16 GEMM of the same operands, relative to its incoherent norm."""
    reference = (a @ b).float()
    incoherent = (a.float().square() @ b.float().square()).sum().sqrt()
    return ((actual.detach().float().reshape(reference.shape) - reference).norm() / incoherent).item()


def gemm_errors(checked: dict) -> tuple[dict[str, float], dict[str, float], list]:
    """Hooks on the converted linears that measure each float8 GEMM against the bf16 one with the
    bf16 weight kept aside: the forward's output, and the input gradient (the gradient coming back
    times the weight)."""
    forward, backward, handles = {}, {}, []
    for key, (parent, attr, weight) in checked.items():

        def output_hook(module, args, output, key=key, weight=weight):
            x = args[0].detach().reshape(-1, weight.shape[1]).to(weight.dtype)
            bias = module.bias.float() if module.bias is not None else 0
            forward[key] = gemm_error(output.detach().float().reshape(-1, weight.shape[0]) - bias, x, weight.T)

        def input_grad_hook(module, grad_input, grad_output, key=key, weight=weight):
            grad = grad_output[0].detach().reshape(-1, weight.shape[0]).to(weight.dtype)
            backward[key] = gemm_error(grad_input[0], grad, weight)

        linear = getattr(parent, attr)
        handles += [linear.register_forward_hook(output_hook), linear.register_full_backward_hook(input_grad_hook)]
    return forward, backward, handles


def compare(cfg, device: torch.device, recipe: str) -> Comparison:
    """The same batch through the same weights, bf16 then float8 by `recipe` (see the module's docstring)."""
    llms = frozen_llms(
        replace(cfg.frozen, fp8="none"),
        cfg.prompt,
        "bf16",
        device,  # cast below, by `recipe`
        checkpointing=checkpoint_options(cfg.recompute.policy),
    )
    torch.manual_seed(cfg.training.seed)
    model = WireEncoder.for_llms(cfg.wire, llms).to(device).train()
    micro = cfg.training.micro_batch_size
    dataset = PromptDataset(DataSources.of(cfg.data, cfg.training.seed).train_examples(micro))
    collate = Collator.for_llms(
        llms,
        cfg.data.max_prompt_bytes,
        cfg.data.max_answer_tokens,
        cfg.data.pad_multiple,
        word_patch=cfg.wire.word_patch,
    )
    batch = to_device(collate([dataset[i] for i in range(micro)]), device)
    backends, _ = sdpa_backends(cuda_capability(device), torch.bfloat16)
    loss_bf16, grad_bf16, wire_bf16 = loss_and_gradients(model, llms, batch, cfg, backends)
    checked, in_series = checked_linears(llms), {name: gemms_in_series(llm) for name, llm in llms.items()}
    for llm in llms.values():
        convert_frozen_linears(llm, recipe)
    forward, backward, handles = gemm_errors(checked)
    loss_fp8, grad_fp8, wire_fp8 = loss_and_gradients(model, llms, batch, cfg, backends)
    for handle in handles:
        handle.remove()

    def cosine(a, b) -> float:
        return F.cosine_similarity(a, b, dim=0).item()

    def rel_diff(a, b) -> float:
        return ((a - b).norm() / b.norm()).item()

    return Comparison(
        recipe,
        Bounds.of(recipe),
        loss_bf16,
        loss_fp8,
        cosine(grad_fp8, grad_bf16),
        rel_diff(grad_fp8, grad_bf16),
        {name: cosine(wire_fp8[name], g) for name, g in wire_bf16.items()},
        {name: rel_diff(wire_fp8[name], g) for name, g in wire_bf16.items()},
        forward,
        backward,
        in_series,
    )


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--profile", default="cpu", help="the hardware profile (train.py's); any train.py flag may follow")
    p.add_argument("--recipe", default="tensorwise", choices=RECIPES, help="torchao's float8 scaling recipe")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the CPU)")
    p.add_argument("--quick", action="store_true", help="micro-batch 2 unless given: checks the script runs")
    args, rest = p.parse_known_args()
    torch.set_num_threads(args.threads)
    quick = ["--micro-batch-size", "2"] if args.quick else []
    cfg = load_config(["--profile", args.profile, *quick, *rest, *FORCED], prog="bench/fp8_numerics.py")
    device = torch.device(cfg.card.device)
    result = compare(cfg, device, args.recipe)
    print(
        f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
        f"readers {cfg.frozen.llama} and {cfg.frozen.qwen}; micro-batch {cfg.training.micro_batch_size}; "
        f"GEMMs in series {result.gemms_in_series}"
    )
    for key, error in result.forward_errors.items():
        print(f"  {key}: error / D forward {error:.3%}, input gradient {result.input_grad_errors[key]:.3%}")
    print(result.line())
    summary(
        "fp8_numerics",
        result.loss_fp8 / result.loss_bf16,
        recipe=args.recipe,
        loss_rel_diff=result.loss_rel_diff,
        loss_estimate=result.loss_bound,
        grad_cosine=result.grad_cosine,
        grad_rel_diff=result.grad_rel_diff,
        grad_estimate=result.grad_rel_bound,
        **{f"wire_rel_diff_{name}": value for name, value in result.wire_rel_diff.items()},
        forward_error_max=max(result.forward_errors.values()),
        input_grad_error_max=max(result.input_grad_errors.values()),
    )


if __name__ == "__main__":
    main()
