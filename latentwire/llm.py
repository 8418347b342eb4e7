"""The two frozen LLMs: loading (hub id, local directory, a tiny one built offline, or a real
architecture with random weights) and freezing.

- `tiny` builds a small randomly initialised Llama or Qwen2 and a tokenizer trained here on the
  built-in synthetic corpus, so the cpu profile needs no download.
- `random:SOURCE` builds the architecture of SOURCE (a hub id whose configuration ships in
  `latentwire.known_llms`, a model directory, or a config.json) with random weights, directly on
  the rank's device, and the tiny tokenizer of its family: the same FLOPs and memory as the real
  model, to benchmark or plan a card before downloading 32 GB.
- a hub id or a local directory loads the real weights, tensor by tensor onto the rank's device.
The random ones are built from fixed seeds, so every rank, every run and the evaluation build the
very same models.
"""
from __future__ import annotations

import glob
import math
import os
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from .errors import UserError

TINY = "tiny"
RANDOM = "random:"
# The two frozen LLMs, named as their configuration fields are.
LLM_NAMES = ("llama", "qwen")
TINY_SEED = 1234
RANDOM_SEED = 4321
# Training feeds [wire ; answer] rows that are never packed and padded only on the right, so the
# LLMs attend causally with no mask at all. Under a name of its own (transformers' SDPA attention,
# registered again), transformers builds no mask: under "sdpa" it would read the position ids on
# every forward to look for packed rows (a host sync per LLM call) and, under torch.compile, build
# an explicit causal mask, which rules out the flash kernel and repeats the grouped K/V heads.
# Evaluation pads prompts on the left and switches to "sdpa" (`padded_attention`).
CAUSAL_ATTENTION = "latentwire_causal_sdpa"
# Rows of the embedding table squared in fp32 at a time: the table itself is up to 2 GiB in bf16.
EMBED_RMS_CHUNK_ELEMENTS = 2 ** 20

# Small but structurally faithful: grouped-query attention, RoPE, SwiGLU, RMSNorm, untied heads,
# and different widths and vocabularies so the two adapters really differ.
TINY_SPECS = {
    "llama": dict(hidden_size=128, intermediate_size=344, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1024),
    "qwen": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=768),
}


