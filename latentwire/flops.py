"""FLOPs of one training step, counted for what really runs.

- Trainable encoder, pooler and adapters: forward, input gradients and weight gradients:
  6 x (matmul parameters) per token they process.
- Frozen LLMs: forward and the input gradients that carry the gradient back to the wire, but no
  weight gradients: 4 x (matmul parameters) per position; the LM head only on the kept positions.
- Attention (scores and weighted values) in both, from torch.utils.flop_counter's own SDPA
  formulas, so the analytic count and FlopCounterMode use the same convention (full, unmasked
  score matrices).

That is the model's FLOPs, which MFU counts. The hardware's (HFU) add what activation
checkpointing recomputes in backward: every frozen decoder layer's forward up to the last tensor
its backward needs (torch.utils.checkpoint stops there), which is all of it but the layer's last
matmul (the MLP's down projection: a frozen weight's matmul saves nothing, and its output only
joins the residual); the head is outside the wrapped layers.

Embedding lookups, norms and elementwise ops are not matmuls and are left out, as in the usual
6ND accounting; `tests/test_flops.py` checks the total against FlopCounterMode within 5%.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch import nn
from torch.utils import flop_counter
from torch.utils.flop_counter import register_flop_formula, sdpa_backward_flop_count, sdpa_flop_count


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
    matmul_params: int   # decoder layers' Linear weights
    head_params: int     # LM head
    recomputed_params: int = 0  # the Linear weights a checkpointed layer's recompute runs (all but its last)

    @classmethod
    def of(cls, model: nn.Module) -> "LLMShape":
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        last = sum([m for m in layer.modules() if isinstance(m, nn.Linear)][-1].weight.numel()
                   for layer in model.get_decoder().layers)
        matmul = linear_params(model.get_decoder())
        return cls(c.num_hidden_layers, c.num_attention_heads, head_dim, matmul,
                   model.get_output_embeddings().weight.numel(), matmul - last)


@dataclass(frozen=True)
class FlopModel:
    encoder_token_params: int  # applied to every byte patch: encoder + the pooler's key/value maps
    latent_params: int         # applied to every wire token: the rest of the pooler, the adapters
    encoder_layers: int
    encoder_heads: int
    encoder_dim: int
    patch_bytes: int
    d_z: int
    num_latents: int
    pooler_rounds: int
    llms: tuple[tuple[str, LLMShape], ...]  # (name, shape) pairs: hashable, so counts can be cached
    recompute: bool = False  # activation checkpointing recomputes the frozen decoder layers

    @classmethod
    def of(cls, wire_encoder: nn.Module, llm_models: dict[str, nn.Module], wire,
           recompute: bool = False) -> "FlopModel":
        """`wire`: the WireConfig the encoder was built from; `recompute`: whether the frozen
        decoder layers are checkpointed (counted by step_hardware_flops only)."""
        kv = sum(linear_params(c.attn.k) + linear_params(c.attn.v) for c in wire_encoder.pooler.cross)
        return cls(encoder_token_params=linear_params(wire_encoder.encoder) + kv,
                   latent_params=linear_params(wire_encoder.pooler) - kv + linear_params(wire_encoder.adapters),
                   encoder_layers=wire.encoder_layers, encoder_heads=wire.encoder_heads, encoder_dim=wire.encoder_dim,
                   patch_bytes=wire.patch_bytes, d_z=wire.d_z, num_latents=wire.num_latents,
                   pooler_rounds=len(wire_encoder.pooler.cross),
                   llms=tuple((n, LLMShape.of(m)) for n, m in llm_models.items()), recompute=recompute)

    @functools.cache  # padding leaves few distinct shapes; the formulas cost ~2 ms per call
    def micro_batch_flops(self, batch: int, prompt_len: int, llm_lens: tuple[tuple[int, int], ...]) -> int:
        """One forward + backward of a micro-batch: `batch` prompts of `prompt_len` bytes (padded);
        for the i-th LLM, `llm_lens[i]` = (lead tokens, tokens after the wire), padded. Distillation
        adds no teacher: its targets come with the batch (latentwire.distillation)."""
        m, h = self.num_latents, self.encoder_heads
        patches = -(-prompt_len // self.patch_bytes)  # the encoder pads the last patch (model.ByteEncoder)
        flops = 6 * (self.encoder_token_params * batch * patches + self.latent_params * batch * m)
        flops += self.encoder_layers * attention_flops(batch, h, patches, patches, self.encoder_dim // h)
        flops += self.pooler_rounds * (attention_flops(batch, h, m, patches, self.d_z // h)  # latents read patches
                                       + attention_flops(batch, h, m, m, self.d_z // h))  # and each other
        for (_, shape), (lead, after) in zip(self.llms, llm_lens):
            seq, kept = lead + m + after, after + 1
            flops += 4 * (shape.matmul_params * batch * seq + shape.head_params * batch * kept)
            flops += shape.layers * attention_flops(batch, shape.heads, seq, seq, shape.head_dim)
        return flops

    @functools.cache
    def micro_batch_recompute_flops(self, batch: int, llm_lens: tuple[tuple[int, int], ...]) -> int:
        """What checkpointing adds to a micro-batch: the decoder layers' forward once more, less
        each layer's last matmul."""
        flops = 0
        for (_, shape), (lead, after) in zip(self.llms, llm_lens):
            q = (batch, shape.heads, lead + self.num_latents + after, shape.head_dim)
            flops += 2 * shape.recomputed_params * batch * q[2] + shape.layers * sdpa_flop_count(q, q, q)
        return flops

    def step_flops(self, micro_batches: list[dict]) -> int:
        """The model's FLOPs of one optimizer step (what MFU counts)."""
        return sum(self.micro_batch_flops(*b["bytes"].shape, self._lens(b)) for b in micro_batches)

    def step_hardware_flops(self, micro_batches: list[dict]) -> int:
        """The FLOPs the device executes in the step (what HFU counts): the recompute included."""
        extra = sum(self.micro_batch_recompute_flops(b["bytes"].shape[0], self._lens(b)) for b in micro_batches)
        return self.step_flops(micro_batches) + (extra if self.recompute else 0)

    def _lens(self, batch: dict) -> tuple[tuple[int, int], ...]:
        return tuple(llm_lens(batch["answers"][n]) for n, _ in self.llms)


