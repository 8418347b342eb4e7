"""LatentWire's settings: its sections of a hardware profile, beside the loop's own
(`harness.loop_config`), each defined by the module that reads it (`cfg.wire`, `cfg.data`, ...),
the rules that tie them together, and the resolved `Config`. The machinery (settings declared
once, profiles, `extends`, flags, --help) is `harness.config`'s.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .dataset import DataConfig
from .fp8 import fp8_refusal
from .harness.checkpoint import META
from .harness.config import setting
from .harness.errors import UserError
from .harness.loop_config import Invocation, LoopConfig
from .harness.loop_config import build_parser as build_loop_parser
from .harness.loop_config import load_config as load_loop_config
from .harness.precision import compute_dtype, sdpa_backends
from .llm import FrozenConfig
from .model import WireConfig
from .objectives import Objectives
from .prompting import PromptFormat

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILES = REPO_ROOT / "hw_profiles.json"


@dataclass(frozen=True)
class Planning:
    """The memory plan's budget, and whether --elastic-batch takes the micro-batch from it."""

    target_util: float = setting(0.9, "fraction of the card's memory the plan may fill", gt=0, le=1)
    elastic_batch: bool = setting(False, "take the micro-batch from the memory plan, keep the global batch")


@dataclass(frozen=True)
class Evaluation:
    """What the periodic evaluation answers (how often: the loop's `output.eval_every`)."""

    examples: int = setting(1000, "held-out examples per evaluation", key="eval_examples", gt=0)
    max_new_tokens: int = setting(32, "greedy generation length limit in evaluation", gt=0)


def check_consistency(v: dict, where: str) -> None:
    """The rules that tie LatentWire's fields together (and to the loop's card and precision)."""
    for dim in ("encoder_dim", "d_z"):
        if v[dim] % v["encoder_heads"]:
            raise UserError(
                f"{where}: field {dim!r} ({v[dim]}) must be divisible by encoder_heads ({v['encoder_heads']})"
            )
    if v["encoder_dim"] // v["encoder_heads"] % 2:
        raise UserError(
            f"{where}: the byte encoder's head width, encoder_dim / encoder_heads = "
            f"{v['encoder_dim'] // v['encoder_heads']}, must be even (rotary positions rotate pairs)"
        )
    if v["frozen_fp8"] != "none":
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
        raise UserError(
            f"{where}: frozen_fp8 with frozen_sharding fsdp: the float8 weights are cast once after they "
            "are read, and FSDP2 shards them before (torchao's float8 FSDP keeps bf16 shards and casts "
            "them every step); use frozen_sharding none, where float8 holds the decoder layers' weights "
            "in half the bytes"
        )


def fused_attention_only(device: str, precision: str, sm80: bool) -> bool:
    """Whether training's attention may run only in the fused SDPA kernels: the math kernel is not
    among those `precision.sdpa_backends` allows this card (bf16 units: sm80+) in this precision."""
    from torch.nn.attention import SDPBackend

    if device != "cuda":
        return False
    backends, _ = sdpa_backends((8, 0) if sm80 else (7, 0), compute_dtype(precision))
    return SDPBackend.MATH not in backends


def check_fused_head_widths(encoder_dim: int, d_z: int, heads: int, where: str) -> None:
    """The encoder's and pooler's attention is masked, so it needs the memory-efficient kernel,
    which takes head widths that are multiples of 8 only; flash takes no mask, and math is not
    allowed there. Caught here, not as "No available kernel" at step 1."""
    for name, dim in (("encoder_dim", encoder_dim), ("d_z", d_z)):
        if dim // heads % 8:
            fitting = [h for h in range(1, heads * 4 + 1) if encoder_dim % (8 * h) == 0 and d_z % (8 * h) == 0]
            works = (
                f"encoder_heads {', '.join(map(str, fitting))} would work"
                if fitting
                else f"make encoder_dim and d_z multiples of 8 x encoder_heads ({8 * heads})"
            )
            raise UserError(
                f"{where}: head width {name} / encoder_heads = {dim // heads} is not a multiple of 8, "
                f"which the fused attention kernels of a cuda bf16/fp16 run need; {works}, "
                "or train this width on the cpu"
            )


@dataclass(frozen=True)
class Config(LoopConfig):
    """The loop's sections (harness.loop_config) and LatentWire's, each defined by the module that
    reads it."""

    frozen: FrozenConfig
    wire: WireConfig
    prompt: PromptFormat
    objectives: Objectives
    data: DataConfig
    planning: Planning
    evaluation: Evaluation

    # The version of the checkpoint's settings, in each meta.json: bumped by every change to a
    # setting (added, or its values of another kind), which declares `since` this version and how
    # earlier checkpoints read it; tests/test_legacy_checkpoints.py holds the two to the fixtures of
    # each version (tests/fixtures/checkpoints).
    version: ClassVar[int] = 5

    @classmethod
    def rules(cls, v: dict, where: str) -> None:
        super().rules(v, where)
        check_consistency(v, where)


def build_parser(prog: str = "train.py", argv: list[str] | None = None) -> argparse.ArgumentParser:
    """train.py's parser, for --help and the commands that take its flags."""
    return build_loop_parser(Config.schema(), DEFAULT_PROFILES, prog, argv)


def load_config(argv: list[str] | None = None, prog: str = "train.py") -> Config:
    """The command line of train.py and of the commands that take its flags, validated."""
    return load_loop_config(Config, argv, DEFAULT_PROFILES, prog)


def read_meta(ckpt: Path) -> tuple[Config, int | None]:
    """The run's configuration from meta.json, every field checked as when it was trained."""
    where = ckpt / META
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where} is not valid JSON: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror}") from None
    schema = Config.schema()
    config = schema.saved(meta, str(where))  # an earlier version's, as this one reads it; a newer one refused
    values = schema.resolve({k: v for k, v in config.items() if k != "profile"}, f"{where}: config")
    return Config.of(values, Invocation(profile=str(meta.get("profile")))), meta.get("step")
