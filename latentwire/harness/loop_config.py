"""The loop's own settings, whatever model it trains: the sections of a profile that train.py reads
itself (the card, numerics, compile, batch, optimizer, schedule, output, profiler), the run's
flags, and the command line that resolves them.

A model's configuration extends `LoopConfig` with sections of its own (dataclasses of
`harness.config.setting` fields) and, where its fields tie together, its own `rules`. Every
setting has a default but the card's name, device and memory: a profile names its card and what
differs (docs/loop.md lists the loop's fields). `load_config` reads the command line for any such
class.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar, Literal

from .compiling import CompileConfig
from .config import Parser, Schema, profile_listing, read_profiles, setting
from .errors import UserError
from .precision import Card, Numerics
from .profiling import ProfilerConfig
from .recompute import Recompute


@dataclass(frozen=True)
class Training:
    num_gpus: int = setting(
        1,
        "ranks the profile is laid out for (train.py runs with as many as torchrun starts, "
        "keeping the profile's global batch where it splits)",
        gt=0,
    )
    micro_batch_size: int = setting(8, "examples per rank per forward pass", gt=0)
    grad_accum_steps: int = setting(1, "micro-batches per optimizer step", gt=0)
    # how lr follows a global batch the profile did not tune it for (harness.layout)
    lr_scaling: Literal["sqrt", "linear"] = setting("sqrt", "how lr follows a changed global batch")
    max_steps: int = setting(5000, "optimizer steps", gt=0, restored=True)
    seed: int = setting(0, "seed of model init, data order and dropout", ge=0)
    max_grad_norm: float = setting(1.0, "clip the global gradient norm to this", gt=0)
    max_nonfinite_steps: int = setting(5, "stop after this many non-finite steps in a row", gt=0)
    dist_timeout_s: int = setting(1800, "collective timeout of the process group", gt=0)


@dataclass(frozen=True)
class Loader:
    """The DataLoader's workers (harness.data.make_loader)."""

    num_workers: int = setting(0, "DataLoader worker processes per rank", ge=0)
    prefetch_factor: int = setting(2, "batches each worker loads ahead", gt=0)


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's (the lr is also OneCycle's peak)."""

    lr: float = setting(3e-4, "peak learning rate of OneCycle", gt=0, restored=True)
    weight_decay: float = setting(0.01, "AdamW weight decay", ge=0, restored=True)
    beta1: float = setting(0.9, "AdamW beta1", key="adam_beta1", ge=0, lt=1, restored=True)
    beta2: float = setting(0.95, "AdamW beta2", key="adam_beta2", ge=0, lt=1, restored=True)
    eps: float = setting(1e-8, "AdamW epsilon, added to the gradient's RMS before dividing by it", key="adam_eps", gt=0)


@dataclass(frozen=True)
class Schedule:
    """OneCycle's shape around the optimizer's lr."""

    pct_start: float = setting(0.05, "fraction of steps spent warming up", gt=0, lt=1, restored=True)
    anneal_strategy: Literal["cos", "linear"] = setting("cos", "OneCycle annealing", restored=True)
    div_factor: float = setting(25.0, "initial lr = lr / div_factor", gt=0, restored=True)
    final_div_factor: float = setting(1000.0, "final lr = initial lr / final_div_factor", gt=0, restored=True)


@dataclass(frozen=True)
class Output:
    """What the run writes, and how often: logs, checkpoints, evaluations."""

    out_dir: str = setting("", "where metrics, traces and checkpoints go ('': runs/<profile>)")
    log_every: int = setting(10, "log every N optimizer steps", gt=0)
    checkpoint_every: int = setting(500, "checkpoint every N steps (0: only at the end)", ge=0)
    keep_checkpoints: int = setting(3, "keep the newest K checkpoints", gt=0)
    eval_every: int = setting(0, "evaluate on the held-out split every N steps (0: never)", ge=0)


def flag(default=dataclasses.MISSING, help: str = "", **options):
    """An invocation's field as a command-line flag (`--stop-at-step` for `stop_at_step`): its
    `default` (none: the flag is required), its `help` and argparse's `options` beyond what its
    type gives (a bool is a switch, `X | None` takes an X). Not a setting: no profile names it,
    and a checkpoint does not record it."""
    return dataclasses.field(default=default, metadata={"flag": {"help": help, **options}})


@dataclass(frozen=True)
class Invocation:
    """Flags that describe this invocation rather than the hardware."""

    profile: str = flag(help="a key of the profile file (listed below)")
    hw_profiles: str = flag("", "the profile file")  # '': the one load_config is given
    resume: bool = flag(False, "continue from the newest complete checkpoint")
    overwrite: bool = flag(False, "start afresh in an out_dir that holds a run")
    stop_at_step: int | None = flag(None, "save and exit 0 after this optimizer step (the schedule is unchanged)")
    init_from: str | None = flag(
        None,
        "a new run whose trainable weights start from this run's newest checkpoint (or this checkpoint), "
        "with its own optimizer and schedule: to train a model further",
        metavar="RUN_OR_CHECKPOINT",
    )
    requeued: bool = flag(
        False,
        "a requeued job (launch.sh adds it under SLURM): --resume where the run has a checkpoint, else "
        "start the run, saying which",
    )
    new_data: bool = flag(
        False,
        "with --resume: continue the weights, optimizer and schedule on this run's training data, which "
        "may differ from the checkpoint's, from the start of a fresh epoch",
    )
    given: tuple[str, ...] = ()  # the settings given as flags, over the profile's values
    restarted: bool = False  # torchrun restarted this job before the run's first checkpoint: out_dir's run is its own

    def setting(self, field: str, value) -> str:
        """A setting and its value as the user gave it: its flag, or its profile's field."""
        if field in self.given:
            return f"--{field.replace('_', '-')} {value}"
        return f"{field} {value} from profile {self.profile!r} of {self.hw_profiles}"


