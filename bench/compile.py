"""Compile time: the whole step as one graph versus one graph per repeated region.

Two ways to torch.compile train.py's step, same shape settings
(`latentwire.harness.compiling.stable_shapes`: dynamic sizes, no duck sizing, constant floats) and
the same compile mode:
- whole:    torch.compile(forward_loss_sums): one graph, every decoder layer of both LLMs unrolled
            in it (how train.py compiled before);
- regional: what train.py compiles (`latentwire.parallelize`: `prepare_frozen_llms`, `wire_regions`): each decoder
            layer (inside its activation checkpointing wrapper), each byte-encoder block and the
            pooler compiled on their own; the layers of one LLM share one graph.
Each runs in a fresh process with an empty inductor cache directory, so neither finds graphs or
kernels the other compiled (dynamo, inductor's in-memory caches and its on-disk FX graph and
kernel caches all start empty). A process times its first step (compiling + one step), runs the
other batches once (any recompile shows there), then alternates compiled and eager steps (the same
modules under torch.compiler.set_stance("force_eager")) batch by batch.

--shapes cpu:        the cpu profile as it is (two tiny LLMs of 2 layers, no recompute).
--shapes h100-slice: the h100 profile's encoder (512 wide, 6 blocks) and its LLMs' layer shapes
                     (Llama-3.1-8B, Qwen2.5-7B from latentwire.known_llms) cut to 4 decoder layers
                     each (--layers N), random weights, activation checkpointing on. Cut further so
                     that a CPU runs it: fp32 (bf16 matmuls run 5x slower than fp32 on a CPU without
                     bf16 units), vocabularies of 32768 (the embedding and the head only; 16 GB of
                     fp32 weights otherwise), 8 latents, prompts of at most 256 bytes, micro-batch 2,
                     compile mode "default" (max-autotune on a CPU tunes CPU GEMM templates, not what
                     it tunes on a GPU). The graphs are the GPU's; the kernels are not.

Summary: compile seconds (wall time of the first step minus a steady compiled step) of each, the
first step's CPU seconds (this process and the C++ compilers; fairer on shared cores), steady
step times; ratio = whole / regional compile seconds.

    python bench/compile.py                        # cpu profile, inductor: about 15 minutes on 2 busy cores
    python bench/compile.py --shapes h100-slice    # 4-layer slice: about 12 minutes, 10 GB of memory
    python bench/compile.py --quick                # one small batch, aot_eager: checks the script (the tests)
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from common import REPO, build_model, child_env, forward_backward, make_loader, median, parse_settings, summary, take
from latentwire.harness.compiling import stable_shapes
from latentwire.known_llms import LLAMA_3_1_8B, QWEN_2_5_7B
from latentwire.objectives import forward_loss_sums
from latentwire.parallelize import prepare_frozen_llms, wire_regions
from latentwire.settings import load_config

VARIANTS = ("whole", "regional")
SLICE_VOCAB = 32768


@dataclass(frozen=True)
class Settings:
    rounds: int  # passes over the batch set after the warm-up, each timing every batch both ways
    batches: int  # micro-batches in the fixed set
    micro_batch_size: int


FULL = {
    "cpu": Settings(rounds=3, batches=4, micro_batch_size=16),
    "h100-slice": Settings(rounds=1, batches=2, micro_batch_size=2),
}
QUICK = Settings(rounds=1, batches=1, micro_batch_size=2)


def flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--shapes",
        choices=tuple(FULL),
        default="cpu",
        help="cpu profile, or the h100 profile's shapes cut to a few decoder layers (see above)",
    )
    p.add_argument("--layers", type=int, default=4, help="decoder layers of each LLM in the h100 slice (default 4)")
    p.add_argument(
        "--backend",
        choices=("inductor", "aot_eager"),
        default=None,
        help="inductor (aot_eager with --quick: dynamo and AOTAutograd without inductor's C++ compiling)",
    )
    p.add_argument("--variant", choices=VARIANTS, help=argparse.SUPPRESS)  # set for the child processes


def slice_configs(directory: Path, layers: int) -> tuple[str, str]:
    """config.json files of Llama-3.1-8B and Qwen2.5-7B cut to `layers` layers, for `random:`."""
    paths = []
    for name, values in (("llama", LLAMA_3_1_8B), ("qwen", QWEN_2_5_7B)):
        values = {k: v for k, v in values.items() if k not in ("bos_token_id", "eos_token_id")}
        values.update(num_hidden_layers=layers, vocab_size=SLICE_VOCAB)
        if "max_window_layers" in values:
            values["max_window_layers"] = layers
        path = directory / f"{name}.json"
        path.write_text(json.dumps(values))
        paths.append(str(path))
    return paths[0], paths[1]


def bench_config(args, s: Settings, workdir: Path):
    common = ["--micro-batch-size", s.micro_batch_size, "--num-workers", 0, "--dropout", 0]
    if args.shapes == "cpu":
        return load_config(["--profile", "cpu", *map(str, common)])
    llama, qwen = slice_configs(workdir, args.layers)
    return load_config(
        [
            "--profile",
            "h100",
            *map(str, common),
            "--llama",
            "random:" + llama,
            "--qwen",
            "random:" + qwen,
            "--precision",
            "fp32",
            "--dataset",
            "synthetic",
            "--num-examples",
            "256",
            "--num-latents",
            "8",
            "--max-prompt-bytes",
            "256",
            "--compile-mode",
            "default",
        ]
    )


def compile_kwargs(mode: str, backend: str) -> dict:
    """train.py's torch.compile arguments (every size symbolic); a backend other than inductor takes no mode."""
    return {"backend": backend, "dynamic": True, **({"mode": mode} if backend == "inductor" else {})}


