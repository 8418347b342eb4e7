"""What the wire carries: answers generated from it, SQuAD EM/F1, answer NLL, baselines, compression.

    python -m latentwire.evaluate --ckpt RUN/checkpoints/step_00000200 [--dataset squad] [--n 500]
    torchrun --nproc_per_node=2 -m latentwire.evaluate --ckpt RUN --eval-examples 500   # the same numbers

For each LLM and each input, on the held-out split:
- `wire`: the M soft tokens of the trained wire, fed as in training: `[soft ; embed(prefix_ids)]`,
  then greedy generation (KV cache, stop at EOS or a newline, at most max_new_tokens);
- `text`: the whole prompt as that LLM's tokens, `prefix_ids + prompt + SEPARATOR`;
- `text_cut`: the same with the prompt cut to its first M tokens (the wire's token budget);
- `joint`: of the two LLMs' answers, the one with the higher log-probability summed over both LLMs.
Each gets SQuAD exact match and F1 (in %, best over the gold answers) and the answer NLL per token:
the summed cross-entropy of the first gold answer's tokens plus EOS over their count, exactly the
training loss quantity, so the targets are the same for every input and the NLLs compare.
Controls for the wire (NLL only): `zeroed` (the wire is all zeros before the adapters),
`shuffled` (every example gets another example's wire), and the wire sent as `bf16` or `int8`
where that changes what the adapters read (under bf16 autocast they read the wire in bf16
anyway, so a bf16 payload is the wire itself and has no control of its own).

The tiny LLMs of the cpu profile are random networks that never saw text, so on that profile the
text baselines score about nothing: only the wire, trained through them, can.

Examples are cut into chunks of `batch_size` consecutive examples and the chunks are dealt to the
ranks round-robin. A chunk is padded and computed the same way whatever the number of ranks, and
per-example results are gathered and reduced in example order, so N processes give exactly the
numbers of one.
"""
from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import sys
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn.functional as F

from .checkpoint import META, WEIGHTS, check_weights, list_checkpoints
from .config import FIELDS, Config, Parser, RunFlags, check_can_create, check_value, positive
from .data import IGNORE_INDEX, Collator, PromptDataset, load_examples, prompt_text, to_device
from .errors import UserError, main_guard
from .distributed import process_group
from .llm import FrozenLLM, load_frozen_llms, padded_attention
from .model import WireConfig, WireEncoder
from .precision import autocast_for, frozen_weight_dtype
from .squad_metrics import best_em_f1

# Between the prompt and the answer in both text baselines. The answer's own tokens (the same
# targets as the wire's) start with the space that makes it a new word, so none is added here.
SEPARATOR = "\nanswer:"
PAYLOADS = ("bf16", "int8")
EXAMPLES_IN_MARKDOWN = 5
# The wire "carries information" when its answer NLL is below each control's by more than this
# many standard errors of the paired difference: a bare "lower" can be noise.
SIGNIFICANT_SE = 3
# The fields of a checkpoint's meta.json this module reads. Only these are required, so a
# checkpoint written before a field was added to config.FIELDS still evaluates.
READ_FIELDS = ("device", "precision", "dist_timeout_s", "llama", "qwen", "num_latents", "d_z", "encoder_dim",
               "encoder_layers", "encoder_heads", "dropout", "dataset", "seed", "max_prompt_bytes",
               "max_answer_tokens", "pad_multiple", "micro_batch_size", "max_new_tokens")


# --- prompts as input embeddings --------------------------------------------------------------

@dataclass(frozen=True)
class Prompts:
    """A batch of prompts as input embeddings, left-padded so every prompt ends at the last column
    and generated tokens append on the right. `mask` is 1 on real positions."""
    embeds: torch.Tensor  # [B, P, hidden]
    mask: torch.Tensor  # [B, P], long


def positions(mask: torch.Tensor) -> torch.Tensor:
    """Position ids counting real tokens only, so left padding does not shift the rotary positions."""
    return (mask.cumsum(-1) - 1).clamp(min=0)


