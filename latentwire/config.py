"""LatentWire's settings: the fields of a hardware profile (`FIELDS`), the rules that tie them
together, and the resolved `Config`, typed: one frozen dataclass per concern, each defined by the
module that uses it, so a function takes the section it reads (`cfg.wire`, `cfg.data`, ...). The
machinery (profiles, `extends`, flags, --help, sections) is `harness.config`'s.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .harness.compiling import CompileConfig
from .data import DataConfig
from .harness.checkpoint import META
from .harness.config import Field, Parser, Schema, flat_of, profile_listing, read_profiles, sections_of
from .harness.errors import UserError
from .llm import FrozenConfig
from .model import WireConfig
from .objectives import Objectives
from .harness.precision import Card, Numerics, fp8_refusal, frozen_weight_dtype, sdpa_backends
from .harness.profiling import ProfilerConfig
from .prompting import CHAT_TEMPLATE_CHOICES, DEFAULT_ANCHOR, DEFAULT_INSTRUCTION, PromptFormat

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILES = REPO_ROOT / "hw_profiles.json"


FIELDS: dict[str, Field] = {
    # --- the card -------------------------------------------------------------------------
    "description": Field(str, "what this profile is for"),
    "device": Field(str, "cuda or cpu", choices=("cuda", "cpu")),
    "memory_gb": Field(float, "memory of one device in GB (GiB for CUDA cards)", positive=True),
    "supports_bf16": Field(bool, "whether the card has bf16 tensor cores"),
    "peak_tflops_bf16": Field(float, "dense bf16 peak TFLOP/s of one device", nullable=True, positive=True),
    "peak_tflops_fp16": Field(float, "dense fp16 peak TFLOP/s of one device", nullable=True, positive=True),
    "peak_tflops_tf32": Field(float, "dense TF32 tensor-core peak TFLOP/s (Ampere and newer)", nullable=True,
                              positive=True, default=None),
    "peak_tflops_fp32": Field(float, "dense IEEE fp32 peak TFLOP/s (no tensor cores)", nullable=True, positive=True),
    # --- numerics -------------------------------------------------------------------------
    "precision": Field(str, "autocast dtype", choices=("bf16", "fp16", "fp32")),
    "tf32": Field(bool, "TF32 tensor cores for fp32 matmuls on Ampere and newer (--precision fp32 --tf32 false: "
                        "the IEEE fp32 reference)", default=False),
    "compile": Field(bool, "torch.compile the forward pass"),
    "compile_mode": Field(str, "torch.compile mode", choices=("default", "max-autotune-no-cudagraphs"),
                          refused=dict.fromkeys(("reduce-overhead", "max-autotune"),
                                                "captures CUDA graphs, which no GPU run has yet tried with this "
                                                "loop's dynamic shapes, per-layer compiled regions and FSDP hooks")),
    "compile_cache": Field(str, "where inductor keeps the compiled regions for the next run, a requeued or resumed "
                                "job on another machine included ('': $TORCHINDUCTOR_CACHE_DIR if set, else "
                                "~/.cache/latentwire/inductor; torch's own default is under /tmp)", default=""),
    "activation_checkpointing": Field(bool, "recompute the frozen LLMs' decoder layers in backward"),
    "frozen_sharding": Field(str, "how a rank holds the frozen LLMs: none (whole, on every rank) or fsdp (sharded "
                                  "over the ranks by FSDP2, a decoder layer gathered only while it runs)",
                             choices=("none", "fsdp"), default="none"),
    "frozen_fp8": Field(bool, "run the frozen LLMs' decoder-layer linears in float8 (torchao: forward and input "
                              "gradients; bf16, compiled, a card with FP8 tensor cores or the CPU's emulation; "
                              "MFU stays counted against the bf16 peak)", default=False),
    # --- batch and schedule ---------------------------------------------------------------
    "num_gpus": Field(int, "ranks the profile is laid out for (the memory plan's default --num-gpus; train.py "
                           "runs with as many as torchrun starts)", positive=True, default=1),
    "micro_batch_size": Field(int, "examples per rank per forward pass", positive=True),
    "grad_accum_steps": Field(int, "micro-batches per optimizer step", positive=True),
    "max_steps": Field(int, "optimizer steps", positive=True),
    "lr": Field(float, "peak learning rate of OneCycle", positive=True),
    "weight_decay": Field(float, "AdamW weight decay", non_negative=True),
    "adam_beta1": Field(float, "AdamW beta1", non_negative=True),
    "adam_beta2": Field(float, "AdamW beta2", non_negative=True),
    "adam_eps": Field(float, "AdamW epsilon, added to the gradient's RMS before dividing by it", positive=True,
                      default=1e-8),
    "max_grad_norm": Field(float, "clip the global gradient norm to this", positive=True),
    "pct_start": Field(float, "fraction of steps spent warming up", positive=True),
    "anneal_strategy": Field(str, "OneCycle annealing", choices=("cos", "linear")),
    "div_factor": Field(float, "initial lr = lr / div_factor", positive=True),
    "final_div_factor": Field(float, "final lr = initial lr / final_div_factor", positive=True),
    "seed": Field(int, "seed of model init, data order and dropout", non_negative=True),
    # --- model ----------------------------------------------------------------------------
    "llama": Field(str, "Llama-family LLM: hub id, local directory, 'tiny' (the shipped tiny reader), 'tiny-random', "
                        "or 'random:HUB_ID_OR_CONFIG_JSON'"),
    "qwen": Field(str, "Qwen-family LLM: hub id, local directory, 'tiny' (the shipped tiny reader), 'tiny-random', "
                       "or 'random:HUB_ID_OR_CONFIG_JSON'"),
    "num_latents": Field(int, "M, the number of soft tokens on the wire", positive=True),
    "d_z": Field(int, "width of one wire token", positive=True),
    "encoder_dim": Field(int, "width of the byte encoder", positive=True),
    "encoder_layers": Field(int, "transformer layers of the byte encoder", positive=True),
    "encoder_heads": Field(int, "attention heads of the byte encoder", positive=True),
    "patch_bytes": Field(int, "bytes per position of the byte encoder (its attention is patch_bytes^2 cheaper)",
                         positive=True, default=4),
    "word_patches": Field(bool, "start every word (a space or newline and the bytes up to the next) at a patch of "
                                "the byte encoder, padding the patch before it, so a word is patched the same wherever "
                                "it sits", default=False),
    "patch_mlp": Field(bool, "the byte encoder reads a patch's bytes jointly (a GELU MLP) instead of as a sum of "
                             "per-slot codes (linear)", default=False),
    "dropout": Field(float, "dropout in the encoder and adapters", non_negative=True),
    # --- prompt contract (latentwire.prompting) ---------------------------------------------
    "anchor_text": Field(str, "text after the wire and after a text prompt, before the answer (training, teacher "
                              "and evaluation alike; '' for none)", default=DEFAULT_ANCHOR),
    "chat_template": Field(str, "wrap the wire and text prompts in a reader's chat template: auto (each reader whose "
                                "tokenizer has one: instruct models), true (both, or an error), false (neither)",
                           choices=CHAT_TEMPLATE_CHOICES, default="auto"),
    "answer_instruction": Field(str, "inside a chat template, after the prompt: the instruction asking for the short "
                                     "answer ('' for none)", default=DEFAULT_INSTRUCTION),
    # --- objectives (latentwire.objectives); the answer cross-entropy always has weight 1 --------------
    "first_token_weight": Field(float, "weight of the cross-entropy of the first answer token (0: off)",
                                non_negative=True, default=0.0),
    "k_token_weight": Field(float, "weight of the cross-entropy of the first k_tokens answer targets (0: off)",
                            non_negative=True, default=0.0),
    "kd_weight": Field(float, "weight of distillation from the LLM reading the text prompt, over the first k_tokens "
                              "answer positions (0: off, and no teacher pass)", non_negative=True, default=0.0),
    "k_tokens": Field(int, "answer positions of k_token_weight and kd_weight", positive=True, default=4),
    "kd_temperature": Field(float, "softmax temperature of distillation", positive=True, default=2.0),
    "kd_top_k": Field(int, "distillation targets kept per answer position where the teacher's full distributions do "
                           "not fit in 1 GiB per LLM: its k most likely tokens and one bucket for the rest",
                      positive=True, default=64),
    # --- data -----------------------------------------------------------------------------
    "dataset": Field(str, "'synthetic', 'squad', 'hotpot_qa' or a local .json/.jsonl/.parquet"),
    "eval_dataset": Field(str, "held-out examples: 'synthetic', 'squad', 'hotpot_qa' or a local file (null: the "
                               "dataset's own validation split; of a local file, a seeded held_out_fraction of it)",
                          nullable=True, default=None),
    "held_out_fraction": Field(float, "part of a local dataset file held out from training when no eval_dataset is "
                                      "named", positive=True, default=0.1),
    "drop_cut_answers": Field(bool, "drop training examples whose answer lies past max_prompt_bytes (the encoder "
                                    "never sees it)", default=False),
    "num_examples": Field(int, "size of the synthetic training set", positive=True),
    "max_prompt_bytes": Field(int, "prompts are cut to this many UTF-8 bytes", positive=True),
    "max_answer_tokens": Field(int, "answers are cut to this many tokens", positive=True),
    "pad_multiple": Field(int, "pad lengths to a multiple of this (few shapes for compile)", positive=True),
    "num_workers": Field(int, "DataLoader worker processes per rank", non_negative=True),
    "prefetch_factor": Field(int, "batches each worker loads ahead", positive=True),
    # --- memory planning and elastic batch ------------------------------------------------
    "target_util": Field(float, "fraction of the card's memory the plan may fill", positive=True),
    "elastic_batch": Field(bool, "take the micro-batch from the memory plan, keep the global batch"),
    "lr_scaling": Field(str, "how lr follows a changed global batch", choices=("sqrt", "linear")),
    # --- evaluation -----------------------------------------------------------------------
    "eval_every": Field(int, "evaluate on the held-out split every N steps (0: never)", non_negative=True),
    "eval_examples": Field(int, "held-out examples per evaluation", positive=True),
    "max_new_tokens": Field(int, "greedy generation length limit in evaluation", positive=True),
    # --- run ------------------------------------------------------------------------------
    "out_dir": Field(str, "where metrics, traces and checkpoints go"),
    "log_every": Field(int, "log every N optimizer steps", positive=True),
    "checkpoint_every": Field(int, "checkpoint every N steps (0: only at the end)", non_negative=True),
    "keep_checkpoints": Field(int, "keep the newest K checkpoints", positive=True),
    "dist_timeout_s": Field(int, "collective timeout of the process group", positive=True),
    "max_nonfinite_steps": Field(int, "stop after this many non-finite steps in a row", positive=True),
    "profiler": Field(bool, "run torch.profiler and write traces under out_dir"),
    "profiler_wait": Field(int, "profiler schedule: steps skipped", non_negative=True),
    "profiler_warmup": Field(int, "profiler schedule: steps traced but discarded", non_negative=True),
    "profiler_active": Field(int, "profiler schedule: steps recorded", positive=True),
    "profiler_shapes": Field(bool, "profiler: record operator input shapes"),
    "profiler_memory": Field(bool, "profiler: record tensor allocations and frees"),
    "profiler_stacks": Field(bool, "profiler: record Python stacks (slower, larger traces)"),
    "memory_snapshot": Field(bool, "CUDA: record allocation history, write a snapshot at the end"),
}


@dataclass(frozen=True)
class RunFlags:
    """Flags that describe this invocation rather than the hardware."""
    profile: str
    resume: bool = False
    overwrite: bool = False
    stop_at_step: int | None = None
    new_data: bool = False  # with resume: a fresh epoch of this run's data, not the checkpoint's position
    given: tuple[str, ...] = ()  # the fields given as flags, over the profile's values
    init_from: str | None = None  # a run or checkpoint whose trainable weights start this new run


# --- the sections the loop reads itself; the others belong to the module that uses them --------

@dataclass(frozen=True)
class Training:
    num_gpus: int  # the layout the profile is written for (the plan's default)
    micro_batch_size: int
    grad_accum_steps: int
    max_steps: int
    seed: int
    max_grad_norm: float
    max_nonfinite_steps: int
    dist_timeout_s: int


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's (the lr is also OneCycle's peak)."""
    lr: float
    weight_decay: float
    beta1: float
    beta2: float
    eps: float
    FLAT_NAMES: ClassVar[dict] = {"beta1": "adam_beta1", "beta2": "adam_beta2", "eps": "adam_eps"}


