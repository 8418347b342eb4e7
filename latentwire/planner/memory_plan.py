"""The traced memory plan: the profile's exact configuration built and stepped under FakeTensorMode
+ MemTracker (`memtrace`), twice (or three times: `make_plan`), a line fitted through the two peaks
nearest the answer, and the largest micro-batch whose peak with the reserve of `budget` fits the
card. What `python -m latentwire.plan` prints and what --elastic-batch takes its micro-batch from.
"""

from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from ..fp8 import parameter_count
from ..harness.errors import UserError
from ..harness.recipe import TrainingStep
from ..harness.recompute import checkpoint_options
from ..known_llms import KNOWN_LLMS, llm_parameter_count
from ..llm import LLM_NAMES, fsdp_units, held_bytes
from ..llm_sources import LLMSpec, llm_spec, read_source
from ..model import WireConfig, WireEncoder
from ..parallelize import prepare_frozen_llms
from ..prompting import CHAT_FRAMING_TOKENS, PromptContract, PromptFormat, own_tail_text, uses_chat_template
from .analytic import StaticMemory, static_memory
from .budget import Budget, Fit, budget_for, fit_line, largest_fitting
from .memtrace import StepTrace, StepTracer, fake_llms


@dataclass(frozen=True)
class Plan:
    cfg: object
    world_size: int
    specs: dict[str, LLMSpec]
    frozen_params: dict[str, int]  # per LLM, counted on the traced model
    params_frozen_bytes: int  # what one rank holds: a shard of each LLM under fsdp
    gathered_bytes: int  # fsdp: the all-gathered units whole at once (0 unsharded)
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
            "profile": cfg.invocation.profile,
            "world_size": self.world_size,
            "device": cfg.card.device,
            "precision": cfg.numerics.precision,
            "activation_checkpointing": cfg.recompute.policy,
            "frozen_fp8": cfg.frozen.fp8,
            "frozen_sharding": self.sharding,
            "fsdp_gathered_bytes": self.gathered_bytes,
            "llms": {
                name: {"source": spec.source, "config_from": spec.origin, "params": self.frozen_params[name]}
                for name, spec in self.specs.items()
            },
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
            "reserve": {
                "cuda_context_bytes": self.budget.cuda_context,
                "nccl_bytes": self.budget.nccl,
                "ddp_bucket_bytes": self.budget.ddp_buckets,
                "fragmentation_of_non_weight_memory": self.budget.fragmentation,
            },
            "allowed_peak_bytes": self.budget.allowed_peak(self.weight_bytes),
            "analytic": self.analytic.to_json(),
            "seconds": self.seconds,
        }


# --- the traced plan --------------------------------------------------------------------------


def trainable_shapes(wire: WireConfig, specs: dict[str, LLMSpec]) -> list[tuple[int, ...]]:
    """The shapes of the encoder's and adapters' parameters (built on the meta device: no memory)."""
    with torch.device("meta"):
        model = WireEncoder(wire, {name: (spec.config.hidden_size, 1.0) for name, spec in specs.items()})
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
        units += [list(unit.parameters()) for unit in fsdp_units(llm)]
        in_units = {id(p) for unit in units for p in unit}
        units.append([p for p in llm.model.parameters() if id(p) not in in_units])
    largest = max(sum(p.numel() * p.element_size() for p in unit) for unit in units)
    return sum(held(p) for unit in units for p in unit), 2 * largest


def shard_trace(trace: StepTrace, frozen_bytes: int, held_bytes: int, gathered_bytes: int) -> StepTrace:
    """The traced step with its whole frozen weights replaced by one rank's shards and the
    all-gathered units (at the peak at most; an upper bound)."""
    if not gathered_bytes:
        return trace
    peak = dict(trace.peak, parameters=trace.peak["parameters"] - frozen_bytes + held_bytes, gathered=gathered_bytes)
    peak["total"] = trace.peak["total"] - frozen_bytes + held_bytes + gathered_bytes
    return replace(trace, peak=peak)


def planned_rows(prompt: PromptFormat, specs: dict[str, LLMSpec]) -> dict[str, tuple[int, int, int]]:
    """Each LLM's (lead tokens, tail tokens, vocabulary size) for memtrace.planning_batch."""
    return {name: (*contract_lengths(name, spec, prompt), spec.config.vocab_size) for name, spec in specs.items()}