def wire_prompts(llm: FrozenLLM, soft: torch.Tensor) -> Prompts:
    """`[soft ; embed(prefix_ids)]`: what training puts before the answer (see data.Collator)."""
    table = llm.model.get_input_embeddings()
    prefix = table(torch.tensor(llm.prefix_ids, dtype=torch.long, device=soft.device))
    prefix = prefix[None].expand(soft.shape[0], -1, -1)
    embeds = torch.cat([soft.to(prefix.dtype), prefix], dim=1)
    return Prompts(embeds, torch.ones(embeds.shape[:2], dtype=torch.long, device=soft.device))


def text_prompt_ids(llm: FrozenLLM, example: dict, max_prompt_tokens: int | None) -> list[int]:
    tok = llm.tokenizer
    ids = tok(prompt_text(example), add_special_tokens=False)["input_ids"][:max_prompt_tokens]
    return llm.prefix_ids + ids + tok(SEPARATOR, add_special_tokens=False)["input_ids"]


def text_prompts(llm: FrozenLLM, examples: list[dict], max_prompt_tokens: int | None) -> Prompts:
    rows = [text_prompt_ids(llm, ex, max_prompt_tokens) for ex in examples]
    table = llm.model.get_input_embeddings()
    length = max(map(len, rows))
    ids = torch.full((len(rows), length), llm.tokenizer.eos_token_id, dtype=torch.long)
    mask = torch.zeros((len(rows), length), dtype=torch.long)
    for row, row_ids in enumerate(rows):
        ids[row, length - len(row_ids):] = torch.tensor(row_ids, dtype=torch.long)
        mask[row, length - len(row_ids):] = 1
    device = table.weight.device
    return Prompts(table(ids.to(device)), mask.to(device))


# --- teacher-forced scoring -------------------------------------------------------------------

def continuation_nll(llm: FrozenLLM, prompts: Prompts, continuations: list[list[int]]) -> tuple[list[float], list[int]]:
    """Per example: the summed NLL of its continuation's tokens and then EOS after its prompt, and
    that target count. With a wire prompt and the answer tokens, this is training's loss quantity."""
    device = prompts.embeds.device
    eos = llm.tokenizer.eos_token_id
    length = max(map(len, continuations))
    ids = torch.full((len(continuations), length), eos, dtype=torch.long, device=device)
    labels = torch.full((len(continuations), length + 1), IGNORE_INDEX, dtype=torch.long, device=device)
    for row, cont in enumerate(continuations):
        ids[row, :len(cont)] = torch.tensor(cont, dtype=torch.long)
        labels[row, :len(cont) + 1] = torch.tensor(cont + [eos], dtype=torch.long)
    lengths = torch.tensor([len(c) for c in continuations], device=device)
    cont_mask = (torch.arange(length, device=device) < lengths[:, None]).long()
    embeds = torch.cat([prompts.embeds, llm.model.get_input_embeddings()(ids).to(prompts.embeds.dtype)], dim=1)
    mask = torch.cat([prompts.mask, cont_mask], dim=1)
    # The last prompt position predicts the first continuation token: keep the last length+1 logits.
    with padded_attention([llm.model]):
        logits = llm.model(inputs_embeds=embeds, attention_mask=mask, position_ids=positions(mask),
                           use_cache=False, logits_to_keep=length + 1).logits
    ce = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=IGNORE_INDEX, reduction="none")
    return ce.sum(1).tolist(), [len(c) + 1 for c in continuations]


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


