"""The loop's own settings, whatever model it trains: the fields of a profile that train.py reads
itself (the card, numerics, compile, batch, optimizer, schedule, output, profiler), their typed
sections, the run's flags, and the command line that resolves them.

A model adds its own fields and sections: its configuration class extends `LoopConfig` with its
sections and names its `SCHEMA` (these fields and its own, `model_schema`), the settings a resume
may not change besides the loop's (`RESTORED`) and those its trained weights depend on
(`WEIGHT_FIELDS`, which `--init-from` compares). `load_config` reads the command line for any
such class.
"""
from __future__ import annotations

import argparse
import dataclasses
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, ClassVar

from .compiling import CompileConfig
from .config import Field, Parser, Schema, flat_of, profile_listing, read_profiles, sections_of
from .errors import UserError
from .precision import Card, Numerics
from .profiling import ProfilerConfig
from .recompute import POLICIES, Recompute

LOOP_FIELDS: dict[str, Field] = {
    # --- the card -------------------------------------------------------------------------
    "description": Field(str, "what this profile is for"),
    "device": Field(str, "cuda or cpu", choices=("cuda", "cpu")),
    "memory_gb": Field(float, "memory of one device in GB (GiB for CUDA cards)", positive=True),
    "cap_memory": Field(bool, "hold a run on a card with more memory than memory_gb to memory_gb", default=True),
    "supports_bf16": Field(bool, "whether the card has bf16 tensor cores"),
    "peak_tflops_bf16": Field(float, "dense bf16 peak TFLOP/s of one device", nullable=True, positive=True),
    "peak_tflops_fp16": Field(float, "dense fp16 peak TFLOP/s of one device", nullable=True, positive=True),
    "peak_tflops_tf32": Field(float, "dense TF32 tensor-core peak TFLOP/s (Ampere and newer)", nullable=True,
                              positive=True, default=None),
    "peak_tflops_fp32": Field(float, "dense IEEE fp32 peak TFLOP/s (no tensor cores)", nullable=True, positive=True),
    # --- numerics, compile and recompute ---------------------------------------------------
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
                                "~/.cache/<app>/inductor; torch's own default is under /tmp)", default=""),
    "activation_checkpointing": Field(str, "what backward recomputes of the model's checkpointed regions: none "
                                           "(every activation kept), selective (attention's and every second "
                                           "matmul's outputs kept, the rest recomputed), full (each region's "
                                           "forward run again)", choices=POLICIES, default="none"),
    # --- batch, optimizer and schedule ----------------------------------------------------
    "num_gpus": Field(int, "ranks the profile is laid out for (train.py runs with as many as torchrun starts, "
                           "keeping the profile's global batch where it splits)", positive=True, default=1),
    "micro_batch_size": Field(int, "examples per rank per forward pass", positive=True),
    "grad_accum_steps": Field(int, "micro-batches per optimizer step", positive=True),
    "lr_scaling": Field(str, "how lr follows a changed global batch", choices=("sqrt", "linear")),
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
    "num_workers": Field(int, "DataLoader worker processes per rank", non_negative=True),
    "prefetch_factor": Field(int, "batches each worker loads ahead", positive=True),
    # --- the run --------------------------------------------------------------------------
    "out_dir": Field(str, "where metrics, traces and checkpoints go"),
    "log_every": Field(int, "log every N optimizer steps", positive=True),
    "checkpoint_every": Field(int, "checkpoint every N steps (0: only at the end)", non_negative=True),
    "keep_checkpoints": Field(int, "keep the newest K checkpoints", positive=True),
    "eval_every": Field(int, "evaluate on the held-out split every N steps (0: never)", non_negative=True),
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

# What a checkpoint's state carries of the loop's settings (the optimizer, the OneCycle schedule and
# the grad scaler, whose state depends on the precision): a resume may not change them.
LOOP_RESTORED = ("max_steps", "lr", "weight_decay", "adam_beta1", "adam_beta2", "pct_start", "div_factor",
                 "final_div_factor", "anneal_strategy", "precision")


def check_loop_rules(v: dict, where: str) -> None:
    """The rules that tie the loop's fields together."""
    if v["precision"] == "bf16" and not v["supports_bf16"]:
        raise UserError(f"{where}: precision bf16 on a card without bf16 support; use fp16 or fp32")
    if not 0 < v["pct_start"] < 1:
        raise UserError(f"{where}: field 'pct_start' must be between 0 and 1, got {v['pct_start']}")
    for beta in ("adam_beta1", "adam_beta2"):
        if v[beta] >= 1:
            raise UserError(f"{where}: field {beta!r} must be below 1, got {v[beta]}")


def model_schema(fields: dict[str, Field], rules: Callable[[dict, str], None]) -> Schema:
    """A model's schema: the loop's fields and the model's own, the loop's rules and then its own."""
    clash = LOOP_FIELDS.keys() & fields.keys()
    assert not clash, f"the model redefines the loop's fields {sorted(clash)}"

    def both(values: dict, where: str) -> None:
        check_loop_rules(values, where)
        rules(values, where)

    return Schema(LOOP_FIELDS | fields, both)


# --- the loop's sections; Card, Numerics, CompileConfig, Recompute and ProfilerConfig are their modules' -

@dataclass(frozen=True)
class Training:
    num_gpus: int  # the layout the profile is written for
    micro_batch_size: int
    grad_accum_steps: int
    lr_scaling: str  # how lr follows a global batch the profile did not tune it for (harness.layout)
    max_steps: int
    seed: int
    max_grad_norm: float
    max_nonfinite_steps: int
    dist_timeout_s: int


