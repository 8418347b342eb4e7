"""One hand-written data-parallel training loop, driven by a profile of hw_profiles.json.

    torchrun --nproc_per_node=N train.py --profile KEY      # N processes: one per GPU, or gloo on CPU
    python train.py --profile KEY --help                    # every setting, with the profile's value

main() is the table of contents; each optimization is a labelled block. The model comes through
one recipe, the one import that names it (a `Recipe` of the harness's recipe module); the
machinery from the harness.
"""

from __future__ import annotations

import os
import random
import time
from contextlib import closing, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.attention import sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from latentwire.harness.checkpoint import Checkpointer, TrainState, checkpoint_dir, load_weights
from latentwire.harness.compiling import inductor_cache_dir
from latentwire.harness.config import SETTINGS_VERSION, check_can_create
from latentwire.harness.data import (
    ShardSampler,
    check_one_global_batch,
    examples_drawn,
    global_batches,
    make_loader,
    to_device,
)
from latentwire.harness.distributed import (
    DistInfo,
    all_reduce,
    all_reduce_together,
    ddp_buffer_options,
    group_options,
    leave_together,
    restarted_by_torchrun,
    torchrun_rank,
)
from latentwire.harness.errors import INTERRUPTED_EXIT_CODE, Diverged, out_of_memory
from latentwire.harness.exits import main_guard
from latentwire.harness.layout import config_for_world
from latentwire.harness.loop_config import LoopConfig, OptimizerConfig, Schedule, load_config
from latentwire.harness.memory_cap import card_memory, memory_fraction
from latentwire.harness.meters import StepMeter
from latentwire.harness.metrics import MetricsLogger
from latentwire.harness.out_dir import check_out_dir, one_run_at_a_time, prepare_out_dir
from latentwire.harness.precision import (
    AMP_DTYPES,
    Numerics,
    compute_dtype,
    cuda_capability,
    matmul_arithmetic,
    sdpa_backends,
    use_tf32,
)
from latentwire.harness.preemption import StopFlag, stop_code
from latentwire.harness.profiling import MemorySnapshots, NoProfiler, profiler_options
from latentwire.harness.recipe import Task, TrainingStep
from latentwire.harness.recompute import checkpoint_options
from latentwire.harness.resume import (
    check_init_from,
    check_resume_data,
    check_resume_settings,
    config_for_resume,
    flags_for_requeue,
    resolve_checkpoint,
    resume,
)
from latentwire.recipe import LatentWire as Recipe  # the model this loop trains

PROFILES = Path(__file__).with_name("hw_profiles.json")
CONTINUE = "continue: the same command with --resume"


def main(argv: list[str] | None = None) -> None:
    started = time.monotonic()
    cfg = load_config(Recipe.Config, argv, PROFILES)
    di = torchrun_rank(cfg.card.device)
    # --- Process group: one rank per process torchrun starts -------------------------------------
    # NCCL on CUDA, gloo on CPU, with a timeout so a dead rank fails the job instead of hanging it.
    # A world of one (plain `python train.py`) joins no group: no DDP, no collectives.
    if di.joins_group:
        if di.device.type == "cuda":
            torch.cuda.set_device(di.device)
        dist.init_process_group(**group_options(di.device, cfg.training.dist_timeout_s))
    # --- A smaller card's memory on a bigger card: the profile's memory_gb, not the card's ------------
    # A profile for an 80 GB card runs out of memory on a 141 GB one where its own card would; the allocator's
    # retries near the cap are in metrics.jsonl (alloc_retries). --cap-memory false lifts it.
    fraction, why = memory_fraction(*card_memory(di.device), cfg.card.memory_gb, cfg.card.cap_memory, di.device.type)
    if fraction is not None:
        torch.cuda.set_per_process_memory_fraction(fraction, di.device)
    di.say(why)
    # Out of memory outside the loop (loading, the last save) is one line and exit 5 too.
    with leave_together(), out_of_memory(Recipe.memory_advice(cfg.invocation.profile)):
        # --- Preemption and Ctrl-C: a signal only sets a flag; ranks agree on it at a step's end,
        # save and exit (75 preempted, 130 interrupted). Set first, so a signal while loading is heard.
        stop = StopFlag(announce=di.is_main)
        # --- One run at a time in out_dir: a lock rank 0 holds, which the kernel drops when it exits
        with one_run_at_a_time(Path(cfg.output.out_dir), di):
            cfg = resolve_run(cfg, di)
            parts = build(cfg, di, stop, started)
            if parts is not None:  # None: a resumed run that had already finished
                train(cfg, di, stop, parts)
            # The run's objects go while its process group stands: DDP's reducer holds the group, and
            # freed after leave_together destroys it, its destructor joins gloo's threads holding the GIL.
            del parts


