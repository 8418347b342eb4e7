"""train.py end to end: the correctness rules of DESIGN.md, checked from the outside."""

import itertools
import json
import math
import re

import pytest
import torch

from conftest import ALL_TERMS_FLAGS, EXACT, FAST, final_weights, max_rel_diff, ok, read_metrics, run_train
from latentwire.llm import build_frozen_llms
from latentwire.settings import load_config

# The cpu profile's shape and batch before November 2026 (one encoder layer, 16 x 1 x 2 since): what the
# counts and measurements in the bf16 and compile-under-DDP tests were made for.
TWO_LAYER_BATCH = ["--encoder-layers", "2", "--grad-accum-steps", "2"]
# Three steps of the cpu profile, the profiler recording steps 2-3 (its trace names the collectives).
PROFILED_STEPS = [
    "--profile",
    "cpu",
    *FAST,
    "--max-steps",
    "3",
    "--micro-batch-size",
    "2",
    "--profiler",
    "true",
    "--profiler-wait",
    "1",
    "--profiler-warmup",
    "0",
    "--profiler-active",
    "2",
]


def train(tmp_path, name, *args, nproc=1, torchrun=None):
    out = tmp_path / name
    ok(run_train([*args, "--out-dir", str(out)], nproc=nproc, torchrun=torchrun))
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "terms", [["--first-token-weight", "0", "--kd-weight", "0"], ALL_TERMS_FLAGS], ids=["answer_ce", "all_terms"]
)
def test_gradient_accumulation_and_ddp_are_exact(tmp_path, terms):
    """mbs 8 x 1, mbs 2 x accum 4, and mbs 2 x accum 2 x 2 ranks end with the same weights, and log
    the same value of every loss term of every LLM: each is normalised by its global count."""
    # Adam divides each gradient element by its own size: an element whose gradient is near zero
    # (1.2e-7 at seed 0, where the splits' rounding differs by 7e-7) takes a full-size step of
    # either sign, and the splits then train different weights. An epsilon far above that noise
    # keeps such elements still, so what is compared is the accumulation. At the default 1e-8,
    # seeds 0-2 differ by up to 3e-4 on one element; at 1e-3 the step-3 gradient norm still
    # differed by 2.8e-6 (a third of the bound) on one CPU; at 1e-2, under ATen's default, AVX2
    # and AVX-512 kernels and MKL's compatible mode alike, the weights differ by at most 1e-6 and
    # the logged values by at most 8e-7.
    common = ["--profile", "cpu", *EXACT, *FAST, "--max-steps", "3", "--adam-eps", "1e-2", *terms]
    big = train(tmp_path, "mbs8", *common, "--micro-batch-size", "8", "--grad-accum-steps", "1")
    accum = train(tmp_path, "accum4", *common, "--micro-batch-size", "2", "--grad-accum-steps", "4")
    ddp = train(tmp_path, "ddp2", *common, "--micro-batch-size", "2", "--grad-accum-steps", "2", nproc=2)
    reference = final_weights(big)
    assert max_rel_diff(reference, final_weights(accum)) < 1e-4
    assert max_rel_diff(reference, final_weights(ddp)) < 1e-4
    # The same global batches, so the same logged losses (of the global batch, not the last
    # micro-batch) and the same pre-clip gradient norms: Adam is blind to a uniformly mis-scaled
    # gradient, the norm is not.
    for other in (accum, ddp):
        for a, b in zip(read_metrics(big), read_metrics(other), strict=True):
            losses = [k for k in a if k.startswith(("loss", "answer_ce_", "first_token_ce_", "k_token_ce_", "kd_"))]
            # loss, loss_<llm>, then each term of each LLM
            assert len(losses) == 3 + 2 * (4 if terms == ALL_TERMS_FLAGS else 1)
            for key in (*losses, "grad_norm"):
                assert a[key] == pytest.approx(b[key], rel=1e-5), key
            # ... and the same tokens per sample: counted over the global batch, all ranks.
            for key in ("tokens_per_s", "target_tokens_per_s"):
                assert a[key] / a["samples_per_s"] == pytest.approx(b[key] / b["samples_per_s"], rel=1e-9), key
    # tokens_per_s counts what the readers read: per reader a row's lead, wire, tail and answer
    # tokens. Beyond the answer's targets (its tokens and the EOS) a sample adds the same count.
    cpu = load_config(["--profile", "cpu"])
    with torch.device("meta"):
        readers = build_frozen_llms(cpu.frozen, cpu.prompt, torch.float32).values()
    fixed = sum(len(r.contract.lead) + cpu.wire.num_latents + len(r.contract.tail) - 1 for r in readers)
    for r in read_metrics(big):
        assert (r["tokens_per_s"] - r["target_tokens_per_s"]) / r["samples_per_s"] == pytest.approx(fixed, rel=1e-9)
    # ... and training moved the weights: the comparison is not between untouched inits.
    untouched = train(tmp_path, "lr_tiny", *common, "--micro-batch-size", "8", "--lr", "1e-12")
    assert max_rel_diff(reference, final_weights(untouched)) > 1e-3


