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

import torch
import torch.nn.functional as F
from torch import nn

from .dataset import IGNORE_INDEX

TERMS = ("answer_ce", "first_token_ce", "k_token_ce", "kd")


@dataclass(frozen=True)
class Objectives:
    first_token_weight: float = 0.0
    k_token_weight: float = 0.0
    kd_weight: float = 0.0
    k_tokens: int = 4
    kd_temperature: float = 2.0
    kd_top_k: int = 64  # distillation targets kept per position where full rows do not fit

    @property
    def weighted(self) -> dict[str, float]:
        """The terms that are on, with their weights, in TERMS order."""
        weights = dict(zip(TERMS, (1.0, self.first_token_weight, self.k_token_weight, self.kd_weight)))
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


def keep_only(labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return labels.masked_fill(~mask, IGNORE_INDEX)


def target_counts(batch: dict, objectives: Objectives) -> torch.Tensor:
    """[LLMs, terms] int64: what each term of each LLM sums over in this micro-batch, its
    normaliser once summed over the global batch. On the batch's device: counting needs no sync."""
    return torch.stack([torch.stack([objectives.targets(answers["labels"], term).sum() for term in objectives.terms])
                        for answers in batch["answers"].values()])


def ce_sum(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed (not averaged) next-token cross-entropy over the labels that are not IGNORE_INDEX."""
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=IGNORE_INDEX, reduction="sum")


def kd_sum(logits: torch.Tensor, rows: dict, mask: torch.Tensor, temperature: float) -> torch.Tensor:
    """tau^2 x KL(teacher || student) of the tau-softened distributions, summed over `mask`'s
    positions, against the teacher's targets in the batch's rows (latentwire.distillation): full
    log-prob rows, or the top k with one bucket for the rest, where the student's distribution is
    folded the same way. Every position is computed and the mask multiplies: indexing by it would
    sync with the host."""
    student = F.log_softmax(logits.float() / temperature, dim=-1)
    target = rows["kd_logprobs"]
    if "kd_ids" in rows:
        rest = student.scatter(-1, rows["kd_ids"], float("-inf")).logsumexp(-1, keepdim=True)
        student = torch.cat([student.gather(-1, rows["kd_ids"]), rest], dim=-1)
        target = torch.cat([target, rows["kd_rest"][..., None]], dim=-1)
    kl = (target.exp() * (target - student)).sum(-1)
    return (kl * mask).sum() * temperature ** 2


def llm_term_sums(logits: torch.Tensor, rows: dict, objectives: Objectives) -> torch.Tensor:
    def term_sum(term: str) -> torch.Tensor:
        mask = objectives.targets(rows["labels"], term)
        if term == "kd":
            return kd_sum(logits, rows, mask, objectives.kd_temperature)
        return ce_sum(logits, keep_only(rows["labels"], mask))

    return torch.stack([term_sum(term) for term in objectives.terms])


def forward_loss_sums(wire_encoder: nn.Module, llms: dict, batch: dict, objectives: Objectives) -> torch.Tensor:
    """One micro-batch: [LLMs, terms], each term's sum for each LLM, in `llms` and `objectives.terms` order."""
    soft = wire_encoder(batch["bytes"], batch["byte_mask"])
    sums = []
    for name, llm in llms.items():
        rows = batch["answers"][name]
        logits = llm.answer_logits(soft[name], rows["lead_ids"], rows["input_ids"])
        sums.append(llm_term_sums(logits, rows, objectives))
    return torch.stack(sums)


class WireTask:
    """The training step's one seam to LatentWire: what the loop asks of the model about a
    micro-batch, as tensors on its device (no host sync). Another model's loop replaces this
    object, not the step.

    - `counts(batch)`: [LLMs, terms] what each loss term sums over; summed over the global batch,
      the term's normaliser (exact accumulation);
    - `loss_sums(model, batch)`: [LLMs, terms] the terms' sums, the forward pass;
    - `objective(terms)`: the scalar backward starts from, from the terms over their global counts;
    - `tokens(counts, samples)`: the tokens a step of `samples` examples fed the LLMs, for throughput;
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

    def tokens(self, counts: torch.Tensor, samples: int) -> torch.Tensor:
        """The answer tokens (answer_ce's targets) and every example's wire tokens, per LLM."""
        return counts[:, 0].sum().long() + self.num_latents * len(self.llms) * samples

    def record(self, terms: torch.Tensor) -> dict:
        """`loss` (the objective, averaged over the LLMs), `loss_<llm>` (its weighted sum of terms)
        and each term per LLM, from the step's [LLMs, terms] values in one read from the device."""
        weighted = torch.cat([terms, self.objectives.weighted_sum(terms)[:, None]], dim=1)
        rows = weighted.tolist()
        per_llm = [row[-1] for row in rows]
        return {"loss": sum(per_llm) / len(per_llm), **{f"loss_{n}": v for n, v in zip(self.llms, per_llm)},
                **{f"{term}_{n}": row[j] for n, row in zip(self.llms, rows) for j, term in enumerate(self.objectives.terms)}}
