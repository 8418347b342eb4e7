"""LatentWire's settings: its fields of a hardware profile (`FIELDS`, beside the loop's own in
`harness.loop_config`), the rules that tie them together, and the resolved `Config`, typed: one
frozen dataclass per concern, each defined by the module that uses it, so a function takes the
section it reads (`cfg.wire`, `cfg.data`, ...). The machinery (profiles, `extends`, flags, --help,
sections) is `harness.config`'s.
"""
from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

from .dataset import DataConfig
from .harness.checkpoint import META
from .harness.config import Field, Schema
from .harness.errors import UserError
from .harness.loop_config import LoopConfig, RunFlags, model_schema
from .harness.loop_config import build_parser as build_loop_parser
from .harness.loop_config import load_config as load_loop_config
from .harness.precision import fp8_refusal, frozen_weight_dtype, sdpa_backends
from .llm import FrozenConfig
from .model import WireConfig
from .objectives import Objectives
from .prompting import CHAT_TEMPLATE_CHOICES, DEFAULT_ANCHOR, DEFAULT_INSTRUCTION, PromptFormat

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_PROFILES = REPO_ROOT / "hw_profiles.json"


FIELDS: dict[str, Field] = {
    # --- the frozen readers ----------------------------------------------------------------
    "activation_checkpointing": Field(bool, "recompute the frozen LLMs' decoder layers in backward"),
    "frozen_sharding": Field(str, "how a rank holds the frozen LLMs: none (whole, on every rank) or fsdp (sharded "
                                  "over the ranks by FSDP2, a decoder layer gathered only while it runs)",
                             choices=("none", "fsdp"), default="none"),
    "frozen_fp8": Field(bool, "run the frozen LLMs' decoder-layer linears in float8 (torchao: forward and input "
                              "gradients; bf16, compiled, a card with FP8 tensor cores or the CPU's emulation; "
                              "MFU stays counted against the bf16 peak)", default=False),
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
    "patch_hash_buckets": Field(int, "rows of a code per byte-encoder patch as a whole, looked up by a hash of its "
                                     "bytes and added to the patch embedding (0: none)", non_negative=True, default=0),
    "question_queries": Field(bool, "the latent pooler's queries start from a projection of the prompt's question (its "
                                    "first line) as the byte encoder reads it", default=False),
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
    "data_seed": Field(int, "seed of the examples: the synthetic set, a dataset's sample and a file's held-out part "
                            "(null: seed), so runs of several seeds can train and be evaluated on the same examples",
                       nullable=True, non_negative=True, default=None),
    "max_prompt_bytes": Field(int, "prompts are cut to this many UTF-8 bytes", positive=True),
    "max_answer_tokens": Field(int, "answers are cut to this many tokens", positive=True),
    "pad_multiple": Field(int, "pad lengths to a multiple of this (few shapes for compile)", positive=True),
    # --- memory planning and elastic batch ------------------------------------------------
    "target_util": Field(float, "fraction of the card's memory the plan may fill", positive=True),
    "elastic_batch": Field(bool, "take the micro-batch from the memory plan, keep the global batch"),
    # --- evaluation -----------------------------------------------------------------------
    "eval_examples": Field(int, "held-out examples per evaluation", positive=True),
    "max_new_tokens": Field(int, "greedy generation length limit in evaluation", positive=True),
}


@dataclass(frozen=True)
class Planning:
    """The memory plan's budget, and whether --elastic-batch takes the micro-batch from it."""
    target_util: float
    elastic_batch: bool


@dataclass(frozen=True)
class Evaluation:
    """What the periodic evaluation answers (how often: the loop's `output.eval_every`)."""
    examples: int
    max_new_tokens: int
    FLAT_NAMES: ClassVar[dict] = {"examples": "eval_examples"}


# The trainable model's shape, which its weights have: a resume may not change it (as it may not the
# loop's restored settings), and --init-from takes weights of the same shape trained for the same readers.
WIRE_SHAPE = ("num_latents", "d_z", "encoder_dim", "encoder_layers", "encoder_heads", "patch_bytes", "patch_mlp",
              "patch_hash_buckets", "question_queries")


def check_consistency(v: dict, where: str) -> None:
    """The rules that tie LatentWire's fields together (and to the loop's card and precision)."""
    if v["target_util"] > 1:
        raise UserError(f"{where}: field 'target_util' must be at most 1, got {v['target_util']}")
    if v["held_out_fraction"] >= 1:
        raise UserError(f"{where}: field 'held_out_fraction' must be below 1, got {v['held_out_fraction']}")
    if v["dropout"] >= 1:
        raise UserError(f"{where}: field 'dropout' must be below 1, got {v['dropout']}")
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
    SCHEMA: ClassVar[Schema] = model_schema(FIELDS, check_consistency)
    RESTORED: ClassVar[tuple[str, ...]] = WIRE_SHAPE
    WEIGHT_FIELDS: ClassVar[tuple[str, ...]] = (*WIRE_SHAPE, "llama", "qwen")


SCHEMA = Config.SCHEMA


def build_parser(prog: str = "train.py", argv: list[str] | None = None) -> argparse.ArgumentParser:
    """train.py's parser, for --help and the commands that take its flags."""
    return build_loop_parser(SCHEMA, DEFAULT_PROFILES, prog, argv)


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
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise UserError(f"{where} has no 'config' object")
    missing = [name for name in SCHEMA.fields if name not in config]
    if missing:
        raise UserError(f"{where}: config has no field {missing[0]!r}")
    values = {name: SCHEMA.check_value(name, config[name], where=str(where)) for name in SCHEMA.fields}
    return Config.of(values, RunFlags(profile=str(meta.get("profile")))), meta.get("step")
