"""Where a frozen LLM comes from, for every kind of source a profile or flag may name:

- `tiny` loads the tiny Llama and Qwen2 readers shipped in `latentwire/tiny_readers/`: small models
  pretrained here (`python -m latentwire.readers`) to answer the synthetic reading-comprehension
  questions from their text, with tokenizers trained on the same corpus, so the cpu profile needs
  no download and its text baseline means something. `tiny-random` is the same architectures
  randomly initialised: readers that cannot read, for tests that need none.
- `random:SOURCE` builds the architecture of SOURCE (a hub id whose configuration ships in
  `latentwire.known_llms`, a model directory, or a config.json) with random weights drawn on the
  rank's device, and the tiny tokenizer of its family: the same FLOPs and memory as the real
  model, to benchmark or plan a card before downloading 32 GB. They are drawn from fixed seeds,
  tensor by tensor: every rank, every run, every layout and the evaluation see the very same models.
- a hub id or a local directory reads the real weights from its .safetensors files.

For each: its configuration and tokenizer, and where its tensors are read from (`read_source`, what
`latentwire.llm` builds and loads), or, for the memory planner, what its configuration is without
any weights (`llm_spec`).
"""

from __future__ import annotations

import glob
import json
import os
import zlib
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
from torch import nn

from .attention import causal_attention
from .harness.errors import UserError
from .known_llms import KNOWN_LLMS

TINY = "tiny"
TINY_RANDOM = "tiny-random"
TINY_READERS = Path(__file__).resolve().parent / "tiny_readers"
RANDOM = "random:"
# The two frozen LLMs, named as their configuration fields are.
LLM_NAMES = ("llama", "qwen")
TINY_SEED = 1234
RANDOM_SEED = 4321

# Small but structurally faithful: grouped-query attention, RoPE, SwiGLU, RMSNorm, untied heads,
# and different widths and vocabularies so the two adapters really differ.
TINY_SPECS = {
    "llama": dict(
        hidden_size=128,
        intermediate_size=344,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=1024,
    ),
    "qwen": dict(
        hidden_size=96,
        intermediate_size=256,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=768,
    ),
}


@dataclass(frozen=True)
class Source:
    """An LLM's configuration and tokenizer, and where its tensors are read from once its model is
    built (`weights(model)`: the random ones are drawn per tensor of the model)."""

    config: object
    tokenizer: object
    weights: Callable[[nn.Module], object]


