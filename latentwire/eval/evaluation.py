"""The evaluation itself: the wire and its controls, a chunk of examples through both LLMs, all
examples sharded over the ranks (`python -m latentwire.evaluate` and train.py's --eval-every).

Examples are cut into chunks of `batch_size` consecutive examples and the chunks are dealt to the
ranks round-robin. A chunk is padded and computed the same way whatever the number of ranks, and
per-example results are gathered and reduced in example order, so N processes give exactly the
numbers of one.
"""

from __future__ import annotations

import random

import torch

from ..dataset import Collator, PromptDataset
from ..harness.data import to_device
from ..harness.distributed import gather_objects
from ..harness.precision import AMP_DTYPES
from ..model import WireEncoder
from .generation import (
    answer_ids,
    continuation_nll,
    decode_answer,
    greedy_generate,
    joint_pick,
    text_prompts,
    wire_prompts,
)
from .report import summarize
from .settings import EvalSettings
from .squad_metrics import best_em_f1

PAYLOADS = ("bf16", "int8")


# --- the wire and its controls ----------------------------------------------------------------


def cyclic_derangement(n: int, seed: int) -> list[int]:
    """A seeded random permutation with no fixed point when n > 1 (Sattolo's algorithm draws one
    n-cycle), so every shuffled example reads another example's wire."""
    perm, rng = list(range(n)), random.Random(seed)
    for i in range(n - 1, 0, -1):
        j = rng.randrange(i)
        perm[i], perm[j] = perm[j], perm[i]
    return perm


def int8_roundtrip(z: torch.Tensor) -> torch.Tensor:
    """The wire as an int8 payload decodes it: symmetric, one fp32 scale per wire token."""
    scale = z.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return (z / scale).round().clamp(-127, 127) * scale


def payload_roundtrip(z: torch.Tensor, payload: str) -> torch.Tensor:
    """The wire as the receiver decodes it from a `payload` ('bf16' or 'int8') message."""
    return z.to(torch.bfloat16).to(z.dtype) if payload == "bf16" else int8_roundtrip(z)


def payload_controls(precision: str) -> tuple[str, ...]:
    """The payload round trips that change what the adapters compute: not the autocast dtype's own,
    which their first Linear applies to the wire anyway."""
    return tuple(p for p in PAYLOADS if p != precision)


def wire_controls(precision: str) -> tuple[str, ...]:
    return ("zeroed", "shuffled", *payload_controls(precision))


# --- one chunk of examples --------------------------------------------------------------------


def evaluate_chunk(
    model: WireEncoder,
    llms: dict,
    examples: list[dict],
    indices: range,
    partners: list[int],
    collate: Collator,
    settings: EvalSettings,
    device: torch.device,
) -> list[dict]:
    """Per-example records of one chunk: NLL sums and target counts, answers, EM and F1, keyed by
    `{input}_{llm}`."""
    dataset = PromptDataset(examples)
    batch = to_device(collate([dataset[i] for i in indices]), device)
    partner = to_device(collate([dataset[partners[i]] for i in indices]), device)
    targets = {name: answer_ids(batch["answers"][name]) for name in llms}
    golds = [examples[i]["answers"]["text"] for i in indices]
    records = [
        {"index": i, "nll_sum": {}, "tokens": {}, "first_token": {}, "em": {}, "f1": {}, "answer": {}} for i in indices
    ]

    z = model.wire(batch["bytes"], batch["byte_mask"])
    wires = {
        "wire": z,
        "zeroed": torch.zeros_like(z),
        "shuffled": model.wire(partner["bytes"], partner["byte_mask"]),
        **{p: payload_roundtrip(z, p) for p in payload_controls(settings.precision)},
    }
    for key, wire in wires.items():
        prompts = {
            name: wire_prompts(llm, model.adapters[name](wire), batch["answers"][name]["lead_ids"])
            for name, llm in llms.items()
        }
        add_nll(records, key, llms, prompts, targets)
        if key == "wire":
            add_answers(records, key, llms, prompts, golds, settings)

    if settings.text_baselines:
        chunk = [examples[i] for i in indices]
        for key, cut in (("text", None), ("text_cut", settings.num_latents)):
            prompts = {name: text_prompts(llm, chunk, cut) for name, llm in llms.items()}
            add_nll(records, key, llms, prompts, targets)
            add_answers(records, key, llms, prompts, golds, settings)
    return records