@dataclass(frozen=True)
class Loader:
    """The DataLoader's workers (harness.data.make_loader)."""
    num_workers: int
    prefetch_factor: int


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
class Output:
    """What the run writes, and how often: logs, checkpoints, evaluations."""
    out_dir: str
    log_every: int
    checkpoint_every: int
    keep_checkpoints: int
    eval_every: int  # 0: never


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
    requeued: bool = False  # a requeued job: resume where the run saved, else start it (launch.sh adds it)
    hw_profiles: str = ""  # the profile file

    def setting(self, field: str, value) -> str:
        """A setting and its value as the user gave it: its flag, or its profile's field."""
        if field in self.given:
            return f"--{field.replace('_', '-')} {value}"
        return f"{field} {value} from profile {self.profile!r} of {self.hw_profiles}"


@dataclass(frozen=True)
class LoopConfig:
    """The resolved configuration: a profile plus command-line overrides, validated, in typed
    sections (a function takes the section it reads). A model's configuration extends it with its
    own sections; every flat field belongs to exactly one section, read under its own name or the
    one its section's FLAT_NAMES gives."""
    card: Card
    numerics: Numerics
    compile: CompileConfig
    recompute: Recompute
    training: Training
    loader: Loader
    optimizer: OptimizerConfig
    schedule: Schedule
    output: Output
    profiler: ProfilerConfig
    run: RunFlags
    SCHEMA: ClassVar[Schema] = Schema(LOOP_FIELDS, check_loop_rules)
    RESTORED: ClassVar[tuple[str, ...]] = ()  # the model's settings a resume may not change
    WEIGHT_FIELDS: ClassVar[tuple[str, ...]] = ()  # the settings its trained weights depend on

    @classmethod
    def sections(cls) -> dict[str, type]:
        hints = typing.get_type_hints(cls)
        return {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "run"}

    @classmethod
    def of(cls, values: dict, run: RunFlags):
        """From checked flat values (every field of SCHEMA)."""
        return cls(**sections_of(cls.sections(), values), run=run)

    def flat(self) -> dict:
        """The flat fields, in SCHEMA order."""
        values = flat_of(self, self.sections())
        return {name: values[name] for name in self.SCHEMA.fields}

    def to_dict(self) -> dict:
        """What meta.json records: the profile's key and the flat fields."""
        return {"profile": self.run.profile, **self.flat()}

    @classmethod
    def restored(cls) -> tuple[str, ...]:
        return LOOP_RESTORED + cls.RESTORED


# --- the command line -----------------------------------------------------------------------------

def build_parser(schema: Schema, profiles: Path, prog: str, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The loop's flags and every field of `schema`, defaulting to the profile's value. --help lists
    the profiles of the file, and shows the values of the one named with --profile in `argv`."""
    pre = Parser(add_help=False)
    pre.add_argument("--profile")
    pre.add_argument("--hw-profiles", default=str(profiles))
    known, _ = pre.parse_known_args(argv)
    described, shown = schema.describe_profiles(Path(known.hw_profiles), known.profile)
    p = Parser(prog=prog, usage=f"{prog} --profile KEY [--resume [--new-data] | --overwrite] [--FIELD VALUE ...]",
               description="Train from a hardware profile. Every field of the profile is also a flag, which "
               "overrides it.", formatter_class=argparse.RawDescriptionHelpFormatter,
               epilog=f"profiles in {known.hw_profiles}:\n{profile_listing(described)}" if described else None)
    p.add_argument("--profile", required=True, help="a key of the profile file (listed below)")
    p.add_argument("--hw-profiles", default=str(profiles), help="the profile file")
    p.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint")
    p.add_argument("--overwrite", action="store_true", help="start afresh in an out_dir that holds a run")
    p.add_argument("--stop-at-step", type=int, default=None,
                   help="save and exit 0 after this optimizer step (the schedule is unchanged)")
    p.add_argument("--init-from", metavar="RUN_OR_CHECKPOINT",
                   help="a new run whose trainable weights start from this run's newest checkpoint (or this "
                        "checkpoint), with its own optimizer and schedule: to train a model further")
    p.add_argument("--requeued", action="store_true",
                   help="a requeued job (launch.sh adds it under SLURM): --resume where the run has a checkpoint, "
                        "else start the run, saying which")
    p.add_argument("--new-data", action="store_true",
                   help="with --resume: continue the weights, optimizer and schedule on this run's training data, "
                        "which may differ from the checkpoint's, from the start of a fresh epoch")
    schema.add_flags(p, shown)
    return p


def load_config(config_type: type[LoopConfig], argv: list[str] | None, profiles: Path, prog: str = "train.py"):
    """Parse the command line into a validated `config_type` (LoopConfig or a model's extension)."""
    schema = config_type.SCHEMA
    args = build_parser(schema, profiles, prog, argv).parse_args(argv)
    path = Path(args.hw_profiles)
    values = schema.with_flags(schema.resolve_profile(read_profiles(path), args.profile, path), args)
    if args.resume and args.overwrite:  # a requeued job may keep --overwrite: its own checkpoint wins then
        raise UserError("--resume and --overwrite exclude each other")
    if args.stop_at_step is not None and args.stop_at_step <= 0:
        raise UserError(f"--stop-at-step must be > 0, got {args.stop_at_step}")
    if args.new_data and not args.resume:
        raise UserError("--new-data continues a run on other data: it needs --resume")
    run = RunFlags(profile=args.profile, resume=args.resume, overwrite=args.overwrite,
                   stop_at_step=args.stop_at_step, new_data=args.new_data,
                   given=tuple(name for name in schema.fields if getattr(args, name) is not None),
                   init_from=args.init_from, requeued=args.requeued, hw_profiles=str(path))
    return config_type.of(values, run)