def resolve_run(cfg: LoopConfig, di: DistInfo) -> LoopConfig:
    """Every input checked before anything heavy loads or anything on disk changes, and the batch
    this world runs: the configuration returned is final."""
    out_dir = Path(cfg.output.out_dir)
    # --- Requeued by SLURM, or restarted by torchrun: resumed where it saved, started where it never did
    flags, why = flags_for_requeue(cfg.invocation, out_dir, restarted_by_torchrun())
    cfg = replace(cfg, invocation=flags)
    di.say(why)
    check_out_dir(out_dir, cfg.invocation.resume or cfg.invocation.restarted, cfg.invocation.overwrite)
    if cfg.invocation.resume:  # a setting newer than the checkpoint: the value it ran with, not the profile's
        cfg, why = config_for_resume(cfg, out_dir)
        di.say(why)
    init = init_checkpoint(cfg)
    if init is not None:
        check_init_from(init, cfg.to_dict(), cfg.schema())
    if cfg.compile.enabled:
        check_can_create(compile_cache(cfg), "compile_cache")
    # --- The profile's batch on this world size: kept where it splits, else the lr follows --------
    cfg, why = config_for_world(cfg, di.world_size)
    di.say(why)
    # --- Micro-batch from the model's memory plan: where the recipe has a planner, it traces this
    # very step (what is planned is what trains); accumulation keeps the global batch.
    cfg, why = Recipe.config_for_memory(cfg, di.world_size, TrainingStep(adamw, train_step))
    di.say(why)
    if cfg.invocation.resume:
        check_resume_settings(out_dir, cfg.to_dict(), cfg.schema(), cfg.invocation)
    return cfg


@dataclass
class Parts:
    """What build() makes and the loop uses."""

    recipe: Recipe
    model: nn.Module  # the trainable model itself: checkpoints and evaluation take it
    ddp_model: nn.Module  # the same, in DDP when there are several ranks: the step takes it
    task: Task
    amp_dtype: torch.dtype | None
    attention_backends: list
    scaler: torch.amp.GradScaler
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    checkpointer: Checkpointer
    state: TrainState
    batches: object
    snapshots: MemorySnapshots
    meter: StepMeter
    logger: MetricsLogger
    profiler: object
    on_disk: int | None  # the step whose checkpoint exists already (a resumed run's)


