"""The largest micro-batch that really fits, found on the device by running it.

    python -m latentwire.find_batch --profile h100 [--cap-gb G] [--steps 3] [--json PATH] [--tb-dir DIR]
    torchrun --nproc_per_node=4 -m latentwire.find_batch --profile h100x4

Each trial builds train.py's trainable model and optimizer afresh next to the frozen LLMs (loaded
once), runs `--steps` real training steps on the longest batch the collator can emit, and
measures the peak. Out of memory is a result, not a crash: the trial's memory is freed and the
search goes on. The search starts at the profile's micro-batch, doubles while trials fit, then
bisects between the last fit and the first failure.

The peak, per device:
- CUDA: `torch.cuda.max_memory_allocated` (tensors) and `max_memory_reserved` (what the caching
  allocator holds; reserved / allocated is the fragmentation the plan reserves for). The cap is
  enforced by the allocator (`set_per_process_memory_fraction`), so going over it raises a real
  `torch.OutOfMemoryError` mid-step.
- CPU: every allocation and free the CPU allocator makes during the trial, as torch.profiler's
  memory events report them, summed in order: the CPU counterpart of max_memory_allocated, plus the
  frozen weights already resident. Unlike the process RSS it counts tensor memory only and is
  the same on every run (glibc's free lists and page reuse make RSS noisy), so tests can hold it
  to the plan. Kernels' own buffers go through the same allocator and are counted too: on a CPU
  whose oneDNN runs bf16 matmuls, its copy of each LLM head's weight per sample, which the plan's
  trace does not see (`latentwire.planner.memtrace`). Nothing enforces a cap while a CPU step runs (Linux
  would overcommit, then kill the process), so a trial over the cap raises `torch.OutOfMemoryError`
  once its steps are done; an allocation the CPU allocator refuses (a RuntimeError) becomes the
  same error.

With `--memory-snapshot true` on CUDA the allocator records every allocation of the trials, with
the Python line that made it, to OUT_DIR/memory/snapshot_rank<r>.pickle: `python
bench/peak_allocations.py` on it lists what was live at the peak (what a plan that misses the
measured peak has not counted); pytorch.org/memory_viz draws it.

The default cap is the profile's target share of the card (target_util x memory_gb), the question
the plan answers. Trials use no DDP: a rank that ran out of memory inside one of its collectives
would leave the other ranks waiting in it; DDP's gradient buckets and NCCL's buffers are in the
plan's reserve instead. Under torchrun every rank runs every trial and a trial fits only if it
fits on all ranks (an all-reduce of the minimum), so all ranks agree on the search and its result.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from .fp8 import check_fp8
from .harness.config import Parser, check_can_create, positive
from .harness.distributed import process_group
from .harness.errors import UserError
from .harness.exits import main_guard
from .harness.precision import compute_dtype, cuda_capability, sdpa_backends
from .harness.profiling import MemorySnapshots
from .harness.recipe import TrainingStep
from .harness.recompute import checkpoint_options
from .model import WireEncoder
from .parallelize import frozen_llms
from .planner.budget import GIB, Fit, fit_line
from .planner.memory_plan import write_json
from .planner.memtrace import planning_batch
from .planner.script import script_step
from .planner.step import run_step
from .settings import load_config

PROG = "python -m latentwire.find_batch"
CPU_OUT_OF_MEMORY = "DefaultCPUAllocator: can't allocate memory"


@dataclass(frozen=True)
class Trial:
    micro_batch: int
    fits: bool
    peak_allocated: int | None  # bytes; None when it ran out of memory before its steps were done
    peak_reserved: int | None  # CUDA only
    seconds: float
    error: str = ""


# --- measuring one trial ----------------------------------------------------------------------


def cpu_allocation_peak(events) -> int:
    """Largest running sum of CPU allocations (positive bytes) and frees (negative), in time order."""
    live = peak = 0
    for nbytes in (e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())):
        live += nbytes
        peak = max(peak, live)
    return peak


class CpuPeak:
    """The peak of tensor bytes the CPU allocator hands out inside the block (see the module doc)."""

    def __enter__(self):
        from torch.profiler import ProfilerActivity, profile

        # Kineto logs a line at every profiler start and stop, above its error level; read when the
        # first profiler starts. A trial reports its own failures.
        os.environ.setdefault("KINETO_LOG_LEVEL", "6")
        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        events = [
            e
            for e in self._profile.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
        self.bytes = cpu_allocation_peak(events)


def resident_bytes(modules) -> int:
    """Bytes of the distinct storages behind these modules' parameters and buffers."""
    storages = {}
    for module in modules:
        for t in (*module.parameters(), *module.buffers()):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(storages.values())


class OverCap(torch.OutOfMemoryError):
    """A CPU trial that ran its steps and measured a peak over the cap."""

    def __init__(self, peak: int, cap: int):
        super().__init__(f"measured peak {peak / GIB:.3f} GiB is over the cap of {cap / GIB:.3f} GiB")
        self.peak = peak


