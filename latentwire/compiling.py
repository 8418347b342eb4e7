"""torch.compile for the training step, one repeated region at a time.

Regional compilation (torchtitan compiles each TransformerBlock the same way): each frozen decoder
layer, inside its activation-checkpointing wrapper, each byte-encoder block and the latent pooler
are compiled on their own, in place (`module.compile`). Dynamo guards on a layer's structure, not
on which layer it is, so the layers of one LLM share one compiled graph: two graphs for the 32
Llama and 28 Qwen layers instead of one graph with all 60 unrolled, and compile time no longer
grows with depth. What lies between the regions (embedding lookup, rotary tables, final norm,
head, loss) runs eagerly: a few kernels per LLM call.

Stable shapes. Prompt widths (multiples of pad_multiple) and answer widths (multiples of 8) change
from batch to batch; `harness.compiling.stable_shapes` keeps them from recompiling the regions (the
whole step compiled as one graph compiled 3 times for 6 shapes, each of them minutes for two 8B
models, on one rank while the others waited in NCCL).

Recompile limit. Dynamo keeps one cache of compiled variants per code object, and every decoder
layer of both LLMs enters it through the same one, `CheckpointWrapper.forward`; a variant past
`recompile_limit` entries runs eagerly, with only a log line. See `DECODER_LAYER_VARIANTS`.

train.py does the compiling itself: `layer.compile(mode=..., dynamic=True)` for each decoder layer
(in `prepare_frozen_llms`) and for each of `wire_regions`.

Compiled regions serve training calls only. Evaluation (eval mode, no_grad, padded attention, a
KV cache) would recompile every region, so it runs under torch.compiler.set_stance("force_eager").
"""
from __future__ import annotations

from torch import nn



# Variants of CheckpointWrapper.forward the step compiles: 2 LLMs (layer classes and widths differ)
# x 2 (the one recompile an inductor size guard may cost) = 4, half dynamo's default recompile
# limit of 8, past which a variant silently runs every layer of an LLM eagerly: room for one nobody
# planned (TORCH_LOGS=recompiles names it). The LLMs' other calls (distillation's teacher before the
# first step, evaluation) run under force_eager and compile nothing.
DECODER_LAYER_VARIANTS = 2 * 2


def wire_regions(wire_encoder: nn.Module) -> list[nn.Module]:
    """The trainable model's regions: each byte-encoder block and the latent pooler (two small
    rounds, one graph). In-place compilation keeps parameter names (no `_orig_mod.`), so
    checkpoints do not notice."""
    return [*wire_encoder.encoder.blocks, wire_encoder.pooler]
