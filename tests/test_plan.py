"""The memory plan: exact configurations, the traced step against a measured one, the analytic
calculator against the trace and against torch's optimizers, the budget, elastic batch."""

import json
import math
import typing

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from conftest import assert_one_line_error, distilled_collator, instruct_reader, ok, run_module, tiny_llms
from latentwire.dataset import IGNORE_INDEX, Collator, PromptDataset
from latentwire.find_batch import Probe
from latentwire.harness.errors import UserError
from latentwire.harness.exits import main_guard
from latentwire.harness.layout import scaled_lr
from latentwire.harness.recompute import Policy, checkpoint_options
from latentwire.known_llms import KNOWN_LLMS, llm_parameter_count
from latentwire.llm import build_frozen_llm
from latentwire.llm_sources import llm_spec
from latentwire.parallelize import frozen_llms, prepare_frozen_llms
from latentwire.plan import main as plan_main
from latentwire.planner.analytic import optimizer_state_bytes, static_memory
from latentwire.planner.budget import GIB, Fit, budget_for, fit_line, largest_fitting
from latentwire.planner.elastic import elastic_batch
from latentwire.planner.memory_plan import make_plan, planned_rows
from latentwire.planner.memtrace import FrozenAwareMemTracker, StepTracer, cuda_kernels, fake_llms, planning_batch
from latentwire.planner.script import script_step
from latentwire.prompting import CHAT_FRAMING_TOKENS, DEFAULT_ANCHOR, PromptFormat
from latentwire.settings import load_config

TRAINING_STEP = script_step()  # train.py's, as the commands plan it

LLAMA_3_1_8B_PARAMS = 8_030_261_248  # the published counts
QWEN_2_5_7B_PARAMS = 7_615_616_512
LLAMA_3_1_70B_PARAMS = 70_553_706_496
QWEN_2_5_72B_PARAMS = 72_706_203_648
CPU = torch.device("cpu")


def specs_and_answers(cfg):
    specs = {name: llm_spec(name, cfg.frozen.source(name)) for name in ("llama", "qwen")}
    return specs, planned_rows(cfg.prompt, specs)


def profile_fakes(cfg, specs):
    """The profile's frozen LLMs as the plan builds and wraps them (call under a FakeTensorMode)."""
    llms = fake_llms(specs, cfg.numerics.precision)
    prepare_frozen_llms(
        llms, checkpointing=checkpoint_options(cfg.recompute.policy), compile_options=None, mesh=None, device=None
    )
    return llms


def traced_peak(cfg, micro_batch: int) -> int:
    specs, answers = specs_and_answers(cfg)
    with torch.random.fork_rng(devices=[]), FakeTensorMode():
        tracer = StepTracer(cfg, profile_fakes(cfg, specs), answers, TRAINING_STEP)
        return tracer.trace(micro_batch).peak["total"]


@pytest.fixture(scope="module")
def cpu_plan():
    return make_plan(load_config(["--profile", "cpu"]), 1, TRAINING_STEP)


# --- exact configurations -------------------------------------------------------------------


def test_shipped_configurations_have_the_published_parameter_counts():
    expected = {
        "meta-llama/Llama-3.1-8B": LLAMA_3_1_8B_PARAMS,
        "Qwen/Qwen2.5-7B": QWEN_2_5_7B_PARAMS,
        "meta-llama/Llama-3.1-70B": LLAMA_3_1_70B_PARAMS,
        "Qwen/Qwen2.5-72B": QWEN_2_5_72B_PARAMS,
    }
    for source, count in expected.items():
        spec = llm_spec("x", source)
        assert llm_parameter_count(spec.config) == count
        cfg = load_config(["--profile", "h100", "--activation-checkpointing", "none"])
        with FakeTensorMode():
            model = profile_fakes(cfg, {"x": spec})["x"].model
            assert sum(p.numel() for p in model.parameters()) == count
            assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert set(expected) <= set(KNOWN_LLMS)


def test_the_sharded_70b_pair_holds_an_eighth_per_gpu():
    """h100x8-70b: FSDP2 shards over its 8 GPUs; the largest unit gathered whole is Qwen2.5-72B's
    head (152064 x 8192 in bf16), two of them at once."""
    from latentwire.planner.memory_plan import fsdp_frozen_memory

    cfg = load_config(["--profile", "h100x8-70b"])
    specs, _ = specs_and_answers(cfg)
    with FakeTensorMode():
        held, gathered = fsdp_frozen_memory(profile_fakes(cfg, specs), cfg.training.num_gpus)
    assert cfg.training.num_gpus == 8 and cfg.frozen.sharding == "fsdp"
    assert held == pytest.approx(2 * (LLAMA_3_1_70B_PARAMS + QWEN_2_5_72B_PARAMS) / 8, rel=0.005)
    assert gathered == 2 * 152064 * 8192 * 2