def build(cfg: LoopConfig, di: DistInfo, stop: StopFlag, started: float) -> Parts | None:
    """The run's parts in the order they are made; None when a resumed run had already finished."""
    device, rank, world, out_dir = di.device, di.rank, di.world_size, Path(cfg.output.out_dir)
    seed, steps = cfg.training.seed, cfg.training.max_steps
    micro, accum = cfg.training.micro_batch_size, cfg.training.grad_accum_steps
    recipe = Recipe(cfg, di, stop=lambda: stop.on_any_rank(device))  # the model's data, loaded and checked
    if cfg.invocation.resume:
        check_resume_data(out_dir, recipe.data_identity, cfg.invocation.new_data)
    # --- Seeds: the same on every rank, so the initial weights agree -------------------------------
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)
    amp_dtype, scaler, tf32, attention_backends = numerics(cfg.numerics, device, di)

    # --- Activation checkpointing: what backward recomputes of the recipe's checkpointed regions ---
    # full: their forward; selective: the cheap ops and every second matmul (a per-operator context_fn,
    # harness.recompute), the outputs of attention and the other matmuls kept; none: nothing.
    checkpointing = checkpoint_options(cfg.recompute.policy)  # checkpoint_wrapper's arguments
    # --- The model: built and wrapped by its recipe in one order, as torchtitan's parallelize ------
    compile_options = {"mode": cfg.compile.mode, "dynamic": True} if cfg.compile.enabled else None
    model, task = recipe.build_model(compile_options, checkpointing)
    init = init_checkpoint(cfg)
    if init is not None:  # --init-from: a new run that trains these weights further
        load_weights(init, model, "this run's model")
        di.say(f"init: the trainable weights of {init}; a new run, with its own optimizer and schedule")
    torch.manual_seed(seed + rank)  # dropout differs per rank

    # --- torch.compile, one region at a time -------------------------------------------------------
    # Each repeated block compiled on its own (torchtitan's way): compile time does not grow with
    # depth; every size symbolic, so varying widths do not recompile; cached where a requeue finds it.
    if compile_options is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache(cfg))
        di.say(f"compile: mode {cfg.compile.mode}, cache {compile_cache(cfg)}")
        for region in recipe.compile_regions(model):
            region.compile(**compile_options)

    # --- DDP over the trainable part only -------------------------------------------------------------
    # Frozen weights are neither broadcast nor bucketed, the constant buffers not re-broadcast, and
    # the gradients live in the all-reduce buckets (gradient_as_bucket_view): one copy less.
    ddp_model = model
    if di.is_distributed:
        device_ids = [device.index] if device.type == "cuda" else None
        ddp_model = DDP(model, device_ids=device_ids, gradient_as_bucket_view=True, **ddp_buffer_options())

    # --- Data: a disjoint shard per rank ---------------------------------------------------------------
    # Each epoch's order follows from (seed, epoch) alone, each source of a mixture by its weight, and
    # the sampler deals every world_size-th index to each rank: the same global batches on any world
    # size, and an epoch can start part-way (resume).
    draws = recipe.draws(seed)
    check_one_global_batch(len(recipe.dataset), micro, accum, world)
    sampler = ShardSampler(draws, num_replicas=world, rank=rank)

    # --- Optimizer: AdamW over the trainable parameters only, fused (see adamw) ----------------------
    optimizer = adamw(model, cfg.optimizer, device.type)
    scheduler = one_cycle(optimizer, cfg.optimizer.lr, cfg.schedule, steps)

    # --- Checkpoints and resume: weights, optimizer, schedule, scaler, RNG and data position -----------
    # The newest checkpoint every rank loads (harness.resume); the same layout resumes bitwise the run
    # that never stopped on CPU, on CUDA to rounding (its attention backward adds in varying order).
    state = TrainState(step=0, epoch=0, examples_done=0, layout=(world, micro, accum), data=recipe.data_identity)
    meta = {
        "profile": cfg.invocation.profile,
        "config": cfg.to_dict(),
        SETTINGS_VERSION: cfg.version,  # how later code reads these settings
        "data": recipe.data_identity,
        "init_from": str(init) if init else None,
        **recipe.meta(),
    }
    checkpointer = Checkpointer(
        out_dir,
        rank=rank,
        keep=cfg.output.keep_checkpoints,
        meta=meta,
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
    )
    if cfg.invocation.resume:
        state = resume(checkpointer, state, cfg.to_dict(), cfg.schema(), steps, cfg.invocation, di.say, di.warn)
        if state is None:
            return None

    # --- The loader: workers collate while the model computes -----------------------------------------
    # Work done once per example (a distillation's targets, say), in the step's numerics, covers
    # the examples the run's steps draw, which the sampler decides in advance.
    with sdpa_kernel(attention_backends), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        collate = recipe.collator(examples_drawn(draws, state=state, steps=steps))
    loader = make_loader(recipe.dataset, sampler, collate, micro, cfg.loader, device.type, seed=seed + rank)
    batches = global_batches(loader, sampler, accum, state.epoch, state.examples_done, micro * accum * world)
    if di.is_main:  # every input has been checked: only now may --overwrite delete the old run
        prepare_out_dir(out_dir, cfg.invocation.overwrite)
    snapshots, meter, logger, profiler = observers(cfg, di, recipe, state.step, tf32, started)
    di.say(
        f"profile {cfg.invocation.profile}: {world} x {device.type}, {cfg.numerics.precision}, global batch "
        f"{micro} x {accum} x {world} = {micro * accum * world}, {recipe.describe(model)}"
    )
    return Parts(
        recipe=recipe,
        model=model,
        ddp_model=ddp_model,
        task=task,
        amp_dtype=amp_dtype,
        attention_backends=attention_backends,
        scaler=scaler,
        optimizer=optimizer,
        scheduler=scheduler,
        checkpointer=checkpointer,
        state=state,
        batches=batches,
        snapshots=snapshots,
        meter=meter,
        logger=logger,
        profiler=profiler,
        on_disk=state.step if cfg.invocation.resume else None,
    )


