"""Frozen LLMs sharded by FSDP2 (--frozen-sharding fsdp) on two gloo ranks: the same training as
whole LLMs on every rank, a resume as exact as unsharded, each rank holding half the frozen bytes
and reading only its rows of the checkpoint."""

import json
import re

import pytest
import torch

from conftest import (
    RUN,
    SMALL_LLAMA,
    assert_same_run,
    evaluate_cli,
    final_weights,
    ok,
    read_metrics,
    run_module,
    run_train,
)

# Two ranks, accumulation 2, fp32 without dropout, the decoder layers recomputed in backward as on
# the GPU profiles; the last step evaluates, which under fsdp must make the same LLM calls on every
# rank (a rank that called fewer would leave the others waiting).
ARGS = [
    *RUN,
    "--max-steps",
    "4",
    "--micro-batch-size",
    "2",
    "--activation-checkpointing",
    "full",
    "--eval-every",
    "4",
    "--eval-examples",
    "6",
]


@pytest.fixture(scope="module")
def runs(tmp_path_factory, saved_reader):
    """The unbroken run with whole LLMs and with sharded ones: their out_dirs and train.py's output.
    The Qwen reader is read from a checkpoint directory (the tiny one, saved), so both ways of
    loading it, whole and a rank's rows, are in the comparison."""
    root = tmp_path_factory.mktemp("sharding")
    args = [*ARGS, "--qwen", str(saved_reader)]
    procs = {
        mode: ok(run_train([*args, "--frozen-sharding", mode, "--out-dir", str(root / mode)], nproc=2))
        for mode in ("none", "fsdp")
    }
    return {mode: (root / mode, proc) for mode, proc in procs.items()}


def held_mib(proc, stream: str = "stdout") -> float:
    """The frozen parameter bytes rank 0 holds, in MiB, as train.py's opening line (and a sharded
    evaluation, on stderr) reports them."""
    return float(re.search(r"\(([\d.]+) MiB held per rank\)", getattr(proc, stream)).group(1))


@pytest.mark.slow
def test_sharded_frozen_llms_train_as_whole_ones(runs):
    (whole, whole_proc), (sharded, sharded_proc) = runs["none"], runs["fsdp"]
    a, b = final_weights(whole), final_weights(sharded)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise: the same arithmetic
    for x, y in zip(read_metrics(whole), read_metrics(sharded), strict=True):
        scalars = [k for k in x if k == "loss" or k.startswith(("loss_", "eval_"))]
        assert {k: y[k] for k in scalars} == {k: x[k] for k in scalars}
    assert "eval_nll_wire_llama" in read_metrics(sharded)[-1]
    assert held_mib(sharded_proc) == pytest.approx(held_mib(whole_proc) / 2, rel=0.02)


@pytest.mark.slow
def test_stop_and_resume_under_fsdp_is_bitwise_exact(runs, saved_reader, tmp_path):
    args, split = [*ARGS, "--qwen", str(saved_reader), "--frozen-sharding", "fsdp"], tmp_path / "split"
    ok(run_train([*args, "--out-dir", str(split), "--stop-at-step", "2"], nproc=2))
    ok(run_train([*args, "--out-dir", str(split), "--resume"], nproc=2))
    assert_same_run(runs["fsdp"][0], split, 2)


@pytest.mark.slow
def test_the_memory_plan_holds_what_a_sharded_rank_holds(runs, saved_reader, tmp_path):
    """The plan computes the shards (padding included) and the all-gathered units rather than
    tracing them: its frozen bytes per rank are what rank 0 of the real run holds."""
    ok(
        run_module(
            "latentwire.plan",
            [
                "--profile",
                "cpu",
                "--qwen",
                str(saved_reader),
                "--frozen-sharding",
                "fsdp",
                "--json",
                str(tmp_path / "p.json"),
            ],
        )
    )
    plan = json.loads((tmp_path / "p.json").read_text())
    assert plan["world_size"] == 2 and plan["frozen_sharding"] == "fsdp"  # the cpu profile's num_gpus
    assert plan["params_frozen_bytes"] / 2**20 == pytest.approx(held_mib(runs["fsdp"][1]), abs=0.006)
    assert 0 < plan["fsdp_gathered_bytes"] < plan["params_frozen_bytes"]


