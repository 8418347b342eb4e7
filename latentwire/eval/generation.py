"""Frozen LLMs reading prompts given as input embeddings: the wire's soft tokens or the prompt's
own tokens, scored teacher-forced on an answer (summed NLL) or answering greedily (KV cache,
stopping at EOS or a newline). What `evaluate` runs for every input and control."""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..attention import padded_attention, padded_causal_mask, positions
from ..dataset import IGNORE_INDEX, prompt_text
from ..llm import FrozenLLM

# --- prompts as input embeddings --------------------------------------------------------------


@dataclass(frozen=True)
class Prompts:
    """A batch of prompts as input embeddings, left-padded so every prompt ends at the last column
    and generated tokens append on the right. `mask` is 1 on real positions."""

    embeds: torch.Tensor  # [B, P, hidden]
    mask: torch.Tensor  # [B, P], long


def whole_sequence_mask(mask: torch.Tensor) -> torch.Tensor:
    """The 4-D mask of a call over a whole left-padded sequence. From the 2-D `mask`, transformers
    would give each left-padding query a row with no key at all, which CUDA's fused kernels may
    answer with NaN; `padded_causal_mask` lets it see itself. Real queries see the same keys either
    way. A cached decoding step needs no such mask: its one query is a real token."""
    return padded_causal_mask(mask.bool())


def wire_prompts(llm: FrozenLLM, soft: torch.Tensor, lead_ids: torch.Tensor) -> Prompts:
    """`[lead ; soft ; tail]`: what training puts before the answer (llm.wire_embeds, the prompt
    contract of latentwire.prompting)."""
    tail = torch.tensor(llm.contract.tail, dtype=torch.long, device=soft.device).expand(soft.shape[0], -1)
    embeds = llm.wire_embeds(soft, lead_ids, tail)
    return Prompts(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=soft.device))


def text_prompt_ids(llm: FrozenLLM, example: dict, max_prompt_tokens: int | None) -> list[int]:
    """`lead ; prompt ; tail` in tokens: what the distillation teacher reads, and the text baselines."""
    ids = llm.tokenizer(prompt_text(example), add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    return llm.contract.around(ids)


def text_prompts(llm: FrozenLLM, examples: list[dict], max_prompt_tokens: int | None) -> Prompts:
    rows = [text_prompt_ids(llm, ex, max_prompt_tokens) for ex in examples]
    table = llm.model.get_input_embeddings()
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), llm.tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, row_ids in enumerate(rows):
        ids[row, length - len(row_ids) :] = torch.tensor(row_ids, dtype=torch.long)
        mask[row, length - len(row_ids) :] = 1
    device = table.weight.device
    return Prompts(table(ids.to(device)), mask.to(device))


# --- teacher-forced scoring -------------------------------------------------------------------


def continuation_nll(
    llm: FrozenLLM, prompts: Prompts, continuations: list[list[int]]
) -> tuple[list[float], list[int], list[bool]]:
    """Per example: the summed NLL of its continuation's tokens and then EOS after its prompt, that
    target count, and whether the prompt's most likely next token is the continuation's first. With
    a wire prompt and the answer tokens, the first two are training's loss quantity; the third is
    first-token accuracy, where a wire that learned only the answer prior fails first."""
    device = prompts.embeds.device
    eos = llm.tokenizer.eos_token_id
    length = max(map(len, continuations))
    ids = torch.full((len(continuations), length), eos, dtype=torch.long, device=device)
    labels = torch.full((len(continuations), length + 1), IGNORE_INDEX, dtype=torch.long, device=device)
    for row, cont in enumerate(continuations):
        ids[row, : len(cont)] = torch.tensor(cont, dtype=torch.long)
        labels[row, : len(cont) + 1] = torch.tensor(cont + [eos], dtype=torch.long)
    lengths = torch.tensor([len(c) for c in continuations], device=device)
    cont_mask = (torch.arange(length, device=device) < lengths[:, None]).long()
    embeds = torch.cat([prompts.embeds, llm.model.get_input_embeddings()(ids).to(prompts.embeds.dtype)], dim=1)
    mask = torch.cat([prompts.mask, cont_mask], dim=1)
    # The last prompt position predicts the first continuation token: keep the last length+1 logits.
    with padded_attention([llm.model]):
        logits = llm.model(
            inputs_embeds=embeds,
            attention_mask=whole_sequence_mask(mask),
            position_ids=positions(mask),
            use_cache=False,
            logits_to_keep=length + 1,
        ).logits
    ce = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    first_hits = (logits[:, 0].argmax(-1) == labels[:, 0]).tolist()
    return ce.sum(1).tolist(), [len(c) + 1 for c in continuations], first_hits