@dataclass(frozen=True)
class Schedule:
    """OneCycle's shape around the optimizer's lr."""
    pct_start: float
    anneal_strategy: str
    div_factor: float
    final_div_factor: float


@dataclass(frozen=True)
class Planning:
    """The memory plan's budget and what --elastic-batch does with it."""
    target_util: float
    elastic_batch: bool
    lr_scaling: str


@dataclass(frozen=True)
class Evaluation:
    every: int  # steps between evaluations; 0: never
    examples: int
    max_new_tokens: int
    FLAT_NAMES: ClassVar[dict] = {"every": "eval_every", "examples": "eval_examples"}


@dataclass(frozen=True)
class Output:
    out_dir: str
    log_every: int
    checkpoint_every: int
    keep_checkpoints: int


# Settings a checkpoint's state carries: the restored optimizer, OneCycle schedule and grad scaler
# (precision: the scaler's state), and the trainable model's shape. A resume may not change them
# (harness.checkpoint.check_restored_settings); --init-from starts a new run from the weights.
# The trainable model's shape, which its weights have.
WIRE_SHAPE = ("num_latents", "d_z", "encoder_dim", "encoder_layers", "encoder_heads", "patch_bytes", "patch_mlp")
RESTORED_SETTINGS = ("max_steps", "lr", "weight_decay", "adam_beta1", "adam_beta2", "pct_start", "div_factor",
                     "final_div_factor", "anneal_strategy", "precision", *WIRE_SHAPE)