def onecycle_reference(
    step: int, total: int, max_lr: float, pct_start: float, div: float, final_div: float, strategy: str
) -> float:
    """The lr of optimizer step `step` (1-based) under OneCycle, written out from its definition."""
    initial, final = max_lr / div, max_lr / div / final_div
    warm_end = pct_start * total - 1
    s = step - 1
    if s <= warm_end:
        start, end, pct = initial, max_lr, s / warm_end
    else:
        start, end, pct = max_lr, final, (s - warm_end) / (total - 1 - warm_end)
    if strategy == "cos":
        return end + (start - end) / 2 * (1 + math.cos(math.pi * pct))
    return start + (end - start) * pct


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["cos", "linear"])
def test_onecycle_schedule(tmp_path, strategy):
    total, lr, pct, div, final_div = 12, 2e-3, 0.25, 20.0, 50.0
    out = train(
        tmp_path,
        "run",
        "--profile",
        "cpu",
        *FAST,
        "--max-steps",
        str(total),
        "--micro-batch-size",
        "2",
        "--grad-accum-steps",
        "1",
        "--lr",
        str(lr),
        "--pct-start",
        str(pct),
        "--div-factor",
        str(div),
        "--final-div-factor",
        str(final_div),
        "--anneal-strategy",
        strategy,
    )
    logged = [m["lr"] for m in read_metrics(out)]
    expected = [onecycle_reference(s, total, lr, pct, div, final_div, strategy) for s in range(1, total + 1)]
    assert logged == pytest.approx(expected, rel=1e-6)
    assert logged[0] == pytest.approx(lr / div) and max(logged) == pytest.approx(lr)
    assert logged.index(max(logged)) == 2  # warm-up ends after pct_start x 12 = 3 steps
    assert logged[-1] == pytest.approx(lr / div / final_div)


def test_onecycle_accepts_any_number_of_steps():
    """--max-steps 10 with pct_start 0.1 is a one-step warm-up, which OneCycleLR alone divides by
    zero on; every run length from 1 step up trains, and a warm-up starts at lr / div_factor."""
    from train import one_cycle_pct_start

    for pct_start in (0.05, 0.1, 0.25, 0.5):
        for max_steps in range(1, 41):
            optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer,
                max_lr=1.0,
                total_steps=max_steps,
                pct_start=one_cycle_pct_start(pct_start, max_steps),
                div_factor=25.0,
                cycle_momentum=False,
            )
            lrs = []
            for _ in range(max_steps):
                lrs.append(scheduler.get_last_lr()[0])
                optimizer.step()
                scheduler.step()
            assert all(math.isfinite(lr) for lr in lrs)
            if pct_start * max_steps >= 1:
                assert lrs[0] == pytest.approx(1.0 / 25.0)


def first_moment(out) -> list[torch.Tensor]:
    state = torch.load(sorted((out / "checkpoints").glob("step_*"))[-1] / "train_state.pt", weights_only=False)
    return [s["exp_avg"] for s in state["optimizer"]["state"].values()]