def test_a_local_model_directory_is_read_from_its_config(tmp_path):
    spec = llm_spec("qwen", "Qwen/Qwen2.5-7B")
    spec.config.save_pretrained(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": None, "eos_token": "<|endoftext|>"}))
    local = llm_spec("qwen", str(tmp_path))
    assert llm_parameter_count(local.config) == QWEN_2_5_7B_PARAMS and not local.has_bos


def test_an_unknown_model_is_a_user_error():
    with pytest.raises(UserError, match="no configuration for 'nobody/Nothing-1B'"):
        llm_spec("llama", "nobody/Nothing-1B")


def test_planning_batch_is_the_longest_the_collator_emits():
    """Shapes as the collator pads prompts cut at max_prompt_bytes and answers cut at max_answer_tokens."""
    cfg = load_config(["--profile", "cpu", "--max-prompt-bytes", "100", "--max-answer-tokens", "5", "--kd-weight", "1"])
    llms = tiny_llms()
    long_example = {
        "context": "Maria lives in Paris. " * 20,
        "question": "Where?",
        "answers": {"text": ["Paris Tokyo Lima Cairo Oslo Berlin Madrid Toronto"]},
    }
    dataset = PromptDataset([long_example] * 3)
    collated = distilled_collator(
        llms, dataset, cfg.objectives, cfg.data.max_prompt_bytes, cfg.data.max_answer_tokens, cfg.data.pad_multiple
    )([dataset[i] for i in range(3)])
    planned = planning_batch(
        cfg.data,
        cfg.objectives,
        {n: (len(llm.contract.lead), len(llm.contract.tail), len(llm.tokenizer)) for n, llm in llms.items()},
        3,
    )
    assert planned["bytes"].shape == collated["bytes"].shape
    assert torch.equal(planned["byte_mask"], collated["byte_mask"])
    for name in llms:
        assert planned["answers"][name].keys() == collated["answers"][name].keys()
        for key in ("lead_ids", "input_ids", "labels", "kd_logprobs"):  # the distillation targets: full rows
            assert planned["answers"][name][key].shape == collated["answers"][name][key].shape, (name, key)
        targets = (collated["answers"][name]["labels"] != IGNORE_INDEX).sum().item()
        assert (planned["answers"][name]["labels"] != IGNORE_INDEX).sum().item() == targets
        # where the head runs: built by hand for the fakes, found by the collator
        assert torch.equal(planned["answers"][name]["label_positions"], collated["answers"][name]["label_positions"])


def test_the_planning_batch_holds_word_patched_prompts():
    """With word patches a prompt's row outgrows its bytes: one-letter words double it here."""
    cfg = load_config(["--profile", "cpu", "--max-prompt-bytes", "300", "--word-patches", "true"])
    llms = tiny_llms()
    dataset = PromptDataset([{"context": "a " * 200, "question": "Which?", "answers": {"text": ["a"]}}])
    collated = Collator.for_llms(llms, 300, 16, 32, word_patch=cfg.wire.word_patch)([dataset[0]])
    rows = {n: (len(llm.contract.lead), len(llm.contract.tail), len(llm.tokenizer)) for n, llm in llms.items()}
    planned = planning_batch(cfg.data, cfg.objectives, rows, 1, word_patch=cfg.wire.word_patch)
    assert collated["bytes"].shape[1] > 2 * 280 and planned["bytes"].shape[1] >= collated["bytes"].shape[1]


def test_planned_rows_hold_each_readers_prompt_contract(tmp_path):
    """A local reader's rows are its prompt contract's, counted by its own tokenizer (an instruct
    one's chat template read from its directory), as the step's are; a known hub model, planned
    without its tokenizer, with a template unless --chat-template false."""
    reader = instruct_reader(tmp_path)
    for prompt in (PromptFormat(), PromptFormat(anchor="", instruction=""), PromptFormat(chat_template="false")):
        specs = {"llama": llm_spec("llama", str(reader)), "qwen": llm_spec("qwen", "tiny")}
        rows = planned_rows(prompt, specs)
        for name, source in (("llama", str(reader)), ("qwen", "tiny")):
            with torch.device("meta"):
                contract = build_frozen_llm(name, source, torch.float32, prompt).contract
            lead, tail, _ = rows[name]
            assert contract.chat == (name == "llama" and prompt.chat_template == "auto")
            assert (lead, tail) == (len(contract.lead), len(contract.tail))
    hub = {"llama": llm_spec("llama", "meta-llama/Llama-3.1-8B-Instruct")}
    assert planned_rows(PromptFormat(), hub)["llama"][0] == CHAT_FRAMING_TOKENS
    assert planned_rows(PromptFormat(chat_template="false"), hub)["llama"][:2] == (1, len(DEFAULT_ANCHOR))


# --- the tracer -----------------------------------------------------------------------------


@pytest.mark.filterwarnings("ignore:global module forward hook")
def test_stock_memtracker_fails_on_frozen_parameters_where_the_subclass_counts_only_trainable_grads():
    """Why FrozenAwareMemTracker exists (torch 2.13); if this starts passing upstream, drop the override."""
    from torch.distributed._tools.mem_tracker import MemTracker

    def model():
        m = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8))
        m[0].requires_grad_(False)
        return m

    m = model()
    with pytest.raises(RuntimeError, match="doesn't require gradient"), MemTracker():
        m(torch.randn(2, 8)).sum().backward()
    m = model()
    tracker = FrozenAwareMemTracker()
    with tracker:
        for _ in range(2):  # a second forward of the root module is refused without a reset
            m(torch.randn(2, 8)).sum().backward()
            tracker.reset_mod_stats()
    assert tracker.categories()["gradients"] == sum(4 * p.numel() for p in m[1].parameters())


