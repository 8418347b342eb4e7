"""The smallest loop built from the harness, for a model that is not the one the harness was written
for: a per-position regression over rows of varying length, whose loss is normalised by its real
positions, as a language model's is by its tokens. It trains the way the project's train.py
does, so the harness's guarantees are tested on their own: exact accumulation over micro-batches
and ranks, one host sync per step, bitwise resume, a preemption signal saved with exit 75.

    python toy_train.py --profile toy --out-dir /tmp/toy [--resume] [--stop-at-step N] [--FIELD VALUE ...]
    torchrun --nproc_per_node=2 toy_train.py --profile toy --out-dir /tmp/toy
"""
from __future__ import annotations

import sys
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the folder that holds harness/
from harness.checkpoint import Checkpointer, TrainState  # noqa: E402
from harness.config import Field, Parser, Schema, read_profiles, sections_of  # noqa: E402
from harness.data import ShardSampler, global_batches, make_loader, to_device  # noqa: E402
from harness.distributed import all_reduce_sum, group_options, leave_together, torchrun_rank  # noqa: E402
from harness.errors import main_guard  # noqa: E402
from harness.metrics import MetricsLogger, StepMeter  # noqa: E402
from harness.preemption import StopFlag, stop_code  # noqa: E402
from harness.resume import resume  # noqa: E402

PROFILES = Path(__file__).with_name("toy_profiles.json")
SCHEMA = Schema({
    "description": Field(str, "what this profile is for"),
    "micro_batch_size": Field(int, "rows per rank per forward pass", positive=True),
    "grad_accum_steps": Field(int, "micro-batches per optimizer step", positive=True),
    "max_steps": Field(int, "optimizer steps", positive=True),
    "lr": Field(float, "SGD's learning rate", positive=True),
    "seed": Field(int, "seed of the data, the weights and the sample order", non_negative=True),
    "num_examples": Field(int, "rows in the dataset", positive=True),
    "checkpoint_every": Field(int, "save every N steps (0: only at the end)", non_negative=True),
    "log_every": Field(int, "log every N steps", positive=True),
})
ROW, FEATURES = 6, 4  # positions per row, features per position


@dataclass(frozen=True)
class Toy:
    micro_batch_size: int
    grad_accum_steps: int
    max_steps: int
    lr: float
    seed: int
    num_examples: int
    checkpoint_every: int
    log_every: int


class RegressionTask:
    """The step's seam to this model, as train.py's WireTask is to its own: one loss term, the
    squared error summed over a micro-batch's real positions, whose count is its normaliser."""

    def counts(self, batch: dict) -> torch.Tensor:
        return batch["mask"].sum().reshape(1)

    def loss_sums(self, model: nn.Module, batch: dict) -> torch.Tensor:
        error = (model(batch["x"]).squeeze(-1) - batch["y"]) ** 2
        return (error * batch["mask"]).sum().reshape(1)

    def objective(self, terms: torch.Tensor) -> torch.Tensor:
        return terms.sum()

    def tokens(self, batch: dict) -> torch.Tensor:
        return batch["mask"].sum().long()  # its real positions

    def target_tokens(self, counts: torch.Tensor) -> torch.Tensor:
        return counts.sum().long()

    def record(self, terms: torch.Tensor) -> dict:
        return {"loss": terms.sum().item()}