def answer_ids(collated_answers: dict) -> list[list[int]]:
    """Each row's answer tokens, read back from the collated labels (its targets minus the final
    EOS), so evaluation scores exactly what training does, truncation included."""
    return [row[row != IGNORE_INDEX][:-1].tolist() for row in collated_answers["labels"]]


# --- greedy generation ------------------------------------------------------------------------


@lru_cache(maxsize=None)
def newline_token_ids(tokenizer) -> frozenset[int]:
    pieces = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return frozenset(i for i, piece in enumerate(pieces) if "\n" in piece)


def stop_token_ids(llm: FrozenLLM) -> frozenset[int]:
    """EOS (the tokenizer's, which training teaches, and any the model's generation config names)
    and every token that contains a newline: an answer is one line."""
    config_eos = llm.model.generation_config.eos_token_id
    config_eos = config_eos if isinstance(config_eos, list) else [config_eos]
    eos = {llm.tokenizer.eos_token_id, *(i for i in config_eos if i is not None)}
    return newline_token_ids(llm.tokenizer) | eos


def all_done(done: torch.Tensor, on_every_rank: bool) -> bool:
    finished = done.all().to(torch.int32).reshape(1)
    if on_every_rank:
        dist.all_reduce(finished, op=dist.ReduceOp.MIN)
    return bool(finished.item())


def greedy_generate(
    llm: FrozenLLM, prompts: Prompts, max_new_tokens: int, use_cache: bool = True, stop_together: bool = False
) -> list[list[int]]:
    """Greedy tokens after each prompt, each row ending at its first stop token (kept) or after
    max_new_tokens. `use_cache=False` recomputes the whole sequence at every step: the reference
    that the KV-cache path must reproduce token for token. `stop_together`: every rank decodes
    until all ranks' rows are done (an LLM sharded over the ranks needs every rank in every forward)."""
    model, table = llm.model, llm.model.get_input_embeddings()
    stops = stop_token_ids(llm)
    stop_ids = torch.tensor(sorted(stops), device=prompts.embeds.device)
    embeds, mask, cache = prompts.embeds, prompts.mask, None
    generated, done = [], torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
    with padded_attention([model]):
        for _ in range(max_new_tokens):
            pos = positions(mask)
            if cache is None:
                out = model(
                    inputs_embeds=embeds,
                    attention_mask=whole_sequence_mask(mask),
                    position_ids=pos,
                    use_cache=use_cache,
                    logits_to_keep=1,
                )
            else:  # only the newest token; the cache holds the keys and values of all earlier ones
                out = model(
                    inputs_embeds=embeds[:, -1:],
                    attention_mask=mask,
                    position_ids=pos[:, -1:],
                    past_key_values=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )
            cache = out.past_key_values if use_cache else None
            next_ids = out.logits[:, -1].argmax(-1)
            generated.append(next_ids)
            done |= torch.isin(next_ids, stop_ids)
            if all_done(done, stop_together):
                break
            # Finished rows keep generating (their tokens are cut below): a batch advances together.
            embeds = torch.cat([embeds, table(next_ids)[:, None].to(embeds.dtype)], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return [cut_after_stop(row, stops) for row in torch.stack(generated, 1).tolist()]


def cut_after_stop(ids: list[int], stops: frozenset[int]) -> list[int]:
    for k, token in enumerate(ids):
        if token in stops:
            return ids[: k + 1]
    return ids


def decode_answer(tokenizer, ids: list[int]) -> str:
    """The answer's text: special tokens (EOS) dropped, and nothing from its first newline on."""
    return tokenizer.decode(ids, skip_special_tokens=True).split("\n", 1)[0].strip()


def joint_pick(llms: dict, prompts: dict[str, Prompts], answers: dict[str, list[str]]) -> list[str]:
    """Per example, of the LLMs' answers the one with the highest log-probability (answer + EOS)
    summed over all LLMs, each reading its own prompt; a tie goes to the first LLM's answer."""
    candidates = [answers[name] for name in llms]
    scores = torch.zeros(len(candidates), len(candidates[0]), dtype=torch.float64)
    for name, llm in llms.items():
        for c, texts in enumerate(candidates):
            ids = [llm.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            scores[c] -= torch.tensor(continuation_nll(llm, prompts[name], ids)[0], dtype=torch.float64)
    return [candidates[c][i] for i, c in enumerate(scores.argmax(0).tolist())]
