"""LatentWire's wrappers, applied in one place and one order (as torchtitan's `parallelize`), for
everything that builds the models: training, the memory plan, find_batch, evaluation and the
compile bench, so what is planned and measured is what trains.

Activation checkpointing. Gradients flow through the frozen LLMs to the wire, so each decoder
layer's activations would be kept for backward; instead each layer is a checkpointed region, and
backward recomputes it whole (full) or all but the outputs of its attention and every second matmul
(selective), as train.py's policy says (`harness.recompute`). Non-reentrant checkpointing takes
frozen weights, keyword arguments and compile. It wraps before compile, so the recompute is planned
inside the layer's graph.

Regional compilation (torchtitan compiles each TransformerBlock the same way): each frozen decoder
layer, inside its checkpointing wrapper, each byte-encoder block and the latent pooler are compiled
on their own, in place (`module.compile`). Dynamo guards on a layer's structure, not on which layer
it is, so the layers of one LLM share one compiled graph: two graphs for the 32 Llama and 28 Qwen
layers instead of one graph with all 60 unrolled, and compile time does not grow with depth. What
lies between the regions (embedding lookup, rotary tables, final norm, head, loss) runs eagerly: a
few kernels per LLM call. In-place compilation keeps parameter names (no `_orig_mod.`), so
checkpoints do not notice. Prompt widths (multiples of pad_multiple) and answer widths (multiples
of 8) change from batch to batch; `harness.compiling.stable_shapes` keeps them from recompiling the
regions (the whole step compiled as one graph compiled 3 times for 6 shapes, each of them minutes
for two 8B models, on one rank while the others waited in NCCL).

Recompile limit. Dynamo keeps one cache of compiled variants per code object, and every decoder
layer of both LLMs enters it through the same one, `CheckpointWrapper.forward`; a variant past
`recompile_limit` entries runs eagerly, with only a log line. See `DECODER_LAYER_VARIANTS`.
Compiled regions serve training calls only. Evaluation (eval mode, no_grad, padded attention, a KV
cache) would recompile every region, so it runs under torch.compiler.set_stance("force_eager"), as
the distillation teacher's one-off pass does.

FSDP2 (--frozen-sharding fsdp). Replicated, every rank holds both LLMs whole (31 GB for 8B + 7B in
bf16, 287 GB for 70B + 72B); sharded, 1/world of every weight, a decoder layer all-gathered only
while it runs, for its forward and again for its backward. No gradients, so no reduce-scatter.
compile and fully_shard commute: module.compile() compiles the module's call, whose hooks are
looked up as it runs, and FSDP2's hooks run outside dynamo.

The LLMs are built on the meta device (the planner's under FakeTensorMode), where wrapping costs
nothing; `to_empty` then allocates what the rank holds, and each tensor, or this rank's rows of it,
is read from the checkpoint's memory map.
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    apply_activation_checkpointing,
    checkpoint_wrapper,
)
from torch.distributed.fsdp import fully_shard

from .fp8 import convert_frozen_linears
from .harness.precision import compute_dtype
from .llm import (
    FrozenConfig,
    build_frozen_llms,
    decoder_layers,
    fsdp_units,
    is_decoder_layer,
    place,
    skip_unused_backward_gathers,
)
from .prompting import PromptFormat

# Variants of CheckpointWrapper.forward the step compiles: 2 LLMs (layer classes and widths differ)
# x 2 (the one recompile an inductor size guard may cost) = 4, half dynamo's default recompile
# limit of 8, past which a variant silently runs every layer of an LLM eagerly: room for one nobody
# planned (TORCH_LOGS=recompiles names it).
DECODER_LAYER_VARIANTS = 2 * 2


def frozen_llms(
    frozen: FrozenConfig,
    prompt: PromptFormat,
    precision: str,
    device,
    *,
    checkpointing: dict | None = None,
    compile_options: dict | None = None,
    mesh=None,
) -> dict:
    """A run's two frozen readers as a rank holds them: built on the meta device in the dtype the
    step computes in (frozen weights need no fp32 master copy: no gradients, no optimizer state; in
    bf16, half the memory of fp32), then wrapped, sharded, placed and read, and cast to float8, in
    one order (`prepare_frozen_llms`). Training, find_batch, evaluation and the benches all take them from
    here, so what is planned and measured is what trains."""
    with torch.device("meta"):
        llms = build_frozen_llms(frozen, prompt, compute_dtype(precision))
    prepare_frozen_llms(
        llms, checkpointing=checkpointing, compile_options=compile_options, mesh=mesh, device=device, fp8=frozen.fp8
    )
    return llms


def prepare_frozen_llms(
    llms: dict, *, checkpointing: dict | None, compile_options: dict | None, mesh, device, fp8: str = "none"
) -> None:
    """Each LLM, built on the meta device, its decoder layers wrapped for activation checkpointing
    with `checkpointing` (checkpoint_wrapper's arguments, `harness.recompute.checkpoint_options`;
    None: not wrapped), compiled with `compile_options` (torch.compile's arguments; None: eager),
    sharded over `mesh` (None: whole), and allocated on `device` and read (None: left as built, the
    planner's fakes), then its decoder layers' linears converted to float8 by the recipe `fp8`
    unless none: last, since each weight is cast once from the values read (latentwire.fp8)."""
    for llm in llms.values():
        if checkpointing is not None:
            checkpoint_decoder_layers(llm, checkpointing)
        if compile_options is not None:
            for layer in decoder_layers(llm):
                layer.compile(**compile_options)
        if mesh is not None:
            for unit in fsdp_units(llm):  # each decoder layer, the embedding table, the norm with the head
                fully_shard(unit, mesh=mesh)
            fully_shard(llm.model, mesh=mesh)  # the root, which then holds nothing
            skip_unused_backward_gathers(llm)
        if device is not None:
            place(llm, device)
        if fp8 != "none":
            convert_frozen_linears(llm, fp8)


def checkpoint_decoder_layers(llm, checkpointing: dict) -> None:
    """Each decoder layer of `llm` in torch's non-reentrant checkpoint_wrapper, with `checkpointing`
    as its arguments (`harness.recompute.checkpoint_options`)."""
    apply_activation_checkpointing(
        llm.model, checkpoint_wrapper_fn=partial(checkpoint_wrapper, **checkpointing), check_fn=is_decoder_layer(llm)
    )


def wire_regions(wire_encoder: nn.Module) -> list[nn.Module]:
    """The trainable model's compiled regions: each byte-encoder block and the latent pooler (two
    small rounds, one graph)."""
    return [*wire_encoder.encoder.blocks, wire_encoder.pooler]
