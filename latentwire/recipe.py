"""LatentWire's recipe: what train.py's setup asks of the model (harness.recipe.Recipe), through
one object built by one call, `LatentWire(cfg, di, stop)`, as torchtitan's model spec and
parallelize function serve its trainer. Its parts live in their modules: the examples and batches
(latentwire.dataset), the frozen readers and their wrappers in one order (latentwire.llm,
latentwire.parallelize), the trainable encoder and adapters (latentwire.model), the objectives and
the step's task (latentwire.objectives), the distillation targets (latentwire.distillation), the
periodic evaluation (latentwire.eval) and the FLOP model (latentwire.flops).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from .dataset import Collator, DataSources, PromptDataset, TrainingSet, describe_mixture, spans
from .distillation import describe_targets, teacher_targets
from .eval.evaluation import evaluate_wire
from .eval.settings import EvalSettings
from .flops import FlopModel
from .fp8 import check_fp8, describe_fp8, parameter_count
from .harness.compiling import stable_shapes
from .harness.data import Mixture, draws_per_source
from .harness.distributed import DistInfo
from .harness.recipe import Recipe, TrainingStep
from .llm import describe_prompts, held_per_rank
from .model import WireEncoder, count_parameters
from .objectives import WireTask, forward_loss_sums
from .parallelize import frozen_llms, wire_regions
from .planner.elastic import apply_elastic_batch
from .settings import Config


class LatentWire(Recipe):
    """A byte encoder and one adapter per frozen reader (a Llama and a Qwen), which read the wire's
    soft tokens in place of the prompt's text."""

    Config = Config

    @classmethod
    def config_for_memory(cls, cfg: Config, world_size: int, step: TrainingStep) -> tuple[Config, str | None]:
        """--elastic-batch: the micro-batch from the memory plan of this very configuration, which
        traces `step` on the CPU (FakeTensorMode: real shapes, no memory); accumulation keeps the
        global batch (latentwire.planner.elastic)."""
        if not cfg.planning.elastic_batch:
            return cfg, None
        return apply_elastic_batch(cfg, world_size, step)

    def __init__(self, cfg: Config, di: DistInfo, stop: Callable[[], int]):
        """The data, loaded and checked, and what it is said up front: the answers the prompt's cut
        hides from the encoder, and where the held-out examples come from. The readers load in
        `build_model`."""
        super().__init__(cfg, di, stop)
        data, training = cfg.data, cfg.training
        sources = DataSources.of(data, seed=training.seed)
        self.training = TrainingSet.load(sources, data.num_examples, data.max_prompt_bytes, data.drop_cut_answers)
        held_out = sources.held_out_source()
        groups = sources.held_out_groups(cfg.evaluation.examples, held_out) if cfg.output.eval_every else {}
        self.eval_examples = [ex for group in groups.values() for ex in group]
        self.eval_groups = spans(groups) if len(groups) > 1 else {}
        self.dataset = PromptDataset(self.training.examples)
        drawn = draws_per_source(
            self.draws(training.seed),
            world=di.world_size,
            micro=training.micro_batch_size,
            accum=training.grad_accum_steps,
            steps=training.max_steps,
        )
        self.data_identity, self.data_facts = self.training.identity(), self.training.facts(drawn)
        self.sharded = cfg.frozen.sharding == "fsdp" and di.is_distributed
        self.di.say(
            f"data: {self.training.summary(data.max_prompt_bytes)}; held out: {sources.describe_held_out(held_out)}"
        )
        if len(self.training.parts) > 1:
            self.di.say("mixture: " + describe_mixture(self.data_facts["train_sources"]))

    def draws(self, seed: int) -> Mixture:
        """Each source's examples by its weight (a single source: as they always were drawn)."""
        return self.training.draws(seed)

    def build_model(self, compile_options: dict | None, checkpointing: dict | None) -> tuple[nn.Module, WireTask]:
        """The frozen readers, stored in the autocast dtype (no gradients and no optimizer state,
        so no fp32 master copy), built on the meta device, wrapped and read (prepare_frozen_llms:
        their decoder layers are the checkpointed regions); the trainable encoder and adapters; the
        step's task."""
        cfg, device = self.cfg, self.di.device
        if cfg.frozen.fp8 != "none":  # float8 readers only where the card has FP8 tensor cores
            check_fp8(device, cfg.numerics.precision, eager_backward=compile_options is None)
        if cfg.frozen.sharding == "fsdp" and not self.sharded:
            self.di.warn("note: --frozen-sharding fsdp in one process: nothing to shard over, the LLMs stay whole")
        mesh = init_device_mesh(device.type, (self.di.world_size,)) if self.sharded else None
        started = time.perf_counter()
        self.llms = frozen_llms(
            cfg.frozen,
            cfg.prompt,
            cfg.numerics.precision,
            device,
            checkpointing=checkpointing,
            compile_options=compile_options,
            mesh=mesh,
        )
        self.di.say(f"loaded the frozen LLMs in {time.perf_counter() - started:.1f} s")  # minutes for two 8B models
        self.di.say(f"prompt: {describe_prompts(self.llms)}")  # what each reader reads around the wire
        if cfg.frozen.fp8 != "none":
            self.di.say(describe_fp8(self.llms, cfg.frozen.fp8, device.type))
        model = WireEncoder.for_llms(cfg.wire, self.llms).to(device)
        self.flops = FlopModel.of(
            model, {n: llm.model for n, llm in self.llms.items()}, cfg.wire, recompute=cfg.recompute.policy
        )
        forward = stable_shapes()(forward_loss_sums) if compile_options is not None else forward_loss_sums
        return model, WireTask(self.llms, cfg.objectives, cfg.wire.num_latents, forward)

    def compile_regions(self, model: nn.Module) -> list[nn.Module]:
        return wire_regions(model)

    def collator(self, visited: list[int]) -> Collator:
        """Each batch's encoder bytes and readers' rows; with distillation on, the teacher's targets
        of each `visited` example too, computed first (once per example, not once per step)."""
        cfg, data = self.cfg, self.cfg.data
        kd_targets = self.teacher_targets(visited) if cfg.objectives.teacher else None  # None: a signal stopped it
        return Collator.for_llms(
            self.llms,
            data.max_prompt_bytes,
            data.max_answer_tokens,
            data.pad_multiple,
            kd_targets=kd_targets,
            word_patch=cfg.wire.word_patch,
        )

    def teacher_targets(self, visited: list[int]) -> dict | None:
        """The teacher's targets (latentwire.distillation): each rank computes a share, gathered to
        all; eagerly (a one-off pass), in the step's autocast and attention kernels, which train.py
        sets around `collator`. None when a signal stopped the pass: the run then saves where it
        stands and leaves, as a signal while loading does."""
        cfg, di, data = self.cfg, self.di, self.cfg.data
        started = time.perf_counter()
        rows = Collator.for_llms(
            self.llms, data.max_prompt_bytes, data.max_answer_tokens, data.pad_multiple, teacher=True
        )
        with torch.compiler.set_stance("force_eager"):
            targets = teacher_targets(
                self.llms,
                self.dataset,
                rows,
                visited,
                k=cfg.objectives.k_tokens,
                temperature=cfg.objectives.kd_temperature,
                top_k=cfg.objectives.kd_top_k,
                batch_size=cfg.training.micro_batch_size,
                device=di.device,
                rank=di.rank,
                world=di.world_size,
                stop=self.stop,
            )
        seconds = time.perf_counter() - started
        self.di.say(
            f"a signal stopped the distillation teacher's pass after {seconds:.1f} s"
            if targets is None
            else describe_targets(targets, len(self.dataset), seconds)
        )
        return targets

    def evaluate(self, model: nn.Module) -> dict | None:
        """The held-out split, sharded over the ranks, equal to `python -m latentwire.evaluate` on
        these weights; eagerly (its eval-mode, padded, KV-cached calls would recompile every
        region). A signal during it (minutes with 8B readers) is heard between its chunks."""
        settings = EvalSettings.of(self.cfg, text_baselines=False, lockstep=self.sharded, stop=self.stop)
        with torch.compiler.set_stance("force_eager"):
            return evaluate_wire(
                model,
                self.llms,
                self.eval_examples,
                settings,
                self.di.device,
                self.di.rank,
                self.di.world_size,
                groups=self.eval_groups,
            )

    def describe(self, model: nn.Module) -> str:
        frozen = sum(parameter_count(llm.model) for llm in self.llms.values())
        return (
            f"trainable {count_parameters(model, True) / 1e6:.2f}M, frozen {frozen / 1e6:.1f}M "
            f"({held_per_rank(self.llms)})"
        )

    def meta(self) -> dict:
        """The wire's settings and versions; of a mixture, each source's examples and share of the draws."""
        sources = {"data_sources": self.data_facts["train_sources"]} if "train_sources" in self.data_facts else {}
        return {"wire": asdict(self.cfg.wire), "versions": {"transformers": transformers.__version__}, **sources}

    @staticmethod
    def memory_advice(profile: str) -> str:
        return (
            f"python -m latentwire.plan --profile {profile} says what a rank holds (--frozen-sharding fsdp "
            "holds 1/world of the frozen LLMs)"
        )

    def next_step(self, out_dir: Path) -> str:
        """A run that sharded its readers over N ranks is evaluated on N ranks, which shard them the
        same way."""
        launch = f"torchrun --nproc_per_node={self.di.world_size} -m" if self.sharded else "python -m"
        return f"evaluate it: {launch} latentwire.evaluate --ckpt {out_dir}"