def measured_and_traced_peaks(cfg) -> tuple[int, int]:
    """The CPU allocator's own count of a real step (find_batch's probe), and the fake trace of it."""
    llms = frozen_llms(
        cfg.frozen, cfg.prompt, cfg.numerics.precision, CPU, checkpointing=checkpoint_options(cfg.recompute.policy)
    )
    measured, _ = Probe(cfg, llms, TRAINING_STEP, CPU, steps=2, cap_bytes=2**62)(cfg.training.micro_batch_size)
    return measured, traced_peak(cfg, cfg.training.micro_batch_size)


# The cpu profile with dropout on and a small micro-batch: the step each activation checkpointing policy runs.
CHECKPOINTED_STEP = ["--profile", "cpu", "--dropout", "0.1", "--micro-batch-size", "6"]


@pytest.fixture(scope="module")
def checkpointed_peaks() -> dict[str, tuple[int, int]]:
    """Each policy's (measured, traced) peak of the same step."""
    return {
        policy: measured_and_traced_peaks(load_config([*CHECKPOINTED_STEP, "--activation-checkpointing", policy]))
        for policy in typing.get_args(Policy)
    }


def test_traced_peak_matches_the_measured_peak_of_the_same_cpu_step(checkpointed_peaks):
    """The fake trace against the CPU allocator's own count of the same real step, tiny readers,
    under each activation checkpointing policy: selective's kept outputs are traced as they are kept."""
    for policy, (measured, traced) in checkpointed_peaks.items():
        assert traced == pytest.approx(measured, rel=0.10), policy


def test_the_plan_keeps_less_with_more_recompute(checkpointed_peaks):
    """The planned peak, and the one measured: full recompute keeps less than selective, which
    keeps less than no recompute."""
    for of in (0, 1):
        peaks = {policy: both[of] for policy, both in checkpointed_peaks.items()}
        assert peaks["full"] < peaks["selective"] < peaks["none"], peaks


# SmolLM-135M's vocabulary and widths with one decoder layer: a reader whose head and loss
# (vocabulary x answer positions) weigh in the step as a real one's do, stepped in seconds.
REAL_VOCAB_READER = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 576,
    "intermediate_size": 1536,
    "num_hidden_layers": 1,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "tie_word_embeddings": True,
}


