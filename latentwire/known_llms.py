"""The released LLMs' architectures, shipped as their config.json values: planning a card
(`llm_sources.llm_spec`) and building `random:` models (`llm_sources.random_config`) need no download.

`llm_parameter_count` counts parameters from a configuration by formula: the analytic side of the
planner's cross-check, and a check of the table against the published counts.
"""

from __future__ import annotations

from .harness.errors import UserError

# The config.json values of the released checkpoints (only the fields that shape the model).
LLAMA_3_1_8B = dict(
    model_type="llama",
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    attention_bias=False,
    mlp_bias=False,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    tie_word_embeddings=False,
    bos_token_id=128000,
    eos_token_id=128001,
)
QWEN_2_5_7B = dict(
    model_type="qwen2",
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=131072,
    max_window_layers=28,
    use_sliding_window=False,
    sliding_window=131072,
    rms_norm_eps=1e-6,
    rope_theta=1000000.0,
    tie_word_embeddings=False,
    bos_token_id=151643,
    eos_token_id=151643,
)
LLAMA_3_1_70B = dict(
    LLAMA_3_1_8B,
    hidden_size=8192,
    intermediate_size=28672,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    head_dim=128,
)
QWEN_2_5_72B = dict(
    QWEN_2_5_7B,
    hidden_size=8192,
    intermediate_size=29568,
    num_hidden_layers=80,
    num_attention_heads=64,
    num_key_value_heads=8,
    max_window_layers=80,
    rms_norm_eps=1e-5,
)

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