def add_nll(records: list[dict], key: str, llms: dict, prompts: dict, targets: dict) -> None:
    for name, llm in llms.items():
        sums, counts, first_hits = continuation_nll(llm, prompts[name], targets[name])
        for record, s, c, hit in zip(records, sums, counts, first_hits, strict=True):
            record["nll_sum"][f"{key}_{name}"], record["tokens"][f"{key}_{name}"] = s, c
            record["first_token"][f"{key}_{name}"] = float(hit)


def add_answers(
    records: list[dict], key: str, llms: dict, prompts: dict, golds: list[list[str]], settings: EvalSettings
) -> None:
    answers = {
        name: [
            decode_answer(llm.tokenizer, ids)
            for ids in greedy_generate(llm, prompts[name], settings.max_new_tokens, stop_together=settings.lockstep)
        ]
        for name, llm in llms.items()
    }
    answers["joint"] = joint_pick(llms, prompts, answers)
    for who, texts in answers.items():
        for record, text, gold in zip(records, texts, golds, strict=True):
            em, f1 = best_em_f1(text, gold)
            record["answer"][f"{key}_{who}"] = text
            record["em"][f"{key}_{who}"], record["f1"][f"{key}_{who}"] = em, f1


# --- all examples, sharded over ranks ---------------------------------------------------------


def rank_chunks(n: int, batch_size: int, rank: int, world: int) -> list[range]:
    """Chunks of consecutive examples dealt round-robin: a chunk's padding and batch mates are the
    same for any number of ranks, so each example's result is too."""
    return [range(s, min(s + batch_size, n)) for s in range(0, n, batch_size)][rank::world]


def gather_records(local: list[dict], world: int) -> list[dict]:
    """Every rank's records on every rank, in example order (`world` ranks share the examples)."""
    if world == 1:
        return local
    return sorted((r for part in gather_objects(local) for r in part), key=lambda r: r["index"])


def evaluate_examples(
    model: WireEncoder,
    llms: dict,
    examples: list[dict],
    settings: EvalSettings,
    device: torch.device,
    rank: int,
    world: int,
) -> list[dict] | None:
    """Per-example records of all `examples`, on every rank, or None when `settings.stop` stopped it. A
    collective when distributed."""
    collate = Collator.for_llms(
        llms,
        settings.max_prompt_bytes,
        settings.max_answer_tokens,
        settings.pad_multiple,
        word_patch=settings.word_patch,
    )
    partners = cyclic_derangement(len(examples), settings.seed)
    amp_dtype = AMP_DTYPES[settings.precision]
    was_training = model.training
    model.eval()  # no dropout: the wire is what the trained encoder writes, deterministically
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            chunks, local = rank_chunks(len(examples), settings.batch_size, rank, world), []
            most = rank_chunks(len(examples), settings.batch_size, 0, world)  # rank 0 is dealt the most
            for i in range(len(most)):
                if settings.stop and settings.stop():
                    return None
                if i >= len(chunks) and not settings.lockstep:
                    continue  # this rank's share is done; it still answers stop() with the others
                chunk = chunks[i] if i < len(chunks) else most[0]  # lockstep: a chunk run again, dropped
                records = evaluate_chunk(model, llms, examples, chunk, partners, collate, settings, device)
                local += records if i < len(chunks) else []
                if settings.progress:
                    settings.progress(len(local), sum(map(len, chunks)))
    finally:
        model.train(was_training)
    return gather_records(local, world)


def evaluate_wire(
    model: WireEncoder,
    llms: dict,
    examples: list[dict],
    settings: EvalSettings,
    device: torch.device,
    rank: int,
    world: int,
    groups: dict[str, range] | None = None,
) -> dict[str, float] | None:
    """The periodic evaluation of train.py: the wire's answers (EM/F1 per LLM and joint) and answer
    NLL, with the controls of `wire_controls`; flat `eval_*` scalars, equal on every rank, or None
    when `settings.stop` stopped it; of each of `groups` (the examples of each source of a mixture)
    on its own too, as `eval_LABEL/*`. A collective: every rank calls it. Pass the bare model, not
    its DDP wrapper."""
    records = evaluate_examples(model, llms, examples, settings, device, rank, world)
    if records is None:
        return None
    return {f"eval_{k}": v for k, v in summarize(records).items()} | {
        f"eval_{label}/{k}": v
        for label, span in (groups or {}).items()
        for k, v in summarize(records[span.start : span.stop]).items()
    }