@pytest.fixture(scope="module")
def real_vocab_reader(tmp_path_factory) -> str:
    config = tmp_path_factory.mktemp("reader") / "config.json"
    config.write_text(json.dumps(REAL_VOCAB_READER))
    return f"random:{config}"


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")
@pytest.mark.parametrize("precision, micro_batch", [("fp32", 4), ("bf16", 1)])  # bf16 matmuls are slow on AVX2
def test_traced_peak_matches_the_measured_peak_with_a_real_sized_vocabulary(real_vocab_reader, precision, micro_batch):
    """The same comparison with the Llama slot's vocabulary at 49152, recompute on. Where oneDNN runs
    bf16 matmuls (AVX512 BW/VL/DQ, AVX-NE-CONVERT or AMX) too: the heads' matmuls are 2-D, over the
    gathered positions against the transposed weight, which oneDNN reads in place. Taken over every
    kept position ([batch, positions, hidden], strided), they were batched against the weight
    expanded over the batch, which oneDNN copied: 34% over the trace at micro-batch 4 (docs/memory.md,
    "How far to trust it")."""
    cfg = load_config(
        [
            "--profile",
            "cpu",
            "--llama",
            real_vocab_reader,
            "--precision",
            precision,
            "--activation-checkpointing",
            "full",
            "--micro-batch-size",
            str(micro_batch),
            "--max-prompt-bytes",
            "384",
        ]
    )
    measured, traced = measured_and_traced_peaks(cfg)
    assert measured == pytest.approx(traced, rel=1e-3)


def test_cuda_attention_is_traced_without_the_math_kernels_score_matrices():
    """On a CUDA profile the trace takes train.py's flash / memory-efficient kernels. A CPU device
    would take the math kernel (masked, with dropout), which keeps [heads, patches, patches] scores
    per layer."""
    cfg = load_config(
        [
            "--profile",
            "cpu",
            "--device",
            "cuda",
            "--precision",
            "bf16",
            "--dropout",
            "0.1",
            "--max-prompt-bytes",
            "8192",
            "--word-patches",
            "false",
        ]
    )  # 8192 bytes, 8192 / 4 patches
    specs, answers = specs_and_answers(cfg)
    with torch.random.fork_rng(devices=[]), FakeTensorMode():
        tracer = StepTracer(cfg, profile_fakes(cfg, specs), answers, TRAINING_STEP)
        small, large = tracer.trace(2), tracer.trace(4)
    per_sample = (large.peak["total"] - small.peak["total"]) / 2
    one_layer_of_bf16_scores = cfg.wire.encoder_heads * (8192 // cfg.wire.patch_bytes) ** 2 * 2
    assert 0 < per_sample < one_layer_of_bf16_scores


def test_a_cuda_trace_keeps_what_cuda_autocast_and_fused_dropout_keep():
    """CUDA's autocast runs layer_norm in fp32 (aten/src/ATen/autocast_mode.cpp), so the norm keeps
    an fp32 copy of its bf16 input for backward, and CUDA's fused dropout keeps a boolean mask. The
    trace's CPU tensors do neither by themselves: they keep the bf16 input and a bf16 mask. An H100
    measured the difference (test_profiles: the h100 plan against its find_batch)."""
    norm, saved = torch.nn.LayerNorm(16), []
    x = torch.randn(4, 8, 16, dtype=torch.bfloat16, requires_grad=True)
    with (
        cuda_kernels(),
        torch.autocast("cpu", dtype=torch.bfloat16),
        torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t),
    ):
        y = torch.nn.functional.dropout(norm(x), 0.1, training=True)
    assert y.dtype == torch.float32
    assert sorted(str(t.dtype) for t in saved if t.shape == x.shape) == ["torch.bool", "torch.float32"]


def test_a_cuda_trace_with_distillation_holds_its_targets_and_their_softmax():
    """The distillation targets each batch carries, and the KL over the student's softened rows."""
    args = ["--profile", "cpu", "--device", "cuda", "--precision", "bf16", "--max-prompt-bytes", "256"]
    peaks = {kd: traced_peak(load_config([*args, "--kd-weight", kd]), 2) for kd in ("0", "1")}
    assert peaks["1"] > peaks["0"]


# --- the plan, the calculator and the budget ------------------------------------------------


def test_analytic_and_traced_plans_agree_on_the_static_memory(cpu_plan):
    a = cpu_plan.analytic
    assert cpu_plan.params_frozen_bytes == pytest.approx(a.frozen, rel=0.01)
    assert cpu_plan.params_trainable_bytes == pytest.approx(a.trainable, rel=0.01)
    assert cpu_plan.gradients == pytest.approx(a.gradients, rel=0.01)
    assert cpu_plan.optimizer == pytest.approx(a.optimizer_state, rel=0.01)
    assert cpu_plan.gradients == 4 * a.trainable_params  # gradients only for what trains


