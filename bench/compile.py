"""Eager versus torch.compile, on the cpu profile's model.

A fixed set of micro-batches (the loader's first ones, so several padded prompt lengths) goes
through forward_ce_sums + backward, eagerly and compiled as train.py compiles it
(`latentwire.model.compiled_forward`: dynamic shapes, constant floats, the profile's compile_mode).
Every batch first runs once each way, untimed, so
compiling (and any recompile for a new shape) is left out; then the two alternate batch by
batch, in alternating order per round.

Summary: median step times and ratio = eager / compiled (above 1: compiling pays off, once
compiled; the warm-up line says what compiling itself cost).

    python bench/compile.py            # full: the compile (about a minute with a warm inductor
                                       # cache, several on a cold one) plus about a minute
    python bench/compile.py --quick    # two small batches (the tests); compiling still dominates
"""
from __future__ import annotations

import time
from dataclasses import dataclass

from common import build_model, cpu_config, forward_backward, make_loader, median, parse_settings, summary, take
from latentwire.model import compiled_forward, forward_ce_sums


@dataclass(frozen=True)
class Settings:
    rounds: int            # passes over the batch set, each timing every batch eager and compiled
    batches: int           # micro-batches in the fixed set
    micro_batch_size: int


FULL = Settings(rounds=6, batches=8, micro_batch_size=16)
QUICK = Settings(rounds=1, batches=2, micro_batch_size=4)


def timed_step(forward, model, llms, batch) -> float:
    """Seconds of one forward + backward; gradients are dropped so every step does the same work."""
    start = time.perf_counter()
    forward_backward(forward, model, llms, batch, micro_steps=1)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def main() -> None:
    _, s = parse_settings(__doc__.splitlines()[0], QUICK, FULL)
    cfg = cpu_config("--micro-batch-size", s.micro_batch_size, "--num-workers", 0)
    llms, model = build_model(cfg)
    batches = take(make_loader(cfg, llms), s.batches)
    print(f"batches: prompt bytes {sorted({b['bytes'].shape[1] for b in batches})}, micro-batch {s.micro_batch_size}; "
          f"compile: mode={cfg.compile_mode} dynamic=True", flush=True)
    compiled = compiled_forward(cfg.compile_mode)

    warmup = [timed_step(compiled, model, llms, b) for b in batches]
    print(f"compile warm-up: {warmup[0]:.1f} s for the first batch, {sum(warmup[1:]):.1f} s for the other "
          f"{len(warmup) - 1} (a recompile for a new shape would show here)", flush=True)
    for b in batches:
        timed_step(forward_ce_sums, model, llms, b)

    eager, fast = [], []
    for r in range(s.rounds):
        for b in batches:
            if r % 2 == 0:
                eager.append(timed_step(forward_ce_sums, model, llms, b))
                fast.append(timed_step(compiled, model, llms, b))
            else:
                fast.append(timed_step(compiled, model, llms, b))
                eager.append(timed_step(forward_ce_sums, model, llms, b))
        print(f"round {r + 1}/{s.rounds}: eager {1e3 * median(eager[-len(batches):]):.1f} ms, "
              f"compiled {1e3 * median(fast[-len(batches):]):.1f} ms (medians of {len(batches)} steps)", flush=True)
    eager_ms, compiled_ms = 1e3 * median(eager), 1e3 * median(fast)
    summary("compile", eager_ms / compiled_ms, eager_step_ms=eager_ms, compiled_step_ms=compiled_ms,
            compile_s=warmup[0], steps_each=len(eager))


if __name__ == "__main__":
    main()
