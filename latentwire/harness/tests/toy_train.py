"""The smallest loop built from the harness, for the template recipe (harness.template: a
per-position regression whose loss is normalised by its real positions, as a language model's is by
its tokens). It trains the way the project's train.py does, so the harness's guarantees are tested
on their own: each step's gradient and loss the whole global batch's over micro-batches and ranks
(--optimizer adamw --save-gradients true), SGD's weights with them, one host sync per step, bitwise
resume, a preemption signal saved with exit 75.

    python toy_train.py --profile toy --out-dir /tmp/toy [--resume] [--stop-at-step N] [--FIELD VALUE ...]
    torchrun --nproc_per_node=2 toy_train.py --profile toy --out-dir /tmp/toy
"""

from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the folder that holds harness/
from safetensors.torch import save_file  # noqa: E402

from harness.checkpoint import Checkpointer, TrainState  # noqa: E402
from harness.config import setting  # noqa: E402
from harness.data import ShardSampler, global_batches, make_loader, to_device  # noqa: E402
from harness.distributed import all_reduce, all_reduce_together, group_options, leave_together, torchrun_rank  # noqa: E402
from harness.exits import main_guard  # noqa: E402
from harness.loop_config import load_config  # noqa: E402
from harness.meters import StepMeter  # noqa: E402
from harness.metrics import MetricsLogger  # noqa: E402
from harness.preemption import StopFlag, stop_code  # noqa: E402
from harness.resume import resume  # noqa: E402
from harness.template import Regression, RegressionConfig  # noqa: E402

PROFILES = Path(__file__).with_name("toy_profiles.json")


@dataclass(frozen=True)
class ToyLoop:
    """What the tests vary of the toy loop itself."""

    optimizer: Literal["sgd", "adamw"] = setting("sgd", "SGD at the loop's lr, or AdamW at all its settings")
    save_gradients: bool = setting(False, "write each step's weights and gradient (before clipping) to gradients/")


@dataclass(frozen=True)
class ToyConfig(RegressionConfig):
    toy: ToyLoop


def main(argv: list[str] | None = None) -> None:
    cfg = load_config(ToyConfig, argv, PROFILES, prog="toy_train.py")
    di = torchrun_rank("cpu")
    if di.joins_group:
        dist.init_process_group(**group_options(di.device, timeout_s=60))
    with leave_together():
        train(cfg, di)


def train(cfg, di) -> None:
    stop = StopFlag(announce=di.is_main)
    out, world, rank, seed = Path(cfg.output.out_dir), di.world_size, di.rank, cfg.training.seed
    micro, accum, steps = cfg.training.micro_batch_size, cfg.training.grad_accum_steps, cfg.training.max_steps
    global_batch = micro * accum * world
    torch.manual_seed(seed)
    recipe = Regression(cfg, di, stop=lambda: 0)
    model, task = recipe.build_model(compile_options=None, checkpointing=None)
    ddp_model = DDP(model) if di.is_distributed else model
    sampler = ShardSampler(recipe.draws(seed), num_replicas=world, rank=rank)
    loader = make_loader(
        recipe.dataset, sampler, recipe.collator([]), micro, cfg.loader, di.device.type, seed=seed + rank
    )
    optimizer = make_optimizer(model, cfg.toy.optimizer, cfg.optimizer)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=steps)
    scaler = torch.amp.GradScaler(di.device.type, enabled=False)
    state = TrainState(0, 0, 0, layout=(world, micro, accum), data=recipe.data_identity)
    checkpointer = Checkpointer(
        out,
        rank=rank,
        keep=2,
        meta={"config": cfg.to_dict(), "data": recipe.data_identity},
        model=model,
        optimizer=optimizer,
        scheduler=scheduler,
        scaler=scaler,
    )
    if cfg.invocation.resume:
        state = resume(checkpointer, state, cfg.to_dict(), cfg.schema(), steps)
    batches = global_batches(loader, sampler, accum, state.epoch, state.examples_done, global_batch)
    out.mkdir(parents=True, exist_ok=True)
    meter = StepMeter(di.device, recipe.flops, peak_tflops=None)
    logger = MetricsLogger(out, enabled=di.is_main, first_step=state.step + 1)
    exit_code = None
    while state.step < steps:
        epoch, done, micro_batches = next(batches)
        micro_batches = [to_device(b, di.device) for b in micro_batches]
        # The global batch's counts and the stop flags in one all-reduce; every term over its count.
        counts = torch.stack([task.counts(b) for b in micro_batches]).sum(0)
        n_targets, stop_flags = all_reduce_together(counts, stop.flags(di.device))
        n_targets = n_targets.float()
        state.step, state.epoch, state.examples_done = state.step + 1, epoch, done
        step_terms = torch.zeros_like(n_targets)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with nullcontext() if last or not di.is_distributed else ddp_model.no_sync():
                terms = task.loss_sums(ddp_model, batch) / n_targets
                (task.objective(terms) * world).backward()  # DDP averages over ranks
            step_terms += terms.detach()
        if cfg.toy.save_gradients and di.is_main:
            save_weights_and_gradients(model, out / "gradients" / f"step_{state.step:08d}.safetensors")
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # The step's one host sync.
        finite, scheduler_stops, person_stops, tokens = torch.stack(
            [torch.isfinite(grad_norm).long(), *stop_flags, task.target_tokens(n_targets)]
        ).tolist()
        lr = scheduler.get_last_lr()[0]
        if finite:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        meter.add(micro_batches, samples=global_batch, tokens=tokens, data_wait=0.0)
        if state.step % cfg.output.log_every == 0 or state.step == steps:
            logger.log(
                {
                    "step": state.step,
                    **task.record(all_reduce(step_terms)),
                    "lr": lr,
                    "grad_norm": grad_norm.item(),
                    **meter.read(),
                }
            )
            meter.next_window(after_pause=False)
        exit_code = stop_code(scheduler_stops, person_stops)
        if exit_code is not None:  # 75 preempted, 130 interrupted: saved below
            break
        if state.step == cfg.invocation.stop_at_step:
            break
        if cfg.output.checkpoint_every and state.step % cfg.output.checkpoint_every == 0 and state.step < steps:
            checkpointer.save(state)
    checkpointer.save(state)
    logger.close()
    if exit_code is not None:
        raise SystemExit(exit_code)


def make_optimizer(model: torch.nn.Module, kind: str, config) -> torch.optim.Optimizer:
    """SGD, whose step is the gradient's: splits of a batch that agree on the gradient to rounding
    train the same weights to rounding. AdamW divides each gradient by its own RMS (plus eps), which
    turns the rounding of a gradient that is zero in exact arithmetic into a full step: the
    gradients agree, the weights need not."""
    if kind == "sgd":
        return torch.optim.SGD(model.parameters(), lr=config.lr)
    betas = (config.beta1, config.beta2)
    return torch.optim.AdamW(model.parameters(), config.lr, betas, config.eps, config.weight_decay)


def save_weights_and_gradients(model: torch.nn.Module, path: Path) -> None:
    """The weights a step starts from and its gradient, summed over the ranks, before clipping."""
    path.parent.mkdir(parents=True, exist_ok=True)
    named = dict(model.named_parameters())
    tensors = {f"weight.{n}": p.detach() for n, p in named.items()} | {f"grad.{n}": p.grad for n, p in named.items()}
    save_file({k: t.contiguous() for k, t in tensors.items()}, str(path))


if __name__ == "__main__":
    main_guard(main)
