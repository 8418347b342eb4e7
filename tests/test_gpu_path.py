"""The GPU path's choices, each taken on CPU with the inputs a GPU would give it (capability,
dtype, device type): TF32, attention kernels, MFU peaks, memory windows, host syncs per step,
frozen-LLM loading straight onto the device, and the memory a GPU-sized embedding table costs."""

import json
from pathlib import Path

import pytest
import torch

from conftest import FAST, SMALL_LLAMA, assert_one_line_error, ok, read_metrics, run_train
from latentwire.harness.errors import UserError

CPU = torch.device("cpu")
MiB = 2**20


# --- TF32 -------------------------------------------------------------------------------------


@pytest.fixture
def restore_matmul_precision():
    before = torch.get_float32_matmul_precision()
    yield
    torch.set_float32_matmul_precision(before)


def test_tf32_switch_leaves_the_precision_query_working(restore_matmul_precision):
    """train.py's TF32 switch, on this torch: inductor's GEMM autotuning (max-autotune) calls
    torch.get_float32_matmul_precision(), which the new fp32_precision API makes raise."""
    torch.set_float32_matmul_precision("high")
    assert torch.get_float32_matmul_precision() == "high"
    assert torch.backends.cuda.matmul.allow_tf32


def test_tf32_only_where_asked_and_the_card_has_it():
    from latentwire.harness.precision import use_tf32

    assert use_tf32(True, (9, 0)) and use_tf32(True, (8, 0))
    assert not use_tf32(True, (7, 0))  # V100: no TF32 units
    assert not use_tf32(False, (9, 0))  # --tf32 false: the IEEE fp32 reference
    assert not use_tf32(True, None)  # CPU


# --- attention kernels --------------------------------------------------------------------------


def test_attention_kernels_follow_the_card_and_the_dtype():
    from torch.nn.attention import SDPBackend

    from latentwire.harness.precision import sdpa_backends

    # No silent math fallback where flash runs, and no cuDNN: NaN gradients of masked attention
    # (pytorch#196678), the encoder's kind, and torch tries it first on sm90.
    fused = {SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION}
    backends, why = sdpa_backends((8, 0), torch.bfloat16)
    assert set(backends) == fused and why is None
    assert set(sdpa_backends((9, 0), torch.float16)[0]) == fused
    assert set(sdpa_backends((9, 0), torch.bfloat16)[0]) == fused
    for capability, dtype in (((7, 0), torch.float16), ((9, 0), torch.float32)):
        backends, why = sdpa_backends(capability, dtype)
        assert backends[-1] == SDPBackend.MATH and SDPBackend.FLASH_ATTENTION not in backends
        assert SDPBackend.EFFICIENT_ATTENTION in backends  # the encoder's masked attention
        assert f"sm{capability[0]}{capability[1]}" in why and "math" in why


@pytest.mark.parametrize(
    "flags, width",
    [
        (["--encoder-dim", "96", "--encoder-heads", "8"], "encoder_dim / encoder_heads = 12"),
        (["--d-z", "200"], "d_z / encoder_heads = 25"),
    ],
)
def test_head_widths_no_fused_kernel_takes_are_refused_on_cuda_only(flags, width):
    """The encoder's and pooler's masked attention has only the memory-efficient kernel on an sm80+
    card in bf16 (flash takes no mask, math is not allowed), and it needs widths % 8 == 0: refused
    when the configuration is read, by train.py, the plan and find_batch alike (load_config)."""
    from latentwire.settings import load_config

    with pytest.raises(UserError, match=f"head width {width} is not a multiple of 8.*encoder_heads 1.* would work"):
        load_config(["--profile", "h100", *flags])
    with pytest.raises(UserError, match=width):
        load_config(["--profile", "rtx6000ada", "--precision", "fp16", *flags])
    load_config(["--profile", "cpu", *flags])  # CPU kernels take any width
    load_config(["--profile", "h100", "--precision", "fp32", *flags])  # math is allowed in fp32
    load_config(["--profile", "v100", *flags])  # sm70: math is allowed


@pytest.mark.parametrize("mode", ["reduce-overhead", "max-autotune"])
def test_cuda_graph_compile_modes_are_refused_until_a_gpu_run_proves_them(mode):
    from latentwire.settings import load_config

    with pytest.raises(UserError, match=f"compile_mode '{mode}' captures CUDA graphs.*max-autotune-no-cudagraphs"):
        load_config(["--profile", "h100", "--compile-mode", mode])


