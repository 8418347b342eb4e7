"""The two frozen LLMs: built from their source (`latentwire.llm_sources`) under the caller's
`torch.device("meta")`, frozen, and, once `to_empty` has allocated them, filled by `read_weights`,
so that FSDP2 can shard them in between and a rank reads only its shards. Which layers activation
checkpointing wraps and which units FSDP2 shards: train.py makes the calls, this module decides.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from .attention import causal_attention, padded_causal_mask, positions
from .harness.config import setting
from .harness.errors import UserError
from .llm_sources import LLM_NAMES, one_line_error, read_source
from .prompting import PromptContract, PromptFormat


@dataclass(frozen=True)
class FrozenConfig:
    """Where the two frozen LLMs come from (a source each, see llm_sources) and how a rank holds them."""

    llama: str = setting(
        "tiny",
        "Llama-family LLM: hub id, local directory, 'tiny' (the shipped tiny reader), "
        "'tiny-random', or 'random:HUB_ID_OR_CONFIG_JSON'",
        weights=True,
    )
    qwen: str = setting(
        "tiny",
        "Qwen-family LLM: hub id, local directory, 'tiny' (the shipped tiny reader), "
        "'tiny-random', or 'random:HUB_ID_OR_CONFIG_JSON'",
        weights=True,
    )
    sharding: Literal["none", "fsdp"] = setting(
        "none",
        "how a rank holds the frozen LLMs: none (whole, on every rank) or fsdp (sharded over the ranks by "
        "FSDP2, a decoder layer gathered only while it runs)",
        key="frozen_sharding",
    )
    fp8: Literal["none", "tensorwise", "rowwise"] = setting(
        "none",
        "run the frozen LLMs' decoder-layer linears in float8, scaled by torchao's recipe: none, "
        "tensorwise (a scale per tensor, each weight 1 byte) or rowwise (a scale per row, each weight cast "
        "for each of its two GEMMs, 2 bytes); forward and input gradients, bf16, compiled, a card with FP8 "
        "tensor cores or the CPU's emulation; MFU stays counted against the bf16 peak",
        key="frozen_fp8",
        since=2,
        carried={False: "none", True: "tensorwise"},  # a boolean before: torchao's tensorwise recipe, or none
    )

    def source(self, name: str) -> str:
        return getattr(self, name)


# Rows of the embedding table squared in fp32 at a time: the table itself is up to 2 GiB in bf16.
EMBED_RMS_CHUNK_ELEMENTS = 2**20


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
    weights: object = None  # where `read_weights` reads the model's tensors from
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
        squares = sum(
            (chunk.float().square().sum(dtype=torch.float64) for chunk in local.split(rows)),
            torch.zeros((), dtype=torch.float64, device=local.device),
        )
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

    def answer_hidden(self, soft: torch.Tensor, lead_ids: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """Last hidden states (after the final norm) of the last T+1 positions of [lead ; soft ;
        embed(input_ids)] (input_ids: the tail, then the answer): the positions that predict the
        tail's and answer's tokens after the wire's last and the EOS after them (see data.Collator
        for the label layout). The decoder alone: the head runs where the labels are, in the loss
        (latentwire.objectives, `head_weight`)."""
        out = self.model.get_decoder()(inputs_embeds=self.wire_embeds(soft, lead_ids, input_ids), use_cache=False)
        return out.last_hidden_state[:, -(input_ids.shape[1] + 1) :]

    @contextmanager
    def head_weight(self):
        """The LM head's weight, whole while the context lasts. Under FSDP2 the head is a unit of its
        own that never runs its forward in a training step (`answer_hidden`): it is gathered here,
        once per call, and freed after; the loss takes what backward needs while it is whole
        (latentwire.head_losses)."""
        from torch.distributed.fsdp import FSDPModule

        head = self.model.get_output_embeddings()
        if not isinstance(head, FSDPModule):
            yield head.weight
            return
        head.unshard()
        try:
            yield head.weight
        finally:
            head.reshard()

    def teacher_logits(self, text_ids: torch.Tensor, text_mask: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
        """The logits of `answer_hidden`'s positions, with the prompt's tokens in place of the wire:
        `text_ids` is [lead ; prompt], left-padded (`text_mask` 0 on padding), so that every row's
        prompt ends where its input_ids begin and the kept logits line up with the wire's."""
        ids = torch.cat([text_ids, input_ids], dim=1)
        real = torch.cat([text_mask, torch.ones_like(input_ids)], dim=1).bool()
        out = self.model(
            input_ids=ids,
            attention_mask=padded_causal_mask(real),
            position_ids=positions(real),
            use_cache=False,
            logits_to_keep=input_ids.shape[1] + 1,
        )
        return out.logits


def freeze(model: nn.Module) -> nn.Module:
    """Eval mode (no dropout) and no parameter gradients: no grad buffers and no optimizer state,
    yet autograd still flows through the layers to the soft tokens."""
    model.eval()
    model.requires_grad_(False)
    return model