def numerics(config: Numerics, device: torch.device, di: DistInfo) -> tuple:
    """The step's autocast dtype, grad scaler, whether TF32 is on, and its attention kernels."""
    # --- Numerics: autocast, grad scaler, TF32 ------------------------------------------------------
    # bf16 autocast (micro_step) needs no loss scaling; fp16 (V100) needs a GradScaler, which passes
    # calls through when disabled; fp32 is the reference. TF32 runs fp32 matmuls on sm80+ tensor cores.
    amp_dtype = AMP_DTYPES[config.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=config.precision == "fp16")
    capability = cuda_capability(device)
    tf32 = use_tf32(config.tf32, capability)
    if tf32:
        torch.set_float32_matmul_precision("high")  # not fp32_precision = "tf32": max-autotune reads this one

    # --- Fused attention kernels: train_step's sdpa_kernel(attention_backends) -----------------------
    # On sm80+ in bf16/fp16 only flash and memory-efficient: a silent fallback to the O(L^2)-memory
    # math kernel becomes an error (harness.precision.sdpa_backends says why, cuDNN included).
    attention_backends, why = sdpa_backends(capability, compute_dtype(config.precision))
    di.warn(why and f"note: {why}")
    return amp_dtype, scaler, tf32, attention_backends


def one_cycle(optimizer: torch.optim.Optimizer, lr: float, s: Schedule, steps: int):
    """The learning rate's schedule, from `lr` / div_factor up to `lr` and down."""
    # --- Schedule: OneCycle, stepped once per optimizer step; momentum not cycled ---------------------
    return torch.optim.lr_scheduler.OneCycleLR(
        optimizer,
        max_lr=lr,
        total_steps=steps,
        pct_start=one_cycle_pct_start(s.pct_start, steps),
        anneal_strategy=s.anneal_strategy,
        div_factor=s.div_factor,
        final_div_factor=s.final_div_factor,
        cycle_momentum=False,
    )