def test_the_pooler_passes_no_mask_where_nothing_is_padded(monkeypatch):
    """An all-True mask would rule out the flash kernel for the latents' self-attention."""
    import torch.nn.functional as F

    from latentwire.model import LatentPooler
    from latentwire.settings import load_config

    cfg = load_config(["--profile", "cpu"])
    pooler = LatentPooler(cfg.wire.num_latents, cfg.wire.d_z, cfg.wire.encoder_dim, cfg.wire.encoder_heads, 0.0)
    masks, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, **kwargs):
        masks.append(attn_mask)
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    byte_mask = torch.ones(2, 32, dtype=torch.bool)
    byte_mask[0, 20:] = False
    pooler(torch.randn(2, 32, cfg.wire.encoder_dim), byte_mask)
    assert [m is None for m in masks] == [False, True, False, True]  # cross (padded bytes), self (latents)


@pytest.mark.parametrize("flags", [[], ["--word-patches", "false", "--patch-bytes", "4"]])
def test_every_attention_mask_has_a_unit_stride_last_dimension(monkeypatch, flags):
    """CUDA's fused kernels refuse a mask whose last dimension is strided, and with math kept out no
    kernel is left: the first H100 run failed so at its first step, on the patch mask that slicing
    the byte mask every patch_bytes makes. The CPU kernels take it, so only the stride shows it."""
    import torch.nn.functional as F

    from latentwire.model import WireEncoder
    from latentwire.settings import load_config

    cfg = load_config(["--profile", "cpu", *flags])
    model = WireEncoder(cfg.wire, {"llama": (48, 1.0), "qwen": (40, 1.0)})
    strides, sdpa = [], F.scaled_dot_product_attention

    def recording_sdpa(*args, attn_mask=None, **kwargs):
        if attn_mask is not None:
            strides.append(attn_mask.stride(-1))
        return sdpa(*args, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    byte_ids = torch.randint(1, 256, (2, 64))
    byte_mask = torch.ones(2, 64, dtype=torch.bool)
    byte_mask[1, 40:] = False
    model(byte_ids, byte_mask)
    assert strides and set(strides) == {1}, strides


def test_process_group_and_profiler_options_follow_the_device_type():
    """train.py's dist.init_process_group and torch.profiler.profile arguments, for a GPU rank and
    a CPU one: NCCL bound to the rank's GPU, gloo on CPU, the explicit timeout either way; CUDA
    activity traced only on a GPU."""
    import datetime

    from torch.profiler import ProfilerActivity

    from latentwire.harness.distributed import group_options
    from latentwire.harness.profiling import ProfilerConfig, profiler_options

    gpu = torch.device("cuda", 3)
    assert group_options(gpu, 300) == {"backend": "nccl", "timeout": datetime.timedelta(seconds=300), "device_id": gpu}
    assert group_options(CPU, 60) == {"backend": "gloo", "timeout": datetime.timedelta(seconds=60), "device_id": None}
    config = ProfilerConfig(
        enabled=True, wait=1, warmup=1, active=2, shapes=True, memory=False, stacks=False, memory_snapshot=False
    )
    assert profiler_options(config, Path("out"), 0, gpu)["activities"] == [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    assert profiler_options(config, Path("out"), 0, CPU)["activities"] == [ProfilerActivity.CPU]


def test_ddp_skips_the_per_forward_buffer_broadcast_without_a_deprecation(tmp_path):
    """DDP built with ddp_buffer_options broadcasts no buffers before a forward, where by default it
    would (a module with buffers, in a one-rank gloo group), and this torch warns of nothing."""
    import warnings

    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from latentwire.harness.distributed import ddp_buffer_options

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        model = torch.nn.BatchNorm1d(3)  # its running statistics are buffers
        assert DDP(model).will_sync_module_buffers()
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            ddp = DDP(model, **ddp_buffer_options())
        assert not ddp.will_sync_module_buffers()
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("device_type", ["cuda", "cpu"])
def test_fused_adamw_everywhere_and_pinned_memory_only_on_cuda(device_type):
    """train.py's optimizer and loader, built for a CUDA device on this CPU and for the CPU: AdamW
    is fused on both (one pass over every tensor; on the CPU it steps here), pinned host memory
    (asynchronous copies) is CUDA's only; frozen parameters get no state, and only matrices decay."""
    from latentwire.harness.data import make_loader
    from latentwire.harness.loop_config import Loader, OptimizerConfig
    from train import adamw

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.LayerNorm(4), torch.nn.Linear(4, 2))
    model[2].weight.requires_grad_(False)
    optimizer = adamw(model, OptimizerConfig(lr=1e-3, weight_decay=0.1, beta1=0.9, beta2=0.95, eps=1e-8), device_type)
    assert optimizer.defaults["fused"] is True
    if device_type == "cpu":
        model(torch.ones(1, 4)).sum().backward()
        optimizer.step()
        assert optimizer.state[model[0].weight]["exp_avg"].abs().sum() > 0
    decay, no_decay = optimizer.param_groups
    assert [p.shape for p in decay["params"]] == [(4, 4)] and decay["weight_decay"] == 0.1
    assert len(no_decay["params"]) == 4 and no_decay["weight_decay"] == 0.0
    loader = make_loader(list(range(8)), None, None, 2, Loader(num_workers=0), device_type, seed=0)
    assert loader.pin_memory is (device_type == "cuda")


def test_cpu_keeps_every_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from latentwire.harness.precision import sdpa_backends

    backends, why = sdpa_backends(None, torch.float32)
    assert why is None
    assert {
        SDPBackend.FLASH_ATTENTION,
        SDPBackend.EFFICIENT_ATTENTION,
        SDPBackend.CUDNN_ATTENTION,
        SDPBackend.MATH,
    } <= set(backends)
    with sdpa_kernel(backends):
        pass


# --- MFU peak ---------------------------------------------------------------------------------


def test_mfu_peak_follows_the_arithmetic_in_use():
    from latentwire.harness.precision import matmul_arithmetic
    from latentwire.settings import load_config

    h100 = load_config(["--profile", "h100"]).card

    def peak(precision, tf32):
        return getattr(h100, "peak_tflops_" + matmul_arithmetic(precision, tf32))

    assert peak("bf16", True) == 989.4
    assert peak("fp32", False) == 66.9  # IEEE fp32: TF32 is off
    assert peak("fp32", True) == 494.7
    a100 = load_config(["--profile", "a100-80gb"]).card
    assert getattr(a100, "peak_tflops_" + matmul_arithmetic("fp32", False)) == 19.5
    assert load_config(["--profile", "rtx6000ada"]).card.peak_tflops_fp32 == 91.1
    v100 = load_config(["--profile", "v100"])
    assert v100.card.peak_tflops_fp16 == 125.0 and not v100.numerics.tf32


# --- memory per window ------------------------------------------------------------------------


def test_peak_memory_is_per_window_and_the_run_peak_is_kept():
    from latentwire.harness.meters import MemoryMeter

    meter = MemoryMeter(CPU)
    spike = torch.ones(256 * MiB, dtype=torch.uint8)  # touched: resident
    del spike
    first = meter.read()
    meter.start_window()
    second = meter.read()
    assert first["peak_mem_gb"] - first["mem_gb"] > 0.2
    assert second["peak_mem_gb"] - second["mem_gb"] < 0.1  # the spike was in the first window only
    assert second["run_peak_mem_gb"] >= first["peak_mem_gb"]
    assert second["reserved_gb"] is None and second["alloc_retries"] is None


def test_cuda_window_resets_the_allocator_peak(monkeypatch):
    from latentwire.harness.meters import GIB, MemoryMeter

    stats = {
        "allocated_bytes.all.current": GIB,
        "allocated_bytes.all.peak": 5 * GIB,
        "reserved_bytes.all.current": 2 * GIB,
        "reserved_bytes.all.peak": 6 * GIB,
        "num_alloc_retries": 1,
    }

    def reset(device):
        stats["allocated_bytes.all.peak"] = stats["allocated_bytes.all.current"]

    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device: dict(stats))
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", reset)
    meter = MemoryMeter(torch.device("cuda", 0))  # starts a window: load-time peaks count for the run only
    assert meter.read() == {
        "mem_gb": 1.0,
        "peak_mem_gb": 1.0,
        "run_peak_mem_gb": 5.0,
        "reserved_gb": 2.0,
        "peak_reserved_gb": 6.0,
        "alloc_retries": 0,
    }
    stats["num_alloc_retries"] = 4  # the allocator's count is the process's: 3 in this window
    assert meter.read()["alloc_retries"] == 3
    meter.start_window()
    assert meter.read()["alloc_retries"] == 0


