"""Which micro-batch fits a profile's card, per component, before renting the card.

    python -m latentwire.plan --profile h100 [--micro-batch-size N] [--num-gpus N] [--json PATH]
    python -m latentwire.plan --profile h100 --analytic [--optimizer adafactor]
    python -m latentwire.plan --analytic --params 8.03e9 [--trainable-params 27e6] [--precision bf16]
        [--optimizer adamw] [--gpu-memory-gb 80] [--num-gpus 4]

The traced plan builds the profile's exact configuration (the real LLM architectures) under
FakeTensorMode on the CPU, where tensors have shapes but no storage, and runs train.py's step
(forward, backward, clipping, AdamW) under MemTracker, which files every byte as parameters,
gradients, optimizer state, activations or temporaries: one step at the profile's micro-batch
(the steady state: the optimizer's state was made beforehand), then one more at the micro-batch the
first points to (and, where that lands more than 10% short of the answer, one more where the two
point). It fits peak = fixed + per_sample x micro-batch through the two nearest the answer and
returns the largest micro-batch whose peak, with the reserve of `latentwire.planner.budget`, fits
the profile's target utilisation.

It traces the eager step: torch.compile (on in the GPU profiles) usually keeps fewer
activations, so the plan errs on the safe side. It counts what operators return, which is what a
CUDA step allocates less the kernels' workspaces (in the reserve), and what a CPU step allocates
(`latentwire.planner.memtrace`). `--analytic` is the quick calculator of
`latentwire.planner.analytic`, also printed beside the traced numbers as a cross-check.

This module is the command; `latentwire.planner` holds the plan itself.
"""

from __future__ import annotations

import argparse
import math

from .dataset import round_up
from .distillation import target_width, targets_bytes
from .harness.config import Parser, positive
from .harness.errors import UserError
from .harness.exits import main_guard
from .known_llms import llm_parameter_count
from .llm import LLM_NAMES
from .llm_sources import llm_spec
from .planner.analytic import GB, OPTIMIZERS, StaticMemory, format_static, frozen_bytes_per_param, static_memory
from .planner.budget import GIB, Budget, budget_for
from .planner.memory_plan import Plan, make_plan, trainable_shapes, write_json
from .planner.script import script_step
from .settings import load_config

PROG = "python -m latentwire.plan"


# --- the report -------------------------------------------------------------------------------


def _unit(plan: Plan) -> tuple[int, str]:
    """GiB for real cards, MiB where the whole step is smaller than a GiB (the cpu profile)."""
    return (GIB, "GiB") if plan.traces[0].peak["total"] >= GIB else (2**20, "MiB")


def _row(label: str, values, size: int) -> str:
    return f"  {label:<40}" + "".join(f"{v / size:10.2f}" for v in values)


def _diff(traced: int, analytic: int) -> str:
    return f"{100 * (traced - analytic) / analytic:+9.3f}%" if analytic else f"{'-':>10}"


def frozen_share(plan: Plan) -> str:
    return f", 1/{plan.world_size} sharded" if plan.gathered_bytes else ""


def distillation_note(plan: Plan) -> str:
    """The teacher's targets each batch carries, and what their cache holds on every rank's host."""
    data, obj = plan.cfg.data, plan.cfg.objectives
    parts = []
    for name, spec in plan.specs.items():
        vocab = spec.config.vocab_size
        width = target_width(data.num_examples, obj.k_tokens, vocab, obj.kd_top_k)
        kind = "full rows" if width == vocab else f"top {width} + rest"
        parts.append(f"{name} {kind}, {targets_bytes(data.num_examples, obj.k_tokens, width, vocab) / GIB:.2f} GiB")
    return (
        f", with the distillation targets of its first {obj.k_tokens} answer positions (computed once; "
        f"host memory per rank: {'; '.join(parts)})"
    )


