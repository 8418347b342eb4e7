"""Train LatentWire: a byte encoder + adapters feeding soft tokens to two frozen LLMs.

    torchrun --nproc_per_node=4 train.py --profile h100     # one node, 4 GPUs
    torchrun --nproc_per_node=2 train.py --profile cpu      # anywhere, 2 gloo processes
    python train.py --profile cpu --max-steps 20            # one process

One loop, top to bottom. Each optimization is a labelled block saying why it is there; the
`latentwire` package holds the model, data, profiles, metrics and checkpoint helpers.
"""
from __future__ import annotations

import os
import random
import shutil
import sys
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import transformers
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing, checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.attention import sdpa_kernel
from torch.nn.parallel import DistributedDataParallel as DDP

from latentwire.compiling import wire_regions
from latentwire.config import RESTORED_SETTINGS, WIRE_SHAPE, OptimizerConfig, load_config, read_meta
from latentwire.data import Collator, DataSources, PromptDataset, TrainingSet, describe_data, same_data
from latentwire.distillation import describe_targets, teacher_targets
from latentwire.eval.evaluation import evaluate_wire
from latentwire.eval.settings import EvalSettings
from latentwire.flops import FlopModel
from latentwire.harness.checkpoint import (Checkpointer, TrainState, check_restored_settings, checkpoint_dir,
                                           list_checkpoints, load_weights, newest_meta, no_checkpoint,
                                           resolve_checkpoint)
from latentwire.harness.compiling import inductor_cache_dir, stable_shapes
from latentwire.harness.config import check_can_create
from latentwire.harness.data import (ShardSampler, examples_visited, global_batches, layout_for_world, make_loader,
                                     to_device)
from latentwire.harness.distributed import (all_reduce_sum, ddp_buffer_options, group_options, leave_together,
                                            torchrun_rank)
from latentwire.harness.errors import INTERRUPTED_EXIT_CODE, Diverged, OutOfMemory, UserError, main_guard
from latentwire.harness.metrics import MetricsLogger, StepMeter
from latentwire.harness.precision import (AMP_DTYPES, cuda_capability, frozen_weight_dtype, matmul_arithmetic,
                                          sdpa_backends, use_tf32)
from latentwire.harness.preemption import StopFlag, stop_code
from latentwire.harness.profiling import MemorySnapshots, NoProfiler, profiler_options
from latentwire.llm import (build_frozen_llms, decoder_layers, describe_prompts, fsdp_units, held_per_rank,
                            is_decoder_layer, read_weights, skip_unused_backward_gathers)
from latentwire.model import WireEncoder, count_parameters
from latentwire.objectives import WireTask, forward_loss_sums
from latentwire.planner.elastic import apply_elastic_batch
from latentwire.planner.step import TrainingStep


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(argv)
    # --- Process group: one rank per process torchrun starts ---------------------------------
    # NCCL on CUDA, gloo on CPU, with an explicit timeout so a dead rank fails the job instead of
    # hanging it (group_options). A world of one (plain `python train.py`, or torchrun with one
    # process) has no group: no DDP, no collectives.
    di = torchrun_rank(cfg.card.device)
    if di.joins_group:
        if di.device.type == "cuda":
            torch.cuda.set_device(di.device)
        dist.init_process_group(**group_options(di.device, cfg.training.dist_timeout_s))
    # Out of memory outside the loop (loading the LLMs, DDP's buckets, the last save) is one line
    # and exit 5 too; the loop's own report below also names the micro-batch and the snapshot.
    with leave_together(), out_of_memory_report(cfg.run.profile):
        train(cfg, di)