# --- a smaller card's memory on a bigger card --------------------------------------------------

H100_BYTES, H200_BYTES = 81559 * MiB, 143771 * MiB  # what nvidia-smi says an H100 SXM 80GB and an H200 hold


def test_a_bigger_card_is_held_to_the_profiles_memory_less_what_is_outside_the_allocator():
    from latentwire.harness.memory_cap import GIB, memory_fraction
    from latentwire.settings import load_config

    h100, h200 = (load_config(["--profile", p]).card for p in ("h100", "h200"))
    context = GIB // 2  # the CUDA context, held before the cap is set
    fraction, line = memory_fraction(H200_BYTES, context, h100.memory_gb, h100.cap_memory, "cuda")
    assert fraction * H200_BYTES == pytest.approx(h100.memory_gb * GIB - context)
    assert "memory_gb 79.6 of this card's 140.4 GiB" in line and "--cap-memory false" in line
    fraction, line = memory_fraction(H200_BYTES, context, h100.memory_gb, False, "cuda")
    assert fraction is None and "the whole card" in line
    assert memory_fraction(H100_BYTES, context, h100.memory_gb, True, "cuda") == (None, None)  # its own card
    assert memory_fraction(H200_BYTES, context, h200.memory_gb, True, "cuda") == (None, None)
    fraction, line = memory_fraction(H100_BYTES, context, h200.memory_gb, True, "cuda")
    assert fraction is None and line.startswith("note: this card has 79.6 GiB, less than")
    assert memory_fraction(0, 0, 8.0, True, "cpu") == (None, None)
    assert not load_config(["--profile", "h100", "--cap-memory", "false"]).card.cap_memory