def greedy_generate(llm: FrozenLLM, prompts: Prompts, max_new_tokens: int, use_cache: bool = True) -> list[list[int]]:
    """Greedy tokens after each prompt, each row ending at its first stop token (kept) or after
    max_new_tokens. `use_cache=False` recomputes the whole sequence at every step: the reference
    that the KV-cache path must reproduce token for token."""
    model, table = llm.model, llm.model.get_input_embeddings()
    stops = stop_token_ids(llm)
    stop_ids = torch.tensor(sorted(stops), device=prompts.embeds.device)
    embeds, mask, cache = prompts.embeds, prompts.mask, None
    generated, done = [], torch.zeros(embeds.shape[0], dtype=torch.bool, device=embeds.device)
    with padded_attention([model]):
        for _ in range(max_new_tokens):
            pos = positions(mask)
            if cache is None:
                out = model(inputs_embeds=embeds, attention_mask=mask, position_ids=pos, use_cache=use_cache,
                            logits_to_keep=1)
            else:  # only the newest token; the cache holds the keys and values of all earlier ones
                out = model(inputs_embeds=embeds[:, -1:], attention_mask=mask, position_ids=pos[:, -1:],
                            past_key_values=cache, use_cache=True, logits_to_keep=1)
            cache = out.past_key_values if use_cache else None
            next_ids = out.logits[:, -1].argmax(-1)
            generated.append(next_ids)
            done |= torch.isin(next_ids, stop_ids)
            if done.all():
                break
            # Finished rows keep generating (their tokens are cut below): a batch advances together.
            embeds = torch.cat([embeds, table(next_ids)[:, None].to(embeds.dtype)], dim=1)
            mask = torch.cat([mask, mask.new_ones(mask.shape[0], 1)], dim=1)
    return [cut_after_stop(row, stops) for row in torch.stack(generated, 1).tolist()]


def cut_after_stop(ids: list[int], stops: frozenset[int]) -> list[int]:
    for k, token in enumerate(ids):
        if token in stops:
            return ids[:k + 1]
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


def payload_bytes(num_latents: int, d_z: int) -> dict[str, int]:
    """Bytes on the wire per example (the wire is shared by all LLMs; adapters run at the receiver)."""
    values = num_latents * d_z
    return {"fp32": 4 * values, "bf16": 2 * values, "int8": values + 4 * num_latents}


# --- one chunk of examples --------------------------------------------------------------------

@dataclass(frozen=True)
class Plan:
    batch_size: int
    max_new_tokens: int
    text_baselines: bool
    progress: Callable[[int, int], object] | None = None  # (examples done, of) on this rank, after each chunk


def evaluate_chunk(model: WireEncoder, llms: dict, examples: list[dict], indices: range, partners: list[int],
                   collate: Collator, cfg, plan: Plan, device: torch.device) -> list[dict]:
    """Per-example records of one chunk: NLL sums and target counts, answers, EM and F1, keyed by
    `{input}_{llm}`."""
    dataset = PromptDataset(examples)
    batch = to_device(collate([dataset[i] for i in indices]), device)
    partner = to_device(collate([dataset[partners[i]] for i in indices]), device)
    targets = {name: answer_ids(batch["answers"][name]) for name in llms}
    golds = [examples[i]["answers"]["text"] for i in indices]
    records = [{"index": i, "nll_sum": {}, "tokens": {}, "em": {}, "f1": {}, "answer": {}} for i in indices]

    z = model.wire(batch["bytes"], batch["byte_mask"])
    wires = {"wire": z, "zeroed": torch.zeros_like(z), "shuffled": model.wire(partner["bytes"], partner["byte_mask"]),
             **{p: payload_roundtrip(z, p) for p in payload_controls(cfg.precision)}}
    for key, wire in wires.items():
        prompts = {name: wire_prompts(llm, model.adapters[name](wire)) for name, llm in llms.items()}
        add_nll(records, key, llms, prompts, targets)
        if key == "wire":
            add_answers(records, key, llms, prompts, golds, plan.max_new_tokens)

    if plan.text_baselines:
        chunk = [examples[i] for i in indices]
        for key, cut in (("text", None), ("text_cut", cfg.num_latents)):
            prompts = {name: text_prompts(llm, chunk, cut) for name, llm in llms.items()}
            add_nll(records, key, llms, prompts, targets)
            add_answers(records, key, llms, prompts, golds, plan.max_new_tokens)
    return records