# Config's sections, by attribute. A section's fields are read from the profile's flat fields (the
# keys of hw_profiles.json, the flags, meta.json) of the same name, or of the name its FLAT_NAMES
# gives; every flat field belongs to exactly one section.
SECTIONS: dict[str, type] = {
    "card": Card, "numerics": Numerics, "compile": CompileConfig, "frozen": FrozenConfig, "training": Training,
    "optimizer": OptimizerConfig, "schedule": Schedule, "wire": WireConfig, "prompt": PromptFormat,
    "objectives": Objectives, "data": DataConfig, "planning": Planning, "evaluation": Evaluation, "output": Output,
    "profiler": ProfilerConfig,
}


@dataclass(frozen=True)
class Config:
    """The resolved configuration: a profile plus command-line overrides, validated, in the
    sections that the modules using them define (a function takes the section it reads)."""
    card: Card
    numerics: Numerics
    compile: CompileConfig
    frozen: FrozenConfig
    training: Training
    optimizer: OptimizerConfig
    schedule: Schedule
    wire: WireConfig
    prompt: PromptFormat
    objectives: Objectives
    data: DataConfig
    planning: Planning
    evaluation: Evaluation
    output: Output
    profiler: ProfilerConfig
    run: RunFlags

    @classmethod
    def of(cls, values: dict, run: RunFlags) -> Config:
        """From checked flat values (every field of FIELDS)."""
        return cls(**sections_of(SECTIONS, values), run=run)

    def flat(self) -> dict:
        """The flat fields, in FIELDS order."""
        values = flat_of(self, SECTIONS)
        return {name: values[name] for name in FIELDS}

    def to_dict(self) -> dict:
        """What meta.json records: the profile's key and the flat fields."""
        return {"profile": self.run.profile, **self.flat()}