def whole_step(mode: str, backend: str):
    """The step as one graph (how train.py compiled before regional compilation)."""
    return stable_shapes()(torch.compile(forward_loss_sums, **compile_kwargs(mode, backend)))


def regional_step(model, llms: dict, mode: str, backend: str):
    """What train.py compiles: each of the step's regions compiled on its own, the decoder layers
    by train.py's own prepare_frozen_llms."""
    prepare_frozen_llms(llms, checkpointing=None, compile_options=compile_kwargs(mode, backend), mesh=None, device=None)
    for region in wire_regions(model):
        region.compile(**compile_kwargs(mode, backend))
    return stable_shapes()(forward_loss_sums)


def timed_step(forward, model, llms, batch) -> float:
    start = time.perf_counter()
    forward_backward(forward, model, llms, batch, micro_steps=1)
    model.zero_grad(set_to_none=True)
    return time.perf_counter() - start


def cpu_seconds() -> float:
    """CPU time of this process and of its waited-for children (the C++ compilers inductor runs):
    on shared cores, a fairer measure of compiling than wall time."""
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.process_time() + children.ru_utime + children.ru_stime


def graphs() -> int:
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def run_variant(variant: str, args, s: Settings, backend: str) -> dict:
    """One variant, in this (fresh) process: build, compile on the first step, then time."""
    with tempfile.TemporaryDirectory() as tmp:
        cfg = bench_config(args, s, Path(tmp))
        t = time.perf_counter()
        llms, model = build_model(cfg)
        batches = take(make_loader(cfg, llms), s.batches)
        print(
            f"[{variant}] built in {time.perf_counter() - t:.0f} s; prompt widths "
            f"{sorted({b['bytes'].shape[1] for b in batches})}, micro-batch {s.micro_batch_size}, "
            f"mode={cfg.compile.mode}, activation checkpointing {cfg.recompute.policy}",
            flush=True,
        )
    if variant == "whole":
        forward = whole_step(cfg.compile.mode, backend)
    else:
        forward = regional_step(model, llms, cfg.compile.mode, backend)

    cpu = cpu_seconds()
    first = timed_step(forward, model, llms, batches[0])
    first_cpu = cpu_seconds() - cpu
    first_graphs = graphs()
    print(
        f"[{variant}] first step (compile + step): {first:.1f} s ({first_cpu:.1f} s of CPU), {first_graphs} graphs",
        flush=True,
    )
    rest = [timed_step(forward, model, llms, b) for b in batches[1:]]
    print(
        f"[{variant}] the other {len(rest)} batches once: {sum(rest):.1f} s, {graphs() - first_graphs} more graphs",
        flush=True,
    )
    eager, compiled = [], []
    for r in range(s.rounds):
        for b in batches:
            order = ("compiled", "eager") if r % 2 == 0 else ("eager", "compiled")
            for kind in order:
                if kind == "eager":
                    with torch.compiler.set_stance("force_eager"):
                        eager.append(timed_step(forward, model, llms, b))
                else:
                    compiled.append(timed_step(forward, model, llms, b))
        print(
            f"[{variant}] round {r + 1}/{s.rounds}: compiled {median(compiled):.3f} s, eager {median(eager):.3f} s",
            flush=True,
        )
    step = median(compiled)
    return {
        "variant": variant,
        "first_step_s": first,
        "compile_s": first - step,
        "first_step_cpu_s": first_cpu,
        "step_s": step,
        "eager_step_s": median(eager),
        "graphs": first_graphs,
        "recompile_graphs": graphs() - first_graphs,
    }


