"""Distillation targets, computed once per example instead of once per step.

The KD term's teacher is the frozen LLM reading the prompt as text (latentwire.objectives). Its
tau-softened next-token distribution at an example's first `k_tokens` answer positions is the
same at every epoch, so `teacher_targets` computes it before the first step, for the training
examples the run's steps will draw (harness.data.examples_visited: all of them once a run goes
round an epoch; a short try pays for its own few), each rank a 1/world share, gathered to all
ranks, since any rank may draw any example in a later epoch; the collator hands each batch its
examples' rows. A step then runs no teacher.

Full rows (every token's log-probability) are exact. A large vocabulary (128k tokens for Llama-3)
makes them too big to keep for a dataset: there each position keeps the teacher's `top_k` most
likely tokens and one bucket for all the others, and the KL is taken over those top_k + 1
outcomes (the student's own mass of the other tokens in the bucket). `target_width` says which.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .harness.data import to_device

# The host memory full rows may take, per LLM and rank; above it, top_k + 1 buckets.
FULL_ROWS_BYTES = 1 << 30


@dataclass(frozen=True)
class TeacherTargets:
    """One LLM's targets for N training examples, at their first k answer positions:
    `logprobs` [N, k, K] (fp32, tau-softened); `ids` [N, k, K] the tokens they belong to, or None
    for full rows (K = the vocabulary, in its order); `rest` [N, k] the log-probability of every
    other token together, or None for full rows; `drawn` the dataset indices of the N rows, in
    increasing order (None: every example, in order): a table as long as the dataset would grow
    with it, on every rank."""

    logprobs: torch.Tensor
    ids: torch.Tensor | None
    rest: torch.Tensor | None
    drawn: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.logprobs, self.ids, self.rest) if t is not None)

    def rows(self, indices: torch.Tensor, tail: int, width: int) -> dict[str, torch.Tensor]:
        """The targets of examples `indices` placed at their rows' kept logit positions (width of
        them; the first answer position comes after the `tail`), zeros elsewhere: the KD term's
        mask picks the first k targets out of the same positions."""
        k = self.logprobs.shape[1]
        span = slice(tail, min(tail + k, width))
        if self.drawn is not None:
            rows = torch.searchsorted(self.drawn, indices).clamp_max(len(self.drawn) - 1)
            assert (self.drawn[rows] == indices).all(), "a batch drew an example whose targets were not computed"
            indices = rows
        out = {}
        for key, table in (("kd_logprobs", self.logprobs), ("kd_ids", self.ids), ("kd_rest", self.rest)):
            if table is not None:
                placed = table.new_zeros((len(indices), width, *table.shape[2:]))
                placed[:, span] = table[indices, : span.stop - span.start]
                out[key] = placed
        return out


def targets_bytes(examples: int, k: int, width: int, vocab: int) -> int:
    """What TeacherTargets of `width` log-probs per position hold (with ids and the rest where
    width < vocab)."""
    per_position = 4 * width + (8 * width + 4 if width < vocab else 0)
    return examples * k * per_position


def describe_targets(targets: dict[str, TeacherTargets], dataset_size: int, seconds: float) -> str:
    parts = [
        f"{name} {'full rows' if t.ids is None else f'top {t.ids.shape[-1]} + rest'} ({t.nbytes / 2**20:.0f} MiB)"
        for name, t in targets.items()
    ]
    n, k = next(iter(targets.values())).logprobs.shape[:2]
    of = "" if n == dataset_size else f" (the {n} of {dataset_size} that this run's steps draw)"
    return (
        f"distillation targets of {n} examples{of} x {k} answer positions, computed once in {seconds:.1f} s: "
        f"{', '.join(parts)}"
    )


def target_width(examples: int, k: int, vocab: int, top_k: int) -> int:
    """Log-probs kept per position: the whole vocabulary (exact) where every example's full rows
    fit FULL_ROWS_BYTES in fp32, else the top_k (and the rest's bucket beside them)."""
    return vocab if targets_bytes(examples, k, vocab, vocab) <= FULL_ROWS_BYTES else min(top_k, vocab)


def softened(teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """The distillation target: log-probabilities of the tau-softened teacher distribution."""
    return F.log_softmax(teacher_logits.float() / temperature, dim=-1)


def top_k_buckets(logprobs: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values, ids, rest) of full log-prob rows [..., V]: the top_k, and the log of the rest's
    mass, summed in log space so that a rest far below the top stays exact. A rest of no mass at
    all is the lowest finite log instead of -inf, whose KL term would be 0 x inf."""
    values, ids = logprobs.topk(top_k, dim=-1)
    rest = logprobs.scatter(-1, ids, float("-inf")).logsumexp(-1)
    return values, ids, rest.clamp_min(torch.finfo(rest.dtype).min)


@torch.no_grad()
def teacher_targets(
    llms: dict,
    dataset,
    collate,
    examples: Sequence[int],
    *,
    k: int,
    temperature: float,
    top_k: int,
    batch_size: int,
    device: torch.device,
    rank: int,
    world: int,
    stop=lambda: None,
) -> dict[str, TeacherTargets] | None:
    """The targets of `examples` (dataset indices, increasing) for each LLM. `collate` must give
    the teacher's rows (a data.Collator with teacher=True); the caller sets autocast and the
    attention kernels as the step does. Rank r computes examples[r], examples[r + world], ...; the
    shares are gathered. Full rows or top-k are chosen for the whole dataset, so a run's terms do
    not depend on how many of its examples it draws. `stop()` is asked before each batch, on every
    rank alike (every rank has as many batches: a collective may answer it): the pass over two 8B
    readers and SQuAD takes minutes, longer than a scheduler's grace before SIGKILL, so a signal
    ends it within a batch, and None is returned."""
    examples = torch.as_tensor(examples, dtype=torch.long)
    n = len(examples)
    mine = examples[rank::world].tolist()
    per_rank = -(-n // world)
    mine += mine[-1:] * (per_rank - len(mine))  # equal shares for the gather; the repeats are dropped
    vocab = {name: llm.model.config.vocab_size for name, llm in llms.items()}
    width = {name: target_width(len(dataset), k, vocab[name], top_k) for name in llms}
    drawn = examples if n < len(dataset) else None
    shares = {name: [] for name in llms}
    for start in range(0, per_rank, batch_size):
        if stop():
            return None
        batch = to_device(collate([dataset[i] for i in mine[start : start + batch_size]]), device)
        for name, llm in llms.items():
            rows = batch["answers"][name]
            logits = llm.teacher_logits(rows["text_ids"], rows["text_mask"], rows["input_ids"])
            tail = len(llm.contract.tail)
            window = softened(logits[:, tail : tail + k], temperature)
            window = F.pad(window, (0, 0, 0, k - window.shape[1]))  # rows shorter than k: never targets
            shares[name].append((window,) if width[name] == vocab[name] else top_k_buckets(window, width[name]))
    targets = {}
    for name, parts in shares.items():
        pieces = [_gather(torch.cat(piece), n, rank, world) for piece in zip(*parts, strict=True)]
        if len(pieces) == 1:  # full rows: no ids, no rest
            pieces += [None, None]
        targets[name] = TeacherTargets(*pieces, drawn=drawn)
    return targets


def _gather(share: torch.Tensor, n: int, rank: int, world: int) -> torch.Tensor:
    """Every rank's share, in row order (rank r held rows r, r + world, ...), on the CPU."""
    if world == 1:
        return share.cpu()
    parts = [torch.empty_like(share) for _ in range(world)]
    dist.all_gather(parts, share.contiguous())
    whole = torch.empty((n, *share.shape[1:]), dtype=share.dtype)
    for r, part in enumerate(parts):
        count = len(range(r, n, world))
        whole[r::world] = part[:count].cpu()
    return whole