def contract_lengths(name: str, spec: LLMSpec, prompt: PromptFormat) -> tuple[int, int]:
    """The tokens before and after the middle of the LLM's prompt contract: counted by its own
    tokenizer, as the step's rows are, wherever that is on this machine. A hub model is planned
    before it is downloaded, without one: the anchor, and inside a chat template the instruction,
    at a token per byte (an upper bound for byte-level BPE), the template's own framing at
    CHAT_FRAMING_TOKENS."""
    who = f"the {name} ({spec.source})"
    tokenizer = local_tokenizer(name, spec.source)
    if tokenizer is not None:
        contract = PromptContract.of(tokenizer, prompt, who)
        return len(contract.lead), len(contract.tail)
    if uses_chat_template(prompt.chat_template, spec.chat_template, who):
        return CHAT_FRAMING_TOKENS, len(own_tail_text(prompt).encode())
    return int(spec.has_bos), len(prompt.anchor.encode())


def local_tokenizer(name: str, source: str):
    """The tokenizer train.py reads `source` with, or None for a hub id (the plan downloads
    nothing) and for a directory train.py could not load (a config.json alone still plans)."""
    if source in KNOWN_LLMS and not os.path.isdir(os.path.expanduser(source)):
        return None
    try:
        return read_source(name, source).tokenizer
    except UserError:
        return None


def make_plan(cfg, world_size: int, step: TrainingStep) -> Plan:
    """Trace the profile `cfg` at its micro-batch size and at the one the first trace predicts, and
    again where the line through those two points if the second landed more than 10% short."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    start = time.perf_counter()
    specs = {name: llm_spec(name, cfg.frozen.source(name)) for name in LLM_NAMES}
    answers = planned_rows(cfg.prompt, specs)
    shapes = trainable_shapes(cfg.wire, specs)
    budget = budget_for(
        cfg.card.device, cfg.card.memory_gb, cfg.planning.target_util, world_size, sum(math.prod(s) for s in shapes)
    )
    sharded = cfg.frozen.sharding == "fsdp" and world_size > 1
    # fork_rng: building and stepping fake models must not move the caller's random stream
    # (train.py plans before it seeds and builds its real models).
    with torch.random.fork_rng(devices=[]), FakeTensorMode():
        llms = fake_llms(specs, cfg.numerics.precision)
        prepare_frozen_llms(
            llms,
            checkpointing=checkpoint_options(cfg.recompute.policy),
            compile_options=None,
            mesh=None,
            device=None,
            fp8=cfg.frozen.fp8,
        )
        frozen_params = {name: parameter_count(llm.model) for name, llm in llms.items()}
        frozen_bytes = sum(held_bytes(llm.model) for llm in llms.values())
        held, gathered = fsdp_frozen_memory(llms, world_size) if sharded else (frozen_bytes, 0)
        tracer = StepTracer(cfg, llms, answers, step)
        first = shard_trace(tracer.trace(cfg.training.micro_batch_size), frozen_bytes, held, gathered)
        weight_bytes = first.peak["parameters"]
        traces = [
            first,
            shard_trace(tracer.trace(next_micro_batch(first, budget, weight_bytes)), frozen_bytes, held, gathered),
        ]
        fit = fit_line({t.micro_batch: t.peak["total"] for t in traces})
        # A part of the first peak that does not grow with the batch (the loss's chunk of logits,
        # latentwire.head_losses) was counted per sample and sent the second trace short of the
        # answer: one more where the line points, and the line through the two nearest it.
        best = largest_fitting(fit, budget, weight_bytes)
        if traces[1].micro_batch < 0.9 * best:
            traces.append(shard_trace(tracer.trace(best), frozen_bytes, held, gathered))
            fit = fit_line({t.micro_batch: t.peak["total"] for t in traces[1:]})
    total_params = sum(llm_parameter_count(spec.config) for spec in specs.values())
    analytic = static_memory(
        math.ceil(total_params / world_size) if sharded else total_params, shapes, cfg.numerics.precision, "adamw"
    )
    return Plan(
        cfg,
        world_size,
        specs,
        frozen_params,
        held,
        gathered,
        weight_bytes - held,
        tuple(sorted(traces, key=lambda t: t.micro_batch)),
        fit,
        budget,
        largest_fitting(fit, budget, weight_bytes),
        analytic,
        time.perf_counter() - start,
    )


def plan_max_micro_batch(cfg, world_size: int, step: TrainingStep) -> int:
    """The largest micro-batch per rank that fits the profile's card: what elastic batch uses."""
    return make_plan(cfg, world_size, step).max_micro_batch


def write_json(path: str, payload: dict) -> None:
    """A plan or a search's trials as JSON; a path that cannot be written is a one-line error."""
    try:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(payload, indent=2) + "\n")
    except OSError as e:
        raise UserError(f"cannot write {path}: {e.strerror}") from None