# --- the rules that tie fields together --------------------------------------------------------

def check_consistency(v: dict, where: str) -> None:
    """Rules that tie fields together."""
    if v["precision"] == "bf16" and not v["supports_bf16"]:
        raise UserError(f"{where}: precision bf16 on a card without bf16 support; use fp16 or fp32")
    if not 0 < v["pct_start"] < 1:
        raise UserError(f"{where}: field 'pct_start' must be between 0 and 1, got {v['pct_start']}")
    if v["target_util"] > 1:
        raise UserError(f"{where}: field 'target_util' must be at most 1, got {v['target_util']}")
    if v["held_out_fraction"] >= 1:
        raise UserError(f"{where}: field 'held_out_fraction' must be below 1, got {v['held_out_fraction']}")
    if v["dropout"] >= 1:
        raise UserError(f"{where}: field 'dropout' must be below 1, got {v['dropout']}")
    for beta in ("adam_beta1", "adam_beta2"):
        if v[beta] >= 1:
            raise UserError(f"{where}: field {beta!r} must be below 1, got {v[beta]}")
    for dim in ("encoder_dim", "d_z"):
        if v[dim] % v["encoder_heads"]:
            raise UserError(f"{where}: field {dim!r} ({v[dim]}) must be divisible by encoder_heads "
                            f"({v['encoder_heads']})")
    if v["encoder_dim"] // v["encoder_heads"] % 2:
        raise UserError(f"{where}: the byte encoder's head width, encoder_dim / encoder_heads = "
                        f"{v['encoder_dim'] // v['encoder_heads']}, must be even (rotary positions rotate pairs)")
    if v["frozen_fp8"]:
        check_fp8_profile(v, where)
    if fused_attention_only(v["device"], v["precision"], v["supports_bf16"]):
        check_fused_head_widths(v["encoder_dim"], v["d_z"], v["encoder_heads"], where)