def format_plan(plan: Plan) -> str:
    cfg, a, fit, budget = plan.cfg, plan.analytic, plan.fit, plan.budget
    size, unit = _unit(plan)
    compile_note = "torch.compile usually keeps less" if cfg.compile.enabled else "no torch.compile"
    prompt = round_up(cfg.data.max_prompt_bytes, cfg.data.pad_multiple)
    fp8 = f", their decoder layers' linears in float8 ({cfg.frozen.fp8})" if cfg.frozen.fp8 != "none" else ""
    lines = [
        f"memory plan for profile {cfg.invocation.profile}: {cfg.card.description}",
        f"{plan.world_size} rank(s) x {cfg.card.device}, {cfg.numerics.precision} autocast, frozen LLMs in "
        f"{cfg.numerics.precision}{fp8}"
        f"{' sharded by FSDP2 (the all-gathered units computed, not traced)' if plan.gathered_bytes else ''}, "
        f"activation checkpointing {cfg.recompute.policy}, "
        f"eager step ({compile_note})",
    ]
    lines += [
        f"  {name}: {spec.source}, {plan.frozen_params[name]:,} parameters ({spec.origin})"
        for name, spec in plan.specs.items()
    ]
    lines += [
        f"  trainable: byte encoder + pooler + adapters, {a.trainable_params:,} parameters (fp32)",
        f"  per sample: {prompt} prompt bytes -> {cfg.wire.num_latents} soft tokens per LLM, after a BOS "
        f"where the tokenizer has one; then the anchor and answers of {cfg.data.max_answer_tokens} tokens + EOS"
        f"{distillation_note(plan) if cfg.objectives.teacher else ''} (the longest batch the collator emits)",
        "",
        "traced under FakeTensorMode + MemTracker, nothing allocated: 1 training step at micro-batch "
        f"{cfg.training.micro_batch_size}, then 1 at each other size, the optimizer's state made beforehand "
        "(the steady state)",
        f"  {'steady state':<40}{'traced ' + unit:>10}{'analytic':>10}{'diff':>10}",
    ]
    for label, traced, analytic in (
        (
            f"parameters, frozen ({cfg.numerics.precision}{', fp8 linears' if cfg.frozen.fp8 != 'none' else ''}"
            f"{frozen_share(plan)})",
            plan.params_frozen_bytes,
            a.frozen,
        ),
        ("parameters, trainable (fp32)", plan.params_trainable_bytes, a.trainable),
        ("gradients (trainable only)", plan.gradients, a.gradients),
        ("optimizer state (AdamW)", plan.optimizer, a.optimizer_state),
    ):
        lines.append(_row(label, (traced, analytic), size) + _diff(traced, analytic))
    if cfg.frozen.fp8 != "none":
        held = "1 byte per weight" if cfg.frozen.fp8 == "tensorwise" else "2 bytes per weight, a cast for each GEMM"
        lines.append(
            f"  (--frozen-fp8 {cfg.frozen.fp8}: the decoder layers' linears hold {held}, the analytic column 2)"
        )
    lines += [
        "",
        f"  {'at the peak (' + unit + '), micro-batch':<40}" + "".join(f"{t.micro_batch:>10}" for t in plan.traces),
    ]
    for key in (
        "parameters",
        "buffers",
        "gradients",
        "optimizer",
        "activations",
        "temporaries",
        "other",
        *(["gathered"] if plan.gathered_bytes else []),
        "total",
    ):
        label = {"total": "peak (total)", "gathered": "fsdp: two units all-gathered"}.get(key, key)
        lines.append(_row(label, (t.peak[key] for t in plan.traces), size))
    lines += [
        f"  fit: peak = {fit.fixed / size:.2f} {unit} + {fit.per_sample / size:.3f} {unit} x micro-batch",
        "  (activations: made in forward, or recomputed for backward by activation checkpointing; "
        "temporaries: made in backward)",
        "",
    ]
    lines += budget.lines()
    lines.append(f"  -> the step's tensors may peak at {budget.allowed_peak(plan.weight_bytes) / GIB:.2f} GiB")
    asked = next(t for t in plan.traces if t.micro_batch == cfg.training.micro_batch_size)
    needed = budget.needed(asked.peak["total"], plan.weight_bytes)
    verdict = "fits" if needed <= budget.target_bytes else "does NOT fit"
    lines.append(
        f"micro-batch {asked.micro_batch}: traced peak {asked.peak['total'] / GIB:.2f} GiB, "
        f"{needed / GIB:.2f} GiB with the reserve: {verdict}"
    )
    best = plan.max_micro_batch
    lines.append(
        "largest micro-batch: none fits, not even 1"
        if best == 0
        else f"largest micro-batch: {best} (fitted peak {fit(best) / GIB:.2f} GiB, "
        f"{budget.needed(fit(best), plan.weight_bytes) / GIB:.2f} GiB with the reserve)"
    )
    lines.append(f"planned in {plan.seconds:.0f} s")
    return "\n".join(lines)


def format_analytic(m: StaticMemory, budget: Budget, num_gpus: int) -> str:
    lines = [
        f"analytic static memory per GPU ({num_gpus} GPU(s); each holds all of it, or 1/{num_gpus} of the "
        "frozen weights under --frozen-sharding fsdp)"
    ]
    lines += format_static(m)
    lines += budget.lines()
    left = budget.target_bytes - budget.fixed_reserve - m.total
    lines.append(
        f"left for activations and temporaries (before fragmentation): {left / GIB:.2f} GiB"
        + ("" if left > 0 else "  -> the static memory alone does not fit")
    )
    return "\n".join(lines)


# --- the command line -------------------------------------------------------------------------