@dataclass(frozen=True)
class LoopConfig:
    """The resolved configuration: a profile plus command-line overrides, validated, in typed
    sections (a function takes the section it reads). A model's configuration extends it with its
    own sections."""

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
    invocation: Invocation

    # The version of these settings, which each checkpoint records (harness.config, "Settings have
    # versions"): a configuration that extends them declares its own, bumped by every change to a
    # setting of its own or of these.
    version: ClassVar[int] = 3

    @classmethod
    def rules(cls, v: dict, where: str) -> None:
        """The checks that tie fields together (a model's configuration adds its own, after these)."""
        if v["precision"] == "bf16" and not v["supports_bf16"]:
            raise UserError(f"{where}: precision bf16 on a card without bf16 support; use fp16 or fp32")

    @classmethod
    @functools.cache
    def schema(cls) -> Schema:
        hints = typing.get_type_hints(cls)
        sections = {f.name: hints[f.name] for f in dataclasses.fields(cls) if f.name != "invocation"}
        return Schema.of(sections, cls.rules, cls.version)

    @classmethod
    def of(cls, values: dict, invocation: Invocation):
        """From checked flat values (every field of the schema)."""
        hints = typing.get_type_hints(cls)
        return cls(
            **{attr: hints[attr](**kwargs) for attr, kwargs in cls.schema().sections(values).items()},
            invocation=invocation,
        )

    def flat(self) -> dict:
        """The flat fields (profile keys), in the schema's order."""
        return self.schema().flat(self)

    def to_dict(self) -> dict:
        """What meta.json records: the profile's key and the flat fields."""
        return {"profile": self.invocation.profile, **self.flat()}


# --- the command line -----------------------------------------------------------------------------


def build_parser(schema: Schema, profiles: Path, prog: str, argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The loop's flags and every field of `schema`, defaulting to the profile's value. --help lists
    the profiles of the file, and shows the values of the one named with --profile in `argv`."""
    pre = Parser(add_help=False)
    pre.add_argument("--profile")
    pre.add_argument("--hw-profiles", default=str(profiles))
    known, _ = pre.parse_known_args(argv)
    described, shown = schema.describe_profiles(Path(known.hw_profiles), known.profile)
    if shown:
        shown["values"]["out_dir"] = default_out_dir(shown["values"]["out_dir"], known.profile)
    p = Parser(
        prog=prog,
        usage=f"{prog} --profile KEY [--resume [--new-data] | --overwrite] [--FIELD VALUE ...]",
        description="Train from a hardware profile. Every field of the profile is also a flag, which overrides it.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=f"profiles in {known.hw_profiles}:\n{profile_listing(described)}" if described else None,
    )
    for f in invocation_flags():
        p.add_argument("--" + f.name.replace("_", "-"), **flag_options(f))
    p.set_defaults(hw_profiles=str(profiles))
    schema.add_flags(p, shown)
    return p


def invocation_flags() -> list[dataclasses.Field]:
    """The fields of `Invocation` that are flags, in its order."""
    return [f for f in dataclasses.fields(Invocation) if "flag" in f.metadata]


def flag_options(f: dataclasses.Field) -> dict:
    """argparse's keyword arguments for an invocation's flag, from its declaration."""
    kind = typing.get_type_hints(Invocation)[f.name]
    options = dict(f.metadata["flag"])
    if f.default is dataclasses.MISSING:
        return {"required": True, **options}
    if kind is bool:
        return {"action": "store_true", **options}
    inner = [a for a in typing.get_args(kind) if a is not type(None)] or [kind]
    return {"type": inner[0], "default": f.default, **options}


def default_out_dir(out_dir: str, profile: str) -> str:
    """A profile's out_dir, runs/<profile> where it names none."""
    return out_dir or f"runs/{profile}"


def load_config(config_type: type[LoopConfig], argv: list[str] | None, profiles: Path, prog: str = "train.py"):
    """Parse the command line into a validated `config_type` (LoopConfig or a model's extension)."""
    schema = config_type.schema()
    args = build_parser(schema, profiles, prog, argv).parse_args(argv)
    path = Path(args.hw_profiles)
    values = schema.with_flags(schema.resolve_profile(read_profiles(path), args.profile, path), args)
    values["out_dir"] = default_out_dir(values["out_dir"], args.profile)
    if args.resume and args.overwrite:  # a requeued job may keep --overwrite: its own checkpoint wins then
        raise UserError("--resume and --overwrite exclude each other")
    if args.stop_at_step is not None and args.stop_at_step <= 0:
        raise UserError(f"--stop-at-step must be > 0, got {args.stop_at_step}")
    if args.new_data and not args.resume:
        raise UserError("--new-data continues a run on other data: it needs --resume")
    invocation = Invocation(
        **{f.name: getattr(args, f.name) for f in invocation_flags()},
        given=tuple(name for name in schema.fields if getattr(args, name) is not None),
    )
    return config_type.of(values, invocation)
