"""The two frozen LLMs: building (hub id, local directory, the tiny readers shipped here, or a real
architecture with random weights), loading their weights, and freezing.

- `tiny` loads the tiny Llama and Qwen2 readers shipped in `latentwire/tiny_readers/`: small models
  pretrained here (`python -m latentwire.readers`) to answer the synthetic reading-comprehension
  questions from their text, with tokenizers trained on the same corpus, so the cpu profile needs
  no download and its text baseline means something. `tiny-random` is the same architectures
  randomly initialised: readers that cannot read, for tests that need none.
- `random:SOURCE` builds the architecture of SOURCE (a hub id whose configuration ships in
  `latentwire.known_llms`, a model directory, or a config.json) with random weights drawn on the
  rank's device, and the tiny tokenizer of its family: the same FLOPs and memory as the real
  model, to benchmark or plan a card before downloading 32 GB.
- a hub id or a local directory reads the real weights from its .safetensors files.
Each is built on the meta device first and filled by `load_weights`, so that FSDP2 can shard it
in between and a rank reads only its shards. The random ones are drawn from fixed seeds, tensor by
tensor: every rank, every run, every layout and the evaluation see the very same models.
"""
from __future__ import annotations

import glob
import math
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch
from torch import nn

from .errors import UserError
from .prompting import PromptContract, PromptFormat