def observers(cfg: LoopConfig, di: DistInfo, recipe: Recipe, step: int, tf32: bool, started: float) -> tuple:
    """What watches the run from `step` on: memory snapshots, the step meter, the log, the profiler."""
    device, out_dir = di.device, Path(cfg.output.out_dir)
    # --- Memory snapshot: allocation history on request, and always one on out-of-memory ------------
    snapshots = MemorySnapshots(cfg.profiler.memory_snapshot, device, out_dir, di.rank)
    snapshots.start()
    # --- Metrics: throughput, MFU against the peak of the arithmetic the matmuls run in, HFU, memory -
    # `mfu` of what the step runs, padding included; `mfu_useful` of the real positions alone.
    peak = getattr(cfg.card, "peak_tflops_" + matmul_arithmetic(cfg.numerics.precision, tf32))
    meter = StepMeter(device, recipe.flops, peak_tflops=peak)
    logger = MetricsLogger(
        out_dir,
        enabled=di.is_main,
        first_step=step + 1,
        total_steps=cfg.training.max_steps,
        first_record=recipe.data_facts,
        started=started,
    )
    # --- Profiler: torch.profiler on the profile's wait / warmup / active schedule ---------------------
    # A few steps after the first (compile, allocator warm-up), not the run: one trace per rank.
    profiler = NoProfiler()
    if cfg.profiler.enabled:
        profiler = torch.profiler.profile(**profiler_options(cfg.profiler, out_dir, di.rank, device))
    return snapshots, meter, logger, profiler


def train(cfg: LoopConfig, di: DistInfo, stop: StopFlag, parts: Parts) -> None:
    """The loop: one optimizer step per global batch until max_steps, --stop-at-step, a signal or
    divergence; every way out saves the same way."""
    device, world, steps, state = di.device, di.world_size, cfg.training.max_steps, parts.state
    global_batch = cfg.training.micro_batch_size * cfg.training.grad_accum_steps * world
    # --- A signal while building: save at once, not after the first step's compile --------------------
    exit_code = stopped(stop.on_any_rank(device), stop, state.step, di.is_main)  # None: go on
    skipped, bad_in_a_row = 0, 0
    parts.model.train()
    oom = out_of_memory(Recipe.memory_advice(cfg.invocation.profile), cfg.training.micro_batch_size, parts.snapshots)
    # closing(batches): every way out, a failure included, stops the loader's workers at once.
    with parts.profiler, closing(parts.batches), oom:
        while exit_code is None and state.step < steps:
            t_wait = time.perf_counter()
            next_epoch, next_done, micro_batches = next(parts.batches)
            data_wait = time.perf_counter() - t_wait
            micro_batches = [to_device(b, device) for b in micro_batches]

            # --- Exact gradient accumulation ---------------------------------------------
            # Each loss term over its count in the whole global batch (the task's counts), made and
            # summed on the device; the tokens read and the stop flags ride the same all-reduce.
            counts = torch.stack([parts.task.counts(b) for b in micro_batches]).sum(0)
            tokens_read = sum(parts.task.tokens(b) for b in micro_batches)
            n_targets, tokens_read, stop_flags = all_reduce_together(counts, tokens_read, stop.flags(device))
            n_targets = n_targets.float()
            state.step, state.epoch, state.examples_done = state.step + 1, next_epoch, next_done
            step_terms, grad_norm = train_step(
                parts.ddp_model,
                parts.task,
                micro_batches,
                n_targets=n_targets,
                amp_dtype=parts.amp_dtype,
                attention_backends=parts.attention_backends,
                scaler=parts.scaler,
                optimizer=parts.optimizer,
                max_grad_norm=cfg.training.max_grad_norm,
                world_size=world,
                no_sync=parts.ddp_model.no_sync if di.is_distributed else nullcontext,
            )

            # --- The step's one host sync ------------------------------------------------
            # Whether the gradient is finite, whether any rank was signalled, the token counts and this
            # rank's FLOPs without padding. The norm is global (after DDP's all-reduce): ranks agree.
            targets, useful = parts.task.target_tokens(n_targets), parts.meter.useful_flops(micro_batches)
            finite, scheduler_stops, person_stops, tokens, target_tokens, useful_flops = torch.stack(
                [torch.isfinite(grad_norm).long(), *stop_flags, tokens_read, targets, useful]
            ).tolist()
            stop_requested = stop_code(scheduler_stops, person_stops)

            # --- Non-finite steps: skipped, counted, and the run stops if they persist ----
            # With fp16 the GradScaler skips the update itself and lowers its scale.
            lr = parts.scheduler.get_last_lr()[0]
            if finite or parts.scaler.is_enabled():
                parts.scaler.step(parts.optimizer)
            parts.scaler.update()
            parts.scheduler.step()  # the schedule follows the step count, skipped steps included
            parts.optimizer.zero_grad(set_to_none=True)
            parts.profiler.step()
            parts.logger.step_done()
            skipped += not finite
            bad_in_a_row = 0 if finite else bad_in_a_row + 1
            if bad_in_a_row >= cfg.training.max_nonfinite_steps:
                exit_code = Diverged.exit_code
                break
            parts.meter.add(
                micro_batches, data_wait, useful_flops, samples=global_batch, tokens=tokens, target_tokens=target_tokens
            )

            # --- Periodic evaluation: every rank answers its share of the held-out split --------
            # Taken after the window's rates, so it never counts as training time; a signal skips it.
            run_ends = state.step == steps or state.step == cfg.invocation.stop_at_step
            every = cfg.output.eval_every
            eval_scheduled = every > 0 and (state.step % every == 0 or state.step == steps)
            eval_due = eval_scheduled and not stop_requested

            # --- Logging: the loss of the whole global batch, not the last micro-batch ----
            if state.step == 1 or state.step % cfg.output.log_every == 0 or state.step == steps or eval_due:
                record = {
                    "step": state.step,
                    "time": time.time(),
                    "epoch": state.epoch,
                    **parts.task.record(all_reduce(step_terms)),
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    "skipped_steps": skipped,
                    **parts.meter.read(),
                }
                if eval_due:
                    scores = parts.recipe.evaluate(parts.model)
                    if scores is None:  # a signal during it: the evaluation is dropped, the step saved
                        stop_requested = stop.on_any_rank(device)
                    record |= scores or {}
                parts.logger.log(record)
                parts.meter.next_window(after_pause=eval_due)

            if run_ends:
                if stop_requested and eval_scheduled:
                    di.warn(
                        f"note: a signal ({stop.signal_name or 'on another rank'}) dropped step {state.step}'s "
                        f"evaluation; the run is done: {parts.recipe.next_step(Path(cfg.output.out_dir))}"
                    )
                break
            # --- A signal: the step is done; save it and leave ---------------------------
            if stop_requested:
                exit_code = stopped(stop_requested, stop, state.step, di.is_main)
                break
            if cfg.output.checkpoint_every and state.step % cfg.output.checkpoint_every == 0:
                parts.checkpointer.save(state)

    # Every way out of the loop (done, --stop-at-step, preempted, diverged) saves the same way.
    out_dir = Path(cfg.output.out_dir)
    path = parts.checkpointer.save(state) if state.step != parts.on_disk else checkpoint_dir(out_dir, state.step)
    parts.snapshots.finish()
    parts.logger.close()
    if exit_code == Diverged.exit_code:
        raise diverged(bad_in_a_row, state.step, cfg.numerics.precision)
    if exit_code is not None:
        raise SystemExit(exit_code)
    di.say(closing_line(path, out_dir, parts.recipe.next_step(out_dir) if state.step == steps else CONTINUE))