def test_plan_answer_is_the_largest_micro_batch_within_the_budget(cpu_plan):
    budget, fit, best, weights = cpu_plan.budget, cpu_plan.fit, cpu_plan.max_micro_batch, cpu_plan.weight_bytes
    assert best >= 1
    assert budget.needed(fit(best), weights) <= budget.target_bytes < budget.needed(fit(best + 1), weights)
    # The fit passes through both traces (two points), one of which sits near the answer.
    for trace in cpu_plan.traces:
        assert fit(trace.micro_batch) == pytest.approx(trace.peak["total"], rel=1e-9)
    assert min(abs(t.micro_batch - best) for t in cpu_plan.traces) <= 0.05 * best
    payload = cpu_plan.to_json()
    for key in (
        "params_frozen_bytes",
        "params_trainable_bytes",
        "grads_bytes",
        "optimizer_bytes",
        "activation_bytes_per_sample",
        "fixed_bytes",
        "peak_bytes",
        "max_micro_batch",
        "card_bytes",
        "target_util",
    ):
        assert key in payload
    assert payload["card_bytes"] == 8 * GIB and payload["target_util"] == 0.8


@pytest.mark.parametrize(
    "name, make",
    [
        ("sgd", lambda ps: torch.optim.SGD(ps, lr=0.1)),
        ("sgd-momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)),
        ("adamw", lambda ps: torch.optim.AdamW(ps)),
        ("adafactor", lambda ps: torch.optim.Adafactor(ps)),
    ],
)
def test_analytic_optimizer_state_is_what_torch_allocates(name, make):
    model = torch.nn.Sequential(torch.nn.Embedding(50, 16), torch.nn.Linear(16, 32), torch.nn.LayerNorm(32))
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer = make(model.parameters())
    optimizer.step()
    allocated = sum(
        v.untyped_storage().nbytes() for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)
    )
    assert optimizer_state_bytes(name, [tuple(p.shape) for p in model.parameters()]) == allocated


def test_static_memory_rules():
    m = static_memory(LLAMA_3_1_8B_PARAMS, 10_000_000, "bf16", "adamw")
    assert m.frozen == 2 * LLAMA_3_1_8B_PARAMS  # 16.06 GB, 14.96 GiB
    assert (m.trainable, m.gradients) == (40_000_000, 40_000_000)
    assert m.optimizer_state == 80_000_004  # two fp32 moments and one step
    assert static_memory(LLAMA_3_1_8B_PARAMS, 0, "fp32", "adamw").total == 4 * LLAMA_3_1_8B_PARAMS
    assert static_memory(0, 1_000_000, "bf16", "adamw-8bit").optimizer_state == 2_000_000 + 8 * 3907


def test_largest_fitting_micro_batch_and_reserve():
    budget = budget_for("cuda", 80.0, 0.9, world_size=2, trainable_params=1_000_000)
    assert (budget.cuda_context, budget.nccl, budget.ddp_buckets) == (GIB, GIB, 4_000_000)
    weights = 30 * GIB
    fit = Fit(fixed=31 * GIB, per_sample=GIB // 2, r2=1.0)
    best = largest_fitting(fit, budget, weights)
    assert budget.needed(fit(best), weights) <= budget.target_bytes < budget.needed(fit(best + 1), weights)
    assert budget_for("cpu", 8.0, 0.8, world_size=2, trainable_params=1).fixed_reserve == 4  # only DDP buckets
    line = fit_line({1: 3.0, 2: 5.0, 4: 9.0})
    assert (line.fixed, line.per_sample, line.r2) == pytest.approx((1.0, 2.0, 1.0))


# --- the command line -----------------------------------------------------------------------


def test_analytic_calculator_command(tmp_path):
    out = tmp_path / "a.json"
    proc = ok(
        run_module(
            "latentwire.plan",
            [
                "--analytic",
                "--params",
                "8.03e9",
                "--trainable-params",
                "1e8",
                "--gpu-memory-gb",
                "80",
                "--num-gpus",
                "4",
                "--json",
                str(out),
            ],
        )
    )
    assert "16.06" in proc.stdout and "DDP gradient buckets" in proc.stdout
    a = json.loads(out.read_text())
    assert a["params_frozen_bytes"] == 2 * 8_030_000_000
    assert (a["grads_bytes"], a["ddp_bucket_bytes"]) == (4 * 10**8, 4 * 10**8)
    assert a["optimizer_bytes"] == 8 * 10**8 + 4


def test_bad_plan_input_is_one_line(forked):
    assert_one_line_error(forked("latentwire.plan", ["--profile", "nope"]), "unknown profile 'nope'")


@pytest.mark.parametrize(
    "args, fragment",
    [
        (["--analytic", "--gpu-memory-gb", "80"], "--params or --model-size-gb"),
        (["--analytic", "--params", "8e9"], "needs --gpu-memory-gb"),
        (["--profile", "h100", "--params", "1e9"], "--params is for --analytic without --profile"),
        (["--profile", "cpu", "--optimizer", "sgd"], "--optimizer is for --analytic"),
        (["--profile", "cpu", "--llama", "org/unknown-model"], "no configuration for 'org/unknown-model'"),
        (["--analytic", "--params", "-3", "--gpu-memory-gb", "80"], "--params"),
    ],
)
def test_bad_plan_flags_are_one_line_errors(args, fragment, capsys):
    with pytest.raises(SystemExit) as exit_:
        main_guard(lambda: plan_main(args))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0]


