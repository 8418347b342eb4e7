"""The training step of train.py, and its memory traced on the CPU without allocating any.

Under `FakeTensorMode` a tensor is shape, dtype and device with no storage behind it, so the
profile's exact configuration (two 8B LLMs included) is built and stepped in seconds and no bytes.
`MemTracker` sees every tensor the step creates and files it as parameter, buffer, gradient,
optimizer state, activation (made in forward, or recomputed for backward by activation
checkpointing) or temporary (made in backward).

It sees the tensors operators return, not what a kernel allocates and frees inside itself: on
CUDA, cuBLAS and attention workspaces (in the plan's reserve). On a CPU the trace equals the CPU
allocator's count of the real step to 0.1% (docs/memory.md, "How far to trust it"), in fp32 and in
bf16, where oneDNN runs bf16 matmuls too.

The step traced here is the one `find_batch` runs for real: the same function on real tensors.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F
from torch.distributed._tools.mem_tracker import _TOTAL_KEY, MemTracker, _MemRefType
from torch.utils._pytree import tree_leaves

from ..dataset import ANSWER_PAD_MULTIPLE, IGNORE_INDEX, PAD_BYTE, DataConfig, padded_positions, round_up
from ..distillation import target_width
from ..harness.precision import compute_dtype, sdpa_backends
from ..harness.recipe import TrainingStep
from ..llm import FrozenLLM, build_model, freeze
from ..model import WireEncoder
from ..objectives import Objectives
from .step import run_step

CATEGORY = {
    _MemRefType.PARAM: "parameters",
    _MemRefType.BUFFER: "buffers",
    _MemRefType.GRAD: "gradients",
    _MemRefType.OPT: "optimizer",
    _MemRefType.ACT: "activations",
    _MemRefType.TEMP: "temporaries",
    _MemRefType.OTH: "other",
    _TOTAL_KEY: "total",
}


def planning_batch(
    data: DataConfig,
    objectives: Objectives,
    answers: dict[str, tuple[int, int, int]],
    micro_batch: int,
    device: torch.device = torch.device("cpu"),  # noqa: B008 (immutable)
    word_patch: int = 0,
) -> dict:
    """The largest batch `data.Collator` can emit for this configuration.

    Every prompt is cut at max_prompt_bytes and every answer at max_answer_tokens, padded as the
    collator pads. `answers` maps an LLM's name to (lead tokens, tail tokens, vocabulary size) of its
    prompt contract. With distillation, the rows carry the teacher's targets as the collator places
    them (latentwire.distillation): full rows or the top kd_top_k with the rest's bucket. With word
    patches (`word_patch` bytes, WireConfig.word_patch) a prompt's row is longer than its bytes:
    counted at the worst case, every byte a word of its own.
    """
    real = data.max_prompt_bytes * max(word_patch, 1)
    length = round_up(real, data.pad_multiple)
    byte_ids = torch.full((micro_batch, length), PAD_BYTE, dtype=torch.long, device=device)
    byte_ids[:, :real] = torch.randint(0, 256, (micro_batch, real), device=device)
    batch = {"bytes": byte_ids, "byte_mask": byte_ids != PAD_BYTE, "answers": {}}
    targets = data.max_answer_tokens + 1  # the answer tokens and the EOS after them
    for name, (lead, tail, vocab) in answers.items():
        width = round_up(tail + data.max_answer_tokens, ANSWER_PAD_MULTIPLE)
        labels = torch.full((micro_batch, width + 1), IGNORE_INDEX, dtype=torch.long, device=device)
        labels[:, tail : tail + targets] = torch.randint(0, vocab, (micro_batch, targets), device=device)
        # Where data.label_positions finds them, built as the labels are: a fake tensor has no
        # values to search.
        at = torch.stack(
            [
                torch.arange(micro_batch, device=device).repeat_interleave(targets),
                torch.arange(tail, tail + targets, device=device).repeat(micro_batch),
            ]
        )
        rows = {
            "lead_ids": torch.randint(0, vocab, (micro_batch, lead), device=device),
            "input_ids": torch.randint(0, vocab, (micro_batch, width), device=device),
            "labels": labels,
            "label_positions": padded_positions(at),
        }
        if objectives.teacher:
            kept = (micro_batch, width + 1)
            per_position = target_width(data.num_examples, objectives.k_tokens, vocab, objectives.kd_top_k)
            rows["kd_logprobs"] = torch.randn((*kept, per_position), device=device)
            if per_position < vocab:
                rows["kd_ids"] = torch.randint(0, vocab, (*kept, per_position), device=device)
                rows["kd_rest"] = torch.randn(kept, device=device)
        batch["answers"][name] = rows
    return batch


# --- CUDA's kernels and autocast on a CPU trace ------------------------------------------------


def cuda_kernels():
    """Within it, the functions whose CUDA tensors differ from the CPU's run as they do on CUDA:
    the trace's fake tensors are CPU tensors (a CPU-only torch makes no fake CUDA ones), and an H100
    measured what that missed (bench/results/h100.json: the byte encoder's layer norms and dropout,
    7% of the h100 profile's memory per sample, until these). Patches of the functions, not a
    TorchFunctionMode: a mode is off inside its own handler, which is where backward, and so the
    recomputation of checkpointed layers, runs."""
    return mock.patch.multiple(
        F, scaled_dot_product_attention=cuda_sdpa, layer_norm=cuda_layer_norm, dropout=cuda_dropout
    )


def cuda_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """train.py's flash attention, or memory-efficient attention where there is a padding mask. On
    a CPU device SDPA takes the math kernel for masked or dropout attention and stores [batch, heads,
    L, L] scores that the CUDA kernels never store (about 10 GiB per sample for the h100 profile's
    4096-byte prompts)."""
    if attn_mask is None:  # the LLMs: causal, no mask; flash reads grouped K/V heads as they are
        return torch.ops.aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[
            0
        ]
    # The encoder's padded attention (a step runs no masked LLM attention, so no grouped heads). As on
    # CUDA: the boolean mask becomes an additive bias in the query's dtype, broadcast (a view).
    bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(~attn_mask, float("-inf"))
    bias = bias.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, bias, True, dropout_p, is_causal, scale=scale
    )[0]


_layer_norm, _dropout = F.layer_norm, F.dropout


def cuda_layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """CUDA's autocast runs layer_norm in fp32, where the CPU's leaves it in the input's dtype: a
    bf16 input is copied to fp32, the copy is what the norm keeps for backward, and the fp32 output
    is cast to bf16 again by each linear that reads it (each keeping its own copy)."""
    if not torch.is_autocast_enabled("cpu"):  # the trace's CPU autocast stands for CUDA's
        return _layer_norm(input, normalized_shape, weight, bias, eps)
    with torch.autocast("cpu", enabled=False):
        up = lambda t: t if t is None or t.dtype == torch.float32 else t.float()  # noqa: E731
        return _layer_norm(up(input), normalized_shape, up(weight), up(bias), eps)


def cuda_dropout(input, p=0.5, training=True, inplace=False):
    """CUDA's dropout is one fused kernel that keeps a boolean mask for backward; the CPU's
    multiplies by a mask in the input's dtype (twice the bytes in bf16)."""
    if not training or not 0 < p < 1 or input.numel() == 0:
        return _dropout(input, p, training, inplace)
    out = torch.native_dropout(input, p, True)[0]
    return input.copy_(out) if inplace else out


# --- tracing ----------------------------------------------------------------------------------


class FrozenAwareMemTracker(MemTracker):
    """torch 2.13's MemTracker, made to trace a frozen-backbone model.

    - It registers a gradient hook on every parameter of every module it meets, and
      `register_hook` raises on a parameter that does not require grad: here only trainable
      parameters get one.
    - After every operator it updates the peak of every module seen so far: quadratic in model
      size, over ten minutes for one step of two 8B models. Only the global peak is kept here.
    - A root module's second forward under one tracker raises ("multiple iterative calls"):
      `StepTracer.trace` traces one step a tracker.
    - Its operator hook also serves DTensor (skipping DTensor's nested fake mode) and rebuilds
      every output tree; with neither here, a lean hook files the same bytes ~15% faster.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if self._in_opt:
            kind = _MemRefType.OPT
        elif self._mod_tracker.is_bw and not self._in_ac:
            kind = _MemRefType.TEMP
        else:
            kind = _MemRefType.ACT
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor):
                self._track(kind, t)
        self._update_peak_stats()
        return out

    def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
        sizes = super()._track_module_params_and_buffers(module, install_grad_hooks=False)
        if install_grad_hooks:
            for p in module.parameters():
                if p.requires_grad and p not in self._param_to_grad_hook_handles:
                    self._param_to_grad_hook_handles[p] = (
                        p.register_hook(self._track_grad),
                        p.register_post_accumulate_grad_hook(lambda q: self._track_grad(q.grad)),
                    )
        return sizes

    def _track_grad(self, grad: torch.Tensor) -> None:
        self._update_and_maybe_create_winfos(grad, _MemRefType.GRAD)

    def _update_peak_stats(self, peak_state=None) -> None:
        for device, snap in self._curr_mem_snap.items():
            if self._peak_mem.get(device, 0) < snap[_TOTAL_KEY]:
                self._peak_mem[device] = snap[_TOTAL_KEY]
                self._peak_mem_snap[device] = dict(snap)

    def categories(self, kind: str = "current") -> dict[str, int]:
        """Bytes per category ('parameters', ..., 'total'), summed over devices."""
        totals = dict.fromkeys(CATEGORY.values(), 0)
        for snap in self.get_tracker_snapshot(kind).values():
            for key, nbytes in snap.items():
                totals[CATEGORY[key]] += nbytes
        return totals


@dataclass(frozen=True)
class StepTrace:
    micro_batch: int
    peak: dict[str, int]  # bytes per category at the moment of the peak, and 'total'
    gradients: int  # after backward
    optimizer: int  # after the optimizer step


def fake_llms(specs: dict, precision: str) -> dict[str, FrozenLLM]:
    """The profile's frozen LLMs from their configurations, unwrapped (the step's prepare_llms wraps
    them as train.py does); call under an active FakeTensorMode."""
    dtype = compute_dtype(precision)
    return {
        name: FrozenLLM(name, freeze(build_model(spec.config, dtype)), tokenizer=None) for name, spec in specs.items()
    }


class StepTracer:
    """train.py's trainable model and optimizer, stepped under MemTracker at any micro-batch size.

    Build it under the FakeTensorMode the LLMs were built in. The optimizer has stepped once when
    it is built, on zero gradients and no forward: its state is alive through every traced step's
    forward and backward, the steady state, so one step is enough (the first traced step of a
    fresh optimizer has no state until its update, and a second step of both LLMs was a third of
    a plan's time).
    """

    def __init__(self, cfg, llms: dict[str, FrozenLLM], answers: dict[str, tuple[int, int, int]], step: TrainingStep):
        self.cfg, self.llms, self.answers, self.step = cfg, llms, answers, step
        # The adapters' output scale (the LLMs' embedding RMS) changes values, not memory.
        self.model = WireEncoder(cfg.wire, {name: (llm.hidden_size, 1.0) for name, llm in llms.items()})
        self.optimizer = step.adamw(self.model, cfg.optimizer, cfg.card.device)
        for p in self.model.parameters():
            if p.requires_grad:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)

    def trace(self, micro_batch: int) -> StepTrace:
        batch = planning_batch(
            self.cfg.data, self.cfg.objectives, self.answers, micro_batch, word_patch=self.cfg.wire.word_patch
        )
        tracker = FrozenAwareMemTracker()
        tracker.track_external(self.model, self.optimizer, *(llm.model for llm in self.llms.values()), batch)
        seen = {}
        # Gradients are complete when the optimizer steps; its state exists once it has stepped.
        hooks = (
            self.optimizer.register_step_pre_hook(lambda *_: seen.update(gradients=tracker.categories()["gradients"])),
            self.optimizer.register_step_post_hook(lambda *_: seen.update(optimizer=tracker.categories()["optimizer"])),
        )
        # Around backward too: activation checkpointing recomputes the frozen layers there.
        kernels = cuda_kernels() if self.cfg.card.device == "cuda" else nullcontext()
        every_kernel, _ = sdpa_backends(None, compute_dtype(self.cfg.numerics.precision))  # traced on the CPU
        with tracker, kernels:
            run_step(self.step, self.cfg, self.model, self.llms, self.optimizer, batch, every_kernel)
        for hook in hooks:
            hook.remove()
        return StepTrace(micro_batch, tracker.categories("peak"), seen["gradients"], seen["optimizer"])
