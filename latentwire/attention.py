"""How the frozen LLMs attend: causally with no mask in training, under a mask where prompts
are left-padded (the distillation teacher, evaluation)."""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

# Training feeds [wire ; answer] rows that are never packed and padded only on the right, so the
# LLMs attend causally with no mask at all. Under a name of its own (transformers' SDPA attention,
# registered again), transformers builds no mask: under "sdpa" it would read the position ids on
# every forward to look for packed rows (a host sync per LLM call) and, under torch.compile, build
# an explicit causal mask, which rules out the flash kernel and repeats the grouped K/V heads.
# Evaluation pads prompts on the left and switches to "sdpa" (`padded_attention`).
CAUSAL_ATTENTION = "latentwire_causal_sdpa"


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