def toy_rows(n: int, seed: int) -> list[dict]:
    """Rows of 1 to ROW real positions (the rest padding), targets a fixed function of the inputs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, ROW, FEATURES, generator=g)
    lengths = torch.randint(1, ROW + 1, (n,), generator=g)
    mask = (torch.arange(ROW) < lengths[:, None]).float()
    y = torch.sin(x.sum(-1)) * mask
    return [{"x": x[i], "y": y[i], "mask": mask[i]} for i in range(n)]


def collate(rows: list[dict]) -> dict:
    return {key: torch.stack([r[key] for r in rows]) for key in rows[0]}


def load(argv: list[str] | None):
    p = Parser(prog="toy_train.py")
    p.add_argument("--profile", required=True)
    p.add_argument("--out-dir", required=True)
    p.add_argument("--resume", action="store_true")
    p.add_argument("--stop-at-step", type=int)
    SCHEMA.add_flags(p, shown={})
    args = p.parse_args(argv)
    values = SCHEMA.with_flags(SCHEMA.resolve_profile(read_profiles(PROFILES), args.profile, PROFILES), args)
    return args, values, sections_of({"toy": Toy}, values)["toy"]


def main(argv: list[str] | None = None) -> None:
    args, values, cfg = load(argv)
    di = torchrun_rank("cpu")
    if di.joins_group:
        dist.init_process_group(**group_options(di.device, timeout_s=60))
    with leave_together():
        train(args, values, cfg, di)


def train(args, values: dict, cfg: Toy, di) -> None:
    stop = StopFlag(announce=di.is_main)
    out, world, rank = Path(args.out_dir), di.world_size, di.rank
    micro, accum = cfg.micro_batch_size, cfg.grad_accum_steps
    global_batch = micro * accum * world
    torch.manual_seed(cfg.seed)
    model = nn.Sequential(nn.Linear(FEATURES, 16), nn.Tanh(), nn.Linear(16, 1))
    ddp_model = DDP(model) if di.is_distributed else model
    dataset = toy_rows(cfg.num_examples, cfg.seed)
    sampler = ShardSampler(dataset, num_replicas=world, rank=rank, seed=cfg.seed)
    loader = make_loader(dataset, sampler, collate, micro_batch_size=micro, num_workers=0, prefetch_factor=2,
                         device_type=di.device.type, seed=cfg.seed + rank)
    # SGD, not Adam: Adam divides by each gradient's own size, which turns the rounding of different
    # summation orders into different steps where a gradient is near zero.
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.lr)
    scheduler = torch.optim.lr_scheduler.LinearLR(optimizer, 1.0, 0.1, total_iters=cfg.max_steps)
    scaler = torch.amp.GradScaler(di.device.type, enabled=False)
    identity = {"dataset": "toy", "examples": cfg.num_examples, "fingerprint": f"seed {cfg.seed}"}
    state = TrainState(0, 0, 0, layout=(world, micro, accum), data=identity)
    checkpointer = Checkpointer(out, rank=rank, keep=2, meta={"config": values, "data": identity}, model=model,
                                optimizer=optimizer, scheduler=scheduler, scaler=scaler)
    if args.resume:
        state = resume(checkpointer, state, values, ("max_steps", "lr"), max_steps=cfg.max_steps)
    batches = global_batches(loader, sampler, accum, state.epoch, state.examples_done, global_batch)
    out.mkdir(parents=True, exist_ok=True)
    task, meter = RegressionTask(), StepMeter(di.device, step_flops=lambda micro_batches: 0.0, peak_tflops=None)
    logger = MetricsLogger(out, enabled=di.is_main, first_step=state.step + 1)
    stopped = None
    while state.step < cfg.max_steps:
        epoch, done, micro_batches = next(batches)
        micro_batches = [to_device(b, di.device) for b in micro_batches]
        # The global batch's counts and the stop flag in one all-reduce; every term over its count.
        counts = torch.stack([task.counts(b) for b in micro_batches]).sum(0)
        reduced = all_reduce_sum(torch.cat([counts, stop.flags(di.device)]))
        n_targets = reduced[:-2].float()
        state.step, state.epoch, state.examples_done = state.step + 1, epoch, done
        step_terms = torch.zeros_like(n_targets)
        for i, batch in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            with nullcontext() if last or not di.is_distributed else ddp_model.no_sync():
                terms = task.loss_sums(ddp_model, batch) / n_targets
                (task.objective(terms) * world).backward()  # DDP averages over ranks
            step_terms += terms.detach()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        # The step's one host sync.
        finite, scheduler_stops, person_stops, tokens = torch.stack(
            [torch.isfinite(grad_norm).long(), *reduced[-2:], task.target_tokens(n_targets)]).tolist()
        lr = scheduler.get_last_lr()[0]
        if finite:
            optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
        meter.add(micro_batches, samples=global_batch, tokens=tokens, data_wait=0.0)
        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            logger.log({"step": state.step, **task.record(all_reduce_sum(step_terms)), "lr": lr,
                        "grad_norm": grad_norm.item(), **meter.read()})
            meter.next_window(after_pause=False)
        code = stop_code(scheduler_stops, person_stops)
        if code:  # 75 preempted, 130 interrupted: saved below
            stopped = SystemExit(code)
            break
        if state.step == args.stop_at_step:
            break
        if cfg.checkpoint_every and state.step % cfg.checkpoint_every == 0 and state.step < cfg.max_steps:
            checkpointer.save(state)
    checkpointer.save(state)
    logger.close()
    if stopped is not None:
        raise stopped


if __name__ == "__main__":
    main_guard(main)