@pytest.mark.slow
def test_clipping_logs_the_pre_clip_norm_and_applies_the_clipped_gradient(tmp_path):
    """After one AdamW step, exp_avg = (1 - beta1) x the gradient the optimizer was given."""
    common = ["--profile", "cpu", *EXACT, *FAST, "--max-steps", "1", "--micro-batch-size", "4", "--adam-beta1", "0.9"]
    free = train(tmp_path, "free", *common, "--max-grad-norm", "1e9")
    clipped = train(tmp_path, "clipped", *common, "--max-grad-norm", "0.5")
    norm = read_metrics(free)[0]["grad_norm"]
    assert norm > 0.5
    assert read_metrics(clipped)[0]["grad_norm"] == pytest.approx(norm, rel=1e-6)  # logged: pre-clip

    def applied(out):
        # In float64: an fp32 norm over the 379k elements is itself off by 1e-5 of the default run's
        # norm of about 270 (distillation's large first gradients); torch's clipping norm is not.
        return torch.cat([m.flatten() for m in first_moment(out)]).double() / (1 - 0.9)

    assert applied(free).norm().item() == pytest.approx(norm, rel=1e-5)
    assert applied(clipped).norm().item() == pytest.approx(0.5, rel=1e-5)  # applied: clipped
    torch.testing.assert_close(applied(clipped), applied(free) * (0.5 / norm), rtol=1e-4, atol=1e-9)


@pytest.mark.slow
def test_profiler_writes_a_trace_only_when_enabled(tmp_path):
    common = ["--profile", "cpu", *FAST, "--max-steps", "3", "--micro-batch-size", "2", "--grad-accum-steps", "1"]
    on = train(
        tmp_path,
        "on",
        *common,
        "--profiler",
        "true",
        "--profiler-wait",
        "0",
        "--profiler-warmup",
        "1",
        "--profiler-active",
        "1",
    )
    off = train(tmp_path, "off", *common)
    traces = list((on / "traces").glob("rank0*.pt.trace.json"))
    assert len(traces) == 1
    events = json.loads(traces[0].read_text())["traceEvents"]
    assert any(e.get("name") == "ProfilerStep#1" for e in events)
    assert any("Input Dims" in e.get("args", {}) for e in events)  # the cpu profile records shapes
    assert not (off / "traces").exists()


@pytest.mark.slow
def test_bf16_autocast_tracks_fp32_and_needs_no_scaler(tmp_path):
    """At step 1 both runs hold the same weights, so their losses differ by rounding alone. bf16
    keeps 8 significant bits: a rounding moves a value by at most u = 2^-8 of itself. On the
    deepest path from the bytes to a logit there are 58 matmuls: the patch projection, 6 blocks
    of 6 (the encoder's 2 and the pooler's 4, each a projection, the scores, their weighting of
    the values, the output projection and the MLP's two), an adapter's 2, the Qwen's 3 layers of
    6 and its head. Each rounds its two inputs and its output; errors of independent sign add
    like a random walk, so the loss moves by about u * sqrt(3 * 58) = 5% of itself (an estimate:
    the worst case, every error of one sign, is 3 * 58 * u = 68% and would test nothing). Every
    CPU kernel (AMX, AVX512-BF16, AVX2 converting to fp32) rounds the same values to 8 bits and
    accumulates in fp32; they differ only in where the bits fall (0.09% to 0.15% under oneDNN's
    SSE4.1, AVX2, AVX-512 and AVX512-BF16 paths).

    Later steps are not compared value by value: Adam turns each near-zero gradient element's
    rounding into a full step of either sign (see the accumulation test), so from step 2 the two
    runs train different weights (on an AVX512-BF16 CPU the losses differ by 1.7% at step 2 and
    3.7% at step 3). What must hold there is that bf16 trains: its loss falls at every step, as
    fp32's does."""
    # On the grid patching: with word patches these three steps' batches give losses that do not
    # fall at every step in fp32 either (22.1, 23.8, 20.5), so "trains as fp32 does" would need more
    # steps; the matmul path counted above is the same.
    common = [
        "--profile",
        "cpu",
        *FAST,
        "--dropout",
        "0",
        "--max-steps",
        "3",
        "--micro-batch-size",
        "4",
        "--word-patches",
        "false",
        *TWO_LAYER_BATCH,
    ]
    runs = {p: train(tmp_path, p, *common, "--precision", p) for p in ("fp32", "bf16")}
    fp32, bf16 = read_metrics(runs["fp32"]), read_metrics(runs["bf16"])
    assert bf16[0]["loss"] == pytest.approx(fp32[0]["loss"], rel=2**-8 * math.sqrt(3 * 58))
    assert bf16[0]["loss"] != fp32[0]["loss"]  # it really ran in bf16
    for run in (fp32, bf16):
        losses = [m["loss"] for m in run]
        assert len(losses) == 3 and all(b < a for a, b in itertools.pairwise(losses)), losses
    assert scaler_state(runs["bf16"]) == {} and scaler_state(runs["fp32"]) == {}