@pytest.mark.slow
def test_h100_plan_counts_every_byte_of_the_real_configuration(tmp_path):
    out = tmp_path / "h100.json"
    proc = ok(
        run_module("latentwire.plan", ["--profile", "h100", "--json", str(out)], timeout=600, elsewhere=tmp_path)
    )  # train.py's step read from the checkout, from any directory
    p = json.loads(out.read_text())
    assert p["params_frozen_bytes"] == pytest.approx(2 * (LLAMA_3_1_8B_PARAMS + QWEN_2_5_7B_PARAMS), rel=0.005)
    trainable = p["analytic"]["params_trainable"]
    assert p["params_trainable_bytes"] == p["grads_bytes"] == 4 * trainable
    assert p["optimizer_bytes"] == pytest.approx(8 * trainable, rel=0.01)
    for key in ("params_frozen_bytes", "params_trainable_bytes", "grads_bytes", "optimizer_bytes"):
        assert p[key] == pytest.approx(p["analytic"][key], rel=0.01)
    assert p["max_micro_batch"] >= 1 and "largest micro-batch" in proc.stdout
    assert p["peak_bytes"][str(load_config(["--profile", "h100"]).training.micro_batch_size)] > p["params_frozen_bytes"]


# --- elastic batch --------------------------------------------------------------------------


def test_elastic_batch_keeps_the_global_batch_when_a_split_fills_the_card():
    cfg = load_config(["--profile", "h100"])  # 64 x 1 = 64
    for world, plan_max in ((1, 55), (1, 64), (1, 500), (2, 7), (4, 3), (1, 1)):
        micro, accum, lr, message = elastic_batch(cfg, world, plan_max)
        assert micro <= plan_max and micro * accum * world == 64 * world
        assert lr == cfg.optimizer.lr and "kept" in message
    assert elastic_batch(cfg, 1, 55)[:2] == (32, 2)


@pytest.mark.parametrize("rule", ["sqrt", "linear"])
def test_elastic_batch_changes_the_global_batch_and_the_lr_by_the_rule_when_it_must(rule):
    cfg = load_config(
        ["--profile", "h100", "--micro-batch-size", "61", "--grad-accum-steps", "1", "--lr-scaling", rule]
    )  # 61 is prime: exact splits are 61 x 1 or 1 x 61
    micro, accum, lr, message = elastic_batch(cfg, 2, 40)
    assert (micro, accum) == (31, 2)  # two micro-steps, the fewest that fit; 62 per rank
    ratio = (31 * 2 * 2) / (61 * 2)
    assert lr == pytest.approx(cfg.optimizer.lr * (math.sqrt(ratio) if rule == "sqrt" else ratio))
    assert lr == pytest.approx(scaled_lr(cfg.optimizer.lr, 122, 124, rule))
    assert "122 -> 124" in message and rule in message


def test_elastic_batch_from_a_real_plan_and_when_nothing_fits(cpu_plan):
    cfg = cpu_plan.cfg
    micro, accum, lr, _ = elastic_batch(cfg, 1, cpu_plan.max_micro_batch)
    assert micro * accum == cfg.training.micro_batch_size * cfg.training.grad_accum_steps and lr == cfg.optimizer.lr
    with pytest.raises(UserError, match="fits no micro-batch"):
        elastic_batch(cfg, 1, 0)