def add_nll(records: list[dict], key: str, llms: dict, prompts: dict, targets: dict) -> None:
    for name, llm in llms.items():
        sums, counts = continuation_nll(llm, prompts[name], targets[name])
        for record, s, c in zip(records, sums, counts, strict=True):
            record["nll_sum"][f"{key}_{name}"], record["tokens"][f"{key}_{name}"] = s, c


def add_answers(records: list[dict], key: str, llms: dict, prompts: dict, golds: list[list[str]],
                max_new_tokens: int) -> None:
    answers = {name: [decode_answer(llm.tokenizer, ids) for ids in greedy_generate(llm, prompts[name], max_new_tokens)]
               for name, llm in llms.items()}
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


def gather_records(local: list[dict]) -> list[dict]:
    """Every rank's records on every rank, in example order."""
    if not dist.is_initialized():
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return sorted((r for part in parts for r in part), key=lambda r: r["index"])


def evaluate_examples(model: WireEncoder, llms: dict, examples: list[dict], cfg, device: torch.device,
                      rank: int, world: int, plan: Plan) -> list[dict]:
    """Per-example records of all `examples`, on every rank. A collective when distributed."""
    collate = Collator.for_llms(llms, cfg.max_prompt_bytes, cfg.max_answer_tokens, cfg.pad_multiple)
    partners = cyclic_derangement(len(examples), cfg.seed)
    was_training = model.training
    model.eval()  # no dropout: the wire is what the trained encoder writes, deterministically
    try:
        with torch.no_grad(), autocast_for(cfg.precision, device)():
            chunks, local = rank_chunks(len(examples), plan.batch_size, rank, world), []
            for chunk in chunks:
                local += evaluate_chunk(model, llms, examples, chunk, partners, collate, cfg, plan, device)
                if plan.progress:
                    plan.progress(len(local), sum(map(len, chunks)))
    finally:
        model.train(was_training)
    return gather_records(local)


def summarize(records: list[dict]) -> dict[str, float]:
    """`nll_*`: summed NLL over summed targets (training's token-weighted loss); `em_*`, `f1_*`:
    the mean over examples, in %."""
    out = {}
    for key in records[0]["tokens"]:
        out[f"nll_{key}"] = sum(r["nll_sum"][key] for r in records) / sum(r["tokens"][key] for r in records)
    for metric in ("em", "f1"):
        for key in records[0][metric]:
            out[f"{metric}_{key}"] = 100 * sum(r[metric][key] for r in records) / len(records)
    return out


def evaluate_wire(model: WireEncoder, llms: dict, examples: list[dict], cfg, device: torch.device,
                  rank: int, world: int) -> dict[str, float]:
    """The periodic evaluation of train.py: the wire's answers (EM/F1 per LLM and joint) and answer
    NLL, with the controls of `wire_controls`; flat `eval_*` scalars, equal on every
    rank. A collective: every rank calls it. Pass the bare model, not its DDP wrapper."""
    plan = Plan(batch_size=cfg.micro_batch_size, max_new_tokens=cfg.max_new_tokens, text_baselines=False)
    records = evaluate_examples(model, llms, examples, cfg, device, rank, world, plan)
    return {f"eval_{k}": v for k, v in summarize(records).items()}


# --- loading a checkpoint ---------------------------------------------------------------------

def resolve_checkpoint(path: Path) -> Path:
    """A checkpoint directory, or a run directory standing for its newest complete checkpoint."""
    try:
        if not path.is_dir():
            raise UserError(f"--ckpt {path} is not a directory")
        if (path / "checkpoints").is_dir():
            complete = list_checkpoints(path)
            if not complete:
                raise UserError(f"run {path} has no complete checkpoint")
            path = complete[-1]
        for name in (WEIGHTS, META):
            if not (path / name).is_file():
                raise UserError(f"--ckpt {path} is not a complete checkpoint: it has no {name}")
    except OSError as e:  # a directory this user may not look into
        raise UserError(f"--ckpt {path} cannot be read: {e.strerror}") from None
    return path