def train_step(
    model,
    task,
    micro_batches: list[dict],
    *,
    n_targets: torch.Tensor,
    amp_dtype: torch.dtype | None,
    attention_backends: list,
    scaler,
    optimizer,
    max_grad_norm: float,
    world_size: int,
    no_sync,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over one optimizer step's micro-batches, then clipping. Returns the
    loss terms over `n_targets` (the task's counts in the whole global batch) and the pre-clip
    gradient norm; the update is the caller's, once it has read whether the norm is finite. A
    recipe's memory planner traces and measures this same function (handed it as a TrainingStep)."""
    step_terms = torch.zeros_like(n_targets)
    # --- Attention kernels: the card's, around backward too, where activation checkpointing
    # recomputes (a recompute in another kernel saves other tensors: CheckpointError).
    with sdpa_kernel(attention_backends):
        for i, batch in enumerate(micro_batches):
            # --- One gradient all-reduce per optimizer step: no_sync on all but the last ---
            with nullcontext() if i == len(micro_batches) - 1 else no_sync():
                step_terms += micro_step(
                    model, task, batch, n_targets=n_targets, amp_dtype=amp_dtype, scaler=scaler, world_size=world_size
                )

    # --- Gradient clipping: the logged norm is the pre-clip norm ---------------------------
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    return step_terms, grad_norm


def micro_step(
    model, task, batch: dict, *, n_targets: torch.Tensor, amp_dtype: torch.dtype | None, scaler, world_size: int
) -> torch.Tensor:
    """One micro-batch's forward and backward (the body a CUDA graph would capture): its loss
    terms over the global counts, detached."""
    # --- Mixed precision: matmuls in amp_dtype; parameters, gradients and the loss in fp32 --
    with torch.autocast(n_targets.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        sums = task.loss_sums(model, batch)
    # --- Loss terms over their global counts: DDP averages over ranks, hence x world_size ---
    terms = sums / n_targets
    scaler.scale(task.objective(terms) * world_size).backward()
    return terms.detach()


# Helpers ------------------------------------------------------------------------------------------


def adamw(model: nn.Module, config: OptimizerConfig, device_type: str) -> torch.optim.AdamW:
    """Frozen parameters get no optimizer state at all (Adam keeps 8 bytes per parameter). The fused
    kernel (CUDA, and the CPU's since torch 2.4) updates every tensor in one pass instead of a loop
    of several ops per tensor. Weight decay on matrices only, not on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(
        groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps, fused=device_type in ("cuda", "cpu")
    )


def one_cycle_pct_start(pct_start: float, max_steps: int) -> float:
    """OneCycleLR divides by the warm-up's steps less one, 0 for a one-step warm-up (0.1 x 10 steps):
    lengthened by a hair, its first step runs at lr / div_factor, and the peak comes next."""
    return pct_start * (1 + 1e-6) if pct_start * max_steps == 1.0 else pct_start  # OneCycleLR's own product


def init_checkpoint(cfg: LoopConfig) -> Path | None:
    """--init-from's checkpoint (a run stands for its newest); None without it, or when resuming
    (a requeued job keeps its flags, and continues from its own checkpoint)."""
    if not cfg.invocation.init_from or cfg.invocation.resume:
        return None
    return resolve_checkpoint(Path(cfg.invocation.init_from), "--init-from")


def compile_cache(cfg: LoopConfig) -> Path:
    return inductor_cache_dir(cfg.compile.cache, app=Recipe.__name__.lower())


def closing_line(checkpoint: Path, out_dir: Path, next_step: str) -> str:
    return f"saved {checkpoint}; metrics in {out_dir / 'metrics.jsonl'} and {out_dir / 'tb'}; {next_step}"


def stopped(code: int | None, stop: StopFlag, step: int, is_main: bool) -> int | None:
    """`code`, the exit of a run a signal stopped (75 preempted, 130 interrupted; None: none did),
    said as it goes to save `step`."""
    if code is not None and is_main:
        what = (
            "interrupted (Ctrl-C)"
            if code == INTERRUPTED_EXIT_CODE
            else f"preempted ({stop.signal_name or 'signal on another rank'})"
        )
        print(f"{what}: saving step {step}; exiting with code {code}, continue with --resume", flush=True)
    return code


def diverged(in_a_row: int, step: int, precision: str) -> Diverged:
    """The exit of a run whose last `in_a_row` steps were not finite, once it has saved the last good
    weights as `step`. fp16 overflows where bf16 does not: a model trained in bf16 may hold
    activations past fp16's range."""
    hint = ""
    if precision == "fp16":
        hint = "; in fp16, models trained in bf16 can overflow: lower --lr, or try --precision fp32 if memory allows"
    return Diverged(
        f"{in_a_row} non-finite steps in a row (to step {step}); saved the last good weights as "
        f"checkpoint step {step}{hint}"
    )


if __name__ == "__main__":
    main_guard(main)