def train(cfg, di) -> None:
    started = time.monotonic()
    device, rank, world = di.device, di.rank, di.world_size
    out_dir = Path(cfg.output.out_dir)
    # --- Preemption and Ctrl-C: SIGTERM / SIGUSR1 / SIGINT only set a flag; ranks agree at the
    # end of a step, save it and exit (75 preempted, 130 interrupted). Set first: a signal while
    # the LLMs load (minutes for two 8B models) is heard before the first step, which saves where
    # the run stands, not a killed rank. A second Ctrl-C stops at once.
    stop = StopFlag(announce=di.is_main)
    # --- Inputs first: a bad out_dir or dataset fails before anything heavy loads. Nothing on
    # disk changes until every input (models, batch sizes, a checkpoint to resume) has passed.
    check_out_dir(out_dir, cfg.run)
    # --init-from names where a new run starts; resumed (a requeued job keeps its flags), the run
    # continues from its own checkpoint.
    init = init_checkpoint(cfg) if cfg.run.init_from and not cfg.run.resume else None
    compile_cache = inductor_cache_dir(cfg.compile.cache, app="latentwire")
    if cfg.compile.enabled:
        check_can_create(compile_cache, "compile_cache")
    # What the data is, said up front: the answers the prompt's cut hides from the encoder (they
    # teach the wire to guess), and where the held-out examples come from (a local file holds
    # out a seeded part that training never sees).
    data = cfg.data
    sources = DataSources.of(data, seed=cfg.training.seed)
    training = TrainingSet.load(sources, data.num_examples, data.max_prompt_bytes, data.drop_cut_answers)
    held_out = sources.held_out_source()
    eval_examples = sources.held_out_examples(cfg.evaluation.examples, held_out) if cfg.evaluation.every else []
    if di.is_main:
        print(f"data: {training.summary(data.max_prompt_bytes)}; held out: {sources.describe_held_out(held_out)}",
              flush=True)

    # --- The profile's batch on this world size ------------------------------------------------
    # A profile means a global batch (micro x accum x the GPUs it is laid out for) and an lr tuned
    # for it. On another number of ranks (torchrun --nproc_per_node=4 with a one-GPU profile, plain
    # python with the 2-rank cpu profile) the batch is kept where it splits, else the lr follows the
    # profile's rule (layout_for_world); said either way, and recorded in meta.json. A micro-batch
    # or accumulation given as a flag is taken as given.
    if not {"micro_batch_size", "grad_accum_steps"} & set(cfg.run.given):
        laid_out = cfg.training
        layout = layout_for_world(laid_out.micro_batch_size, laid_out.grad_accum_steps, laid_out.num_gpus, world,
                                  cfg.optimizer.lr, cfg.planning.lr_scaling)
        lr = cfg.optimizer.lr if "lr" in cfg.run.given else layout.lr  # an lr given is the user's
        cfg = replace(cfg, training=replace(laid_out, micro_batch_size=layout.micro_batch_size,
                                            grad_accum_steps=layout.grad_accum_steps),
                      optimizer=replace(cfg.optimizer, lr=lr))
        if di.is_main:
            print(f"batch: {layout.why}" + ("; --lr as given" if lr != layout.lr else ""), flush=True)

    # --- A resume refused before the heavy work, from the checkpoint's meta.json --------------
    if cfg.run.resume:
        check_resume_before_loading(out_dir, cfg, training.identity())

    # --- Elastic batch: the micro-batch from the memory plan ---------------------------------
    # The plan traces this very configuration on the CPU (FakeTensorMode: real shapes, no memory)
    # and returns the largest micro-batch that fits the card. Accumulation makes up the profile's
    # global batch; only when no exact split fills the card well does the global batch change,
    # and the lr with it by the profile's lr_scaling rule.
    if cfg.planning.elastic_batch:
        cfg, why = apply_elastic_batch(cfg, world, TrainingStep(adamw, train_step, prepare_frozen_llms))
        if di.is_main:
            print(why, flush=True)
    steps, micro, accum = cfg.training.max_steps, cfg.training.micro_batch_size, cfg.training.grad_accum_steps

    # --- Seeds -------------------------------------------------------------------------------
    # The same seed on every rank gives identical initial weights (DDP also broadcasts rank 0's);
    # dropout is re-seeded per rank below so ranks do not drop the same units.
    seed = cfg.training.seed
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)

    # --- Numerics: autocast, grad scaler, TF32 -----------------------------------------------
    # bf16 autocast (train_step's torch.autocast) needs no loss scaling: bf16 has fp32's exponent
    # range. fp16 (V100) needs a GradScaler or small gradients underflow; disabled, its calls pass
    # through. fp32 is the reference. TF32 runs fp32 matmuls (those left outside autocast, or all of
    # them with --precision fp32) on tensor cores, ~7x IEEE fp32 on an H100, where the profile asks
    # for it and the card (sm80+) has them. The legacy switch, not the new `fp32_precision = "tf32"`:
    # after that one torch.get_float32_matmul_precision() raises, and max-autotune calls it.
    amp_dtype = AMP_DTYPES[cfg.numerics.precision]
    scaler = torch.amp.GradScaler(device.type, enabled=cfg.numerics.precision == "fp16")
    capability = cuda_capability(device)
    tf32 = use_tf32(cfg.numerics.tf32, capability)
    if tf32:
        torch.set_float32_matmul_precision("high")

    # --- Fused attention kernels -------------------------------------------------------------
    # All attention goes through SDPA. On an sm80+ card in bf16/fp16 only flash (the LLMs' causal
    # attention) and memory-efficient (the encoder's padded attention) are allowed, so a silent
    # fallback to the O(L^2)-memory math kernel becomes an error instead; cuDNN, which torch tries
    # first on an H100, has returned NaN gradients for masked attention. Older cards and fp32 have
    # no fused kernel for the LLMs' grouped-query attention: there math is allowed last, and the
    # run says so.
    # train_step enters torch.nn.attention.sdpa_kernel(attention_backends) around each forward.
    attention_backends, why = sdpa_backends(capability, frozen_weight_dtype(cfg.numerics.precision))
    if why and di.is_main:
        print(f"note: {why}", file=sys.stderr, flush=True)

    # --- Frozen LLMs: built on the meta device, then wrapped, compiled, sharded and read -------
    # Stored in the autocast dtype: no gradients and no optimizer state means no fp32 master copy
    # (bf16 weights take 16 GB instead of 32 GB for an 8B model). On the meta device a model is
    # shapes without memory, so wrapping costs nothing until to_empty allocates what this rank
    # holds. prepare_frozen_llms (below) applies activation checkpointing, compile and FSDP2 in
    # one order, the one the planner, find_batch and evaluation use too.
    shard_frozen = cfg.frozen.sharding == "fsdp" and di.is_distributed
    if cfg.frozen.sharding == "fsdp" and not shard_frozen and di.is_main:
        print("note: --frozen-sharding fsdp in one process: nothing to shard over, the LLMs stay whole",
              file=sys.stderr, flush=True)
    mesh = init_device_mesh(device.type, (world,)) if shard_frozen else None  # NCCL's all-gathers on a GPU
    with torch.device("meta"):
        llms = build_frozen_llms(cfg.frozen, cfg.prompt, frozen_weight_dtype(cfg.numerics.precision))
    if di.is_main:  # what each reader reads around the wire: its chat template, or the bare anchor
        print(f"prompt: {describe_prompts(llms)}", flush=True)
    compile_options = {"mode": cfg.compile.mode, "dynamic": True} if cfg.compile.enabled else None
    t_load = time.perf_counter()
    prepare_frozen_llms(llms, checkpointing=cfg.frozen.activation_checkpointing, compile_options=compile_options,
                        mesh=mesh, device=device)
    if di.is_main:  # minutes for two 8B models: the first lines should not be silence
        print(f"loaded the frozen LLMs in {time.perf_counter() - t_load:.1f} s", flush=True)

    # --- Trainable model: the byte encoder and one adapter per LLM ----------------------------
    model = WireEncoder.for_llms(cfg.wire, llms).to(device)
    # --- Initial weights from a checkpoint (--init-from): a new run extends a trained wire -----
    if init is not None:
        load_weights(init, model, "this run's model")
        if di.is_main:
            print(f"init: the trainable weights of {init}; a new run, with its own optimizer and schedule", flush=True)
    torch.manual_seed(seed + rank)

    # --- torch.compile, one region at a time --------------------------------------------------
    # Fuses each decoder layer's (above), encoder block's and the pooler's elementwise ops and norms
    # into few kernels. Each is compiled on its own, as torchtitan compiles each TransformerBlock:
    # the layers of one LLM share one graph, so compile time does not grow with depth. Every size is
    # symbolic (dynamic=True), so varying prompt and answer widths do not recompile;
    # stable_shapes() adds the dynamo settings that make this hold, patched around each call of
    # the step because dynamo reads them whenever it traces (docs/performance.md).
    # What inductor compiles is cached where the next run, or this one requeued on a fresh machine,
    # finds it (inductor_cache_dir; torch's default is under /tmp): a warm start reads the kernels
    # instead of compiling them.
    forward = forward_loss_sums
    if cfg.compile.enabled:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(compile_cache)
        if di.is_main:
            print(f"compile: mode {cfg.compile.mode}, cache {compile_cache}", flush=True)
        for region in wire_regions(model):
            region.compile(**compile_options)
        forward = stable_shapes()(forward_loss_sums)

    # --- The step's one seam to the model --------------------------------------------------------
    # What the loop asks of LatentWire about a micro-batch (its loss terms' counts and sums, the
    # scalar to backpropagate, its tokens, its logged values) goes through this one object: the
    # step and the loop below name nothing of the model.
    task = WireTask(llms, cfg.objectives, cfg.wire.num_latents, forward)

    # --- DDP over the trainable part only ------------------------------------------------------
    # The frozen LLMs are neither broadcast nor bucketed. The model's only buffers are constants
    # (the LLMs' embedding RMS), equal on every rank, so it need not re-broadcast them before every
    # forward. The gradients live in DDP's all-reduce buckets (gradient_as_bucket_view) instead of
    # being copied into them: one copy and one memcpy less.
    ddp_model = model
    if di.is_distributed:
        ddp_model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                        gradient_as_bucket_view=True, **ddp_buffer_options())

    # --- Data: a disjoint shard per rank -----------------------------------------------------
    # The sampler permutes with (seed + epoch) and deals every world_size-th index to each rank,
    # so the global batch of a step is the same set of examples for any world size; it can start
    # an epoch part-way, which is how a resumed run continues the same sample order.
    dataset = PromptDataset(training.examples)
    sampler = ShardSampler(dataset, num_replicas=world, rank=rank, seed=seed)
    objectives = cfg.objectives
    global_batch = micro * accum * world
    if len(dataset) < global_batch:  # the loader's drop_last would leave no whole step
        raise UserError(f"dataset of {len(dataset)} examples is smaller than one global batch "
                        f"({micro} x {accum} x {world} ranks)")

    # --- Optimizer: AdamW over the trainable parameters only, fused (see adamw) -------------
    optimizer = adamw(model, cfg.optimizer, device.type)

    # --- Schedule: OneCycle, stepped once per optimizer step ---------------------------------
    # Warm up from lr/div_factor to lr over pct_start of the run, then anneal to the final lr.
    # Momentum is not cycled: beta1 stays what the profile says.
    schedule = cfg.schedule
    scheduler = torch.optim.lr_scheduler.OneCycleLR(
        optimizer, max_lr=cfg.optimizer.lr, total_steps=steps, pct_start=one_cycle_pct_start(schedule.pct_start, steps),
        anneal_strategy=schedule.anneal_strategy, div_factor=schedule.div_factor,
        final_div_factor=schedule.final_div_factor, cycle_momentum=False)

    # --- Resume: weights, optimizer, schedule, scaler, RNG and data position ------------------
    # The Checkpointer owns the format: it saves these objects and loads them back into the same
    # ones. Resume takes the newest checkpoint that every rank loads (a partial or corrupt newer
    # one is skipped with a warning). Same layout (world size, micro-batch, accumulation):
    # bitwise the run that never stopped on CPU; on CUDA equal to rounding, as any two CUDA runs
    # are (attention's backward kernels add in a varying order). A data position means something
    # only in the same training set, so a resume on other data is refused unless --new-data starts
    # a fresh epoch.
    state = TrainState(step=0, epoch=0, examples_done=0, layout=(world, micro, accum), data=training.identity())
    checkpointer = Checkpointer(out_dir, rank=rank, keep=cfg.output.keep_checkpoints,
                                meta={"profile": cfg.run.profile, "config": cfg.to_dict(), "wire": asdict(cfg.wire),
                                      "data": training.identity(), "init_from": str(init) if init else None,
                                      "versions": {"transformers": transformers.__version__}},
                                restored=RESTORED_SETTINGS, model=model, optimizer=optimizer, scheduler=scheduler,
                                scaler=scaler)
    if cfg.run.resume:
        state = resume(checkpointer, state, cfg.run, steps, di.is_main)
        if state is None:
            return
    # --- Distillation: the teacher once per example, not once per step ------------------------
    # The KD term's teacher (each LLM reading the prompt's text) gives an example the same targets
    # at every epoch, so they are computed before the first step, for the examples the run's steps
    # draw (the sampler's permutations decide them in advance): a short try pays for its own. The
    # whole run's, from its first step, whether it stops early or resumes late: a teacher batch of
    # other examples pads differently, which moves a target by fp32 rounding, and the run that
    # stopped and resumed must train bitwise as the one that did not; and those from the resumed
    # position, where --new-data or another layout draws others. Each rank computes a 1/world
    # share, all of them gathered to every rank (the sampler deals any example to any rank),
    # eagerly (a one-off pass), in the step's autocast and kernels. The collator adds each batch's
    # rows; a step runs no teacher. Full rows where they fit (exact), else the top kd_top_k and one
    # bucket.
    kd_targets = None
    if objectives.teacher:
        draws = dict(seed=seed, world=world, micro=micro, accum=accum)
        visited = sorted({*examples_visited(len(dataset), **draws, epoch=0, examples_done=0, steps=steps),
                          *examples_visited(len(dataset), **draws, epoch=state.epoch,
                                            examples_done=state.examples_done, steps=steps - state.step)})
        t_teacher = time.perf_counter()
        teacher_rows = Collator.for_llms(llms, data.max_prompt_bytes, data.max_answer_tokens, data.pad_multiple,
                                         teacher=True)
        with torch.compiler.set_stance("force_eager"), sdpa_kernel(attention_backends), \
                torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            kd_targets = teacher_targets(llms, dataset, teacher_rows, visited, k=objectives.k_tokens,
                                         temperature=objectives.kd_temperature, top_k=objectives.kd_top_k,
                                         batch_size=micro, device=device, rank=rank, world=world)
        if di.is_main:
            print(describe_targets(kd_targets, len(dataset), time.perf_counter() - t_teacher), flush=True)
    collate = Collator.for_llms(llms, data.max_prompt_bytes, data.max_answer_tokens, data.pad_multiple,
                                kd_targets=kd_targets, word_patch=cfg.wire.word_patch)
    loader = make_loader(dataset, sampler, collate, micro_batch_size=micro, num_workers=data.num_workers,
                         prefetch_factor=data.prefetch_factor, device_type=device.type, seed=seed + rank)
    batches = global_batches(loader, sampler, accum, state.epoch, state.examples_done, global_batch)

    # Every input has been checked: only now may --overwrite delete the old run.
    if di.is_main:
        prepare_out_dir(out_dir, cfg.run)

    # --- Memory snapshot: allocation history on request, and always one on out-of-memory -----
    # The caching allocator records the stack of every allocation; the snapshot, written at the
    # end (and on out-of-memory, with or without history), opens at pytorch.org/memory_viz.
    snapshots = MemorySnapshots(cfg.profiler.memory_snapshot, device, out_dir, rank)
    snapshots.start()

    # --- Metrics: throughput, MFU and memory per log window; jsonl and TensorBoard -------------
    # MFU against the peak of the arithmetic the matmuls really run in: `mfu` of what the step runs,
    # padding included; `mfu_useful` of the real positions alone.
    flops = FlopModel.of(model, {n: llm.model for n, llm in llms.items()}, cfg.wire)
    meter = StepMeter(device, flops.step_flops, useful_flops=flops.useful_flops,
                      peak_tflops=getattr(cfg.card, "peak_tflops_" + matmul_arithmetic(cfg.numerics.precision, tf32)))
    logger = MetricsLogger(out_dir, enabled=di.is_main, first_step=state.step + 1, total_steps=steps,
                           first_record=training.facts(), started=started)
    eval_settings = EvalSettings.of(cfg, text_baselines=False, lockstep=shard_frozen,
                                    stop=lambda: stop.on_any_rank(device))
    if di.is_main:
        print(run_summary(cfg.run.profile, device, cfg.numerics.precision, state.layout, model, llms), flush=True)

    # --- A signal before the first step: save and leave -------------------------------------
    # One collective after loading: a signal during it would otherwise wait for the first step,
    # whose compile takes minutes. A resumed run has its step on disk already.
    on_disk = state.step if cfg.run.resume else None
    code = stop.on_any_rank(device)
    exit_after_save = stopped(code, stop, state.step, di.is_main) if code else None

    # --- Profiler: torch.profiler on the profile's wait / warmup / active schedule ---------------
    # A few steps, not the run: a trace of every kernel is large and slows the steps it records, and
    # the first steps (compile, allocator warm-up) are not the steady state, hence wait and warmup.
    # One trace per rank under out_dir/traces (TensorBoard's profiler plugin and Perfetto read it).
    profiler = (torch.profiler.profile(**profiler_options(cfg.profiler, out_dir, rank, device))
                if cfg.profiler.enabled else NoProfiler())

    # --- The loop ----------------------------------------------------------------------------
    model.train()
    skipped, bad_in_a_row = 0, 0
    with profiler, out_of_memory_report(cfg.run.profile, micro, snapshots):
        # Preempted or diverged: leave the loop, save, then exit with exit_after_save's code.
        while exit_after_save is None and state.step < steps:
            t_wait = time.perf_counter()
            next_epoch, next_done, micro_batches = next(batches)
            data_wait = time.perf_counter() - t_wait
            micro_batches = [to_device(b, device) for b in micro_batches]

            # --- Exact gradient accumulation ---------------------------------------------
            # Each loss term is its sum over a micro-batch divided by its count in the whole global
            # batch (all micro-batches, all ranks: the task's counts, here answer tokens, first
            # tokens, first-k positions per LLM), so the step equals one big batch however it is
            # split. The counts are made and summed on the device: no host sync. The tokens read and
            # the stop flags (a scheduler's signal, a Ctrl-C) ride along in the same all-reduce: no
            # extra collective, and every rank learns of a signal any rank received.
            counts = torch.stack([task.counts(b) for b in micro_batches]).sum(0)
            tokens_read = sum(task.tokens(b) for b in micro_batches)
            reduced = all_reduce_sum(torch.cat([counts.flatten(), tokens_read[None], stop.flags(device)]))
            n_targets = reduced[:-3].view_as(counts).float()
            state.step, state.epoch, state.examples_done = state.step + 1, next_epoch, next_done
            step_terms, grad_norm = train_step(
                ddp_model, task, micro_batches, n_targets=n_targets, amp_dtype=amp_dtype,
                attention_backends=attention_backends, scaler=scaler, optimizer=optimizer,
                max_grad_norm=cfg.training.max_grad_norm, world_size=world,
                no_sync=ddp_model.no_sync if di.is_distributed else nullcontext)

            # --- The step's one host sync ------------------------------------------------
            # Read together: whether the gradient is finite, whether any rank was signalled, the
            # global token counts and this rank's FLOPs without padding, for the throughput. The
            # norm is global (after DDP's all-reduce), so every rank decides alike; a NaN loss on
            # any rank makes it NaN.
            finite, scheduler_stops, person_stops, tokens, target_tokens, useful_flops = torch.stack(
                [torch.isfinite(grad_norm).long(), *reduced[-2:], reduced[-3], task.target_tokens(n_targets),
                 meter.useful_flops(micro_batches)]).tolist()
            stop_requested = stop_code(scheduler_stops, person_stops)

            # --- Non-finite steps are skipped, counted, and stop the run if they persist --
            # With fp16 the GradScaler skips the update itself and lowers its scale.
            lr = scheduler.get_last_lr()[0]
            if finite or scaler.is_enabled():
                scaler.step(optimizer)
            scaler.update()
            scheduler.step()  # the schedule follows the step count, skipped steps included
            optimizer.zero_grad(set_to_none=True)
            profiler.step()
            logger.step_done()
            skipped += not finite
            bad_in_a_row = 0 if finite else bad_in_a_row + 1
            if bad_in_a_row >= cfg.training.max_nonfinite_steps:
                exit_after_save = Diverged(f"{bad_in_a_row} non-finite steps in a row (to step {state.step}); saved "
                                           f"the last good weights as checkpoint step {state.step}"
                                           f"{nonfinite_hint(cfg.numerics.precision)}")
                break

            meter.add(micro_batches, useful_flops=useful_flops, data_wait=data_wait, samples=global_batch,
                      tokens=tokens, target_tokens=target_tokens)

            # --- Periodic evaluation on the held-out split ---------------------------------
            # Every rank answers its share of the split and the results are gathered, so all ranks
            # hold the same numbers, equal to `python -m latentwire.evaluate` on this step's
            # weights. It joins the step's log record after the window's rates are taken, and the
            # next window starts after it, so evaluation never counts as training time. A step
            # that is preempted skips it: the grace before SIGKILL is for saving.
            run_ends = state.step == steps or state.step == cfg.run.stop_at_step
            eval_every = cfg.evaluation.every
            eval_scheduled = eval_every > 0 and (state.step % eval_every == 0 or state.step == steps)
            eval_due = eval_scheduled and not stop_requested

            # --- Logging: the loss of the whole global batch, not the last micro-batch ---
            if state.step == 1 or state.step % cfg.output.log_every == 0 or state.step == steps or eval_due:
                record = {"step": state.step, "time": time.time(), "epoch": state.epoch,
                          **task.record(all_reduce_sum(step_terms)),
                          "lr": lr, "grad_norm": grad_norm.item(), "skipped_steps": skipped, **meter.read()}
                if eval_due:
                    # Evaluation's eval-mode, padded, KV-cached calls would recompile every region.
                    with torch.compiler.set_stance("force_eager"):
                        scores = evaluate_wire(model, llms, eval_examples, eval_settings, device, rank, world)
                    # A signal during it (minutes with 8B readers) is heard between its chunks
                    # (eval_settings.stop): the unfinished evaluation is dropped and the step saved.
                    if scores is None:
                        stop_requested = stop.on_any_rank(device)
                    record |= scores or {}
                logger.log(record)
                meter.next_window(after_pause=eval_due)

            if run_ends:
                if stop_requested and eval_scheduled and di.is_main:
                    print(f"note: a signal ({stop.signal_name or 'on another rank'}) dropped step {state.step}'s "
                          f"evaluation; the run is done: python -m latentwire.evaluate --ckpt {out_dir}",
                          file=sys.stderr, flush=True)
                break
            # --- Preemption: the step is done; save it and leave ------------------------
            if stop_requested:
                exit_after_save = stopped(stop_requested, stop, state.step, di.is_main)
                break
            if cfg.output.checkpoint_every and state.step % cfg.output.checkpoint_every == 0:
                checkpointer.save(state)

    # Every way out of the loop (done, --stop-at-step, preempted, diverged) saves the same way.
    batches.close()  # the loader's workers stop here: nothing more to load
    path = checkpointer.save(state) if state.step != on_disk else checkpoint_dir(out_dir, state.step)
    snapshots.finish()
    logger.close()
    if exit_after_save is not None:
        raise exit_after_save
    if di.is_main:
        print(closing_line(path, out_dir, finished=state.step == steps,
                           sharded_over=world if shard_frozen else 0), flush=True)