# --- host syncs per step ----------------------------------------------------------------------


def host_reads(tmp_path, steps: int) -> int:
    import train
    from latentwire.harness.host_syncs import HostReads

    args = [
        "--profile",
        "cpu",
        *FAST,
        "--log-every",
        "1000",
        "--micro-batch-size",
        "2",
        "--grad-accum-steps",
        "2",
        "--kd-weight",
        "0",
        "--max-steps",
        str(steps),
        "--out-dir",
        str(tmp_path / f"steps{steps}"),
    ]
    with HostReads() as reads:
        train.main(args)
    return reads.count


def test_one_host_sync_per_step(tmp_path):
    """Runs of 2 and 5 steps log and save alike (first and last step), so the difference is what 3
    steps in the middle read: one host sync each, as train.py says. Without distillation: its
    one-off teacher pass, before the first step, asks for a stop signal once per batch, and a
    longer run's draws more examples."""
    assert (host_reads(tmp_path, 5) - host_reads(tmp_path, 2)) / 3 == 1


# --- frozen LLMs ------------------------------------------------------------------------------


def test_embed_rms_needs_no_fp32_copy_of_the_table():
    """A v100 holds 29 GiB of bf16 weights in 32 GiB: an fp32 copy of Qwen2.5-7B's table (2 GiB, and
    its square as much again) would not fit beside them."""
    from types import SimpleNamespace

    from latentwire.find_batch import CpuPeak
    from latentwire.llm import FrozenLLM

    table = torch.nn.Embedding(32768, 1024, dtype=torch.bfloat16)
    llm = FrozenLLM("llama", SimpleNamespace(get_input_embeddings=lambda: table), tokenizer=None)
    with CpuPeak() as peak:
        rms = llm.embed_rms()
    table_bytes = table.weight.numel() * table.weight.element_size()
    assert peak.bytes < table_bytes / 4
    assert rms == pytest.approx(table.weight.float().pow(2).mean().sqrt().item(), rel=1e-5)


def test_a_checkpoint_loads_tensor_by_tensor_into_the_model_built_on_the_device(saved_reader):
    from transformers import AutoModelForCausalLM

    from latentwire.llm import load_frozen_llm

    llm = load_frozen_llm("qwen", str(saved_reader), torch.bfloat16, CPU)
    reference = AutoModelForCausalLM.from_pretrained(saved_reader, dtype=torch.bfloat16).state_dict()
    loaded = llm.model.state_dict()
    assert loaded.keys() == reference.keys()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)
    assert not any(p.requires_grad for p in llm.model.parameters())


