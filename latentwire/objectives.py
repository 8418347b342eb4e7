"""The training objectives: per LLM, a few terms, each a sum over a micro-batch that the loop divides
by that term's count in the whole global batch, so every term is exact under accumulation and DDP.

- `answer_ce` (always on, weight 1): cross-entropy of every answer token and the EOS after it.
- `first_token_ce`: the same on the first answer token only. A wire that carries only the answer
  prior can still predict an answer's later tokens from its earlier ones; the first it can get only
  from the wire. LatentWire's authors found weights of 12 and more collapse training.
- `k_token_ce`: the same on the first `k_tokens` targets.
- `kd`: distillation from a teacher, the same frozen LLM reading the prompt's text where the wire
  would be (prompting's contract): tau^2 x KL(teacher || wire) of the tau-softened next-token
  distributions over the first `k_tokens` answer positions. Answer CE alone teaches one token per
  position; the teacher's distribution says how sure reading makes it, and which near misses are
  near. The teacher's side is computed once per example before training (latentwire.distillation)
  and comes with the batch.

With every weight 0 only `answer_ce` is computed, the arithmetic of a loop that has no other term.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from .dataset import IGNORE_INDEX, input_lengths
from .harness.config import setting
from .head_losses import head_losses

TERMS = ("answer_ce", "first_token_ce", "k_token_ce", "kd")


@dataclass(frozen=True)
class Objectives:
    """The terms' weights beside the answer cross-entropy, which always has weight 1."""

    first_token_weight: float = setting(0.0, "weight of the cross-entropy of the first answer token (0: off)", ge=0)
    k_token_weight: float = setting(
        0.0, "weight of the cross-entropy of the first k_tokens answer targets (0: off)", ge=0
    )
    kd_weight: float = setting(
        0.0,
        "weight of distillation from the LLM reading the text prompt, over the first "
        "k_tokens answer positions (0: off, and no teacher pass)",
        ge=0,
    )
    k_tokens: int = setting(4, "answer positions of k_token_weight and kd_weight", gt=0)
    kd_temperature: float = setting(2.0, "softmax temperature of distillation", gt=0)
    kd_top_k: int = setting(
        64,
        "distillation targets kept per answer position where the teacher's full "
        "distributions do not fit in 1 GiB per LLM: its k most likely tokens and one bucket "
        "for the rest",
        gt=0,
    )

    @property
    def weighted(self) -> dict[str, float]:
        """The terms that are on, with their weights, in TERMS order."""
        weights = dict(zip(TERMS, (1.0, self.first_token_weight, self.k_token_weight, self.kd_weight), strict=True))
        return {term: w for term, w in weights.items() if w > 0}

    @property
    def terms(self) -> tuple[str, ...]:
        return tuple(self.weighted)

    @property
    def teacher(self) -> bool:
        """Whether batches need the prompt's tokens and the step a teacher pass."""
        return self.kd_weight > 0

    def targets(self, labels: torch.Tensor, term: str) -> torch.Tensor:
        """The positions `term` sums over, and counts: every target for the answer's cross-entropy,
        the first for the first token's, the first k_tokens for the first-k cross-entropy and KD."""
        if term == "answer_ce":
            return labels != IGNORE_INDEX
        return first_targets(labels, 1 if term == "first_token_ce" else self.k_tokens)

    def weighted_sum(self, terms: torch.Tensor) -> torch.Tensor:
        """[LLMs] from [LLMs, terms]: Python floats as factors, so no weight tensor is made or copied."""
        return sum(terms[:, j] * w for j, w in enumerate(self.weighted.values()))


def first_targets(labels: torch.Tensor, k: int) -> torch.Tensor:
    """True on each row's first k targets (labels that are not IGNORE_INDEX)."""
    real = labels != IGNORE_INDEX
    return real & (real.cumsum(-1) <= k)


def target_counts(batch: dict, objectives: Objectives) -> torch.Tensor:
    """[LLMs, terms] int64: what each term of each LLM sums over in this micro-batch, its
    normaliser once summed over the global batch. On the batch's device: counting needs no sync."""
    return torch.stack(
        [
            torch.stack([objectives.targets(answers["labels"], term).sum() for term in objectives.terms])
            for answers in batch["answers"].values()
        ]
    )


KD_TARGETS = ("kd_logprobs", "kd_ids", "kd_rest")  # a batch's distillation targets: full rows, or top k and the rest


def position_losses(
    logits: torch.Tensor, labels: torch.Tensor, *kd_targets: torch.Tensor, temperature: float
) -> torch.Tensor:
    """[positions, 1 or 2]: each position's next-token cross-entropy (0 where its label is
    IGNORE_INDEX) and, given the teacher's targets there, its `kd_divergence`: what every term sums
    over its positions, from the logits of a chunk of positions (latentwire.head_losses)."""
    logits = logits.float()
    ce = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="none")
    if not kd_targets:
        return ce[:, None]
    return torch.stack([ce, kd_divergence(logits, *kd_targets, temperature=temperature)], dim=1)


def kd_divergence(
    logits: torch.Tensor,
    kd_logprobs: torch.Tensor,
    kd_ids: torch.Tensor | None = None,
    kd_rest: torch.Tensor | None = None,
    *,
    temperature: float,
) -> torch.Tensor:
    """KL(teacher || student) of the tau-softened distributions at each position, against the
    teacher's targets there (latentwire.distillation): full log-prob rows, or the top k
    (`kd_ids`) with one bucket for the rest (`kd_rest`), where the student's distribution is folded
    the same way. The KD term is tau^2 x its sum over the term's positions."""
    student = F.log_softmax(logits.float() / temperature, dim=-1)
    target = kd_logprobs
    if kd_ids is not None:
        rest = student.scatter(-1, kd_ids, float("-inf")).logsumexp(-1, keepdim=True)
        student = torch.cat([student.gather(-1, kd_ids), rest], dim=-1)
        target = torch.cat([target, kd_rest[..., None]], dim=-1)
    return (target.exp() * (target - student)).sum(-1)


