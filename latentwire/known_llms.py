"""The frozen LLMs' architectures, without their weights: what the memory planner builds.

The planner needs each LLM's transformers configuration (shapes and parameter count) and whether
its tokenizer puts a BOS before the answer (one more position per sample). It takes them from
- `tiny`: the cpu profile's offline models (`latentwire.llm`),
- `random:SOURCE`: SOURCE's configuration, read by its family's tiny tokenizer (`latentwire.llm`),
- a local directory: its `config.json` and `tokenizer_config.json`,
- a hub id in `KNOWN_LLMS`: exact configurations shipped here, so planning needs no download.

`llm_parameter_count` counts parameters from a configuration by formula: the analytic side of the
planner's cross-check, and a check of the table against the published counts.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

from .errors import UserError

# The config.json values of the released checkpoints (only the fields that shape the model).
LLAMA_3_1_8B = dict(
    model_type="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
    num_attention_heads=32, num_key_value_heads=8, head_dim=128, hidden_act="silu", attention_bias=False,
    mlp_bias=False, max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
    rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192},
    tie_word_embeddings=False, bos_token_id=128000, eos_token_id=128001)
QWEN_2_5_7B = dict(
    model_type="qwen2", vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
    num_attention_heads=28, num_key_value_heads=4, hidden_act="silu", max_position_embeddings=131072,
    max_window_layers=28, use_sliding_window=False, sliding_window=131072, rms_norm_eps=1e-6,
    rope_theta=1000000.0, tie_word_embeddings=False, bos_token_id=151643, eos_token_id=151643)
LLAMA_3_1_70B = dict(
    LLAMA_3_1_8B, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, head_dim=128)
QWEN_2_5_72B = dict(
    QWEN_2_5_7B, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
    num_key_value_heads=8, max_window_layers=80, rms_norm_eps=1e-5)

# hub id -> (config values, whether its tokenizer has a BOS token). Instruct variants share the
# base model's architecture; Qwen2.5's tokenizer has no BOS (its config's bos_token_id is unused).
KNOWN_LLMS: dict[str, tuple[dict, bool]] = {
    "meta-llama/Llama-3.1-8B": (LLAMA_3_1_8B, True),
    "meta-llama/Llama-3.1-8B-Instruct": (LLAMA_3_1_8B, True),
    "Qwen/Qwen2.5-7B": (QWEN_2_5_7B, False),
    "Qwen/Qwen2.5-7B-Instruct": (QWEN_2_5_7B, False),
    "meta-llama/Llama-3.1-70B": (LLAMA_3_1_70B, True),
    "meta-llama/Llama-3.1-70B-Instruct": (LLAMA_3_1_70B, True),
    "Qwen/Qwen2.5-72B": (QWEN_2_5_72B, False),
    "Qwen/Qwen2.5-72B-Instruct": (QWEN_2_5_72B, False),
}


@dataclass(frozen=True)
class LLMSpec:
    """What the planner needs of one frozen LLM."""
    source: str          # as the profile names it
    config: object       # a transformers PretrainedConfig
    has_bos: bool        # a BOS leads every prompt (latentwire.prompting)
    origin: str          # where the configuration came from, for the report


def llm_spec(name: str, source: str) -> LLMSpec:
    """`name` is 'llama' or 'qwen'; `source` is 'tiny', 'tiny-random', 'random:SOURCE', a local
    directory or a known hub id."""
    from .llm import RANDOM, TINY, TINY_RANDOM, tiny_reader, tiny_tokenizer

    if source == TINY_RANDOM:
        return _tiny_spec(name)
    if source == TINY:
        return _local_spec(tiny_reader(name))
    if source.startswith(RANDOM):
        has_bos = tiny_tokenizer(name).bos_token_id is not None  # the tokenizer llm.random_architecture reads it with
        return LLMSpec(source, random_config(source), has_bos, "random weights, configuration of " + source[len(RANDOM):])
    if os.path.isdir(os.path.expanduser(source)):
        return _local_spec(source)
    if source in KNOWN_LLMS:
        values, has_bos = KNOWN_LLMS[source]
        return LLMSpec(source, _config_from_values(values), has_bos, "configuration shipped in latentwire.known_llms")
    raise UserError(f"no configuration for {source!r}: name a local model directory (with config.json) "
                    f"or one of {', '.join(KNOWN_LLMS)}")


def random_config(source: str):
    """The configuration behind `random:SOURCE`: a hub id of `KNOWN_LLMS`, a model directory
    (its config.json) or the path of a config.json."""
    from .llm import RANDOM

    target = source[len(RANDOM):]
    if target in KNOWN_LLMS:
        return _config_from_values(KNOWN_LLMS[target][0])
    path = os.path.expanduser(target)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not path.endswith(".json"):
        raise UserError(f"{source}: name a config.json, a model directory or one of {', '.join(KNOWN_LLMS)}")
    try:
        with open(path) as f:
            values = json.load(f)
    except OSError as e:
        raise UserError(f"{source}: cannot read {path}: {e.strerror}") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{source}: {path} is not valid JSON: {e.msg} at line {e.lineno}") from None
    if not isinstance(values, dict) or "model_type" not in values:
        raise UserError(f"{source}: {path} has no field 'model_type'")
    try:
        return _config_from_values(values)
    except (ValueError, TypeError) as e:
        raise UserError(f"{source}: {path}: {str(e).splitlines()[0]}") from None


def _config_from_values(values: dict):
    from transformers import AutoConfig

    values = dict(values)
    return AutoConfig.for_model(values.pop("model_type"), **values)


def _tiny_spec(name: str) -> LLMSpec:
    from torch._subclasses.fake_tensor import FakeTensorMode

    from .llm import tiny_model, tiny_tokenizer

    tokenizer = tiny_tokenizer(name)
    with FakeTensorMode():  # its configuration is built with it; the weights are never allocated
        config = tiny_model(name, tokenizer).config
    return LLMSpec("tiny-random", config, tokenizer.bos_token_id is not None, "configuration built offline by latentwire.llm")


def _local_spec(directory: str) -> LLMSpec:
    from transformers import AutoConfig

    path = os.path.expanduser(directory)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the model configuration in {directory}: {str(e).splitlines()[0]}") from None
    return LLMSpec(directory, config, _local_has_bos(path), f"configuration read from {directory}/config.json")


def _local_has_bos(path: str) -> bool:
    """From tokenizer_config.json; without one, assume a BOS: one more position is the worst case."""
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    try:
        with open(tokenizer_config) as f:
            return json.load(f).get("bos_token") is not None
    except FileNotFoundError:
        return True
    except json.JSONDecodeError as e:
        raise UserError(f"{tokenizer_config} is not valid JSON: {e.msg}") from None


def llm_parameter_count(config) -> int:
    """Parameters of a Llama- or Qwen2-architecture causal LM, by formula from its configuration."""
    if config.model_type not in ("llama", "qwen2"):
        raise UserError(f"the analytic parameter count knows llama and qwen2 architectures, not {config.model_type!r}")
    hidden, heads, kv_heads = config.hidden_size, config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    q_out, kv_out = heads * head_dim, kv_heads * head_dim
    attention = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
    if config.model_type == "qwen2":
        attention += q_out + 2 * kv_out  # Qwen2 has biases on q, k and v (not on o)
    elif config.attention_bias:
        attention += q_out + 2 * kv_out + hidden
    mlp = 3 * hidden * config.intermediate_size  # gate, up, down (SwiGLU)
    if getattr(config, "mlp_bias", False):
        mlp += 2 * config.intermediate_size + hidden
    layer = attention + mlp + 2 * hidden  # + input and post-attention RMSNorm gains
    embeddings = config.vocab_size * hidden
    head = 0 if config.tie_word_embeddings else config.vocab_size * hidden
    return embeddings + config.num_hidden_layers * layer + hidden + head  # + the final norm