def test_a_checkpoint_missing_a_tensor_is_a_user_error(saved_reader, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    from latentwire.harness.errors import UserError
    from latentwire.llm import load_frozen_llm

    broken = tmp_path / "broken"
    shutil.copytree(saved_reader, broken)
    weights = load_file(str(broken / "model.safetensors"))
    del weights["model.norm.weight"]
    save_file(weights, str(broken / "model.safetensors"))
    with pytest.raises(UserError, match="no tensor for model.norm.weight"):
        load_frozen_llm("qwen", str(broken), torch.float32, CPU)


# --- random: LLMs -----------------------------------------------------------------------------


def test_random_llm_is_the_configured_architecture_seeded_and_planned_alike(tmp_path):
    from latentwire.llm import load_frozen_llm
    from latentwire.llm_sources import llm_spec

    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    a, b = (load_frozen_llm("llama", f"random:{config}", torch.float32, CPU) for _ in range(2))
    assert a.model.config.hidden_size == 64 and a.model.config.vocab_size == 4096
    # every rank alike
    assert all(torch.equal(x, y) for x, y in zip(a.model.parameters(), b.model.parameters(), strict=True))
    assert a.contract.lead == (a.tokenizer.bos_token_id,)  # the Llama family's tokenizer: BOS leads every prompt
    spec = llm_spec("llama", f"random:{config}")
    assert spec.has_bos and spec.config.vocab_size == 4096
    # A shipped hub configuration plans exactly as the hub id does.
    for name, hub_id in (("llama", "meta-llama/Llama-3.1-8B"), ("qwen", "Qwen/Qwen2.5-7B")):
        real, random = llm_spec(name, hub_id), llm_spec(name, f"random:{hub_id}")
        assert random.config.to_dict() == real.config.to_dict() and random.has_bos == real.has_bos


def test_tied_embeddings_stay_one_tensor_after_loading(tmp_path):
    """Built on the meta device and allocated by to_empty, which gives each module a parameter of its
    own: a model that ties its head to its embedding table must come out tied (one table, not two)."""
    from latentwire.llm import load_frozen_llm

    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(SMALL_LLAMA, tie_word_embeddings=True)))
    model = load_frozen_llm("llama", f"random:{config}", torch.float32, CPU).model
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight


@pytest.mark.parametrize(
    "source, message",
    [
        ("random:nobody/Nothing-1B", "name a config.json, a model directory or one of"),
        ("random:/no/such/config.json", "cannot read /no/such/config.json"),
    ],
)
def test_a_bad_random_source_is_one_line(tmp_path, forked, source, message):
    proc = forked("train.py", ["--profile", "cpu", "--llama", source, "--out-dir", tmp_path / "run"])
    assert_one_line_error(proc, message)
    assert proc.returncode == 2 and not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_runs_with_a_random_llm_from_a_config_file(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL_LLAMA))
    out = tmp_path / "run"
    ok(
        run_train(
            [
                "--profile",
                "cpu",
                *FAST,
                "--llama",
                f"random:{config}",
                "--max-steps",
                "3",
                "--micro-batch-size",
                "4",
                "--out-dir",
                str(out),
            ]
        )
    )
    records = read_metrics(out)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert all(r["loss"] > 0 for r in records)
    meta = json.loads(next((out / "checkpoints").iterdir()).joinpath("meta.json").read_text())
    assert meta["config"]["llama"] == f"random:{config}"


def test_recomputed_layers_run_in_the_steps_attention_kernels():
    """Activation checkpointing recomputes each frozen decoder layer inside backward, so the step's
    SDPA allowlist must hold there too: on an H100 the recompute picked cuDNN (torch's first choice
    there) where the forward had run flash, saved other tensors, and every eager step with
    checkpointing raised CheckpointError. On CPU the same happens with the math kernel alone in the
    forward and the flash kernel, the CPU's first choice, in the recompute. Through train_step with
    one kernel allowed, the gradients equal those of the step without recompute."""
    from torch.nn.attention import SDPBackend

    from latentwire.harness.recompute import checkpoint_options
    from latentwire.model import WireEncoder
    from latentwire.parallelize import frozen_llms
    from latentwire.planner.memtrace import planning_batch
    from latentwire.planner.script import script_step
    from latentwire.planner.step import run_step
    from latentwire.settings import load_config

    cfg = load_config(
        ["--profile", "cpu", "--precision", "fp32", "--dropout", "0", "--kd-weight", "0", "--max-prompt-bytes", "64"]
    )
    grads = []
    for recompute in ("none", "full"):
        llms = frozen_llms(cfg.frozen, cfg.prompt, "fp32", CPU, checkpointing=checkpoint_options(recompute))
        torch.manual_seed(0)
        model = WireEncoder.for_llms(cfg.wire, llms)
        answers = {
            n: (len(llm.contract.lead), len(llm.contract.tail), llm.model.config.vocab_size) for n, llm in llms.items()
        }
        batch = planning_batch(cfg.data, cfg.objectives, answers, 2, CPU, cfg.wire.word_patch)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)  # the step's gradients, kept by zero_grad below
        optimizer.zero_grad = lambda set_to_none=True: None
        run_step(script_step(), cfg, model, llms, optimizer, batch, [SDPBackend.MATH])
        grads.append([p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