def _count(text: str) -> int:
    """A parameter count: 8030261248, 8.03e9."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if value < 0 or not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a non-negative count, got {text!r}")
    return round(value)


CALCULATOR_FLAGS = ("params", "model_size_gb", "trainable_params", "gpu_memory_gb")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="Memory plan of a profile (every train.py flag applies), or the analytic calculator (--analytic).",
    )
    p.add_argument("--profile", help="a key of hw_profiles.json")
    p.add_argument("--json", help="also write the plan to this JSON file")
    p.add_argument(
        "--num-gpus",
        type=positive(int),
        help="ranks (adds NCCL and DDP buckets; divides the frozen weights under fsdp); default: the "
        "profile's num_gpus, 1 without a profile",
    )
    p.add_argument("--analytic", action="store_true", help="the quick calculator: static memory from parameter counts")
    p.add_argument(
        "--optimizer", choices=tuple(OPTIMIZERS), help="(--analytic) the optimizer (default: adamw, as train.py)"
    )
    p.add_argument("--params", type=_count, help="(--analytic without --profile) frozen parameters, e.g. 8.03e9")
    p.add_argument(
        "--model-size-gb",
        type=positive(float),
        help="(--analytic without --profile) instead of --params: frozen weights in GB (1e9 bytes) at --precision",
    )
    p.add_argument("--trainable-params", type=_count, help="(--analytic without --profile) trainable parameters")
    p.add_argument("--gpu-memory-gb", type=positive(float), help="(--analytic without --profile) card memory in GiB")
    return p


def _calculator(args, rest: list[str]) -> tuple[StaticMemory, Budget]:
    extra = Parser(prog=PROG)
    extra.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default="bf16")
    extra.add_argument("--target-util", type=positive(float), default=1.0)
    more = extra.parse_args(rest)
    if (args.params is None) == (args.model_size_gb is None):
        raise UserError("--analytic without --profile needs one of --params or --model-size-gb")
    if args.gpu_memory_gb is None:
        raise UserError("--analytic without --profile needs --gpu-memory-gb")
    if more.target_util > 1:
        raise UserError(f"--target-util must be at most 1, got {more.target_util}")
    frozen = (
        args.params
        if args.params is not None
        else round(args.model_size_gb * GB / frozen_bytes_per_param(more.precision))
    )
    memory = static_memory(frozen, args.trainable_params or 0, more.precision, args.optimizer or "adamw")
    return memory, budget_for("cuda", args.gpu_memory_gb, more.target_util, args.num_gpus, memory.trainable_params)


def _profile_analytic(cfg, args) -> tuple[StaticMemory, Budget]:
    specs = {name: llm_spec(name, cfg.frozen.source(name)) for name in LLM_NAMES}
    shapes = trainable_shapes(cfg.wire, specs)
    frozen = sum(llm_parameter_count(s.config) for s in specs.values())
    if cfg.frozen.sharding == "fsdp":
        frozen = math.ceil(frozen / args.num_gpus)
    memory = static_memory(frozen, shapes, cfg.numerics.precision, args.optimizer or "adamw")
    return memory, budget_for(
        cfg.card.device, cfg.card.memory_gb, cfg.planning.target_util, args.num_gpus, memory.trainable_params
    )


def analytic_json(memory: StaticMemory, budget: Budget, num_gpus: int) -> dict:
    return {
        **memory.to_json(),
        "num_gpus": num_gpus,
        "ddp_bucket_bytes": budget.ddp_buckets,
        "card_bytes": budget.card_bytes,
        "target_util": budget.target_util,
    }


def main(argv: list[str] | None = None) -> None:
    args, rest = build_parser().parse_known_args(argv)
    if args.profile is None and not args.analytic:
        raise UserError("--profile is required (or --analytic with --params or --model-size-gb)")
    if args.profile is None:
        args.num_gpus = args.num_gpus or 1
        memory, budget = _calculator(args, rest)
        print(format_analytic(memory, budget, args.num_gpus))
        payload = analytic_json(memory, budget, args.num_gpus)
    else:
        given = [f"--{name.replace('_', '-')}" for name in CALCULATOR_FLAGS if getattr(args, name) is not None]
        if given:
            raise UserError(f"{given[0]} is for --analytic without --profile; a profile sets it")
        cfg = load_config(["--profile", args.profile, *rest], prog=PROG)
        args.num_gpus = args.num_gpus or cfg.training.num_gpus
        if args.analytic:
            memory, budget = _profile_analytic(cfg, args)
            print(format_analytic(memory, budget, args.num_gpus))
            payload = {"profile": args.profile, **analytic_json(memory, budget, args.num_gpus)}
        elif args.optimizer not in (None, "adamw"):
            raise UserError("the traced plan steps train.py's AdamW; --optimizer is for --analytic")
        else:
            plan = make_plan(cfg, args.num_gpus, script_step())
            print(format_plan(plan))
            payload = plan.to_json()
    if args.json:
        write_json(args.json, payload)


if __name__ == "__main__":
    main_guard(main)