@pytest.mark.slow
def test_a_sharded_run_is_evaluated_sharded_with_the_numbers_of_whole_llms(runs, tmp_path):
    """The run says to evaluate it on as many ranks; there the LLMs are sharded again, each rank
    holding half, and the report is the one-process, whole-LLM report."""
    sharded_run, proc = runs["fsdp"]
    assert f"torchrun --nproc_per_node=2 -m latentwire.evaluate --ckpt {sharded_run}" in proc.stdout
    two = evaluate_cli(sharded_run, tmp_path / "two", nproc=2, n=12)
    evaluate_cli(sharded_run, tmp_path / "one", n=12)
    assert held_mib(two, stream="stderr") == pytest.approx(held_mib(proc), abs=0.006)
    reports = [json.loads(next((tmp_path / d).glob("*.json")).read_text()) for d in ("two", "one")]
    assert reports[0]["answers"] == reports[1]["answers"]
    assert reports[0]["metrics"] == pytest.approx(reports[1]["metrics"], rel=1e-6)


@pytest.fixture(params=[(2, 1), (3, 2)], ids=["rank1of2", "rank2of3"])
def fake_rank(request):
    """This process as one rank of a world on torch's fake backend: a mesh to shard over whose
    collectives do nothing. Loading needs none: a rank allocates and reads its shards on its own.
    Three ranks split dim-0 sizes unevenly (torch.chunk gives the last rank fewer rows)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world, rank = request.param
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield init_device_mesh("cpu", (world,)), world, rank
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("source", ["checkpoint", "random"])
def test_a_sharded_rank_allocates_and_reads_only_its_rows(fake_rank, saved_reader, tmp_path, source):
    """Built on the meta device, wrapped and sharded as train.py does, then loaded: the rank holds its
    torch.chunk of every tensor of the whole model (the Qwen's 256-row MLP splits 86/86/84 over
    three; the Llama's odd vocabulary too), and reads no more than that."""
    from torch.distributed.fsdp import fully_shard

    from latentwire.harness.recompute import checkpoint_options
    from latentwire.llm import build_frozen_llm, fsdp_units, load_frozen_llm, read_weights
    from latentwire.parallelize import checkpoint_decoder_layers

    if source == "checkpoint":
        name, source = "qwen", str(saved_reader)
    else:
        (tmp_path / "config.json").write_text(json.dumps(dict(SMALL_LLAMA, vocab_size=4099, intermediate_size=130)))
        name, source = "llama", f"random:{tmp_path / 'config.json'}"
    reference = load_frozen_llm(name, source, torch.float32, torch.device("cpu")).model
    whole = reference.state_dict()
    with torch.device("meta"):
        llm = build_frozen_llm(name, source, torch.float32)
    checkpoint_decoder_layers(llm, checkpoint_options("full"))
    mesh, world, rank = fake_rank
    for unit in fsdp_units(llm):
        fully_shard(unit, mesh=mesh)
    fully_shard(llm.model, mesh=mesh)
    read_rows, read = [], llm.weights.read

    def counted_read(key, rows, like):
        tensor = read(key, rows, like)
        read_rows.append(tensor.shape[0])
        return tensor

    llm.weights.read = counted_read
    llm.model.to_empty(device=torch.device("cpu"))
    read_weights(llm)

    sharded = llm.model.state_dict()
    assert sharded.keys() == whole.keys()
    for key, tensor in whole.items():
        pieces = torch.chunk(tensor, world)
        mine = pieces[rank] if rank < len(pieces) else tensor[:0]
        assert torch.equal(sharded[key].to_local(), mine), key
    assert sum(read_rows) == sum(t.to_local().shape[0] for t in sharded.values())
    assert sum(read_rows) <= sum(-(-t.shape[0] // world) for t in whole.values())
    # RoPE's inverse frequencies, in no checkpoint, computed again on the device.
    assert torch.equal(llm.model.get_decoder().rotary_emb.inv_freq, reference.get_decoder().rotary_emb.inv_freq)


@pytest.mark.parametrize("fake_rank", [(2, 1)], indirect=True)
def test_backward_gathers_every_decoder_layer_and_never_the_embedding_table(fake_rank, monkeypatch):
    """A training call's backward all-gathers each decoder layer (the wire's gradient passes through
    it) and nothing that backward does not use: FSDP2's default prefetch would gather the embedding
    table, the unit that ran before layer 0, at the end of every backward (2.5 GB for Qwen2.5-7B's);
    nor the head, gathered once for the loss, which takes there what backward needs."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup, TrainingState
    from torch.distributed.tensor import DTensor

    from latentwire.dataset import label_positions
    from latentwire.llm import build_frozen_llm, fsdp_units, read_weights, skip_unused_backward_gathers
    from latentwire.objectives import Objectives, llm_term_sums

    with torch.device("meta"):
        llm = build_frozen_llm("llama", "tiny-random", torch.float32)
    mesh, _, _ = fake_rank
    for unit in fsdp_units(llm):  # as train.py shards
        fully_shard(unit, mesh=mesh)
    fully_shard(llm.model, mesh=mesh)
    skip_unused_backward_gathers(llm)
    llm.model.to_empty(device=torch.device("cpu"))
    read_weights(llm)
    gathered_in_backward, unshard = [], FSDPParamGroup.unshard

    def recording_unshard(group, async_op=False):
        was_gathered = group.is_unsharded or group._all_gather_result is not None
        unshard(group, async_op)
        now_gathered = group.is_unsharded or group._all_gather_result is not None
        if group._training_state == TrainingState.PRE_BACKWARD and now_gathered and not was_gathered:
            gathered_in_backward.extend(group.modules)

    monkeypatch.setattr(FSDPParamGroup, "unshard", recording_unshard)
    soft = torch.randn(2, 3, llm.hidden_size, requires_grad=True)
    ids = torch.ones((2, 4), dtype=torch.long)
    labels = torch.tensor([[-100, 5, 2, -100, -100], [-100, 7, 8, 2, -100]])
    hidden = llm.answer_hidden(soft, ids[:, :1], ids)
    head = llm.model.get_output_embeddings()
    with llm.head_weight() as weight:  # gathered whole for the loss, released after
        assert not isinstance(weight, DTensor) and weight.shape == (llm.model.config.vocab_size, llm.hidden_size)
        sums = llm_term_sums(
            hidden, weight, {"labels": labels, "label_positions": label_positions(labels)}, Objectives()
        )
    assert isinstance(head.weight, DTensor)
    sums.sum().backward()
    assert soft.grad is not None
    layers = list(llm.model.get_decoder().layers)
    assert all(any(m is layer for m in gathered_in_backward) for layer in layers)
    assert not any(m is llm.model.get_input_embeddings() or m is head for m in gathered_in_backward)


@pytest.mark.parametrize("fake_rank", [(2, 1)], indirect=True)
def test_layers_compiled_before_sharding_compile_nothing_while_the_llm_is_read(fake_rank):
    """train.py compiles each decoder layer before fully_shard; FSDP2's one root forward at load
    (`start_fsdp_root`) must run eagerly, or it would compile a variant no training step uses, on
    every sharded GPU profile, before the first step."""
    from torch._dynamo.utils import counters
    from torch.distributed.fsdp import fully_shard

    from latentwire.llm import build_frozen_llm, decoder_layers, fsdp_units, read_weights

    torch._dynamo.reset()
    counters.clear()
    with torch.device("meta"):
        llm = build_frozen_llm("llama", "tiny-random", torch.float32)
    for layer in decoder_layers(llm):
        layer.compile(backend="eager", dynamic=True)
    mesh, _, _ = fake_rank
    for unit in fsdp_units(llm):
        fully_shard(unit, mesh=mesh)
    fully_shard(llm.model, mesh=mesh)
    llm.model.to_empty(device=torch.device("cpu"))
    read_weights(llm)
    assert counters["stats"]["unique_graphs"] == 0
    ids = torch.ones((1, 4), dtype=torch.long)
    with torch.no_grad():
        llm.model(input_ids=ids, use_cache=False)  # the layers are compiled, for the calls that follow
    assert counters["stats"]["unique_graphs"] > 0
    torch._dynamo.reset()
