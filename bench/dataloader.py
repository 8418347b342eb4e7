"""Does the cpu profile's DataLoader keep up with the model?

Two rates, measured in alternating rounds in this process:

- loader: train.py's DataLoader exactly as the cpu profile configures it (its workers, prefetch,
  sampler and Collator; no model), one whole epoch per round. A round runs from `iter()` to the
  epoch's last batch, so refilling the prefetch queue at the epoch start is charged to the
  loader, and no worker is still busy when the model's round starts.
- model: forward + backward of each micro-batch and the optimizer step, on micro-batches the
  loader just produced, with nothing loading meanwhile.

Summary: ratio = loader samples/s / model samples/s, per rank; above 1 the loader keeps up, and
the ratio says by how much, i.e. what share of a core the loader needs while the model runs.

    python bench/dataloader.py            # full: about a minute
    python bench/dataloader.py --quick    # a few batches (the tests)
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from common import bare_step, build_model, cpu_config, make_loader, median, parse_settings, summary


@dataclass(frozen=True)
class Settings:
    rounds: int  # loader epochs, each followed by model steps
    model_steps: int  # optimizer steps timed per round
    num_examples: int  # epoch size: the loader's round


FULL = Settings(rounds=8, model_steps=8, num_examples=8192)
QUICK = Settings(rounds=2, model_steps=2, num_examples=256)


def loader_round(loader, epoch: int, keep: int) -> tuple[float, list[dict]]:
    """Samples/s over one epoch, and its first `keep` micro-batches for the model to consume."""
    loader.sampler.start_epoch(epoch)
    kept, samples = [], 0
    start = time.perf_counter()
    for batch in loader:
        samples += batch["bytes"].shape[0]
        if len(kept) < keep:
            kept.append(batch)
    return samples / (time.perf_counter() - start), kept


def model_round(model, llms, optimizer, batches: list[dict], accum: int) -> list[float]:
    """Samples/s of each optimizer step over `batches`, `accum` micro-batches a step."""
    rates = []
    for i in range(0, len(batches), accum):
        group = batches[i : i + accum]
        start = time.perf_counter()
        bare_step(model, llms, optimizer, group)
        rates.append(sum(b["bytes"].shape[0] for b in group) / (time.perf_counter() - start))
    return rates


def main() -> None:
    _, s = parse_settings(__doc__.splitlines()[0], QUICK, FULL)
    cfg = cpu_config("--num-examples", s.num_examples)
    print(
        f"model step: {cfg.training.micro_batch_size} x {cfg.training.grad_accum_steps} micro-batches; loader: "
        + (
            f"{cfg.loader.num_workers} worker(s), prefetch {cfg.loader.prefetch_factor}"
            if cfg.loader.num_workers
            else "no workers (the profile's num_workers is 0): it collates in the training process, in series "
            "with the model, so 1/ratio is the share of each step spent loading"
        ),
        flush=True,
    )
    llms, model = build_model(cfg)
    loader = make_loader(cfg, llms)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.optimizer.lr)
    needed = s.model_steps * cfg.training.grad_accum_steps
    # Untimed warm-up: starts the persistent workers and creates the optimizer state.
    _, first = loader_round(loader, epoch=0, keep=cfg.training.grad_accum_steps)
    model_round(model, llms, optimizer, first, cfg.training.grad_accum_steps)

    loader_rates, model_rates = [], []
    for r in range(s.rounds):
        rate, batches = loader_round(loader, epoch=r + 1, keep=needed)
        steps = model_round(model, llms, optimizer, batches, cfg.training.grad_accum_steps)
        loader_rates.append(rate)
        model_rates += steps
        print(
            f"round {r + 1}/{s.rounds}: loader {rate:.0f} samples/s, model {median(steps):.1f} samples/s "
            f"(median of {len(steps)} steps)",
            flush=True,
        )
    loader_rate, model_rate = median(loader_rates), median(model_rates)
    summary(
        "dataloader",
        loader_rate / model_rate,
        loader_samples_per_s=loader_rate,
        model_samples_per_s=model_rate,
        num_workers=cfg.loader.num_workers,
    )


if __name__ == "__main__":
    main()