# --- Helpers the loop calls --------------------------------------------------------------------

def adamw(model: torch.nn.Module, config: OptimizerConfig, device_type: str) -> torch.optim.AdamW:
    """Frozen parameters get no optimizer state at all (Adam keeps 8 bytes per parameter). The fused
    kernel (CUDA, and the CPU's since torch 2.4) updates every tensor in one pass instead of a loop
    of several ops per tensor: 1.2 against 5.4 ms a step for the two-layer cpu profile's 104
    tensors of 0.38M parameters. Weight decay on matrices only, not on biases and norm gains."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": config.weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=config.lr, betas=(config.beta1, config.beta2), eps=config.eps,
                             fused=device_type in ("cuda", "cpu"))


def prepare_frozen_llms(llms: dict, *, checkpointing: bool, compile_options: dict | None, mesh, device) -> None:
    """The frozen LLMs' wrappers, in one place and one order (torchtitan's), for everything that
    builds them: training, the memory plan, find_batch, evaluation and the compile bench, so what is
    planned and measured is what trains. Each LLM, built on the meta device (the planner's under
    FakeTensorMode), is wrapped for activation checkpointing if `checkpointing`, its decoder layers
    compiled with `compile_options` (torch.compile's arguments; None: eager), sharded over `mesh`
    (None: whole), and allocated on `device` and read (None: left as built, the planner's fakes)."""
    for llm in llms.values():
        # --- Activation checkpointing: gradients flow through the frozen layers to the wire, so
        # their activations would be kept for backward; each decoder layer is recomputed instead
        # (one more forward). Non-reentrant: takes frozen weights, keyword arguments and compile.
        # Wrapped before compile, so the recompute is planned inside the layer's graph.
        if checkpointing:
            apply_activation_checkpointing(llm.model, checkpoint_wrapper_fn=checkpoint_wrapper,
                                           check_fn=is_decoder_layer(llm))
        # --- torch.compile, one decoder layer at a time (see the trainable model's compile block)
        if compile_options is not None:
            for layer in decoder_layers(llm):
                layer.compile(**compile_options)
        # --- FSDP2 (--frozen-sharding fsdp): replicated, every rank holds both LLMs whole (31 GB
        # for 8B + 7B in bf16, 287 GB for 70B + 72B); sharded, 1/world of every weight, a decoder
        # layer all-gathered only while it runs, for its forward and again for its backward. No
        # gradients, so no reduce-scatter. compile and fully_shard commute: module.compile()
        # compiles the module's call, whose hooks are looked up as it runs, and FSDP2's hooks run
        # outside dynamo.
        if mesh is not None:
            for unit in fsdp_units(llm):  # each decoder layer, the embedding table, the norm with the head
                fully_shard(unit, mesh=mesh)
            fully_shard(llm.model, mesh=mesh)  # the root, which then holds nothing
            skip_unused_backward_gathers(llm)
        # --- to_empty, then each tensor, or this rank's rows of it, read from the checkpoint's
        # memory map.
        if device is not None:
            llm.model.to_empty(device=device)
            read_weights(llm)


def train_step(model, task, micro_batches: list[dict], *, n_targets: torch.Tensor, amp_dtype: torch.dtype | None,
               attention_backends: list, scaler, optimizer, max_grad_norm: float, world_size: int,
               no_sync) -> tuple[torch.Tensor, torch.Tensor]:
    """Forward and backward over one optimizer step's micro-batches, then clipping. Returns the
    loss terms over `n_targets` (the task's counts in the whole global batch) and the pre-clip
    gradient norm; the update is the caller's, once it has read whether the norm is finite. The
    memory plan and find_batch trace and measure this same function."""
    step_terms = torch.zeros_like(n_targets)
    # --- Attention in the SDPA kernels the card allows (see the fused attention block) -------
    # Around backward too: activation checkpointing recomputes each frozen layer there, and a
    # recompute in another kernel saves other tensors (CheckpointError; on an H100 cuDNN, torch's
    # first choice, in place of the forward's flash) or brings back the kernel kept out.
    with sdpa_kernel(attention_backends):
        for i, batch in enumerate(micro_batches):
            # --- One gradient all-reduce per optimizer step: no_sync on all but the last -----
            with nullcontext() if i == len(micro_batches) - 1 else no_sync():
                step_terms += micro_step(model, task, batch, n_targets=n_targets, amp_dtype=amp_dtype, scaler=scaler,
                                         world_size=world_size)

    # --- Gradient clipping (the logged norm is the pre-clip norm) ----------------------------
    scaler.unscale_(optimizer)
    grad_norm = torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    return step_terms, grad_norm


def micro_step(model, task, batch: dict, *, n_targets: torch.Tensor, amp_dtype: torch.dtype | None, scaler,
               world_size: int) -> torch.Tensor:
    """One micro-batch's forward and backward (the body a CUDA graph would capture): its loss
    terms over the global counts, detached."""
    # --- Mixed precision: matmuls in amp_dtype; parameters, gradients and the loss in fp32
    # (checkpointing's recompute restores the forward's autocast itself) ---------------------
    with torch.autocast(n_targets.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        sums = task.loss_sums(model, batch)
    # --- Objectives: each term over its count in the whole global batch (see the counts) ----
    # DDP averages gradients over ranks, hence the factor world_size.
    terms = sums / n_targets
    scaler.scale(task.objective(terms) * world_size).backward()
    return terms.detach()


def check_out_dir(out_dir: Path, run) -> None:
    """Refuse to mix two runs in one directory unless asked to resume or overwrite, and refuse a
    directory that cannot be created, before anything is written."""
    check_can_create(out_dir, "out_dir")  # first: the look inside needs a directory this user may search
    holds_run = (out_dir / "metrics.jsonl").exists() or bool(list_checkpoints(out_dir))
    if holds_run and not (run.resume or run.overwrite):
        raise UserError(f"{out_dir} already holds a run; pass --resume to continue it or --overwrite to replace it")


def prepare_out_dir(out_dir: Path, run) -> None:
    if run.overwrite:
        for name in ("metrics.jsonl", "tb", "checkpoints", "traces"):
            path = out_dir / name
            shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"cannot create out_dir {out_dir}: {e.strerror}") from None


def one_cycle_pct_start(pct_start: float, max_steps: int) -> float:
    """OneCycleLR divides by the warm-up's length in steps less one, which is 0 for a warm-up of
    exactly one step (pct_start 0.1 with --max-steps 10): lengthened by a hair, the first step
    runs at lr / div_factor as every warm-up's first step does, and the peak comes next."""
    return pct_start * (1 + 1e-6) if pct_start * max_steps == 1.0 else pct_start  # OneCycleLR's own product


def run_summary(profile: str, device: torch.device, precision: str, layout: tuple[int, int, int],
                model: torch.nn.Module, llms: dict) -> str:
    world, micro, accum = layout
    frozen = sum(count_parameters(llm.model, False) for llm in llms.values())
    return (f"profile {profile}: {world} x {device.type}, {precision}, global batch {micro} x {accum} x {world} = "
            f"{micro * accum * world}, trainable {count_parameters(model, True) / 1e6:.2f}M, frozen {frozen / 1e6:.1f}M "
            f"({held_per_rank(llms)})")


def closing_line(checkpoint: Path, out_dir: Path, finished: bool, sharded_over: int) -> str:
    """Where the run left its checkpoint, and what to run next: a run that sharded its LLMs over N
    ranks is evaluated on N ranks, which shard them the same way."""
    launch = f"torchrun --nproc_per_node={sharded_over} -m" if sharded_over else "python -m"
    nxt = (f"evaluate it: {launch} latentwire.evaluate --ckpt {out_dir}" if finished
           else "continue: the same command with --resume")
    return f"saved {checkpoint}; metrics in {out_dir / 'metrics.jsonl'} and {out_dir / 'tb'}; {nxt}"


def init_checkpoint(cfg) -> Path:
    """--init-from's checkpoint (a run stands for its newest), refused in one line where its
    trainable weights do not fit this run (another shape) or were trained for other readers."""
    path = resolve_checkpoint(Path(cfg.run.init_from), "--init-from")
    saved = read_meta(path)[0].to_dict()
    ours = cfg.to_dict()
    different = [f"{name} {saved[name]} (this run: {ours[name]})" for name in (*WIRE_SHAPE, "llama", "qwen")
                 if saved[name] != ours[name]]
    if different:
        raise UserError(f"--init-from {path}: its weights were trained with {', '.join(different)}; give this run "
                        "the same shape and readers")
    return path


def check_resume_before_loading(out_dir: Path, cfg, fresh_data: dict) -> None:
    """What the newest checkpoint's meta.json says of a resume, before anything heavy loads (two
    LLMs take minutes, the teacher's targets more): no checkpoint, a changed setting the state
    carries, other training data (where meta.json records it), --stop-at-step not after it.
    `resume` checks the loaded checkpoint again, the one every rank reads (a newer one that does
    not load is skipped there, so whether the run has finished is said there too)."""
    if not list_checkpoints(out_dir):
        raise no_checkpoint(out_dir)
    found = newest_meta(out_dir)
    if found is None:  # none reads: resume says why, once it has tried each
        return
    path, meta = found
    check_restored_settings(cfg.to_dict(), meta.get("config", {}), RESTORED_SETTINGS,
                            new_run=f"start a new run from its weights: --init-from {out_dir} with another --out-dir")
    if "data" in meta:  # checkpoints from before meta.json recorded it: resume compares train_state's
        refuse_resume(cfg.run, path, meta["step"], meta["data"], fresh_data)


def refuse_resume(run, path: Path, saved_step: int, saved_data: dict | None, fresh_data: dict) -> None:
    """A resume refused in one line: --stop-at-step not after the saved step, or other training
    data than the checkpoint's (None: a checkpoint from before they recorded it) without
    --new-data."""
    if run.stop_at_step is not None and run.stop_at_step <= saved_step:
        raise UserError(f"--stop-at-step {run.stop_at_step} is not after the resumed step {saved_step}")
    if saved_data is not None and not same_data(saved_data, fresh_data) and not run.new_data:
        raise UserError(f"--resume on other training data: {path.name} trained on {describe_data(saved_data)}, this "
                        f"run loads {describe_data(fresh_data)}; resume with the same data, or add --new-data to "
                        "train on this data from a fresh epoch with the resumed weights and optimizer")
    if saved_data is None and fresh_data["held_out_fraction"] and not run.new_data:
        raise UserError(f"{path.name} was written before checkpoints recorded their data, when a run trained on all "
                        f"of {fresh_data['dataset']}; this one holds out {fresh_data['held_out_fraction']:.0%} of it: "
                        "add --new-data to go on with the rest from a fresh epoch, or name held-out examples with "
                        "--eval-dataset to train on all of it as before")


def resume(checkpointer: Checkpointer, fresh: TrainState, run, max_steps: int, is_main: bool) -> TrainState | None:
    """The saved state, continued with this run's layout and data (`fresh`'s); None when the run
    has already finished."""
    saved, path = checkpointer.resume(warn=lambda message: is_main and print(message, file=sys.stderr))
    refuse_resume(run, path, saved.step, saved.data, fresh.data)
    unknown = saved.data is None  # a checkpoint from before they recorded their data
    changed = not unknown and not same_data(saved.data, fresh.data)
    if saved.step >= max_steps:
        if is_main:
            print(f"{path} is the run's last step ({max_steps}): nothing to do, nothing changed")
        return None
    fresh_epoch = run.new_data and (changed or unknown)  # the same data (a requeued job's flags): its position holds
    if fresh_epoch:
        saved = replace(saved, epoch=saved.epoch + 1, examples_done=0)
    if is_main:
        print(f"resumed from {path} (step {saved.step}, epoch {saved.epoch}, {saved.examples_done} examples into it)"
              + (f"; --new-data: a fresh epoch of {describe_data(fresh.data)}" if fresh_epoch else ""))
        if unknown:
            print(f"note: {path.name} does not record its training data (written before it did), so it is not "
                  "compared with this run's", file=sys.stderr)
        if saved.layout != fresh.layout:
            print(f"note: layout (world, micro-batch, accumulation) is {fresh.layout}, the checkpoint's was "
                  f"{saved.layout}: the sample order is kept, but the run is bitwise identical to an "
                  "unbroken one only for the same layout", file=sys.stderr)
    return replace(saved, layout=fresh.layout, data=fresh.data)


@contextmanager
def out_of_memory_report(profile: str, micro_batch_size: int | None = None, snapshots: MemorySnapshots | None = None):
    """Out-of-memory ends the run with one line pointing to the planner: in the loop (a
    `micro_batch_size` given) also to the memory snapshot; outside it with torch's own words."""
    plan = f"python -m latentwire.plan --profile {profile}"
    try:
        yield
    except torch.OutOfMemoryError as e:
        if snapshots is None:
            torch_says = (str(e).strip().splitlines() or ["torch.OutOfMemoryError"])[0]
            raise OutOfMemory(f"out of memory outside the training steps ({torch_says}); {plan} says what a rank "
                              "holds (--frozen-sharding fsdp holds 1/world of the frozen LLMs)") from None
        path = snapshots.dump()
        where = f"memory snapshot: {path}" if path else "no memory snapshot on this device"
        raise OutOfMemory(f"out of memory at micro-batch {micro_batch_size} ({where}); lower "
                          f"--micro-batch-size or see {plan}") from None


def stopped(code: int, stop: StopFlag, step: int, is_main: bool) -> SystemExit:
    """What a run a signal stopped exits with (`code`: 75 preempted, 130 interrupted), once it has
    saved `step`."""
    if is_main:
        what = ("interrupted (Ctrl-C)" if code == INTERRUPTED_EXIT_CODE
                else f"preempted ({stop.signal_name or 'signal on another rank'})")
        print(f"{what}: saving step {step}; exiting with code {code}, continue with --resume", flush=True)
    return SystemExit(code)


def nonfinite_hint(precision: str) -> str:
    """fp16 overflows where bf16 does not: an LLM trained in bf16 (Qwen2.5 is a known case) may
    produce inf activations under fp16 autocast on a V100."""
    if precision != "fp16":
        return ""
    return ("; in fp16, LLMs trained in bf16 (Qwen2.5 among them) can overflow: lower --lr, or try "
            "--precision fp32 if memory allows")


if __name__ == "__main__":
    main_guard(main)