def read_meta(ckpt: Path) -> tuple[Config, int | None]:
    """The run's configuration from meta.json, every field checked as when it was trained."""
    where = ckpt / META
    try:
        meta = json.loads(where.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise UserError(f"{where} is not valid JSON: {e}") from None
    except OSError as e:
        raise UserError(f"cannot read {where}: {e.strerror}") from None
    config = meta.get("config") if isinstance(meta, dict) else None
    if not isinstance(config, dict):
        raise UserError(f"{where} has no 'config' object")
    missing = [name for name in READ_FIELDS if name not in config]
    if missing:
        raise UserError(f"{where}: config has no field {missing[0]!r}")
    values = {name: check_value(name, value, where=str(where)) for name, value in config.items() if name in FIELDS}
    return Config(values, RunFlags(profile=str(meta.get("profile")))), meta.get("step")


def load_wire_encoder(ckpt: Path, cfg, llms: dict, device: torch.device) -> WireEncoder:
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    path = ckpt / WEIGHTS
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError) as e:
        raise UserError(f"cannot read {path}: {e}") from None
    model = WireEncoder.for_llms(WireConfig.of(cfg), llms)
    check_weights(state, model.state_dict(), path, "the model of its meta.json")
    model.load_state_dict(state)
    return model.to(device)


# --- the report -------------------------------------------------------------------------------

def control_margin(records: list[dict], control: str, name: str) -> dict[str, float]:
    """How much higher the answer NLL per token is with `control` than with the trained wire, and
    the standard error of that paired difference: both read the same targets of the same examples,
    so the per-example differences are what varies."""
    diffs = [r["nll_sum"][f"{control}_{name}"] - r["nll_sum"][f"wire_{name}"] for r in records]
    tokens = sum(r["tokens"][f"wire_{name}"] for r in records)
    se = statistics.stdev(diffs) * math.sqrt(len(diffs)) / tokens if len(diffs) > 1 else math.inf
    return {"margin": sum(diffs) / tokens, "se": se}


def compression(llms: dict, examples: list[dict], num_latents: int) -> dict:
    """Mean prompt length in UTF-8 bytes and in each LLM's tokens, and tokens per wire token."""
    texts = [prompt_text(ex) for ex in examples]
    out = {"prompt_bytes": sum(len(t.encode("utf-8")) for t in texts) / len(texts)}
    for name, llm in llms.items():
        tokens = sum(map(len, llm.tokenizer(texts, add_special_tokens=False)["input_ids"])) / len(texts)
        out[f"prompt_tokens_{name}"] = tokens
        out[f"compression_{name}"] = tokens / num_latents
    return out


def build_report(ckpt: Path, step, cfg, dataset: str, examples: list[dict], records: list[dict], llms: dict,
                 plan: Plan, world: int) -> dict:
    metrics = summarize(records)
    margins = {name: {control: control_margin(records, control, name) for control in ("zeroed", "shuffled")}
               for name in llms}
    return {
        "checkpoint": str(ckpt), "step": step, "profile": cfg.run.profile,
        "dataset": dataset, "split": "validation", "examples": len(examples), "world_size": world,
        "settings": {"num_latents": cfg.num_latents, "d_z": cfg.d_z, "batch_size": plan.batch_size,
                     "max_new_tokens": plan.max_new_tokens, "text_separator": SEPARATOR},
        "metrics": metrics,
        "wire_vs_controls": margins,
        "wire_carries_information": {name: all(m["margin"] > SIGNIFICANT_SE * m["se"] for m in by_control.values())
                                     for name, by_control in margins.items()},
        "compression": compression(llms, examples, cfg.num_latents),
        "payload_bytes": payload_bytes(cfg.num_latents, cfg.d_z),
        "answers": [{"index": r["index"], "question": examples[r["index"]]["question"],
                     "gold": examples[r["index"]]["answers"]["text"], **r["answer"]} for r in records],
    }


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ") or "(empty)"