class Probe:
    """Runs a trial: a fresh trainable model and optimizer, `steps` real training steps at one
    micro-batch, the peak measured; raises torch.OutOfMemoryError past `cap_bytes`."""

    def __init__(self, cfg, llms: dict, step: TrainingStep, device: torch.device, steps: int, cap_bytes: int):
        self.cfg, self.llms, self.step, self.device, self.steps = cfg, llms, step, device, steps
        self.cap_bytes = cap_bytes
        self.answers = {
            name: (len(llm.contract.lead), len(llm.contract.tail), llm.model.config.vocab_size)
            for name, llm in llms.items()
        }
        # train.py's attention kernels for this card and dtype
        self.attention_backends, _ = sdpa_backends(cuda_capability(device), compute_dtype(cfg.numerics.precision))
        self.resident = resident_bytes(llm.model for llm in llms.values())
        if device.type == "cuda":
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(min(cap_bytes / total, 1.0), device)

    def __call__(self, micro_batch: int) -> tuple[int, int | None]:
        """(peak allocated, peak reserved or None) in bytes."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self._run(micro_batch)
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)
        try:
            with CpuPeak() as measured:
                self._run(micro_batch)
        except RuntimeError as e:
            # The CPU allocator's failure is a plain RuntimeError; make it the error CUDA raises.
            if CPU_OUT_OF_MEMORY not in str(e):
                raise
            raise torch.OutOfMemoryError(str(e).splitlines()[0]) from e
        peak = self.resident + measured.bytes
        if peak > self.cap_bytes:
            raise OverCap(peak, self.cap_bytes)
        return peak, None

    def _run(self, micro_batch: int) -> None:
        torch.manual_seed(self.cfg.training.seed)
        model = WireEncoder.for_llms(self.cfg.wire, self.llms)
        model.to(self.device).train()
        optimizer = self.step.adamw(model, self.cfg.optimizer, self.device.type)
        batch = planning_batch(
            self.cfg.data, self.cfg.objectives, self.answers, micro_batch, self.device, self.cfg.wire.word_patch
        )
        for _ in range(self.steps):
            run_step(self.step, self.cfg, model, self.llms, optimizer, batch, self.attention_backends)


def free_memory(device: torch.device) -> None:
    """After a failed trial: its tensors die with the exception's frames; return them to the device."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def all_ranks_fit(fits: bool, device: torch.device) -> bool:
    """A trial fits only if it fits on every rank (an all-reduce of the minimum)."""
    if not dist.is_initialized():
        return fits
    flag = torch.tensor([int(fits)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def run_trial(probe, micro_batch: int, device: torch.device) -> Trial:
    start = time.perf_counter()
    allocated = reserved = None
    error = ""
    try:
        allocated, reserved = probe(micro_batch)
    except torch.OutOfMemoryError as e:
        allocated = getattr(e, "peak", None)  # an OverCap trial did run, and was measured
        error = str(e).splitlines()[0]
    if error:
        free_memory(device)  # outside the except block, so the exception and its frames are gone
    fits = all_ranks_fit(not error, device)
    if not fits and not error:
        error = "out of memory on another rank"
    return Trial(micro_batch, fits, allocated, reserved, time.perf_counter() - start, error)


# --- the search -------------------------------------------------------------------------------


def search(try_micro_batch, start: int, limit: int | None = None, report=lambda trial: None) -> tuple[int, list[Trial]]:
    """Largest micro-batch for which `try_micro_batch(m).fits`, assuming that fitting is monotone:
    double from `start` while trials fit (up to `limit`), then bisect. 0 if not even 1 fits."""
    trials: dict[int, Trial] = {}

    def fits(m: int) -> bool:
        trials[m] = try_micro_batch(m)
        report(trials[m])
        return trials[m].fits

    good, bad = 0, None
    m = start if limit is None else min(start, limit)
    while bad is None:
        if fits(m):
            good = m
            if limit is not None and m >= limit:
                break
            m = 2 * m if limit is None else min(2 * m, limit)
        else:
            bad = m
    while bad is not None and bad - good > 1:
        mid = (good + bad) // 2
        if fits(mid):
            good = mid
        else:
            bad = mid
    return good, [trials[m] for m in sorted(trials)]


def fit_trials(trials: list[Trial]) -> Fit | None:
    """The line through every measured peak, over the cap or not."""
    points = {t.micro_batch: t.peak_allocated for t in trials if t.peak_allocated is not None}
    return fit_line(points) if len(points) >= 2 else None


# --- output -----------------------------------------------------------------------------------


def format_trial(t: Trial) -> str:
    if not t.fits:
        return f"trial micro-batch {t.micro_batch:>5}: out of memory: {t.error}  {t.seconds:.1f} s"
    reserved = "" if t.peak_reserved is None else f", {t.peak_reserved / GIB:.3f} GiB reserved"
    return (
        f"trial micro-batch {t.micro_batch:>5}: peak {t.peak_allocated / GIB:.3f} GiB allocated{reserved}, "
        f"fits  {t.seconds:.1f} s"
    )


def write_tensorboard(tb_dir: str, trials: list[Trial], fit: Fit | None) -> None:
    """Peak versus micro-batch as TensorBoard scalars (the step axis is the micro-batch)."""
    from torch.utils.tensorboard import SummaryWriter

    with SummaryWriter(tb_dir) as writer:
        for t in trials:
            if t.peak_allocated is not None:
                writer.add_scalar("find_batch/peak_allocated_gib", t.peak_allocated / GIB, t.micro_batch)
            if t.peak_reserved is not None:
                writer.add_scalar("find_batch/peak_reserved_gib", t.peak_reserved / GIB, t.micro_batch)
            if fit is not None:
                writer.add_scalar("find_batch/fitted_peak_gib", fit(t.micro_batch) / GIB, t.micro_batch)
            writer.add_scalar("find_batch/fits", int(t.fits), t.micro_batch)


# --- the command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog=PROG,
        description="Find the largest micro-batch that fits, by running it "
        "(every train.py flag applies; --micro-batch-size is where the search starts).",
    )
    p.add_argument("--cap-gb", type=positive(float), help="memory cap in GiB (default: target_util x memory_gb)")
    p.add_argument("--steps", type=positive(int), default=3, help="training steps per trial")
    p.add_argument("--max-micro-batch", type=positive(int), help="stop growing here")
    p.add_argument("--json", help="where to write the trials (default: OUT_DIR/find_batch.json)")
    p.add_argument("--tb-dir", help="TensorBoard plot of peak vs micro-batch (default: OUT_DIR/find_batch_tb)")
    return p


def main(argv: list[str] | None = None) -> None:
    args, rest = build_parser().parse_known_args(argv)
    cfg = load_config(rest, prog=PROG)
    with process_group(cfg.card.device, cfg.training.dist_timeout_s) as di:
        find(cfg, args, di, script_step())


def find(cfg, args, di, step: TrainingStep) -> None:
    if cfg.frozen.sharding == "fsdp":
        raise UserError(
            "find_batch measures with whole frozen LLMs on each rank; for --frozen-sharding fsdp, "
            f"plan the micro-batch with python -m latentwire.plan --profile {cfg.invocation.profile}"
        )
    if cfg.frozen.fp8 != "none":
        check_fp8(di.device, cfg.numerics.precision, eager_backward=not cfg.compile.enabled)
    out = Path(cfg.output.out_dir)
    json_path, tb_dir = Path(args.json or out / "find_batch.json"), Path(args.tb_dir or out / "find_batch_tb")
    check_can_create(json_path.parent, "output directory")
    check_can_create(tb_dir, "TensorBoard directory")
    cap = round((args.cap_gb or cfg.planning.target_util * cfg.card.memory_gb) * GIB)
    # Built and wrapped as train.py builds them: the run's prompt contract, its checkpointing.
    llms = frozen_llms(
        cfg.frozen,
        cfg.prompt,
        cfg.numerics.precision,
        di.device,
        checkpointing=checkpoint_options(cfg.recompute.policy),
    )
    probe = Probe(cfg, llms, step, di.device, args.steps, cap)
    say = print if di.is_main else (lambda *a, **k: None)
    say(
        f"find_batch {cfg.invocation.profile}: {di.world_size} x {di.device.type}, cap {cap / GIB:.2f} GiB, "
        f"{args.steps} steps per trial, starting at micro-batch {cfg.training.micro_batch_size}",
        flush=True,
    )
    # On request (--memory-snapshot true), the allocator's history over the trials: every block
    # live at a trial's peak and the line that allocated it (bench/peak_allocations.py, memory_viz).
    snapshots = MemorySnapshots(cfg.profiler.memory_snapshot, di.device, out, di.rank)
    snapshots.start()
    best, trials = search(
        lambda m: run_trial(probe, m, di.device),
        cfg.training.micro_batch_size,
        args.max_micro_batch,
        report=lambda t: say(format_trial(t), flush=True),
    )
    snapshot = snapshots.finish()
    if snapshot is not None:
        say(f"memory snapshot: {snapshot}")
    fit = fit_trials(trials)
    if fit is not None:
        say(f"fit: peak = {fit.fixed / GIB:.3f} GiB + {fit.per_sample / GIB:.4f} GiB x micro-batch, R^2 = {fit.r2:.5f}")
    say(f"largest micro-batch that fits: {best}" if best else "not even micro-batch 1 fits", flush=True)
    if di.is_main:
        write_json(
            str(json_path),
            {
                "profile": cfg.invocation.profile,
                "world_size": di.world_size,
                "device": di.device.type,
                "cap_bytes": cap,
                "steps": args.steps,
                "max_micro_batch": best,
                "fit": None if fit is None else asdict(fit),
                "trials": [asdict(t) for t in trials],
            },
        )
        write_tensorboard(str(tb_dir), trials, fit)


if __name__ == "__main__":
    main_guard(main)
