"""Which micro-batch fits a profile's card, per component, before renting the card.

    python -m latentwire.plan --profile h100 [--micro-batch-size N] [--num-gpus N] [--json PATH]
    python -m latentwire.plan --profile h100 --analytic [--optimizer adafactor]
    python -m latentwire.plan --analytic --params 8.03e9 [--trainable-params 27e6] [--precision bf16]
        [--optimizer adamw] [--gpu-memory-gb 80] [--num-gpus 4]

The traced plan builds the profile's exact configuration (the real LLM architectures) under
FakeTensorMode on the CPU, where tensors have shapes but no storage, and runs train.py's step
(forward, backward, clipping, AdamW) under MemTracker, which files every byte as parameters,
gradients, optimizer state, activations or temporaries: two steps at the profile's micro-batch
(the second is the steady state, with optimizer state), then one more at the micro-batch the
first points to. It fits peak = fixed + per_sample x micro-batch through the two and returns the
largest micro-batch whose peak, with the reserve of `latentwire.budget`, fits the profile's
target utilisation.

It traces the eager step: torch.compile (on in the GPU profiles) usually keeps fewer
activations, so the plan errs on the safe side. It counts what operators return, which is what a
CUDA step allocates less the kernels' workspaces (in the reserve). A CPU bf16 step on a CPU whose
oneDNN runs bf16 matmuls holds more: a copy of each LLM head's weight per sample while the head's
matmul runs (`latentwire.memtrace`). `--analytic` is the quick calculator of
`latentwire.analytic`, also printed beside the traced numbers as a cross-check.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .analytic import GB, OPTIMIZERS, StaticMemory, format_static, frozen_bytes_per_param, static_memory
from .budget import GIB, Budget, Fit, budget_for, fit_line, largest_fitting
from .config import Parser, load_config, positive
from .data import round_up
from .errors import UserError, main_guard
from .known_llms import llm_parameter_count
from .llm import LLM_NAMES, fsdp_units
from .llm_sources import LLMSpec, llm_spec
from .memtrace import StepTrace, StepTracer, fake_llms
from .model import WireConfig, WireEncoder
from .objectives import Objectives

PROG = "python -m latentwire.plan"


@dataclass(frozen=True)
class Plan:
    cfg: object
    world_size: int
    specs: dict[str, LLMSpec]
    frozen_params: dict[str, int]       # per LLM, counted on the traced model
    params_frozen_bytes: int            # what one rank holds: a shard of each LLM under fsdp
    gathered_bytes: int                 # fsdp: the all-gathered units whole at once (0 unsharded)
    params_trainable_bytes: int
    traces: tuple[StepTrace, ...]
    fit: Fit
    budget: Budget
    max_micro_batch: int
    analytic: StaticMemory
    seconds: float

    @property
    def sharding(self) -> str:
        """How the plan holds the frozen LLMs: sharded only where there is more than one rank."""
        return "fsdp" if self.gathered_bytes else "none"

    @property
    def weight_bytes(self) -> int:
        return self.params_frozen_bytes + self.params_trainable_bytes

    @property
    def gradients(self) -> int:
        return self.traces[-1].gradients

    @property
    def optimizer(self) -> int:
        return self.traces[-1].optimizer

    def to_json(self) -> dict:
        cfg = self.cfg
        return {
            "profile": cfg.run.profile, "world_size": self.world_size, "device": cfg.device,
            "precision": cfg.precision, "activation_checkpointing": cfg.activation_checkpointing,
            "frozen_sharding": self.sharding, "fsdp_gathered_bytes": self.gathered_bytes,
            "llms": {name: {"source": spec.source, "config_from": spec.origin, "params": self.frozen_params[name]}
                     for name, spec in self.specs.items()},
            "params_frozen_bytes": self.params_frozen_bytes,
            "params_trainable_bytes": self.params_trainable_bytes,
            "grads_bytes": self.gradients,
            "optimizer_bytes": self.optimizer,
            "activation_bytes_per_sample": self.fit.per_sample,
            "fixed_bytes": self.fit.fixed,
            "fit_r2": self.fit.r2,
            "peak_bytes": {str(t.micro_batch): t.peak["total"] for t in self.traces},
            "peak_breakdown_bytes": {str(t.micro_batch): t.peak for t in self.traces},
            "max_micro_batch": self.max_micro_batch,
            "card_bytes": self.budget.card_bytes,
            "target_util": self.budget.target_util,
            "reserve": {"cuda_context_bytes": self.budget.cuda_context, "nccl_bytes": self.budget.nccl,
                        "ddp_bucket_bytes": self.budget.ddp_buckets,
                        "fragmentation_of_non_weight_memory": self.budget.fragmentation},
            "allowed_peak_bytes": self.budget.allowed_peak(self.weight_bytes),
            "analytic": self.analytic.to_json(),
            "seconds": self.seconds,
        }


# --- the traced plan --------------------------------------------------------------------------

def trainable_shapes(cfg, specs: dict[str, LLMSpec]) -> list[tuple[int, ...]]:
    """The shapes of the encoder's and adapters' parameters (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = WireEncoder(WireConfig.of(cfg), {name: (spec.config.hidden_size, 1.0) for name, spec in specs.items()})
    return [tuple(p.shape) for p in model.parameters()]


def next_micro_batch(first: StepTrace, budget: Budget, weight_bytes: int) -> int:
    """Where to trace the second time: at the micro-batch the first trace points to, so the line is
    fitted around the answer instead of extrapolated to it. The persistent bytes (parameters,
    buffers, optimizer state, FSDP's all-gathered units) do not grow with the batch; the rest of
    the peak does."""
    persistent = first.peak["parameters"] + first.peak["buffers"] + first.peak.get("gathered", 0) + first.optimizer
    per_sample = (first.peak["total"] - persistent) / first.micro_batch
    guess = max(math.floor((budget.allowed_peak(weight_bytes) - persistent) / per_sample), 1)
    return guess if guess != first.micro_batch else 2 * first.micro_batch


def fsdp_frozen_memory(llms: dict, world_size: int) -> tuple[int, int]:
    """(frozen bytes one rank holds, bytes all-gathered at once) under train.py's fully_shard of
    `llm.fsdp_units`, every parameter split on its first dimension, padded to a multiple of the
    world size (anything left to the root counts as one more unit). A unit is whole from its
    forward (or backward) to the end of it, and FSDP gathers the next one meanwhile: at most two of
    the largest at once. Computed, not traced: the trace runs the unsharded step, and this replaces
    its frozen weights."""
    def held(p) -> int:
        return math.ceil(p.shape[0] / world_size) * (p.numel() // p.shape[0]) * p.element_size()

    units = []
    for llm in llms.values():
        modules = [unit if isinstance(unit, list) else [unit] for unit in fsdp_units(llm)]
        units += [[p for m in unit for p in m.parameters()] for unit in modules]
        in_units = {id(p) for unit in units for p in unit}
        units.append([p for p in llm.model.parameters() if id(p) not in in_units])
    largest = max(sum(p.numel() * p.element_size() for p in unit) for unit in units)
    return sum(held(p) for unit in units for p in unit), 2 * largest


def shard_trace(trace: StepTrace, frozen_bytes: int, held_bytes: int, gathered_bytes: int) -> StepTrace:
    """The traced step with its whole frozen weights replaced by one rank's shards and the
    all-gathered units (at the peak at most; an upper bound)."""
    if not gathered_bytes:
        return trace
    peak = dict(trace.peak, parameters=trace.peak["parameters"] - frozen_bytes + held_bytes,
                gathered=gathered_bytes)
    peak["total"] = trace.peak["total"] - frozen_bytes + held_bytes + gathered_bytes
    return replace(trace, peak=peak)


def planned_rows(anchor_text: str, specs: dict[str, LLMSpec]) -> dict[str, tuple[int, int, int]]:
    """Each LLM's (lead tokens, tail tokens, vocabulary size) for memtrace.planning_batch. No
    tokenizer here (a hub model is planned before it is downloaded): the anchor is counted at a
    token per byte, an upper bound for byte-level BPE; a chat template's framing is not counted."""
    return {name: (int(spec.has_bos), len(anchor_text.encode()), spec.config.vocab_size)
            for name, spec in specs.items()}


def make_plan(cfg, world_size: int = 1) -> Plan:
    """Trace the profile `cfg` at its micro-batch size and at the one the first trace predicts."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    specs = {name: llm_spec(name, getattr(cfg, name)) for name in LLM_NAMES}
    answers = planned_rows(cfg.anchor_text, specs)
    shapes = trainable_shapes(cfg, specs)
    budget = budget_for(cfg.device, cfg.memory_gb, cfg.target_util, world_size, sum(math.prod(s) for s in shapes))
    sharded = cfg.frozen_sharding == "fsdp" and world_size > 1
    # fork_rng: building and stepping fake models must not move the caller's random stream
    # (train.py plans before it seeds and builds its real models).
    with torch.random.fork_rng(devices=[]), FakeTensorMode():
        llms = fake_llms(cfg, specs)
        frozen_params = {name: sum(p.numel() for p in llm.model.parameters()) for name, llm in llms.items()}
        frozen_bytes = sum(p.numel() * p.element_size() for llm in llms.values() for p in llm.model.parameters())
        held, gathered = fsdp_frozen_memory(llms, world_size) if sharded else (frozen_bytes, 0)
        tracer = StepTracer(cfg, llms, answers)
        first = shard_trace(tracer.trace(cfg.micro_batch_size, steps=2), frozen_bytes, held, gathered)
        trainable_bytes = first.peak["parameters"] - held
        second = tracer.trace(next_micro_batch(first, budget, held + trainable_bytes), steps=1)
        second = shard_trace(second, frozen_bytes, held, gathered)
    traces = tuple(sorted((first, second), key=lambda t: t.micro_batch))
    fit = fit_line({t.micro_batch: t.peak["total"] for t in traces})
    total_params = sum(llm_parameter_count(spec.config) for spec in specs.values())
    analytic = static_memory(math.ceil(total_params / world_size) if sharded else total_params, shapes,
                             cfg.precision, "adamw")
    return Plan(cfg, world_size, specs, frozen_params, held, gathered, trainable_bytes, traces, fit, budget,
                largest_fitting(fit, budget, held + trainable_bytes), analytic, time.perf_counter() - start)


def plan_max_micro_batch(cfg, world_size: int) -> int:
    """The largest micro-batch per rank that fits the profile's card: what elastic batch uses."""
    return make_plan(cfg, world_size).max_micro_batch


# --- the report -------------------------------------------------------------------------------

def _unit(plan: Plan) -> tuple[int, str]:
    """GiB for real cards, MiB where the whole step is smaller than a GiB (the cpu profile)."""
    return (GIB, "GiB") if plan.traces[0].peak["total"] >= GIB else (2 ** 20, "MiB")


def _row(label: str, values, size: int) -> str:
    return f"  {label:<40}" + "".join(f"{v / size:10.2f}" for v in values)


def _diff(traced: int, analytic: int) -> str:
    return f"{100 * (traced - analytic) / analytic:+9.3f}%" if analytic else f"{'-':>10}"


def frozen_share(plan: Plan) -> str:
    return f", 1/{plan.world_size} sharded" if plan.gathered_bytes else ""


def format_plan(plan: Plan) -> str:
    cfg, a, fit, budget = plan.cfg, plan.analytic, plan.fit, plan.budget
    size, unit = _unit(plan)
    compile_note = "torch.compile usually keeps less" if cfg.compile else "no torch.compile"
    prompt = round_up(cfg.max_prompt_bytes, cfg.pad_multiple)
    lines = [f"memory plan for profile {cfg.run.profile}: {cfg.description}",
             f"{plan.world_size} rank(s) x {cfg.device}, {cfg.precision} autocast, frozen LLMs in {cfg.precision}"
             f"{' sharded by FSDP2 (the all-gathered units computed, not traced)' if plan.gathered_bytes else ''}, "
             f"activation checkpointing {'on' if cfg.activation_checkpointing else 'off'}, "
             f"eager step ({compile_note})"]
    lines += [f"  {name}: {spec.source}, {plan.frozen_params[name]:,} parameters ({spec.origin})"
              for name, spec in plan.specs.items()]
    lines += [f"  trainable: byte encoder + pooler + adapters, {a.trainable_params:,} parameters (fp32)",
              f"  per sample: {prompt} prompt bytes -> {cfg.num_latents} soft tokens per LLM, after a BOS where the "
              f"tokenizer has one; then the anchor and answers of {cfg.max_answer_tokens} tokens + EOS"
              f"{', and the distillation teacher reading the prompt as tokens' if Objectives.of(cfg).teacher else ''} "
              "(the longest batch the collator emits)",
              "",
              "traced under FakeTensorMode + MemTracker, nothing allocated: 2 training steps at micro-batch "
              f"{cfg.micro_batch_size}, then 1 more step of the same model and optimizer at the second size",
              f"  {'steady state':<40}{'traced ' + unit:>10}{'analytic':>10}{'diff':>10}"]
    for label, traced, analytic in (
            (f"parameters, frozen ({cfg.precision}{frozen_share(plan)})", plan.params_frozen_bytes, a.frozen),
            ("parameters, trainable (fp32)", plan.params_trainable_bytes, a.trainable),
            ("gradients (trainable only)", plan.gradients, a.gradients),
            ("optimizer state (AdamW)", plan.optimizer, a.optimizer_state)):
        lines.append(_row(label, (traced, analytic), size) + _diff(traced, analytic))
    lines += ["", f"  {'at the peak (' + unit + '), micro-batch':<40}" + "".join(f"{t.micro_batch:>10}" for t in plan.traces)]
    for key in ("parameters", "buffers", "gradients", "optimizer", "activations", "temporaries", "other",
                *(["gathered"] if plan.gathered_bytes else []), "total"):
        label = {"total": "peak (total)", "gathered": "fsdp: two units all-gathered"}.get(key, key)
        lines.append(_row(label, (t.peak[key] for t in plan.traces), size))
    lines += [f"  fit: peak = {fit.fixed / size:.2f} {unit} + {fit.per_sample / size:.3f} {unit} x micro-batch",
              "  (activations: made in forward, or recomputed for backward by activation checkpointing; "
              "temporaries: made in backward)",
              ""]
    lines += budget.lines()
    lines.append(f"  -> the step's tensors may peak at {budget.allowed_peak(plan.weight_bytes) / GIB:.2f} GiB")
    asked = next(t for t in plan.traces if t.micro_batch == cfg.micro_batch_size)
    needed = budget.needed(asked.peak["total"], plan.weight_bytes)
    lines.append(f"micro-batch {asked.micro_batch}: traced peak {asked.peak['total'] / GIB:.2f} GiB, {needed / GIB:.2f} GiB "
                 f"with the reserve: {'fits' if needed <= budget.target_bytes else 'does NOT fit'}")
    best = plan.max_micro_batch
    lines.append("largest micro-batch: none fits, not even 1" if best == 0 else
                 f"largest micro-batch: {best} (fitted peak {fit(best) / GIB:.2f} GiB, "
                 f"{budget.needed(fit(best), plan.weight_bytes) / GIB:.2f} GiB with the reserve)")
    lines.append(f"planned in {plan.seconds:.0f} s")
    return "\n".join(lines)


def format_analytic(m: StaticMemory, budget: Budget, num_gpus: int) -> str:
    lines = [f"analytic static memory per GPU ({num_gpus} GPU(s); each holds all of it, or 1/{num_gpus} of the "
             "frozen weights under --frozen-sharding fsdp)"]
    lines += format_static(m)
    lines += budget.lines()
    left = budget.target_bytes - budget.fixed_reserve - m.total
    lines.append(f"left for activations and temporaries (before fragmentation): {left / GIB:.2f} GiB"
                 + ("" if left > 0 else "  -> the static memory alone does not fit"))
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
    p = Parser(prog=PROG, description="Memory plan of a profile (every train.py flag applies), or the "
                                       "analytic calculator (--analytic).")
    p.add_argument("--profile", help="a key of hw_profiles.json")
    p.add_argument("--json", help="also write the plan to this JSON file")
    p.add_argument("--num-gpus", type=positive(int),
                   help="ranks (adds NCCL and DDP buckets; divides the frozen weights under fsdp); default: the "
                        "profile's num_gpus, 1 without a profile")
    p.add_argument("--analytic", action="store_true", help="the quick calculator: static memory from parameter counts")
    p.add_argument("--optimizer", choices=tuple(OPTIMIZERS), help="(--analytic) the optimizer (default: adamw, as train.py)")
    p.add_argument("--params", type=_count, help="(--analytic without --profile) frozen parameters, e.g. 8.03e9")
    p.add_argument("--model-size-gb", type=positive(float),
                   help="(--analytic without --profile) instead of --params: frozen weights in GB (1e9 bytes) at --precision")
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
    frozen = args.params if args.params is not None else round(args.model_size_gb * GB / frozen_bytes_per_param(more.precision))
    memory = static_memory(frozen, args.trainable_params or 0, more.precision, args.optimizer or "adamw")
    return memory, budget_for("cuda", args.gpu_memory_gb, more.target_util, args.num_gpus, memory.trainable_params)


def _profile_analytic(cfg, args) -> tuple[StaticMemory, Budget]:
    specs = {name: llm_spec(name, getattr(cfg, name)) for name in LLM_NAMES}
    shapes = trainable_shapes(cfg, specs)
    frozen = sum(llm_parameter_count(s.config) for s in specs.values())
    if cfg.frozen_sharding == "fsdp":
        frozen = math.ceil(frozen / args.num_gpus)
    memory = static_memory(frozen, shapes, cfg.precision, args.optimizer or "adamw")
    return memory, budget_for(cfg.device, cfg.memory_gb, cfg.target_util, args.num_gpus, memory.trainable_params)


def analytic_json(memory: StaticMemory, budget: Budget, num_gpus: int) -> dict:
    return {**memory.to_json(), "num_gpus": num_gpus, "ddp_bucket_bytes": budget.ddp_buckets,
            "card_bytes": budget.card_bytes, "target_util": budget.target_util}


def write_json(path: str, payload: dict) -> None:
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None


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
        args.num_gpus = args.num_gpus or cfg.num_gpus
        if args.analytic:
            memory, budget = _profile_analytic(cfg, args)
            print(format_analytic(memory, budget, args.num_gpus))
            payload = {"profile": args.profile, **analytic_json(memory, budget, args.num_gpus)}
        elif args.optimizer not in (None, "adamw"):
            raise UserError("the traced plan steps train.py's AdamW; --optimizer is for --analytic")
        else:
            plan = make_plan(cfg, args.num_gpus)
            print(format_plan(plan))
            payload = plan.to_json()
    if args.json:
        write_json(args.json, payload)


if __name__ == "__main__":
    main_guard(main)