def check_fp8_profile(v: dict, where: str) -> None:
    """--frozen-fp8 refused where the profile alone says it cannot run or help (its card is checked
    when the run starts), or beside --frozen-sharding fsdp (latentwire.fp8 says why)."""
    why = fp8_refusal(v["device"], None, v["precision"], eager_backward=not v["compile"])
    if why:
        raise UserError(f"{where}: frozen_fp8: {why}")
    if v["frozen_sharding"] == "fsdp":
        raise UserError(f"{where}: frozen_fp8 with frozen_sharding fsdp: the float8 weights are cast once after they "
                        "are read, and FSDP2 shards them before (torchao's float8 FSDP keeps bf16 shards and casts "
                        "them every step); use frozen_sharding none, where float8 holds the decoder layers' weights "
                        "in half the bytes")


def fused_attention_only(device: str, precision: str, sm80: bool) -> bool:
    """Whether training's attention may run only in the fused SDPA kernels: the math kernel is not
    among those `precision.sdpa_backends` allows this card (bf16 units: sm80+) in this precision."""
    from torch.nn.attention import SDPBackend

    if device != "cuda":
        return False
    backends, _ = sdpa_backends((8, 0) if sm80 else (7, 0), frozen_weight_dtype(precision))
    return SDPBackend.MATH not in backends


def check_fused_head_widths(encoder_dim: int, d_z: int, heads: int, where: str) -> None:
    """The encoder's and pooler's attention is masked, so it needs the memory-efficient kernel,
    which takes head widths that are multiples of 8 only; flash takes no mask, and math is not
    allowed there. Caught here, not as "No available kernel" at step 1."""
    for name, dim in (("encoder_dim", encoder_dim), ("d_z", d_z)):
        if dim // heads % 8:
            fitting = [h for h in range(1, heads * 4 + 1) if encoder_dim % (8 * h) == 0 and d_z % (8 * h) == 0]
            works = (f"encoder_heads {', '.join(map(str, fitting))} would work" if fitting
                     else f"make encoder_dim and d_z multiples of 8 x encoder_heads ({8 * heads})")
            raise UserError(f"{where}: head width {name} / encoder_heads = {dim // heads} is not a multiple of 8, "
                            f"which the fused attention kernels of a cuda bf16/fp16 run need; {works}, "
                            "or train this width on the cpu")


