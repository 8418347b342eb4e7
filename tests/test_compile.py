"""torch.compile of the training step, one region at a time (latentwire.compiling).

On the cpu profile's tiny LLMs with activation checkpointing on, as the GPU profiles run them.
The backend is aot_eager: dynamo's graphs and guards and AOTAutograd's forward/backward split,
exactly what inductor is handed, without inductor's minutes of C++ compiling. train.py's
`--compile true` run (tests/test_train.py::test_compiled_loss_equals_eager_under_ddp_with_checkpointing)
goes through inductor.
"""

import random

import pytest
import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

from conftest import ALL_TERMS
from latentwire.dataset import IGNORE_INDEX, PAD_BYTE, label_positions
from latentwire.harness.compiling import stable_shapes
from latentwire.harness.recompute import checkpoint_options
from latentwire.model import WireEncoder
from latentwire.objectives import Objectives, forward_loss_sums
from latentwire.parallelize import DECODER_LAYER_VARIANTS, frozen_llms, prepare_frozen_llms, wire_regions
from latentwire.settings import load_config

CPU = torch.device("cpu")
BACKEND = "aot_eager"
MICRO_BATCH = 32


def graphs() -> int:
    """Graphs dynamo has compiled in this process (each compile or recompile of any region)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def build():
    cfg = load_config(["--profile", "cpu", "--dropout", "0"])
    llms = frozen_llms(cfg.frozen, cfg.prompt, "fp32", CPU, checkpointing=checkpoint_options("full"))
    torch.manual_seed(0)
    model = WireEncoder.for_llms(cfg.wire, llms)
    return cfg, model, llms


def make_batch(llms: dict, rows: int, prompt_width: int, answer_widths: dict, seed: int) -> dict:
    """A collated batch of the given padded widths: random bytes and tokens, rows of random real
    lengths (the first one full), padding and labels laid out as data.Collator lays them out."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, prompt_width + 1, (rows,), generator=g)
    lengths[0] = prompt_width
    byte_mask = torch.arange(prompt_width) < lengths[:, None]
    byte_ids = torch.randint(0, 256, (rows, prompt_width), generator=g).masked_fill(~byte_mask, PAD_BYTE)
    answers = {}
    for name, llm in llms.items():
        width, vocab = answer_widths[name], llm.model.config.vocab_size
        real = torch.randint(1, width + 1, (rows,), generator=g)
        real[0] = width
        targets = torch.randint(0, vocab, (rows, width + 1), generator=g)
        labels = targets.masked_fill(torch.arange(width + 1) > real[:, None], IGNORE_INDEX)
        answers[name] = {
            "lead_ids": torch.tensor([list(llm.contract.lead)] * rows, dtype=torch.long).view(rows, -1),
            "input_ids": torch.randint(0, vocab, (rows, width), generator=g),
            "labels": labels,
            "label_positions": label_positions(labels),
        }
    return {"bytes": byte_ids, "byte_mask": byte_mask, "answers": answers}


def with_kd_targets(batch: dict, llms: dict) -> dict:
    """The batch with distillation targets as the collator places them: full log-prob rows."""
    for name, rows in batch["answers"].items():
        logits = torch.randn(*rows["labels"].shape, llms[name].model.config.vocab_size)
        rows["kd_logprobs"] = torch.log_softmax(logits, -1)
    return batch


def widths(n: int = 20) -> list[tuple[int, dict]]:
    """(prompt width, answer width per LLM) of n batches: prompt widths multiples of 32 (the cpu
    profile's pad_multiple), answer widths multiples of 8, as the collator pads them. The first
    three make sizes coincide as real batches now and then do: prompt width = micro-batch (32),
    both answer widths equal (24), the Qwen's sequence (8 latents + 24, no BOS) = micro-batch. Duck sizing
    would give coinciding sizes one symbol, a guard that a later batch breaks (the step compiled
    as one graph compiles 3 times here)."""
    rng = random.Random(0)
    out = [(32, {"llama": 24, "qwen": 24}), (64, {"llama": 24, "qwen": 24}), (64, {"llama": 24, "qwen": 8})]
    while len(out) < n:
        out.append((32 * rng.randint(1, 8), {"llama": 8 * rng.randint(1, 3), "qwen": 8 * rng.randint(1, 3)}))
    return out


def compile_as_train_py(model, llms):
    """train.py's compile blocks, with the test backend in place of inductor."""
    options = {"backend": BACKEND, "dynamic": True}
    prepare_frozen_llms(llms, checkpointing=None, compile_options=options, mesh=None, device=None)
    for region in wire_regions(model):
        region.compile(**options)
    return stable_shapes()(forward_loss_sums)


@pytest.fixture(scope="module")
def compiled_run():
    """20 batches of varied prompt and answer lengths through the compiled step, forward and
    backward; the graphs compiled after each."""
    torch.set_num_threads(1)
    torch._dynamo.reset()
    cfg, model, llms = build()
    step = compile_as_train_py(model, llms)
    batches = [make_batch(llms, MICRO_BATCH, p, w, seed) for seed, (p, w) in enumerate(widths())]
    graphs_before, graphs_after = [], []
    for batch in batches:
        graphs_before.append(graphs())
        step(model, llms, batch, Objectives()).sum().backward()
        graphs_after.append(graphs())
    model.zero_grad(set_to_none=True)
    yield {
        "model": model,
        "llms": llms,
        "step": step,
        "batches": batches,
        "compiled_in": [i for i, (a, b) in enumerate(zip(graphs_before, graphs_after, strict=True)) if b > a],
        "graphs": graphs_after[-1] - graphs_before[0],
    }
    torch._dynamo.reset()


