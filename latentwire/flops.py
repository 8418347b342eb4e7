"""FLOPs of one training step, counted for what really runs.

- Trainable encoder, pooler and adapters: forward, input gradients and weight gradients:
  6 x (matmul parameters) per token they process.
- Frozen LLMs: forward and the input gradients that carry the gradient back to the wire, but no
  weight gradients: 4 x (matmul parameters) per position; the LM head only at the labelled
  positions, with one input gradient per loss output (latentwire.head_losses).
- Attention (scores and weighted values) in both, from torch.utils.flop_counter's own SDPA
  formulas, so the analytic count and FlopCounterMode use the same convention (full, unmasked
  score matrices).

That is the model's FLOPs, which MFU counts. The hardware's (HFU) add what activation
checkpointing recomputes in backward (`harness.recompute`). Full: every frozen decoder layer's
forward up to the last tensor its backward needs (torch.utils.checkpoint stops there), which is all
of it but the layer's last matmul (the MLP's down projection: a frozen weight's matmul saves
nothing, and its output only joins the residual). Selective: the layer's matmuls whose outputs the
policy did not keep, and no attention (kept). The head is outside the wrapped layers.

Embedding lookups, norms and elementwise ops are not matmuls and are left out, as in the usual
6ND accounting; `tests/test_flops.py` checks the total against FlopCounterMode within 5%.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count

from .dataset import IGNORE_INDEX, input_lengths
from .harness.recipe import StepFlops
from .harness.recompute import recomputed_matmuls


def linear_params(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def attention_flops(batch: int, heads: int, q_len: int, k_len: int, head_dim: int) -> int:
    """Forward plus backward of one SDPA call."""
    q, k = (batch, heads, q_len, head_dim), (batch, heads, k_len, head_dim)
    return sdpa_flop_count(q, k, k) + sdpa_backward_flop_count(q, q, k, k)


@dataclass(frozen=True)
class LLMShape:
    layers: int
    heads: int
    head_dim: int
    matmul_params: int  # decoder layers' Linear weights
    head_params: int  # LM head
    # Per policy, the Linear weights a checkpointed layer's recompute runs: full, all but its last;
    # selective, those whose outputs the policy does not keep.
    recomputed_params: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, model: nn.Module) -> "LLMShape":
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        # Each layer's Linear weights in the order its forward runs them (the order they are registered).
        sizes = [
            [m.weight.numel() for m in layer.modules() if isinstance(m, nn.Linear)]
            for layer in model.get_decoder().layers
        ]
        matmul = linear_params(model.get_decoder())
        recomputed = {"full": sum(sum(s[:-1]) for s in sizes), "selective": sum(map(recomputed_matmuls, sizes))}
        return cls(
            c.num_hidden_layers,
            c.num_attention_heads,
            head_dim,
            matmul,
            model.get_output_embeddings().weight.numel(),
            recomputed,
        )


@dataclass(frozen=True)
class Sizes:
    """What a micro-batch's FLOPs depend on, as numbers (its padded shapes) or as 0-dim tensors on
    its device (its real lengths, counted without a sync): its rows; the byte patches its encoder
    reads and their squares, summed over the rows; per LLM the positions its decoder reads, summed
    and their squares summed, and the positions its head runs at; whether a distillation term
    takes a second gradient through each head (latentwire.head_losses)."""

    rows: int
    patches: int | torch.Tensor
    patches_squared: int | torch.Tensor
    llms: tuple[tuple[int | torch.Tensor, int | torch.Tensor, int | torch.Tensor], ...]
    kd: bool


@dataclass(frozen=True)
class FlopModel(StepFlops):
    encoder_token_params: int  # applied to every byte patch: encoder + the pooler's key/value maps
    latent_params: int  # applied to every wire token: the rest of the pooler, the adapters
    encoder_layers: int
    encoder_heads: int
    encoder_dim: int
    patch_bytes: int
    d_z: int
    num_latents: int
    pooler_rounds: int
    llms: tuple[tuple[str, LLMShape], ...]  # (name, shape) pairs, in the batches' order
    recompute: str = "none"  # what activation checkpointing recomputes of the frozen decoder layers
    row_params: int = 0  # applied once per row: the pooler's question projection

    @classmethod
    def of(
        cls, wire_encoder: nn.Module, llm_models: dict[str, nn.Module], wire, recompute: str = "none"
    ) -> "FlopModel":
        """`wire`: the WireConfig the encoder was built from; `recompute`: the activation
        checkpointing policy of the frozen decoder layers (counted by step_hardware_flops only)."""
        kv = sum(linear_params(c.attn.k) + linear_params(c.attn.v) for c in wire_encoder.pooler.cross)
        question = linear_params(wire_encoder.pooler.question) if wire_encoder.pooler.question is not None else 0
        return cls(
            encoder_token_params=linear_params(wire_encoder.encoder) + kv,
            latent_params=linear_params(wire_encoder.pooler) - kv - question + linear_params(wire_encoder.adapters),
            row_params=question,
            encoder_layers=wire.encoder_layers,
            encoder_heads=wire.encoder_heads,
            encoder_dim=wire.encoder_dim,
            patch_bytes=wire.patch_bytes,
            d_z=wire.d_z,
            num_latents=wire.num_latents,
            pooler_rounds=len(wire_encoder.pooler.cross),
            llms=tuple((n, LLMShape.of(m)) for n, m in llm_models.items()),
            recompute=recompute,
        )

    def flops(self, s: Sizes) -> int | torch.Tensor:
        """One forward + backward of a micro-batch of these sizes. Every count is a sum over the
        rows of a polynomial in the row's lengths (attention: in the product of its query and key
        lengths), so summed lengths and summed squares make it exact for rows of any lengths.
        Distillation adds no teacher: its targets come with the batch (latentwire.distillation)."""
        m, h = self.num_latents, self.encoder_heads
        flops = 6 * (self.encoder_token_params * s.patches + (self.latent_params * m + self.row_params) * s.rows)
        flops += self.encoder_layers * attention_flops_per_pair(h, self.encoder_dim // h) * s.patches_squared
        flops += self.pooler_rounds * attention_flops_per_pair(h, self.d_z // h) * (m * s.patches + m * m * s.rows)
        for (_, shape), (seq, seq_squared, head_positions) in zip(self.llms, s.llms, strict=True):
            flops += 4 * shape.matmul_params * seq
            flops += shape.layers * attention_flops_per_pair(shape.heads, shape.head_dim) * seq_squared
            # The head's forward, and one input gradient per loss output: no weight gradient.
            flops += (4 + 2 * s.kd) * shape.head_params * head_positions
        return flops

    def step_flops(self, micro_batches: list[dict]) -> int:
        """FLOPs as the step runs them: every row at its micro-batch's padded lengths, each head at
        its gathered positions (the padding to their multiple included). From shapes alone."""
        return sum(self.flops(self.padded_sizes(b)) for b in micro_batches)

    def step_hardware_flops(self, micro_batches: list[dict]) -> int:
        """The FLOPs the device executes in the step (what HFU counts): with activation
        checkpointing, what each frozen decoder layer's recompute runs (the module's docstring)."""
        flops = self.step_flops(micro_batches)
        if self.recompute == "none":
            return flops
        for batch in micro_batches:
            for (_, shape), (seq, seq_squared, _) in zip(self.llms, self.padded_sizes(batch).llms, strict=True):
                flops += 2 * shape.recomputed_params[self.recompute] * seq
                if self.recompute == "full":
                    flops += shape.layers * attention_forward_flops_per_pair(shape.heads, shape.head_dim) * seq_squared
        return flops

    def useful_flops(self, micro_batches: list[dict]) -> torch.Tensor:
        """FLOPs of the same rows at their real lengths, each head at the real labels: a 0-dim int64
        tensor on the batches' device, for the step's one read."""
        return sum(self.flops(self.real_sizes(b)) for b in micro_batches)

    def padded_sizes(self, batch: dict) -> Sizes:
        rows, width = batch["bytes"].shape
        patches = -(-width // self.patch_bytes)  # the encoder pads the last patch (model.ByteEncoder)
        llms = []
        for name, _ in self.llms:
            answers = batch["answers"][name]
            seq = answers["lead_ids"].shape[1] + self.num_latents + answers["input_ids"].shape[1]
            llms.append((rows * seq, rows * seq * seq, answers["label_positions"].shape[1]))
        return Sizes(rows, rows * patches, rows * patches * patches, tuple(llms), distilled(batch))

    def real_sizes(self, batch: dict) -> Sizes:
        # A patch is real when its first byte is (model.ByteEncoder), with word patches too.
        patches = batch["byte_mask"][:, :: self.patch_bytes].sum(-1)
        llms = []
        for name, _ in self.llms:
            answers = batch["answers"][name]
            seq = answers["lead_ids"].shape[1] + self.num_latents + input_lengths(answers["labels"])
            llms.append((seq.sum(), seq.square().sum(), (answers["labels"] != IGNORE_INDEX).sum()))
        return Sizes(len(patches), patches.sum(), patches.square().sum(), tuple(llms), distilled(batch))


def distilled(batch: dict) -> bool:
    """Whether the batch carries distillation targets, which the step then takes a gradient of."""
    return any("kd_logprobs" in rows for rows in batch["answers"].values())


@functools.cache
def attention_flops_per_pair(heads: int, head_dim: int) -> int:
    """SDPA's forward and backward FLOPs per (query, key) pair of one row: torch's formulas are
    products of the batch, the heads, both lengths and the head width."""
    return attention_flops(1, heads, 1, 1, head_dim)


@functools.cache
def attention_forward_flops_per_pair(heads: int, head_dim: int) -> int:
    """SDPA's forward FLOPs per (query, key) pair of one row (what a recompute runs again)."""
    q = (1, heads, 1, head_dim)
    return sdpa_flop_count(q, q, q)


# --- FlopCounterMode on CPU -------------------------------------------------------------------
# torch 2.13 counts the CUDA SDPA kernels but not the CPU flash kernel the cpu profile runs;
# register the same formulas for it so FlopCounterMode sees attention on CPU too.


def _as_query_heads(query_shape, *shapes) -> list[tuple]:
    """Grouped K/V shapes with the query's head count: the LLMs' calls pass fewer K/V heads
    (enable_gqa); torch 2.12+'s formulas count them so, 2.11's assert equal head counts."""
    return [(s[0], query_shape[1], *s[2:]) for s in shapes]


def _cpu_flash_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, *_as_query_heads(query_shape, key_shape, value_shape))


def _cpu_flash_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, *_as_query_heads(query_shape, key_shape, value_shape))


def register_cpu_attention_flops() -> None:
    aten = torch.ops.aten
    fwd = aten._scaled_dot_product_flash_attention_for_cpu
    bwd = aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd not in flop_counter.flop_registry:
        register_flop_formula(fwd)(_cpu_flash_forward)
        register_flop_formula(bwd)(_cpu_flash_backward)