def markdown(report: dict) -> str:
    m, c, names = report["metrics"], report["compression"], list(report["wire_carries_information"])
    M = report["settings"]["num_latents"]
    tokens = " / ".join(f"{c[f'prompt_tokens_{n}']:.0f} {n}" for n in names)
    lines = [
        f"# LatentWire evaluation: step {report['step']} ({report['profile']} profile)",
        "",
        f"Checkpoint `{report['checkpoint']}`, {report['examples']} examples of {report['dataset']} "
        f"({report['split']}), M = {M} wire tokens.",
        "",
        "## Answers",
        "",
        "EM and F1 in % (SQuAD-normalised, best over the gold answers); answer NLL in nats per target "
        "token (the first gold answer + EOS, as in training). Joint: of the LLMs' answers, the one with "
        "the higher log-probability summed over both LLMs.",
        "",
        "| input | LLM | EM | F1 | answer NLL |",
        "|---|---|---:|---:|---:|",
    ]
    inputs = (("wire", f"wire, {M} soft tokens"), ("text", f"text, full prompt ({tokens} tokens)"),
              ("text_cut", f"text, prompt cut to {M} tokens"))
    for key, label in inputs:
        for who in (*names, "joint"):
            nll = f"{m[f'nll_{key}_{who}']:.3f}" if who != "joint" else ""
            lines.append(f"| {label} | {who} | {m[f'em_{key}_{who}']:.1f} | {m[f'f1_{key}_{who}']:.1f} | {nll} |")
    lines += [
        "",
        "## Does the wire carry information?",
        "",
        "Answer NLL per token with the trained wire, with the wire zeroed before the adapters, and with "
        "every example given another example's wire; each margin is the control's NLL minus the trained "
        f"wire's, ± the standard error of that paired difference. Yes: both margins exceed {SIGNIFICANT_SE} "
        "standard errors.",
        "",
        "| LLM | trained wire | zeroed wire | shuffled wires | margin zeroed | margin shuffled | carries information |",
        "|---|---:|---:|---:|---:|---:|---|",
        *(control_row(report, n) for n in names),
        "",
        "## Compression and payload",
        "",
        "| | " + " | ".join(names) + " |",
        "|---|" + "---:|" * len(names),
        "| prompt tokens (mean) | " + " | ".join(f"{c[f'prompt_tokens_{n}']:.1f}" for n in names) + " |",
        "| compression (prompt tokens / M) | " + " | ".join(f"{c[f'compression_{n}']:.1f}x" for n in names) + " |",
        "",
        "| per example | bytes | " + " | ".join(f"answer NLL {n}" for n in names) + " |",
        "|---|---:|" + "---:|" * len(names),
        *(payload_row(report, precision, names) for precision in report["payload_bytes"]),
        f"| prompt as UTF-8 text (mean) | {c['prompt_bytes']:.0f} | " + " | ".join("" for _ in names) + " |",
        "",
        "## Examples",
        "",
        "| question | gold | " + " | ".join(f"wire {w}" for w in (*names, "joint")) + " |",
        "|---|---|" + "---|" * (len(names) + 1),
        *(f"| {_cell(a['question'])} | {_cell(' / '.join(a['gold']))} | "
          + " | ".join(_cell(a[f'wire_{w}']) for w in (*names, "joint")) + " |"
          for a in report["answers"][:EXAMPLES_IN_MARKDOWN]),
    ]
    return "\n".join(lines) + "\n"


def control_row(report: dict, name: str) -> str:
    m, margins = report["metrics"], report["wire_vs_controls"][name]
    nlls = " | ".join(f"{m[f'nll_{key}_{name}']:.3f}" for key in ("wire", "zeroed", "shuffled"))
    diffs = " | ".join(f"{margins[c]['margin']:.4f} ± {margins[c]['se']:.4f}" for c in ("zeroed", "shuffled"))
    return f"| {name} | {nlls} | {diffs} | {'yes' if report['wire_carries_information'][name] else 'no'} |"