def scaler_state(out) -> dict:
    state = torch.load(sorted((out / "checkpoints").glob("step_*"))[-1] / "train_state.pt", weights_only=False)
    return state["scaler"]


@pytest.mark.slow
def test_fp16_trains_with_a_grad_scaler(tmp_path):
    out = train(
        tmp_path,
        "fp16",
        "--profile",
        "cpu",
        *FAST,
        "--max-steps",
        "2",
        "--micro-batch-size",
        "4",
        "--precision",
        "fp16",
    )
    assert scaler_state(out)["scale"] > 0  # an enabled scaler saves its scale; a disabled one saves {}
    assert all(math.isfinite(m["loss"]) for m in read_metrics(out))


def test_precision_selection():
    from latentwire.harness.precision import compute_dtype

    assert [compute_dtype(p) for p in ("bf16", "fp16", "fp32")] == [torch.bfloat16, torch.float16, torch.float32]


def all_reduces_per_step(out) -> float:
    trace = next((out / "traces").glob("rank0*.pt.trace.json"))
    events = json.loads(trace.read_text())["traceEvents"]
    steps = sum(e.get("name", "").startswith("ProfilerStep#") for e in events)
    return sum(e.get("name") == "gloo:all_reduce" for e in events) / steps


@pytest.mark.slow
def test_one_gradient_all_reduce_per_optimizer_step(tmp_path):
    """With accumulation 4, DDP must not all-reduce on the first three micro-steps (no_sync):
    the collectives per optimizer step are the same as with no accumulation."""
    single = train(tmp_path, "accum1", *PROFILED_STEPS, "--grad-accum-steps", "1", nproc=2)
    accum = train(tmp_path, "accum4", *PROFILED_STEPS, "--grad-accum-steps", "4", nproc=2)
    assert {p.name.split(".")[0] for p in (single / "traces").iterdir()} == {"rank0", "rank1"}  # one per rank
    assert all_reduces_per_step(single) >= 2  # the token count and at least one gradient bucket
    assert all_reduces_per_step(accum) == all_reduces_per_step(single)


@pytest.mark.slow
@pytest.mark.parametrize(
    "nproc, layout, said",
    [
        (1, (16, 2), "global batch 32 (16 x 1 x 2, as the profile lays it out) kept on 1 rank(s) as 16 x 2 x 1"),
        (2, (16, 1), "global batch 32 (16 x 1 x 2, as the profile lays it out)\n"),
    ],
)
def test_the_profile_s_global_batch_on_another_world_size(tmp_path, nproc, layout, said):
    """The cpu profile is laid out for 2 ranks (16 x 1 x 2 = 32): one process trains the same
    global batch at the same lr, as 16 x 2, says so in its opening lines, and meta.json records it
    (before, one process trained half the global batch at the lr tuned for all of it, and said only
    the product)."""
    out = tmp_path / "run"
    stdout = ok(
        run_train(
            [
                "--profile",
                "cpu",
                "--num-examples",
                "512",
                "--num-workers",
                "0",
                "--kd-weight",
                "0",
                "--max-steps",
                "1",
                "--out-dir",
                str(out),
            ],
            nproc=nproc,
        )
    ).stdout
    config = json.loads(next((out / "checkpoints").iterdir()).joinpath("meta.json").read_text())["config"]
    assert (config["micro_batch_size"], config["grad_accum_steps"], config["lr"]) == (*layout, 1e-3)
    assert f"batch: {said}" in stdout