@dataclass
class FrozenLLM:
    """A frozen causal LM and its tokenizer.

    Not an nn.Module on purpose: it stays outside the DDP wrapper, so DDP neither broadcasts nor
    buckets its (possibly 16 GB of) weights; only the trainable encoder and adapters are DDP's.
    """
    name: str
    model: nn.Module
    tokenizer: object

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    @property
    def prefix_ids(self) -> list[int]:
        """Tokens fed between the wire and the answer: BOS if the model has one (Llama), else none (Qwen)."""
        bos = self.tokenizer.bos_token_id
        return [] if bos is None else [bos]

    def embed_rms(self) -> float:
        """RMS of the input-embedding table: adapters scale their output to it, so soft tokens look
        to the LLM like the token embeddings it was trained on. Summed in fp32 a chunk of rows at
        a time: an fp32 copy of a whole table (2 GiB for Qwen2.5-7B, and its square as much
        again) would not fit next to the weights on a 32 GB card."""
        w = self.model.get_input_embeddings().weight.detach()
        rows = max(1, EMBED_RMS_CHUNK_ELEMENTS // w.shape[-1])
        squares = sum(chunk.float().square().sum(dtype=torch.float64) for chunk in w.split(rows))
        return math.sqrt(squares.item() / w.numel())

    def answer_logits(self, soft: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last T+1 positions of [soft ; embed(input_ids)], i.e. the predictions of the
        answer tokens and the EOS after them (see data.Collator for the label layout)."""
        tok_embeds = self.model.get_input_embeddings()(input_ids)
        embeds = torch.cat([soft.to(tok_embeds.dtype), tok_embeds], dim=1)
        out = self.model(inputs_embeds=embeds, use_cache=False, logits_to_keep=input_ids.shape[1] + 1)
        return out.logits


def causal_attention() -> str:
    """The attention implementation the frozen LLMs are built with (see CAUSAL_ATTENTION)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(CAUSAL_ATTENTION, sdpa_attention_forward)
    return CAUSAL_ATTENTION


@contextmanager
def padded_attention(models: list[nn.Module]):
    """Within it, the LLMs take attention masks (left-padded prompts, KV cache): transformers' "sdpa"."""
    for model in models:
        model.set_attn_implementation("sdpa")
    try:
        yield
    finally:
        for model in models:
            model.set_attn_implementation(causal_attention())


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode (no dropout) and no parameter gradients: no grad buffers and no optimizer state,
    yet autograd still flows through the layers to the soft tokens."""
    model.eval()
    model.requires_grad_(False)
    return model


# --- tiny, offline models ---------------------------------------------------------------------

@lru_cache(maxsize=None)
def tiny_tokenizer(family: str):
    """A byte-level BPE trained on the synthetic corpus; Llama-style (BOS + EOS) or Qwen-style
    (EOS only, as in Qwen2.5, where the pad token is the end-of-text token)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    from .data import synthetic_corpus_text

    if family == "llama":
        specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
    else:
        specials = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=TINY_SPECS[family]["vocab_size"],
                                  special_tokens=list(dict.fromkeys(specials.values())),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(synthetic_corpus_text(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def tiny_model(family: str, tokenizer) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(TINY_SPECS[family], vocab_size=len(tokenizer))
    cls = LlamaConfig if family == "llama" else Qwen2Config
    config = cls(**spec, max_position_embeddings=512, tie_word_embeddings=False,
                 initializer_range=0.1,
                 bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                 pad_token_id=tokenizer.pad_token_id)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(TINY_SEED + (family == "qwen"))
        return AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(), dtype=torch.float32)


# --- loading ---------------------------------------------------------------------------------

def random_model(name: str, source: str, dtype: torch.dtype, device: torch.device):
    """`random:SOURCE`: SOURCE's architecture with seeded random weights, allocated and initialised
    on `device` (no host copy of 16 GB), read through its family's tiny tokenizer."""
    from transformers import AutoModelForCausalLM

    from .known_llms import random_config

    config = random_config(source)
    tokenizer = tiny_tokenizer(name)
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"{source}: vocabulary of {config.vocab_size} is smaller than the {len(tokenizer)} ids "
                        "of the tokenizer that reads it")
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.device(device):
        torch.manual_seed(RANDOM_SEED + LLM_NAMES.index(name))
        model = AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(), dtype=dtype)
    return model, tokenizer


def load_pretrained(source: str, dtype: torch.dtype, device: torch.device):
    """A hub id or a local directory. Hub ids download only because the user named one.

    The model is built on `device` and its weights are copied in one tensor at a time, so a rank
    holds at most one tensor (the largest is the embedding table, about 1 GiB) in host memory
    instead of the whole model (31 GB for the two LLMs, on each of a node's ranks)."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    looks_local = source.startswith((".", "/", "~")) or os.path.isdir(os.path.expanduser(source))
    if looks_local and not os.path.isdir(os.path.expanduser(source)):
        raise UserError(f"model directory {source} does not exist")
    # transformers says what it cannot build with OSError (files), ValueError (an unknown
    # model_type, a tokenizer it cannot instantiate) or KeyError (a config missing a field).
    with one_line_error(f"cannot read the configuration of model {source!r}"):
        config = AutoConfig.from_pretrained(source)
    with one_line_error(f"cannot load the tokenizer of model {source!r}"):
        tokenizer = AutoTokenizer.from_pretrained(source)
    with one_line_error(f"cannot load model {source!r}"):
        files = weight_files(source)
    if tokenizer.eos_token_id is None:
        raise UserError(f"model {source!r}: its tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # right padding never reaches the loss
    with one_line_error(f"cannot build model {source!r} from its configuration"), torch.device(device):
        model = AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(), dtype=dtype)
    with one_line_error(f"cannot read the weights of model {source!r}"):
        copy_weights(model, files, source)
    return model, tokenizer


@contextmanager
def one_line_error(what: str):
    """transformers', safetensors' and the hub's failures to read a model become `what: <their
    first line>`."""
    from safetensors import SafetensorError

    try:
        yield
    except (OSError, ValueError, KeyError, SafetensorError) as e:
        first = next((line.strip() for line in str(e).splitlines() if line.strip()), type(e).__name__)
        raise UserError(f"{what}: {first.rstrip(':')}") from None


def weight_files(source: str) -> list[str]:
    """The .safetensors files of a local directory or of a hub repository (downloaded once)."""
    directory = os.path.expanduser(source)
    if not os.path.isdir(directory):
        from huggingface_hub import snapshot_download

        directory = snapshot_download(source, allow_patterns=["*.safetensors"])
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    if not files:
        raise UserError(f"model {source!r} has no .safetensors weights")
    return files


def copy_weights(model: nn.Module, files: list[str], source: str) -> None:
    """Each checkpoint tensor read from the memory-mapped file and copied into its parameter (cast
    to the parameter's dtype); every parameter must be filled, directly or through a tied one."""
    from safetensors import safe_open

    targets = model.state_dict()
    filled = set()
    with torch.no_grad():
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    if key in targets:
                        shape = tuple(f.get_slice(key).get_shape())
                        if shape != tuple(targets[key].shape):
                            raise UserError(f"model {source!r}: tensor {key} has shape {shape} in its checkpoint, "
                                            f"{tuple(targets[key].shape)} in its configuration")
                        targets[key].copy_(f.get_tensor(key))
                        filled.add(targets[key].data_ptr())
    missing = [key for key, t in targets.items() if t.data_ptr() not in filled]
    if missing:
        raise UserError(f"model {source!r}: its checkpoint has no tensor for {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))


def load_frozen_llm(name: str, source: str, dtype: torch.dtype, device: torch.device) -> FrozenLLM:
    """`name` is 'llama' or 'qwen'; `source` is 'tiny', 'random:SOURCE', a hub id or a local directory."""
    if source == TINY:
        tokenizer = tiny_tokenizer(name)
        model = tiny_model(name, tokenizer).to(dtype=dtype, device=device)
    elif source.startswith(RANDOM):
        model, tokenizer = random_model(name, source, dtype, device)
    else:
        model, tokenizer = load_pretrained(source, dtype, device)
    return FrozenLLM(name, freeze(model), tokenizer)


def load_frozen_llms(cfg, dtype: torch.dtype, device: torch.device) -> dict[str, FrozenLLM]:
    """Both frozen LLMs of a configuration by name, each from its source field (`cfg.llama`, `cfg.qwen`)."""
    return {name: load_frozen_llm(name, getattr(cfg, name), dtype, device) for name in LLM_NAMES}


def held_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters that this rank holds: its shards where FSDP sharded them."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def fsdp_units(llm: FrozenLLM) -> list[nn.Module | list[nn.Module]]:
    """What --frozen-sharding fsdp shards, each unit whole only while it runs: each decoder layer;
    the embedding table, looked up on its own before the model's forward; the final norm with the
    head, one unit rather than left to the root, which FSDP keeps whole from forward to the end of
    backward (a 152k-token head is 2.5 GB). The model itself, the root, then holds nothing."""
    decoder = llm.model.get_decoder()
    return [*decoder.layers, llm.model.get_input_embeddings(), [decoder.norm, llm.model.get_output_embeddings()]]


def check_untied(llm: FrozenLLM) -> None:
    """--frozen-sharding fsdp shards the embedding table and the head as separate units; an LLM that
    ties them (Qwen2.5 up to 3B, Llama-3.2) would put one parameter in two."""
    if llm.model.get_output_embeddings().weight is llm.model.get_input_embeddings().weight:
        raise UserError(f"--frozen-sharding fsdp: the {llm.name} LLM ties its input and output embeddings, "
                        "which are sharded separately; use --frozen-sharding none")


def start_fsdp_root(llm: FrozenLLM) -> None:
    """FSDP2 makes the first of its modules to run forward the root, which sets up every module
    under it, and fails if a module under it ran first. The embedding table, sharded on its own, is
    looked up outside the model's forward (soft tokens are joined to its output), so the model runs
    once first: one token, no gradients, the same on every rank."""
    device = llm.model.get_input_embeddings().weight.device
    with torch.no_grad():
        llm.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def apply_activation_checkpointing(llm: FrozenLLM) -> None:
    """Recompute each decoder layer in backward instead of storing its activations. The layers are
    frozen, but gradients flow through them to the wire, so their activations would otherwise be
    kept for backward: this trades ~1/3 more compute for most of that memory."""
    # Non-reentrant checkpointing (the wrapper's default): works with frozen inputs-to-layer
    # weights, keyword arguments and torch.compile.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as wrap

    layer_cls = type(llm.model.get_decoder().layers[0])
    wrap(llm.model, check_fn=lambda m: isinstance(m, layer_cls))