def payload_row(report: dict, precision: str, names: list[str]) -> str:
    # The fp32 payload is the wire itself; so is the payload in the autocast dtype, which the
    # adapters read the wire in anyway; the others are round trips with controls of their own.
    lossless = f"nll_{precision}_{names[0]}" not in report["metrics"]
    key = "wire" if lossless else precision
    label = f"wire in {precision}" + (" (+ one fp32 scale per token)" if precision == "int8" else "")
    if lossless and precision != "fp32":
        label += " (what the adapters read under its autocast: the wire itself)"
    nlls = " | ".join(f"{report['metrics'][f'nll_{key}_{n}']:.3f}" for n in names)
    return f"| {label} | {report['payload_bytes'][precision]} | {nlls} |"


def write_report(report: dict, out_dir: Path, stem: str) -> tuple[Path, Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out_dir / f"{stem}.json", out_dir / f"{stem}.md"
    json_path.write_text(json.dumps(report, indent=2) + "\n")
    md_path.write_text(markdown(report))
    return json_path, md_path


# --- the command line -------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m latentwire.evaluate",
                description="EM/F1 and answer NLL from a LatentWire checkpoint's wire, with text baselines.")
    p.add_argument("--ckpt", required=True, help="RUN/checkpoints/step_N, or RUN for its newest checkpoint")
    p.add_argument("--dataset", help="held-out data: synthetic, squad, hotpot_qa or a local file (default: the run's)")
    # torchrun's own parser reads `--n` as an ambiguous abbreviation of its flags (--nnodes, ...)
    # before the module sees it, so under torchrun the long name is needed.
    p.add_argument("--n", "--eval-examples", dest="n", type=positive(int), default=500,
                   help="number of held-out examples (under torchrun: --eval-examples)")
    p.add_argument("--batch-size", type=positive(int), help="examples per forward (default: the run's micro-batch)")
    p.add_argument("--max-new-tokens", type=positive(int), help="generation limit (default: the run's)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: the run's")
    p.add_argument("--out-dir", help="where the .json and .md go (default: RUN/eval)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ckpt = resolve_checkpoint(Path(args.ckpt))
    cfg, step = read_meta(ckpt)
    device_type = args.device or cfg.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("the run used CUDA and no GPU is visible; pass --device cpu")
    with process_group(device_type, cfg.dist_timeout_s) as di:
        run(args, ckpt, cfg, step, di)


def report_progress(world: int):
    """Generation takes minutes: a line per chunk of rank 0's share, on stderr (stdout is the report)."""
    share = " (rank 0's share)" if world > 1 else ""
    return lambda done, total: print(f"evaluated {done}/{total} examples{share}", file=sys.stderr, flush=True)


def run(args, ckpt: Path, cfg, step, di) -> None:
    dataset = args.dataset or cfg.dataset
    out_dir = Path(args.out_dir) if args.out_dir else ckpt.parent.parent / "eval"
    check_can_create(out_dir, "output directory")
    examples = load_examples(dataset, "validation", args.n, cfg.seed)
    llms = load_frozen_llms(cfg, frozen_weight_dtype(cfg.precision), di.device)
    model = load_wire_encoder(ckpt, cfg, llms, di.device)
    plan = Plan(batch_size=args.batch_size or cfg.micro_batch_size,
                max_new_tokens=args.max_new_tokens or cfg.max_new_tokens, text_baselines=True,
                progress=report_progress(di.world_size) if di.is_main else None)
    records = evaluate_examples(model, llms, examples, cfg, di.device, di.rank, di.world_size, plan)
    if not di.is_main:
        return
    report = build_report(ckpt, step, cfg, dataset, examples, records, llms, plan, di.world_size)
    paths = write_report(report, out_dir, f"{ckpt.name}_{Path(dataset).stem}_n{len(examples)}")
    print(markdown(report), flush=True)
    print("wrote " + " and ".join(map(str, paths)), flush=True)


if __name__ == "__main__":
    main_guard(main)
