"""FP8 frozen readers (--frozen-fp8) against bf16, on the same weights and the same batch: the loss,
the wire's gradient (every trainable parameter's), and the error of each float8 GEMM of the first
and last decoder layers, with the bounds the arithmetic gives them.

    python bench/fp8_numerics.py                          # the cpu profile's tiny readers, on the CPU
    python bench/fp8_numerics.py --profile h100 --llama random:meta-llama/Llama-3.1-8B \\
        --qwen random:Qwen/Qwen2.5-7B --dataset synthetic --micro-batch-size 4   # on a card

Any train.py flag after the script's own picks the configuration (bf16, dropout 0 and no
distillation are forced: the same forward twice, no teacher pass). The readers are built and read
as train.py builds them, stepped once in bf16 through train.py's own micro-step, converted in place
by latentwire.fp8 (each weight cast once, from the same values) and stepped again. Both steps run
eagerly: compile changes which GEMMs run (tests/test_fp8.py), not what any of them computes.

The bounds (docs/performance.md, "FP8 frozen readers"). Round-to-nearest leaves a relative error
of at most u per element: u = 2^-4 in e4m3 (3 mantissa bits; activations and weights), 2^-3 in
e5m2 (2 bits; the gradient coming back), scaled tensorwise so the largest element sits at the top
of the format. A GEMM output e = sum_k a_k b_k (d_a + d_b) with independent zero-mean errors of
variance u^2 / 3 (uniform on [-u, u], the high side: a value uniform within a binade has u^2 / 6)
has E[e^2] = (u_a^2 + u_b^2) / 3 * sum_k (a_k b_k)^2: relative to the incoherent norm
D = sqrt(sum_k (a_k b_k)^2), whatever the cancellation in the sum, the error is
    forward (e4m3 x e4m3)        eps_f = sqrt(2/3) 2^-4 = 5.1%
    input gradient (e5m2 x e4m3) eps_b = sqrt((2^-6 + 2^-8) / 3) = 8.1%.
Each GEMM's forward error is checked against eps_f directly: at most 1.5 x eps_f (the uniform
variance is the high side already), at least eps_f / 4, over three times what bf16's own rounding
leaves (sqrt(2/3) 2^-8 = 0.32% for the operands, and the output's 2^-9), so a float8 that did not
run fails it. Through the network, an estimate as for bf16 in
tests/test_train.py: the errors of the n converted GEMMs in series on a reader's deepest path (per
decoder layer: a query/key/value projection, the output projection, the gate or up projection,
the down projection) add like a random walk, so the loss moves by about sqrt(n) eps_f of itself
and the wire's gradient, which every forward error and every backward one reaches, by
r = sqrt(n (eps_f^2 + eps_b^2)) of its norm: a cosine of at least sqrt(1 - r^2). Past r = 1 (over
about 100 GEMMs in series, the 8B readers) the estimate says nothing and the per-GEMM bound is
the check; the residual stream, to which each branch adds a part, makes the real error smaller.

Ends with `ratio=<fp8 loss / bf16 loss>`.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from common import summary

# isort: split
import train  # found through the repository path that common puts on sys.path
from latentwire.dataset import Collator, DataSources, PromptDataset
from latentwire.fp8 import convert_frozen_linears, convertible_linears, fp8_linears
from latentwire.harness.data import to_device
from latentwire.harness.precision import cuda_capability, sdpa_backends
from latentwire.harness.recompute import checkpoint_options
from latentwire.llm import build_frozen_llms, decoder_layers
from latentwire.model import WireEncoder
from latentwire.objectives import WireTask
from latentwire.parallelize import prepare_frozen_llms
from latentwire.settings import load_config

E4M3_U, E5M2_U = 2.0 ** -4, 2.0 ** -3
EPS_FORWARD = math.sqrt(2 / 3) * E4M3_U
EPS_BACKWARD = math.sqrt((E5M2_U ** 2 + E4M3_U ** 2) / 3)
GEMM_ERROR_RANGE = (EPS_FORWARD / 4, 1.5 * EPS_FORWARD)
FORCED = ["--precision", "bf16", "--dropout", "0", "--kd-weight", "0"]
PATH_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass(frozen=True)
class Comparison:
    loss_bf16: float
    loss_fp8: float
    grad_cosine: float
    grad_rel_diff: float  # |g_fp8 - g_bf16| / |g_bf16|
    gemm_errors: dict[str, float]  # per checked float8 linear: its forward error / D
    gemms_in_series: dict[str, int]  # per reader: the n of the estimate

    @property
    def loss_rel_diff(self) -> float:
        return abs(self.loss_fp8 - self.loss_bf16) / abs(self.loss_bf16)

    @property
    def loss_bound(self) -> float:
        """sqrt(n) eps_f of the reader with the most GEMMs in series: the objective averages both
        readers' positive losses, so it moves by at most the larger relative change."""
        return math.sqrt(max(self.gemms_in_series.values())) * EPS_FORWARD

    @property
    def grad_rel_bound(self) -> float:
        return math.sqrt(max(self.gemms_in_series.values()) * (EPS_FORWARD ** 2 + EPS_BACKWARD ** 2))

    @property
    def cosine_bound(self) -> float:
        return math.sqrt(1 - min(self.grad_rel_bound, 1.0) ** 2)

    def line(self) -> str:
        low, high = min(self.gemm_errors.values()), max(self.gemm_errors.values())
        return (f"loss bf16 {self.loss_bf16:.5f} fp8 {self.loss_fp8:.5f} (relative difference "
                f"{self.loss_rel_diff:.3%}, estimate {self.loss_bound:.1%}); wire gradient cosine "
                f"{self.grad_cosine:.5f} (estimate >= {self.cosine_bound:.3f}), relative difference "
                f"{self.grad_rel_diff:.2%}; forward error of {len(self.gemm_errors)} float8 GEMMs {low:.2%} to "
                f"{high:.2%} of their incoherent norm (bound {GEMM_ERROR_RANGE[0]:.2%} to {GEMM_ERROR_RANGE[1]:.2%})")