def read_source(name: str, source: str) -> Source:
    """`name` is 'llama' or 'qwen'; `source` is 'tiny', 'tiny-random', 'random:SOURCE', a hub id or a
    local directory."""
    if source == TINY_RANDOM:
        tokenizer = tiny_tokenizer(name)
        whole = tiny_model(name, tokenizer)
        return Source(whole.config, tokenizer, lambda model: StateDictWeights(whole.state_dict()))
    if source.startswith(RANDOM):
        config, tokenizer = random_architecture(name, source)
        seed = RANDOM_SEED + LLM_NAMES.index(name)
        return Source(config, tokenizer, lambda model: SeededWeights(model, seed, config.initializer_range, source))
    config, tokenizer, weights = pretrained_config(
        tiny_reader(name) if source == TINY else source, plain_tokenizer=source == TINY
    )
    return Source(config, tokenizer, lambda model: weights)


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

    from .dataset import synthetic_corpus_text

    if family == "llama":
        specials = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "pad_token": "<|pad|>"}
    else:
        specials = {"eos_token": "<|endoftext|>", "pad_token": "<|endoftext|>"}
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=TINY_SPECS[family]["vocab_size"],
        special_tokens=list(dict.fromkeys(specials.values())),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(synthetic_corpus_text(), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


def tiny_model(family: str, tokenizer) -> nn.Module:
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    spec = dict(TINY_SPECS[family], vocab_size=len(tokenizer))
    cls = LlamaConfig if family == "llama" else Qwen2Config
    config = cls(
        **spec,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        initializer_range=0.1,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    # On the CPU whatever device the caller builds under: these are the weights themselves.
    with torch.random.fork_rng(devices=[]), torch.device("cpu"):
        torch.manual_seed(TINY_SEED + (family == "qwen"))
        return AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(), dtype=torch.float32)


# --- where the tensors are read from --------------------------------------------------------


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
        generator = torch.Generator(like.device).manual_seed(self.seed * 2**32 + zlib.crc32(key.encode()))
        full = torch.empty(self.shapes[key], dtype=like.dtype, device=like.device)
        return full.normal_(0.0, self.std, generator=generator)[rows]


def random_architecture(name: str, source: str):
    """`random:SOURCE`: SOURCE's configuration, read through its family's tiny tokenizer."""
    config = random_config(source)
    tokenizer = tiny_tokenizer(name)
    if len(tokenizer) > config.vocab_size:
        raise UserError(
            f"{source}: vocabulary of {config.vocab_size} is smaller than the {len(tokenizer)} ids "
            "of the tokenizer that reads it"
        )
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


# --- configurations without weights: the memory planner's -------------------------------------


@dataclass(frozen=True)
class LLMSpec:
    """What the planner needs of one frozen LLM."""

    source: str  # as the profile names it
    config: object  # a transformers PretrainedConfig
    has_bos: bool  # a BOS leads every prompt (latentwire.prompting)
    chat_template: bool  # its tokenizer ships a chat template (latentwire.prompting)
    origin: str  # where the configuration came from, for the report


def llm_spec(name: str, source: str) -> LLMSpec:
    """`name` is 'llama' or 'qwen'; `source` is 'tiny', 'tiny-random', 'random:SOURCE', a local
    directory or a known hub id."""
    if source == TINY_RANDOM:
        return _tiny_spec(name)
    if source == TINY:
        return _local_spec(tiny_reader(name))
    if source.startswith(RANDOM):
        has_bos = tiny_tokenizer(name).bos_token_id is not None  # the tokenizer random_architecture reads it with
        return LLMSpec(
            source, random_config(source), has_bos, False, "random weights, configuration of " + source[len(RANDOM) :]
        )
    if os.path.isdir(os.path.expanduser(source)):
        return _local_spec(source)
    if source in KNOWN_LLMS:
        values, has_bos = KNOWN_LLMS[source]
        # Their hub tokenizers, base and instruct alike, ship a chat template.
        return LLMSpec(
            source, _config_from_values(values), has_bos, True, "configuration shipped in latentwire.known_llms"
        )
    raise UserError(
        f"no configuration for {source!r}: name a local model directory (with config.json) "
        f"or one of {', '.join(KNOWN_LLMS)}"
    )


def random_config(source: str):
    """The configuration behind `random:SOURCE`: a hub id of `KNOWN_LLMS`, a model directory
    (its config.json) or the path of a config.json."""
    target = source[len(RANDOM) :]
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

    tokenizer = tiny_tokenizer(name)
    with FakeTensorMode():  # its configuration is built with it; the weights are never allocated
        config = tiny_model(name, tokenizer).config
    return LLMSpec(
        "tiny-random",
        config,
        tokenizer.bos_token_id is not None,
        False,
        "configuration built offline by latentwire.llm_sources",
    )


def _local_spec(directory: str) -> LLMSpec:
    from transformers import AutoConfig

    path = os.path.expanduser(directory)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read the model configuration in {directory}: {str(e).splitlines()[0]}") from None
    return LLMSpec(directory, config, *_local_tokenizer_facts(path), f"configuration read from {directory}/config.json")


def _local_tokenizer_facts(path: str) -> tuple[bool, bool]:
    """Whether the tokenizer starts with a BOS and ships a chat template, from tokenizer_config.json
    (and chat_template.jinja, where newer transformers write the template). Without a
    tokenizer_config.json, assume a BOS: one more position is the worst case."""
    tokenizer_config = os.path.join(path, "tokenizer_config.json")
    template_file = os.path.isfile(os.path.join(path, "chat_template.jinja"))
    try:
        with open(tokenizer_config) as f:
            values = json.load(f)
    except FileNotFoundError:
        return True, template_file
    except json.JSONDecodeError as e:
        raise UserError(f"{tokenizer_config} is not valid JSON: {e.msg}") from None
    return values.get("bos_token") is not None, template_file or bool(values.get("chat_template"))