def run_child(variant: str, args, s: Settings, backend: str) -> dict:
    """`run_variant` in a fresh process with an empty inductor cache, compiling in-process (no
    worker pool, so the C++ compilers are its waited-for children); its output streams through."""
    with tempfile.TemporaryDirectory(prefix=f"inductor-{variant}-") as cache:
        env = child_env(args.threads)
        env.update(TORCHINDUCTOR_CACHE_DIR=cache, TORCHINDUCTOR_COMPILE_THREADS="1")
        cmd = [
            sys.executable,
            str(Path(__file__).resolve()),
            "--variant",
            variant,
            "--shapes",
            args.shapes,
            "--layers",
            str(args.layers),
            "--backend",
            backend,
            "--threads",
            str(args.threads),
            *(f"--{k.replace('_', '-')}={v}" for k, v in asdict(s).items()),
        ]
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)
        result = None
        for line in proc.stdout:
            if line.startswith("RESULT "):
                result = json.loads(line[len("RESULT ") :])
            elif line.startswith("["):
                print(line, end="", flush=True)
        if proc.wait() != 0 or result is None:
            raise SystemExit(f"{variant}: child exited with {proc.returncode}")
        return result


def main() -> None:
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--shapes", choices=tuple(FULL), default="cpu")
    full = FULL[pre.parse_known_args()[0].shapes]  # the full settings depend on the shapes
    args, s = parse_settings(__doc__.splitlines()[0], QUICK, full, extra=flags)
    backend = args.backend or ("aot_eager" if args.quick else "inductor")
    if args.variant:  # a child: one variant, result as one JSON line
        print("RESULT " + json.dumps(run_variant(args.variant, args, s, backend)), flush=True)
        return
    layers = f", {args.layers} decoder layers per LLM" if args.shapes != "cpu" else ""
    print(f"backend {backend}, shapes {args.shapes}{layers}", flush=True)
    results = {v: run_child(v, args, s, backend) for v in VARIANTS}
    for v, r in results.items():
        print(
            f"{v:8s}: first step {r['first_step_s']:7.1f} s ({r['first_step_cpu_s']:7.1f} s of CPU) = compile "
            f"{r['compile_s']:7.1f} s + step; "
            f"steady step {1e3 * r['step_s']:8.1f} ms compiled, {1e3 * r['eager_step_s']:8.1f} ms eager; "
            f"{r['graphs']} graphs, {r['recompile_graphs']} more after the first step",
            flush=True,
        )
    whole, regional = results["whole"], results["regional"]
    summary(
        "compile",
        whole["compile_s"] / regional["compile_s"],
        shapes=args.shapes,
        **({"layers": args.layers} if args.shapes != "cpu" else {}),
        backend=backend,
        whole_compile_s=whole["compile_s"],
        regional_compile_s=regional["compile_s"],
        whole_first_step_cpu_s=whole["first_step_cpu_s"],
        regional_first_step_cpu_s=regional["first_step_cpu_s"],
        whole_step_ms=1e3 * whole["step_s"],
        regional_step_ms=1e3 * regional["step_s"],
        eager_step_ms=1e3 * regional["eager_step_s"],
        whole_graphs=whole["graphs"],
        regional_graphs=regional["graphs"],
    )


if __name__ == "__main__":
    main()