@pytest.mark.slow
def test_twenty_batches_of_varied_lengths_compile_the_step_at_most_twice(compiled_run):
    compiled_in = compiled_run["compiled_in"]
    assert compiled_in[0] == 0 and len(compiled_in) <= 2, f"steps that compiled: {compiled_in}"
    # Encoder block, pooler, Llama layer, Qwen2 layer: one graph each (a recompile allowed each),
    # not one per decoder layer.
    assert 4 <= compiled_run["graphs"] <= 8


def assert_compiled_equals_eager(model, llms, step, batch, objectives):
    def loss_and_grads(run):
        loss = run(model, llms, batch, objectives)
        loss.sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        return loss.detach(), grads

    compiled_loss, compiled_grads = loss_and_grads(step)
    eager_loss, eager_grads = loss_and_grads(forward_loss_sums)  # compiled regions, told to run eagerly below
    with torch.compiler.set_stance("force_eager"):
        forced_loss, forced_grads = loss_and_grads(step)
    torch.testing.assert_close(forced_loss, compiled_loss, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(eager_loss, compiled_loss, rtol=1e-5, atol=1e-4)
    for name, grad in compiled_grads.items():
        torch.testing.assert_close(forced_grads[name], grad, rtol=1e-4, atol=1e-6)


@pytest.mark.slow
def test_compiled_step_equals_eager(compiled_run):
    assert_compiled_equals_eager(
        compiled_run["model"], compiled_run["llms"], compiled_run["step"], compiled_run["batches"][-1], Objectives()
    )


@pytest.mark.slow
def test_evaluation_under_force_eager_compiles_nothing(compiled_run):
    """Compiled regions would recompile for evaluation's calls (eval mode, no_grad, padded
    attention, a KV cache): evaluation runs under torch.compiler.set_stance("force_eager")."""
    model, llms = compiled_run["model"], compiled_run["llms"]
    before = graphs()
    model.eval()
    try:
        with torch.compiler.set_stance("force_eager"), torch.no_grad():
            forward_loss_sums(model, llms, compiled_run["batches"][0], Objectives())
    finally:
        model.train()
    assert graphs() == before


@pytest.mark.slow
def test_decoder_layer_variants_compile_within_the_recompile_limit(compiled_run):
    """Every decoder layer of both LLMs enters dynamo through one code object,
    CheckpointWrapper.forward, whose cache holds recompile_limit variants; past it a variant runs
    eagerly with a log line, here an error (fail_on_recompile_limit_hit). The step makes 2, one per
    LLM, with every distillation term on (its teacher ran before the step); each may cost one
    recompile, which aot_eager (no inductor size guards) shows with a 1-row batch (dynamo
    specialises a size of 1): the 4 planned. A loss-only pass under no_grad, one more per LLM,
    still compiles within dynamo's default limit."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    model, llms, step = compiled_run["model"], compiled_run["llms"], compiled_run["step"]

    def entries():
        return len(_debug_get_cache_entry_list(CheckpointWrapper.forward.__code__))

    varied = [with_kd_targets(make_batch(llms, MICRO_BATCH, p, w, seed), llms) for seed, (p, w) in enumerate(widths(4))]
    one_row = with_kd_targets(make_batch(llms, 1, 64, {"llama": 16, "qwen": 8}, seed=7), llms)
    counts = []
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        for batch in varied:
            step(model, llms, batch, ALL_TERMS).sum().backward()
        counts.append(entries())
        step(model, llms, one_row, ALL_TERMS).sum().backward()
        counts.append(entries())
        with torch.no_grad():
            step(model, llms, varied[0], Objectives())
        counts.append(entries())
    model.zero_grad(set_to_none=True)
    assert counts == [2, DECODER_LAYER_VARIANTS, DECODER_LAYER_VARIANTS + 2]
    assert counts[-1] <= torch._dynamo.config.recompile_limit


def test_regions_are_the_checkpointed_decoder_layers_and_the_encoder_blocks():
    cfg, model, llms = build()
    names = list(model.state_dict())
    compile_as_train_py(model, llms)
    decoder_layers = [layer for llm in llms.values() for layer in llm.model.get_decoder().layers]
    assert all(isinstance(layer, CheckpointWrapper) for layer in decoder_layers)  # compiled with its recompute
    compiled = [
        m
        for m in [*model.modules(), *(m for llm in llms.values() for m in llm.model.modules())]
        if getattr(m, "_compiled_call_impl", None) is not None
    ]
    assert compiled == [*model.encoder.blocks, model.pooler, *decoder_layers]
    assert list(model.state_dict()) == names  # checkpoints keep their tensor names


def test_stable_shapes_is_scoped():
    import torch.fx.experimental._config as fx_config

    def settings():
        return torch._dynamo.config.specialize_float, fx_config.use_duck_shape

    outside = settings()
    with stable_shapes():
        assert settings() == (True, False)
    assert settings() == outside


def test_the_compile_cache_outlives_tmp(monkeypatch, tmp_path):
    """Inductor's own default is under /tmp, gone on a requeued job's fresh machine: the run's
    cache is --compile-cache, else the user's TORCHINDUCTOR_CACHE_DIR, else the home directory's
    cache (docs/performance.md measures a warm start)."""
    from latentwire.harness.compiling import inductor_cache_dir

    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert inductor_cache_dir("", "latentwire") == tmp_path / "home" / ".cache" / "latentwire" / "inductor"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert inductor_cache_dir("", "latentwire") == tmp_path / "xdg" / "latentwire" / "inductor"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "mine"))
    assert inductor_cache_dir("", "latentwire") == tmp_path / "mine"
    assert inductor_cache_dir(str(tmp_path / "asked"), "latentwire") == tmp_path / "asked"