@pytest.mark.slow
def test_one_process_under_torchrun_runs_no_collective(tmp_path):
    """`torchrun --nproc_per_node=1`, one GPU's usual launch, trains as `python train.py` does: no
    DDP, no all-reduce (before, a world of one joined a group and all-reduced every gradient with
    itself)."""
    run = train(
        tmp_path,
        "torchrun1",
        *PROFILED_STEPS,
        torchrun=True,
    )
    names = {
        e.get("name", "")
        for e in json.loads(next((run / "traces").glob("rank0*.pt.trace.json")).read_text())["traceEvents"]
    }
    assert any(n.startswith("ProfilerStep#") for n in names)
    assert not any("all_reduce" in n or "DistributedDataParallel" in n for n in names), sorted(names)[:50]


@pytest.mark.slow
def test_compiled_loss_equals_eager_under_ddp_with_checkpointing(tmp_path):
    """train.py's --compile (each decoder layer, encoder block and the pooler compiled by inductor)
    on 2 gloo ranks with activation checkpointing, as the GPU profiles run it, trains as eagerly,
    and the evaluation after it (run eagerly) reads the same weights. Inside DDP's forward dynamo's
    DDP optimizer may split a compiled region at gradient-bucket boundaries: each region here holds
    less than one bucket (25 MiB), so every graph stays whole, and the regions compile as the
    single-process run does: no graph break, and one recompile, the decoder layer's (the two LLMs'
    widths). What
    inductor compiled is cached where --compile-cache says, for the next run to read."""
    # As in the accumulation test: Adam at its default epsilon turns the reordered reductions'
    # rounding into different weights from step 2 (the step-3 loss differed by 1.06e-5 on an
    # AVX-512 CPU); at 1e-3 the two runs stay within 7e-7 on every CPU path tried.
    common = [
        "--profile",
        "cpu",
        *FAST,
        "--dropout",
        "0",
        "--precision",
        "fp32",
        "--max-steps",
        "3",
        "--micro-batch-size",
        "4",
        "--eval-every",
        "3",
        "--eval-examples",
        "16",
        "--adam-eps",
        "1e-3",
        "--activation-checkpointing",
        "full",
        *TWO_LAYER_BATCH,
    ]
    eager = train(tmp_path, "eager", *common, "--compile", "false", nproc=2)
    compiled_dir = tmp_path / "compiled"
    cache = tmp_path / "compile_cache"
    proc = ok(
        run_train(
            [*common, "--compile", "true", "--compile-cache", str(cache), "--out-dir", str(compiled_dir)],
            nproc=2,
            TORCH_LOGS="recompiles,graph_breaks,torch._dynamo.backends.distributed",
        )
    )
    assert f"compile: mode default, cache {cache}" in proc.stdout
    assert any((cache / "fxgraph").rglob("*")) and any((cache / "aotautograd").rglob("*"))  # for the next run
    for a, b in zip(read_metrics(eager), read_metrics(compiled_dir), strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
    a, b = read_metrics(eager)[-1], read_metrics(compiled_dir)[-1]
    for name in ("eval_nll_wire_llama", "eval_nll_wire_qwen"):
        assert b[name] == pytest.approx(a[name], rel=1e-4)
    rank0 = [line for line in proc.stderr.splitlines() if line.startswith("[rank0]")]
    buckets = [
        int(n) for line in rank0 for n in re.findall(r"DDPOptimizer used bucket cap \d+ and created (\d+)", line)
    ]
    # One graph for both encoder blocks and one for the pooler, neither split into buckets. (Without
    # the hashed patch code the first block's input is the patch Linear's output, a view, and the
    # second's not: dynamo's guard on the view's base recompiled the block.)
    assert buckets == [1, 1], "\n".join(rank0)
    assert sum("Recompiling function" in line for line in rank0) == 1
    assert not any("Graph break" in line for line in rank0)