# --- loading: built on the meta device, then filled -------------------------------------------
# Every source's model is built under the caller's torch.device("meta") (the structure, no memory)
# with a weight source beside it; `to_empty` then allocates the model on the rank's device and
# `read_weights` fills it. In between, train.py may wrap the layers for activation checkpointing
# and shard them with FSDP2: a sharded parameter is then allocated and read only for the rows this
# rank holds, so no rank ever holds a 70B model whole, in host or device memory.


def build_model(config, dtype: torch.dtype) -> nn.Module:
    """The model of a configuration, on the device of the caller's context: `torch.device("meta")`
    (structure, no memory), or a FakeTensorMode for the memory plan."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, attn_implementation=causal_attention(), dtype=dtype)


def build_frozen_llm(name: str, source: str, dtype: torch.dtype, prompt: PromptFormat = PromptFormat()) -> FrozenLLM:  # noqa: B008 (a frozen dataclass)
    """`name` is 'llama' or 'qwen'; `source` is what `llm_sources.read_source` reads; `prompt` makes
    its tokenizer's prompt contract. Built under `torch.device("meta")`, the model is frozen
    structure until `to_empty` and `read_weights`."""
    found = read_source(name, source)
    with one_line_error(f"cannot build model {source!r} from its configuration"):
        model = build_model(found.config, dtype)
    assert next(model.parameters()).is_meta, "build the frozen LLMs under torch.device('meta')"
    weights = found.weights(model)
    check_buffers_computable(model, source)
    contract = PromptContract.of(found.tokenizer, prompt, who=f"the {name} ({source})")
    return FrozenLLM(name, freeze(model), found.tokenizer, contract, weights, source)


def rotary_embedding(model: nn.Module) -> nn.Module | None:
    return getattr(model.get_decoder(), "rotary_emb", None)


def check_buffers_computable(model: nn.Module, source: str) -> None:
    """Buffers outside the state dict are in no checkpoint: `read_weights` computes RoPE's inverse
    frequencies again from the configuration, and knows no other."""
    rotary = rotary_embedding(model)
    computed = set() if rotary is None else {id(b) for b in rotary.buffers()}
    saved = model.state_dict().keys()
    for key, buffer in model.named_buffers():
        if key not in saved and id(buffer) not in computed:
            raise UserError(
                f"model {source!r}: its buffer {key} is in no checkpoint and not one latentwire can "
                "compute again (it recomputes RoPE's: Llama, Qwen, Mistral and their like load)"
            )


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


def read_weights(llm: FrozenLLM) -> None:
    """Fill the model `to_empty` allocated with its weights, one tensor, or one rank's rows of it, at
    a time, cast to the parameter's dtype. Every parameter must be filled, directly or through a
    tied one. A model FSDP2 sharded then runs once, so that it is the root (`start_fsdp_root`):
    read, it is ready to use either way."""
    from torch.distributed.fsdp import FSDPModule

    model, weights, source = llm.model, llm.weights, llm.source
    model.tie_weights()  # to_empty gave each module a parameter of its own, tied ones included
    filled = set()
    with torch.no_grad(), one_line_error(f"cannot read the weights of model {source!r}"):
        for key, target in model.state_dict().items():
            local, rows = held_rows(target)
            if key not in weights.shapes or local.data_ptr() in filled or local.numel() == 0:
                continue
            if weights.shapes[key] != tuple(target.shape):
                raise UserError(
                    f"model {source!r}: tensor {key} has shape {weights.shapes[key]} in its checkpoint, "
                    f"{tuple(target.shape)} in its configuration"
                )
            local.copy_(weights.read(key, rows, local))
            filled.add(local.data_ptr())
    missing = [
        key
        for key, target in model.state_dict().items()
        if (local := held_rows(target)[0]).numel() and local.data_ptr() not in filled
    ]
    if missing:
        raise UserError(
            f"model {source!r}: its checkpoint has no tensor for {missing[0]}"
            + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
        )
    device = next(model.parameters()).device
    if (rotary := rotary_embedding(model)) is not None:
        with torch.device(device):
            model.get_decoder().rotary_emb = freeze(type(rotary)(config=model.config))
    llm.weights = None  # the tiny models' host copy goes
    if isinstance(model, FSDPModule):
        start_fsdp_root(llm)


def place(llm: FrozenLLM, device: torch.device) -> None:
    """Allocate an LLM built on the meta device (wrapped or sharded since) on `device` (what the rank
    holds of it), and fill it from its checkpoint."""
    llm.model.to_empty(device=device)
    read_weights(llm)


def load_frozen_llm(name: str, source: str, dtype: torch.dtype, device: torch.device) -> FrozenLLM:
    """An LLM built and loaded whole on `device`."""
    with torch.device("meta"):
        llm = build_frozen_llm(name, source, dtype)
    place(llm, device)
    return llm


def build_frozen_llms(frozen: FrozenConfig, prompt: PromptFormat, dtype: torch.dtype) -> dict[str, FrozenLLM]:
    """Both frozen LLMs of a configuration by name, each from its source."""
    return {name: build_frozen_llm(name, frozen.source(name), dtype, prompt) for name in LLM_NAMES}


def load_frozen_llms(frozen: FrozenConfig, dtype: torch.dtype, device: torch.device) -> dict[str, FrozenLLM]:
    """Both frozen LLMs of a configuration, built and loaded whole on `device`."""
    return {name: load_frozen_llm(name, frozen.source(name), dtype, device) for name in LLM_NAMES}


def describe_prompts(llms: dict[str, FrozenLLM]) -> str:
    """'llama: its chat template, 24 + 20 tokens around the prompt; qwen: ...': the contract each reader got."""
    return "; ".join(f"{name}: {llm.contract.describe()}" for name, llm in llms.items())


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes a tensor holds: a wrapper subclass's are its inner tensors' (a DTensor's, this rank's
    shard; a float8 weight's, 1 byte per element and its scale), not its shape times the dtype it
    shows."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    if is_traceable_wrapper_subclass(tensor):
        inner, _ = tensor.__tensor_flatten__()  # a DTensor's names its device mesh too, not a tensor
        return sum(stored_bytes(t) for t in (getattr(tensor, name) for name in inner) if isinstance(t, torch.Tensor))
    return tensor.nbytes


def held_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters that this rank holds: its shards where FSDP sharded them,
    1 byte per weight where they are float8."""
    return sum(stored_bytes(p) for p in model.parameters())