def gemms_in_series(llm) -> int:
    """The n of the estimate: the linears that convert on each decoder layer's deepest path, summed
    over the layers (before the conversion)."""
    converted = {id(linear) for _, _, linear in fp8_linears(llm)}
    return sum(any(id(getattr(module, name, None)) in converted
                   for module in layer.modules() for name in group)
               for layer in decoder_layers(llm) for group in PATH_GROUPS)


def loss_and_gradient(model, llms: dict, batch: dict, cfg, backends) -> tuple[float, torch.Tensor]:
    """train.py's micro-step on one batch: the objective and the trainable parameters' gradient."""
    task = WireTask(llms, cfg.objectives, cfg.wire.num_latents)
    scaler = torch.amp.GradScaler(batch["bytes"].device.type, enabled=False)
    with sdpa_kernel(backends):
        terms = train.micro_step(model, task, batch, n_targets=task.counts(batch).float(), amp_dtype=torch.bfloat16,
                                 scaler=scaler, world_size=1)
    grad = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()
    model.zero_grad(set_to_none=True)
    return task.objective(terms).item(), grad


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


def gemm_errors(checked: dict) -> tuple[dict[str, float], list]:
    """Forward hooks on the converted linears that measure each float8 output against the bf16 GEMM
    of the same input with the bf16 weight kept aside: |y_fp8 - y_bf16| / D."""
    errors, handles = {}, []
    for key, (parent, attr, weight) in checked.items():
        def hook(module, args, output, key=key, weight=weight):
            x = args[0].detach().reshape(-1, weight.shape[1]).to(weight.dtype)
            reference = F.linear(x, weight).float()
            y = (output.detach().reshape(reference.shape).float()
                 - (module.bias.float() if module.bias is not None else 0))
            incoherent = (x.float().square() @ weight.float().square().T).sum().sqrt()
            errors[key] = ((y - reference).norm() / incoherent).item()
        handles.append(getattr(parent, attr).register_forward_hook(hook))
    return errors, handles


def compare(cfg, device: torch.device) -> Comparison:
    """The same batch through the same weights, bf16 then float8 (see the module's docstring)."""
    with torch.device("meta"):
        llms = build_frozen_llms(cfg.frozen, cfg.prompt, torch.bfloat16)
    prepare_frozen_llms(llms, checkpointing=checkpoint_options(cfg.recompute.policy), compile_options=None,
                        mesh=None, device=device)
    torch.manual_seed(cfg.training.seed)
    model = WireEncoder.for_llms(cfg.wire, llms).to(device).train()
    micro = cfg.training.micro_batch_size
    dataset = PromptDataset(DataSources.of(cfg.data, cfg.training.seed).train_examples(micro))
    collate = Collator.for_llms(llms, cfg.data.max_prompt_bytes, cfg.data.max_answer_tokens, cfg.data.pad_multiple,
                                word_patch=cfg.wire.word_patch)
    batch = to_device(collate([dataset[i] for i in range(micro)]), device)
    backends, _ = sdpa_backends(cuda_capability(device), torch.bfloat16)
    loss_bf16, grad_bf16 = loss_and_gradient(model, llms, batch, cfg, backends)
    checked, in_series = checked_linears(llms), {name: gemms_in_series(llm) for name, llm in llms.items()}
    for llm in llms.values():
        convert_frozen_linears(llm)
    errors, handles = gemm_errors(checked)
    loss_fp8, grad_fp8 = loss_and_gradient(model, llms, batch, cfg, backends)
    for handle in handles:
        handle.remove()
    return Comparison(loss_bf16, loss_fp8, F.cosine_similarity(grad_fp8, grad_bf16, dim=0).item(),
                      ((grad_fp8 - grad_bf16).norm() / grad_bf16.norm()).item(), errors, in_series)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="cpu", help="the hardware profile (train.py's); any train.py flag may follow")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the CPU)")
    p.add_argument("--quick", action="store_true", help="micro-batch 2 unless given: checks the script runs")
    args, rest = p.parse_known_args()
    torch.set_num_threads(args.threads)
    quick = ["--micro-batch-size", "2"] if args.quick else []
    cfg = load_config(["--profile", args.profile, *quick, *rest, *FORCED], prog="bench/fp8_numerics.py")
    device = torch.device(cfg.card.device)
    result = compare(cfg, device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}; "
          f"readers {cfg.frozen.llama} and {cfg.frozen.qwen}; micro-batch {cfg.training.micro_batch_size}; "
          f"GEMMs in series {result.gemms_in_series}")
    for key, error in result.gemm_errors.items():
        print(f"  {key}: forward error {error:.3%} of its incoherent norm")
    summary("fp8_numerics", result.loss_fp8 / result.loss_bf16, loss_rel_diff=result.loss_rel_diff,
            grad_cosine=result.grad_cosine, grad_rel_diff=result.grad_rel_diff,
            cosine_estimate=result.cosine_bound, loss_estimate=result.loss_bound,
            gemm_error_max=max(result.gemm_errors.values()), gemm_error_min=min(result.gemm_errors.values()))


if __name__ == "__main__":
    main()