SCHEMA = Schema(FIELDS, check_consistency)


# --- the command line -------------------------------------------------------------------------

def build_parser(prog: str = "train.py", argv: list[str] | None = None) -> argparse.ArgumentParser:
    """train.py's flags: every profile field, defaulting to the profile's value. Its --help lists
    the profiles, and shows the values of the one named with --profile, if any, in `argv`."""
    pre = Parser(add_help=False)
    pre.add_argument("--profile")
    pre.add_argument("--hw-profiles", default=str(DEFAULT_PROFILES))
    known, _ = pre.parse_known_args(argv)
    described, shown = SCHEMA.describe_profiles(Path(known.hw_profiles), known.profile)
    p = Parser(prog=prog, usage=f"{prog} --profile KEY [--resume [--new-data] | --overwrite] [--FIELD VALUE ...]",
               description="Train LatentWire from a hardware profile. Every field of the profile is also a flag, "
               "which overrides it.", formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=f"profiles in {known.hw_profiles}:\n{profile_listing(described)}" if described else None)
    p.add_argument("--profile", required=True, help="a key of hw_profiles.json (listed below)")
    p.add_argument("--hw-profiles", default=str(DEFAULT_PROFILES), help="the profile file")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an out_dir that holds a run")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="save and exit 0 after this optimizer step (the schedule is unchanged)")
    p.add_argument("--init-from", metavar="RUN_OR_CHECKPOINT",
                   help="a new run whose trainable weights start from this run's newest checkpoint (or this "
                        "checkpoint), with its own optimizer and schedule: to train a wire further")
    p.add_argument("--new-data", action="store_true",
                   help="with --resume: continue the weights, optimizer and schedule on this run's training data, "
                        "which may differ from the checkpoint's, from the start of a fresh epoch")
    SCHEMA.add_flags(p, shown)
    return p


def load_config(argv: list[str] | None = None, prog: str = "train.py") -> Config:
    """Parse the command line and return the validated configuration."""
    args = build_parser(prog, argv).parse_args(argv)
    path = Path(args.hw_profiles)
    values = SCHEMA.with_flags(SCHEMA.resolve_profile(read_profiles(path), args.profile, path), args)
    if args.resume and args.overwrite:
        raise UserError("--resume and --overwrite exclude each other")
    if args.stop_at_step is not None and args.stop_at_step <= 0:
        raise UserError(f"--stop-at-step must be > 0, got {args.stop_at_step}")
    if args.new_data and not args.resume:
        raise UserError("--new-data continues a run on other data: it needs --resume")
    run = RunFlags(profile=args.profile, resume=args.resume, overwrite=args.overwrite,
                   stop_at_step=args.stop_at_step, new_data=args.new_data,
                   given=tuple(name for name in FIELDS if getattr(args, name) is not None), init_from=args.init_from)
    return Config.of(values, run)


def read_meta(ckpt: Path) -> tuple[Config, int | None]:
    """The run's configuration from meta.json, every field checked as when it was trained."""
    where = ckpt / META
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where} is not valid JSON: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror}") from None
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise UserError(f"{where} has no 'config' object")
    # Fields added after the checkpoint was written take their defaults, as an older profile's do,
    # but for one: a run from before held_out_fraction trained on all of a local file.
    values = SCHEMA.defaults() | {"held_out_fraction": 0.0}
    missing = [name for name in FIELDS if name not in config and name not in values]
    if missing:
        raise UserError(f"{where}: config has no field {missing[0]!r}")
    values |= {name: SCHEMA.check_value(name, value, where=str(where)) for name, value in config.items() if name in FIELDS}
    return Config.of(values, RunFlags(profile=str(meta.get("profile")))), meta.get("step")