def llm_lens(rows: dict) -> tuple[int, int]:
    """(lead, after the wire) widths of one LLM's collated rows."""
    return rows["lead_ids"].shape[1], rows["input_ids"].shape[1]


# --- FlopCounterMode on CPU -------------------------------------------------------------------
# torch 2.13 counts the CUDA SDPA kernels but not the CPU flash kernel the cpu profile runs;
# register the same formulas for it so FlopCounterMode sees attention on CPU too.

def _as_query_heads(query_shape, *shapes) -> list[tuple]:
    """Grouped K/V shapes with the query's head count: the LLMs' calls pass fewer K/V heads
    (enable_gqa); torch 2.12+'s formulas count them so, 2.11's assert equal head counts."""
    return [(s[0], query_shape[1], *s[2:]) for s in shapes]


def _cpu_flash_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, *_as_query_heads(query_shape, key_shape, value_shape))


def _cpu_flash_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None,
                        **kwargs) -> int:
    return sdpa_backward_flop_count(grad_out_shape, query_shape, *_as_query_heads(query_shape, key_shape, value_shape))


def register_cpu_attention_flops() -> None:
    aten = torch.ops.aten
    fwd, bwd = aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_flash_attention_for_cpu_backward
    if fwd not in flop_counter.flop_registry:
        register_flop_formula(fwd)(_cpu_flash_forward)
        register_flop_formula(bwd)(_cpu_flash_backward)