TINY = "tiny"
TINY_RANDOM = "tiny-random"
TINY_READERS = Path(__file__).resolve().parent / "tiny_readers"
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
    "qwen": dict(hidden_size=96, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
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
    contract: PromptContract | None = None  # the token ids around every prompt (latentwire.prompting)
    weights: object = None  # where `load_weights` reads the model's tensors from
    source: str = ""

    @property
    def hidden_size(self) -> int:
        return self.model.config.hidden_size

    def embed_rms(self) -> float:
        """RMS of the input-embedding table: adapters scale their output to it, so soft tokens look
        to the LLM like the token embeddings it was trained on. Summed in fp32 a chunk of rows at
        a time: an fp32 copy of a whole table (2 GiB for Qwen2.5-7B, and its square as much
        again) would not fit next to the weights on a 32 GB card. Under FSDP2 each rank sums its
        shard and an all-reduce adds them up."""
        from torch.distributed.tensor import DTensor

        w = self.model.get_input_embeddings().weight.detach()
        local = w.to_local() if isinstance(w, DTensor) else w
        rows = max(1, EMBED_RMS_CHUNK_ELEMENTS // w.shape[-1])
        squares = sum((chunk.float().square().sum(dtype=torch.float64) for chunk in local.split(rows)),
                      torch.zeros((), dtype=torch.float64, device=local.device))
        if isinstance(w, DTensor):
            torch.distributed.all_reduce(squares, group=w.device_mesh.get_group())
        return math.sqrt(squares.item() / w.numel())

    def wire_embeds(self, soft: torch.Tensor, lead_ids: torch.Tensor, after_ids: torch.Tensor) -> torch.Tensor:
        """`[embed(lead) ; soft ; embed(after)]`: the wire where a text prompt's tokens would be."""
        table = self.model.get_input_embeddings()
        # One lookup for both sides: FSDP2 gathers the table once, and MemTracker (the memory plan)
        # takes a second call of a top-level module for a second training step.
        tokens = table(torch.cat([lead_ids, after_ids], dim=1))
        lead = lead_ids.shape[1]
        return torch.cat([tokens[:, :lead], soft.to(tokens.dtype), tokens[:, lead:]], dim=1)

    def answer_logits(self, soft: torch.Tensor, lead_ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Logits of the last T+1 positions of [lead ; soft ; embed(input_ids)] (input_ids: the tail,
        then the answer), i.e. the predictions of the tail's and answer's tokens after the wire's
        last and the EOS after them (see data.Collator for the label layout)."""
        out = self.model(inputs_embeds=self.wire_embeds(soft, lead_ids, input_ids), use_cache=False,
                         logits_to_keep=input_ids.shape[1] + 1)
        return out.logits

    def teacher_logits(self, text_ids: torch.Tensor, text_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The same positions as `answer_logits`, with the prompt's tokens in place of the wire:
        `text_ids` is [lead ; prompt], left-padded (`text_mask` 0 on padding), so that every row's
        prompt ends where its input_ids begin and the kept logits line up with the wire's."""
        ids = torch.cat([text_ids, input_ids], dim=1)
        real = torch.cat([text_mask, torch.ones_like(input_ids)], dim=1).bool()
        out = self.model(input_ids=ids, attention_mask=padded_causal_mask(real), position_ids=positions(real),
                         use_cache=False, logits_to_keep=input_ids.shape[1] + 1)
        return out.logits


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting real tokens only, so left padding does not shift the rotary positions."""
    return (mask.long().cumsum(-1) - 1).clamp(min=0)


def padded_causal_mask(real: torch.Tensor) -> torch.Tensor:
    """[B, 1, L, L], True where a query may attend: causal, never to padding. A 4-D mask goes to
    attention as it is, under the training attention too (transformers builds no mask of its own
    for it). A padding query attends to itself: for a query with no key, CUDA's memory-efficient
    kernel has returned NaN (pytorch#110213; the CPU kernels give 0), and a NaN value poisons even
    the queries that give it zero weight."""
    length = real.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=real.device).tril()
    diagonal = torch.eye(length, dtype=torch.bool, device=real.device)
    return ((causal & real[:, None, :]) | diagonal)[:, None]


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

def tiny_reader(name: str) -> str:
    """The directory of the shipped tiny reader of the `name` slot."""
    return str(TINY_READERS / name)


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


# --- loading: built on the meta device, then filled -------------------------------------------
# Every source builds its model on the meta device (the structure, no memory) with a weight
# source beside it; `load_weights` then allocates the model on the rank's device and fills it. In
# between, train.py may wrap the layers for activation checkpointing and shard them with FSDP2:
# a sharded parameter is then allocated and read only for the rows this rank holds, so no rank
# ever holds a 70B model whole, in host or device memory.

class CheckpointWeights:
    """The tensors of a model's .safetensors files, read a row range at a time from the memory map."""

    def __init__(self, files: list[str]):
        from safetensors import safe_open

        self.file_of = {}
        self.shapes = {}
        for path in files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    self.file_of[key] = path
                    self.shapes[key] = tuple(f.get_slice(key).get_shape())

    def read(self, key: str, rows: slice, like: torch.Tensor) -> torch.Tensor:
        from safetensors import safe_open

        with safe_open(self.file_of[key], framework="pt") as f:
            return f.get_slice(key)[rows]


class StateDictWeights:
    """The tensors of a model built whole in host memory (the tiny ones, a few MB)."""

    def __init__(self, state: dict[str, torch.Tensor]):
        self.state = state
        self.shapes = {key: tuple(t.shape) for key, t in state.items()}

    def read(self, key: str, rows: slice, like: torch.Tensor) -> torch.Tensor:
        return self.state[key][rows]


class SeededWeights:
    """`random:` weights drawn tensor by tensor, each from a generator seeded by its name, on the
    rank's device: the same values whatever layout (whole or sharded, any world size) reads them.
    Each rank draws a whole tensor and keeps its rows (one tensor at a time, 2.5 GB at most for a
    72B's embedding table). The initialisation transformers' models use: N(0, initializer_range)
    for linear and embedding weights, zero biases, unit norm weights."""

    def __init__(self, model: nn.Module, seed: int, std: float, source: str):
        self.seed, self.std = seed, std
        self.shapes, self.kinds = {}, {}
        for module_name, module in model.named_modules():
            for name, p in module.named_parameters(recurse=False):
                key = f"{module_name}.{name}" if module_name else name
                self.shapes[key] = tuple(p.shape)
                self.kinds[key] = self.kind(module, name)
                if self.kinds[key] is None:
                    raise UserError(f"{source}: no random initialisation for {key} of a {type(module).__name__}")

    @staticmethod
    def kind(module: nn.Module, name: str) -> str | None:
        if name == "bias":
            return "zeros"
        if name == "weight" and isinstance(module, (nn.Linear, nn.Embedding)):
            return "normal"
        if name == "weight" and "Norm" in type(module).__name__:
            return "ones"
        return None

    def read(self, key: str, rows: slice, like: torch.Tensor) -> torch.Tensor:
        kind = self.kinds[key]
        if kind != "normal":
            return (torch.zeros if kind == "zeros" else torch.ones)(like.shape, dtype=like.dtype, device=like.device)
        generator = torch.Generator(like.device).manual_seed(self.seed * 2 ** 32 + zlib.crc32(key.encode()))
        full = torch.empty(self.shapes[key], dtype=like.dtype, device=like.device)
        return full.normal_(0.0, self.std, generator=generator)[rows]


def meta_model(config, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(), dtype=dtype)


def build_frozen_llm(name: str, source: str, dtype: torch.dtype, prompt: PromptFormat = PromptFormat()) -> FrozenLLM:
    """`name` is 'llama' or 'qwen'; `source` is 'tiny', 'tiny-random', 'random:SOURCE', a hub id or a
    local directory; `prompt` makes its tokenizer's prompt contract. The model is on the meta
    device, frozen, until `load_weights`."""
    if source == TINY_RANDOM:
        tokenizer = tiny_tokenizer(name)
        whole = tiny_model(name, tokenizer)
        config, weights = whole.config, StateDictWeights(whole.state_dict())
    elif source.startswith(RANDOM):
        config, tokenizer = random_architecture(name, source)
    else:
        config, tokenizer, weights = pretrained_config(tiny_reader(name) if source == TINY else source,
                                                       plain_tokenizer=source == TINY)
    with one_line_error(f"cannot build model {source!r} from its configuration"):
        model = meta_model(config, dtype)
    if source.startswith(RANDOM):
        weights = SeededWeights(model, RANDOM_SEED + LLM_NAMES.index(name), config.initializer_range, source)
    check_buffers_computable(model, source)
    contract = PromptContract.of(tokenizer, prompt, who=f"the {name} ({source})")
    return FrozenLLM(name, freeze(model), tokenizer, contract, weights, source)


def random_architecture(name: str, source: str):
    """`random:SOURCE`: SOURCE's configuration, read through its family's tiny tokenizer."""
    from .known_llms import random_config

    config = random_config(source)
    tokenizer = tiny_tokenizer(name)
    if len(tokenizer) > config.vocab_size:
        raise UserError(f"{source}: vocabulary of {config.vocab_size} is smaller than the {len(tokenizer)} ids "
                        "of the tokenizer that reads it")
    return config, tokenizer


def pretrained_config(source: str, plain_tokenizer: bool = False):
    """A hub id or a local directory: its configuration, tokenizer and weight files. Hub ids
    download only because the user named one. The tiny readers' tokenizers are plain BPE files
    (`plain_tokenizer`): AutoTokenizer would wrap the Qwen one in Qwen2's class, as its config says
    qwen2, and that class's own pre-tokenizer splits numbers digit by digit."""
    from transformers import AutoConfig, AutoTokenizer, PreTrainedTokenizerFast

    looks_local = source.startswith((".", "/", "~")) or os.path.isdir(os.path.expanduser(source))
    if looks_local and not os.path.isdir(os.path.expanduser(source)):
        raise UserError(f"model directory {source} does not exist")
    # transformers says what it cannot build with OSError (files), ValueError (an unknown
    # model_type, a tokenizer it cannot instantiate) or KeyError (a config missing a field).
    with one_line_error(f"cannot read the configuration of model {source!r}"):
        config = AutoConfig.from_pretrained(source)
    with one_line_error(f"cannot load the tokenizer of model {source!r}"):
        tokenizer = (PreTrainedTokenizerFast if plain_tokenizer else AutoTokenizer).from_pretrained(source)
    with one_line_error(f"cannot load model {source!r}"):
        weights = CheckpointWeights(weight_files(source))
    if tokenizer.eos_token_id is None:
        raise UserError(f"model {source!r}: its tokenizer has no EOS token")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token  # right padding never reaches the loss
    return config, tokenizer, weights


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


def rotary_embedding(model: nn.Module) -> nn.Module | None:
    return getattr(model.get_decoder(), "rotary_emb", None)


def check_buffers_computable(model: nn.Module, source: str) -> None:
    """Buffers outside the state dict are in no checkpoint: `load_weights` computes RoPE's inverse
    frequencies again from the configuration, and knows no other."""
    rotary = rotary_embedding(model)
    computed = set() if rotary is None else {id(b) for b in rotary.buffers()}
    saved = model.state_dict().keys()
    for key, buffer in model.named_buffers():
        if key not in saved and id(buffer) not in computed:
            raise UserError(f"model {source!r}: its buffer {key} is in no checkpoint and not one latentwire can "
                            "compute again (it recomputes RoPE's: Llama, Qwen, Mistral and their like load)")


def held_rows(target: torch.Tensor) -> tuple[torch.Tensor, slice]:
    """The part of a parameter this rank holds, and which rows of the whole one it is: all of them,
    or under FSDP2 the rank's piece of dim 0 (torch.chunk's, so the last ranks may hold fewer)."""
    from torch.distributed.tensor import DTensor

    if not isinstance(target, DTensor):
        return target, slice(0, target.shape[0])
    (placement,) = target.placements
    assert placement.is_shard(0), f"FSDP2 shards dim 0, not {placement}"
    mesh = target.device_mesh
    per_rank = -(-target.shape[0] // mesh.size())
    start = min(mesh.get_local_rank() * per_rank, target.shape[0])
    local = target.to_local()
    return local, slice(start, start + local.shape[0])


def load_weights(llm: FrozenLLM, device: torch.device) -> None:
    from torch.distributed.fsdp import FSDPModule

    """Allocate the model on `device` (it was built on the meta device) and copy its weights in, one
    tensor, or one rank's rows of it, at a time, cast to the parameter's dtype. Every parameter
    must be filled, directly or through a tied one. A model FSDP2 sharded then runs once, so that
    it is the root (`start_fsdp_root`): loaded, it is ready to use either way."""
    model, weights, source = llm.model, llm.weights, llm.source
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gave each module a parameter of its own, tied ones included
    filled = set()
    with torch.no_grad(), one_line_error(f"cannot read the weights of model {source!r}"):
        for key, target in model.state_dict().items():
            local, rows = held_rows(target)
            if key not in weights.shapes or local.data_ptr() in filled or local.numel() == 0:
                continue
            if weights.shapes[key] != tuple(target.shape):
                raise UserError(f"model {source!r}: tensor {key} has shape {weights.shapes[key]} in its checkpoint, "
                                f"{tuple(target.shape)} in its configuration")
            local.copy_(weights.read(key, rows, local))
            filled.add(local.data_ptr())
    missing = [key for key, target in model.state_dict().items()
               if (local := held_rows(target)[0]).numel() and local.data_ptr() not in filled]
    if missing:
        raise UserError(f"model {source!r}: its checkpoint has no tensor for {missing[0]}"
                        + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    if (rotary := rotary_embedding(model)) is not None:
        with torch.device(device):
            model.get_decoder().rotary_emb = freeze(type(rotary)(config=model.config))
    llm.weights = None  # the tiny models' host copy goes
    if isinstance(model, FSDPModule):
        start_fsdp_root(llm)


def load_frozen_llm(name: str, source: str, dtype: torch.dtype, device: torch.device) -> FrozenLLM:
    """An LLM built and loaded whole on `device`."""
    llm = build_frozen_llm(name, source, dtype)
    load_weights(llm, device)
    return llm


def build_frozen_llms(cfg, dtype: torch.dtype) -> dict[str, FrozenLLM]:
    """Both frozen LLMs of a configuration by name, each from its source field (`cfg.llama`,
    `cfg.qwen`), on the meta device."""
    return {name: build_frozen_llm(name, getattr(cfg, name), dtype, PromptFormat.of(cfg)) for name in LLM_NAMES}


def load_frozen_llms(cfg, dtype: torch.dtype, device: torch.device) -> dict[str, FrozenLLM]:
    """Both frozen LLMs of a configuration, built and loaded whole on `device`."""
    llms = build_frozen_llms(cfg, dtype)
    for llm in llms.values():
        load_weights(llm, device)
    return llms


def held_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters that this rank holds: its shards where FSDP sharded them."""
    from torch.distributed.tensor import DTensor

    return sum((p.to_local() if isinstance(p, DTensor) else p).nbytes for p in model.parameters())


def held_per_rank(llms: dict[str, FrozenLLM]) -> str:
    """'1.79 MiB held per rank': the frozen weights one rank holds, as the opening lines say it."""
    held = sum(held_bytes(llm.model) for llm in llms.values())
    return (f"{held / 2 ** 30:.2f} GiB" if held >= 2 ** 30 else f"{held / 2 ** 20:.2f} MiB") + " held per rank"


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


def shard_frozen_llm(llm: FrozenLLM, mesh) -> None:
    """FSDP2 over `mesh`: fully_shard each of `fsdp_units`, then the model, which becomes the root."""
    from torch.distributed.fsdp import fully_shard

    check_untied(llm)
    for unit in fsdp_units(llm):
        fully_shard(unit, mesh=mesh)
    fully_shard(llm.model, mesh=mesh)
    # Backward never needs the table (frozen, looked up by token ids), but FSDP2's default prefetch
    # would all-gather it at the end of every backward: layer 0 prefetches the unit run before it.
    llm.model.get_input_embeddings().set_unshard_in_backward(False)


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