def llm_term_sums(hidden: torch.Tensor, head: torch.Tensor, rows: dict, objectives: Objectives) -> torch.Tensor:
    """[terms] of one LLM, from its last hidden states at the kept positions (`hidden` [B, T+1, H],
    FrozenLLM.answer_hidden) and its head's weight: the head and the losses run only at the
    labelled positions (`label_positions`, the collator's), where every term's positions lie, a
    chunk at a time (latentwire.head_losses). Gathered by index, not by a mask: indexing by a mask
    would sync with the host. The padding after the real positions has IGNORE_INDEX for a label,
    and every term's mask leaves it out."""
    labels, (row, col) = rows["labels"], rows["label_positions"]
    real = torch.arange(row.shape[0], device=row.device) < (labels != IGNORE_INDEX).sum()
    kd_targets = [rows[key][row, col] for key in KD_TARGETS if key in rows] if objectives.teacher else []
    values = head_losses(
        hidden[row, col],
        head,
        partial(position_losses, temperature=objectives.kd_temperature),
        labels[row, col].masked_fill(~real, IGNORE_INDEX),
        *kd_targets,
    )

    def term_sum(term: str) -> torch.Tensor:
        mask = objectives.targets(labels, term)[row, col] & real
        if term == "kd":
            return (values[:, 1] * mask).sum() * objectives.kd_temperature**2
        return (values[:, 0] * mask).sum()

    return torch.stack([term_sum(term) for term in objectives.terms])


def forward_loss_sums(wire_encoder: nn.Module, llms: dict, batch: dict, objectives: Objectives) -> torch.Tensor:
    """One micro-batch: [LLMs, terms], each term's sum for each LLM, in `llms` and `objectives.terms` order."""
    soft = wire_encoder(batch["bytes"], batch["byte_mask"])
    sums = []
    for name, llm in llms.items():
        rows = batch["answers"][name]
        hidden = llm.answer_hidden(soft[name], rows["lead_ids"], rows["input_ids"])
        with llm.head_weight() as head:
            sums.append(llm_term_sums(hidden, head, rows, objectives))
    return torch.stack(sums)


class WireTask:
    """The training step's one seam to LatentWire: what the loop asks of the model about a
    micro-batch, as tensors on its device (no host sync). Another model's loop replaces this
    object, not the step.

    - `counts(batch)`: [LLMs, terms] what each loss term sums over; summed over the global batch,
      the term's normaliser (exact accumulation);
    - `loss_sums(model, batch)`: [LLMs, terms] the terms' sums, the forward pass;
    - `objective(terms)`: the scalar backward starts from, from the terms over their global counts;
    - `tokens(batch)`: the positions the LLMs read in it, padding left out, for throughput;
    - `target_tokens(counts)`: the positions the loss reads (answer_ce's targets), for throughput;
    - `record(terms)`: the logged losses.
    """

    def __init__(self, llms: dict, objectives: Objectives, num_latents: int, forward=forward_loss_sums):
        """`forward`: forward_loss_sums, or the same compiled (train.py's compile block)."""
        self.llms, self.objectives, self.num_latents, self.forward = llms, objectives, num_latents, forward

    def counts(self, batch: dict) -> torch.Tensor:
        return target_counts(batch, self.objectives)

    def loss_sums(self, model: nn.Module, batch: dict) -> torch.Tensor:
        return self.forward(model, self.llms, batch, self.objectives)

    def objective(self, terms: torch.Tensor) -> torch.Tensor:
        """Each LLM's weighted sum of terms, averaged over the LLMs."""
        return self.objectives.weighted_sum(terms).mean()

    def tokens(self, batch: dict) -> torch.Tensor:
        """What peers call tokens: the positions the LLMs read, without the padding. Each row's lead,
        wire and input tokens (the tail and the answer), summed over the rows and the LLMs, on the
        device: no sync."""
        return sum(
            input_lengths(rows["labels"]).sum() + rows["lead_ids"].numel() + len(rows["labels"]) * self.num_latents
            for rows in batch["answers"].values()
        )

    def target_tokens(self, counts: torch.Tensor) -> torch.Tensor:
        """The positions the loss reads: answer_ce's targets (every answer token and the EOS after
        it), summed over the LLMs."""
        return counts[:, 0].sum().long()

    def record(self, terms: torch.Tensor) -> dict:
        """`loss` (the objective, averaged over the LLMs), `loss_<llm>` (its weighted sum of terms)
        and each term per LLM, from the step's [LLMs, terms] values in one read from the device."""
        weighted = torch.cat([terms, self.objectives.weighted_sum(terms)[:, None]], dim=1)
        rows = weighted.tolist()
        per_llm = [row[-1] for row in rows]
        return {
            "loss": sum(per_llm) / len(per_llm),
            **{f"loss_{n}": v for n, v in zip(self.llms, per_llm, strict=True)},
            **{
                f"{term}_{n}": row[j]
                for n, row in zip(self.llms, rows, strict=True)
                for j, term in enumerate(self.objectives.terms)
            },
        }
