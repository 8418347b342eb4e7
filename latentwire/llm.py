"""The two frozen LLMs: loading (hub id, local directory, or a tiny one built offline) and freezing.

`tiny` builds a small randomly initialised Llama or Qwen2 and a tokenizer trained here on the
built-in synthetic corpus, so the cpu profile needs no download. Both are built from fixed seeds,
so every rank, every run and the evaluation build the very same models.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import nn

from .config import UserError

TINY = "tiny"
# The two frozen LLMs, named as their configuration fields are.
LLM_NAMES = ("llama", "qwen")
TINY_SEED = 1234

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
        to the LLM like the token embeddings it was trained on."""
        w = self.model.get_input_embeddings().weight
        return w.detach().float().pow(2).mean().sqrt().item()

    def answer_logits(self, soft: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last T+1 positions of [soft ; embed(input_ids)], i.e. the predictions of the
        answer tokens and the EOS after them (see data.Collator for the label layout)."""
        tok_embeds = self.model.get_input_embeddings()(input_ids)
        embeds = torch.cat([soft.to(tok_embeds.dtype), tok_embeds], dim=1)
        out = self.model(inputs_embeds=embeds, use_cache=False, logits_to_keep=input_ids.shape[1] + 1)
        return out.logits

    def to(self, device) -> "FrozenLLM":
        self.model.to(device)
        return self


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
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)


# --- loading ----------------------------------------------------------------------------------

def load_pretrained(source: str, dtype: torch.dtype):
    """A hub id or a local directory. Hub ids download only because the user named one."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    looks_local = source.startswith((".", "/", "~")) or os.path.isdir(os.path.expanduser(source))
    if looks_local and not os.path.isdir(os.path.expanduser(source)):
        raise UserError(f"model directory {source} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, attn_implementation="sdpa")
    except OSError as e:
        raise UserError(f"cannot load model {source!r}: {str(e).splitlines()[0]}") from None
    if tokenizer.eos_token_id is None:
        raise UserError(f"model {source!r}: its tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # right padding never reaches the loss
    return model, tokenizer


def load_frozen_llm(name: str, source: str, dtype: torch.dtype, device: torch.device) -> FrozenLLM:
    """`name` is 'llama' or 'qwen'; `source` is 'tiny', a hub id or a local directory."""
    if source == TINY:
        tokenizer = tiny_tokenizer(name)
        model = tiny_model(name, tokenizer).to(dtype)
    else:
        model, tokenizer = load_pretrained(source, dtype)
    return FrozenLLM(name, freeze(model), tokenizer).to(device)


def load_frozen_llms(cfg, dtype: torch.dtype, device: torch.device) -> dict[str, FrozenLLM]:
    """Both frozen LLMs of a configuration by name, each from its source field (`cfg.llama`, `cfg.qwen`)."""
    return {name: load_frozen_llm(name, getattr(cfg, name), dtype, device) for name in LLM_NAMES}


def apply_activation_checkpointing(llm: FrozenLLM) -> None:
    """Recompute each decoder layer in backward instead of storing its activations. The layers are
    frozen, but gradients flow through them to the wire, so their activations would otherwise be
    kept for backward: this trades ~1/3 more compute for most of that memory."""
    # Non-reentrant checkpointing (the wrapper's default): works with frozen inputs-to-layer
    # weights, keyword arguments and torch.compile.
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing as wrap

    layer_cls = type(llm.model.get_decoder().layers[0])
    wrap(llm.model, check_fn=lambda m: isinstance(m, layer_cls))