def held_per_rank(llms: dict[str, FrozenLLM]) -> str:
    """'1.79 MiB held per rank': the frozen weights one rank holds, as the opening lines say it."""
    held = sum(held_bytes(llm.model) for llm in llms.values())
    return (f"{held / 2**30:.2f} GiB" if held >= 2**30 else f"{held / 2**20:.2f} MiB") + " held per rank"


def fsdp_units(llm: FrozenLLM) -> list[nn.Module]:
    """What --frozen-sharding fsdp shards, each unit whole only while it runs: each decoder layer;
    the embedding table, looked up on its own before the decoder; the final norm; the head, which
    a training step never calls (the loss gathers its weight: `FrozenLLM.head_weight`), apart from
    the norm, because a unit of several modules is released only once all of them have run. None is
    left to the root, which FSDP keeps whole from forward to the end of backward (a 152k-token head
    is 2.5 GB): the model itself then holds nothing. An LLM that ties its table and head is refused
    (`check_untied`)."""
    check_untied(llm)
    return [
        *decoder_layers(llm),
        llm.model.get_input_embeddings(),
        llm.model.get_decoder().norm,
        llm.model.get_output_embeddings(),
    ]


def check_untied(llm: FrozenLLM) -> None:
    """--frozen-sharding fsdp shards the embedding table and the head as separate units; an LLM that
    ties them (Qwen2.5 up to 3B, Llama-3.2) would put one parameter in two."""
    if llm.model.get_output_embeddings().weight is llm.model.get_input_embeddings().weight:
        raise UserError(
            f"--frozen-sharding fsdp: the {llm.name} LLM ties its input and output embeddings, "
            "which are sharded separately; use --frozen-sharding none"
        )


def skip_unused_backward_gathers(llm: FrozenLLM) -> None:
    """Backward never needs the embedding table (frozen, looked up by token ids), but FSDP2's default
    prefetch would all-gather it at the end of every backward: layer 0 prefetches the unit that ran
    before it."""
    llm.model.get_input_embeddings().set_unshard_in_backward(False)


def start_fsdp_root(llm: FrozenLLM) -> None:
    """FSDP2 makes the first of its modules to run forward the root, which sets up every module
    under it, and fails if a module under it ran first. The embedding table, sharded on its own, is
    looked up outside the model's forward (soft tokens are joined to its output), so the model runs
    once first: one token, no gradients, the same on every rank. Eagerly: layers compiled before
    sharding would otherwise compile this call, a variant no training step uses."""
    device = llm.model.get_input_embeddings().weight.device
    with torch.no_grad(), torch.compiler.set_stance("force_eager"):
        llm.model(input_ids=torch.zeros((1, 1), dtype=torch.long, device=device), use_cache=False)


def decoder_layers(llm: FrozenLLM) -> nn.ModuleList:
    """The LLM's decoder layers: what activation checkpointing wraps, compile compiles one at a time
    and FSDP2 shards one unit each."""
    return llm.model.get_decoder().layers


def is_decoder_layer(llm: FrozenLLM):
    """What activation checkpointing wraps: each decoder layer. The layers are frozen, but gradients
    flow through them to the wire, so their activations would otherwise be kept for backward;
    recomputing them trades ~1/3 more compute for most of that memory."""
    layer_cls = type(decoder_layers(llm)[0])
    return lambda module: isinstance(module, layer_cls)
