"""Per-position losses of a frozen LM head, without the logits of the whole batch.

A frozen LLM's head maps each position's last hidden state to a row of vocabulary logits (128k for
Llama-3, 152k for Qwen2.5). Taken at every kept position of every row and copied to fp32 for the
loss, those rows held most of the memory the step's losses took, and most of them were padding or
positions no loss term reads. Here the head runs only at the positions the caller gathered (the
labelled ones: data.label_positions), a chunk of rows at a time: a chunk's logits, their fp32 copy
and its losses exist only while that chunk is computed, and the gradient of each loss with respect
to the chunk's hidden states is taken there and then (torch.func.vjp) and kept, [outputs, positions,
hidden], which is all backward needs: it scales them by the gradient that arrives. This is the
pattern of Liger-Kernel's fused linear cross-entropy and of Horace He's chunked cross-entropy, in
plain PyTorch, so it runs on any device, inside or outside autocast.

The head's weight is frozen: the vjp is taken with respect to the hidden states only, so no weight
gradient is ever computed, and backward needs no weight (under FSDP2 it is gathered once, for the
forward: latentwire.llm.FrozenLLM.head_weight).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# Logits computed at once: 440-520 rows of a 152k-128k vocabulary. What a chunk holds (its fp32
# logits, their log-softmax and gradients) does not grow with the batch; a chunk needs a few
# hundred rows for its GEMMs to be bound by arithmetic on an H100, not by reading the head's weight
# (docs/performance.md).
HEAD_CHUNK_ELEMENTS = 2**26


def chunk_rows(vocab: int) -> int:
    """Positions per chunk: HEAD_CHUNK_ELEMENTS logits, in whole multiples of 8 rows (tensor-core
    tiles)."""
    return max(8, HEAD_CHUNK_ELEMENTS // vocab // 8 * 8)


class _HeadLosses(torch.autograd.Function):
    """Forward: every chunk's values and their gradients with respect to its hidden states;
    backward: those gradients, each output's scaled by the gradient that arrives for it."""

    @staticmethod
    def forward(ctx, hidden, weight, losses, rows, *inputs):
        values, grads = [], []
        for start in range(0, hidden.shape[0], rows):
            part = [x[start : start + rows] for x in inputs]
            out, vjp = torch.func.vjp(
                lambda h, part=part: losses(F.linear(h, weight), *part), hidden[start : start + rows]
            )
            values.append(out)
            grads.append(torch.stack([vjp(one_output(out, j))[0] for j in range(out.shape[1])]))
        ctx.save_for_backward(torch.cat(grads, dim=1))
        ctx.inputs = len(inputs)
        return torch.cat(values)

    @staticmethod
    def backward(ctx, grad_values):
        (grads,) = ctx.saved_tensors
        grad = sum(grads[j] * grad_values[:, j, None] for j in range(grads.shape[0]))
        return grad.to(grads.dtype), None, None, None, *[None] * ctx.inputs


def one_output(values: torch.Tensor, j: int) -> torch.Tensor:
    """The cotangent that picks output j of every position: its vjp is each position's gradient of
    that output alone, a position's outputs depending on that position only."""
    return F.one_hot(torch.full(values.shape[:1], j, device=values.device), values.shape[1]).to(values.dtype)


def head_losses(
    hidden: torch.Tensor, weight: torch.Tensor, losses: Callable[..., torch.Tensor], *inputs: torch.Tensor
) -> torch.Tensor:
    """[positions, outputs]: `losses(logits, *inputs)` of each position's logits `hidden @ weight.T`,
    where `losses` maps [n, vocab] logits and the inputs' matching n rows to [n, outputs] values, each
    of a position's outputs depending on that position alone (a per-position cross-entropy, a
    KL divergence). `hidden` [positions, hidden] requires grad; `weight` [vocab, hidden] does not.
    `chunk_rows` positions at a time."""
    return _HeadLosses.apply(hidden, weight, losses, chunk_rows(weight.shape[0]), *inputs)
