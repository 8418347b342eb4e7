"""The cpu profile's tiny readers: the tiny Llama and Qwen2, pretrained here as language models on
the synthetic reading-comprehension set written in the evaluation's text-prompt format, until they
answer held-out questions from the text. Random readers score ~0 EM on their own text, so the
wire's share of the text baseline (what LatentWire measures) cannot be asked of them.

    OMP_NUM_THREADS=1 python -m latentwire.readers [--out DIR] [--steps N] [--only llama|qwen]

builds them from scratch into latentwire/tiny_readers/ (or DIR) and prints each one's held-out
exact match, in about 25 minutes on one core (14 for the Llama, 11 for the Qwen). It is seeded: on
the same torch and thread count it gives the shipped weights bit for bit. Each reader is a model
directory (safetensors, config, tokenizer) that `--llama tiny` / `--qwen tiny` load, the tokenizer
as the plain BPE file it is (see llm.pretrained_config).
"""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from .dataset import IGNORE_INDEX, answer_text, answer_token_ids, load_examples, synthetic_examples
from .eval.generation import decode_answer, greedy_generate, text_prompt_ids, text_prompts
from .eval.squad_metrics import best_em_f1
from .harness.config import Parser, positive
from .harness.exits import main_guard
from .llm import LLM_NAMES, FrozenLLM
from .llm_sources import TINY_READERS, tiny_model, tiny_tokenizer
from .prompting import PromptContract

# Disjoint from the seeds the wire's runs draw their examples from (config seeds are small).
PRETRAIN_SEED = 7_000_001
HELD_OUT_EXAMPLES = 300
MAX_NEW_TOKENS = 8
# The prompt's tokens teach the readers the text; most of them are facts no model can predict. The
# answer's few tokens are what reading is for, so they weigh more: unweighted, the tiny Llama
# answered 77% of the held-out questions after 5000 steps; with its answers weighted 4x, 80% (of
# 100) by step 750.
ANSWER_WEIGHT = 8.0
# Steps that take each past 80% with a margin: the 2-layer Llama was at 81% after 3000 and 84% after
# 6000; the Qwen, narrower, stayed at 82-83% on two layers and got a third (84% after 4000).
STEPS = {"llama": 6000, "qwen": 4000}


def lm_batch(llm: FrozenLLM, examples: list[dict]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded rows, their next-token targets (IGNORE_INDEX on padding) and each target's
    weight: 1 on the prompt's tokens, ANSWER_WEIGHT on the answer's (as the wire's training targets
    them) and the EOS after it."""
    eos = llm.tokenizer.eos_token_id
    answers = answer_token_ids(llm.tokenizer, [answer_text(ex) for ex in examples])
    rows = [(text_prompt_ids(llm, ex, None), answer + [eos]) for ex, answer in zip(examples, answers, strict=True)]
    length = max(len(prompt) + len(answer) for prompt, answer in rows)
    ids = torch.full((len(rows), length), eos, dtype=torch.long)
    targets = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    weights = torch.zeros((len(rows), length))
    for r, (prompt, answer) in enumerate(rows):
        row = torch.tensor(prompt + answer)
        ids[r, : len(row)] = row
        targets[r, : len(row) - 1] = row[1:]
        weights[r, : len(prompt) - 1] = 1.0
        weights[r, len(prompt) - 1 : len(row) - 1] = ANSWER_WEIGHT
    return ids, targets, weights


def pretrain(llm: FrozenLLM, steps: int, batch_size: int, lr: float, seed: int, log) -> None:
    """AdamW with a linear warm-up and a cosine decay; the examples are drawn fresh for every batch."""
    model = llm.model.train().requires_grad_(True)
    examples = synthetic_examples(steps * batch_size, seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min((s + 1) / warmup, 0.5 * (1 + math.cos(math.pi * s / steps)))
    )
    for step in range(steps):
        ids, targets, weights = lm_batch(llm, examples[step * batch_size : (step + 1) * batch_size])
        logits = model(input_ids=ids, use_cache=False).logits
        ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
        loss = (ce * weights.flatten()).sum() / weights.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if (step + 1) % 100 == 0 or step + 1 == steps:
            log(f"{llm.name} step {step + 1}/{steps} weighted loss {loss.item():.3f}")
    model.eval().requires_grad_(False)


@torch.no_grad()
def held_out_em(llm: FrozenLLM, n: int = HELD_OUT_EXAMPLES, seed: int = 0, batch_size: int = 50) -> float:
    """Exact match (%) of greedy answers to the evaluation's own held-out synthetic questions,
    read from the text prompt the evaluation's `text` baseline feeds."""
    examples = load_examples("synthetic", "validation", n, seed)
    total = 0.0
    for start in range(0, n, batch_size):
        chunk = examples[start : start + batch_size]
        generated = greedy_generate(llm, text_prompts(llm, chunk, None), MAX_NEW_TOKENS)
        total += sum(
            best_em_f1(decode_answer(llm.tokenizer, ids), ex["answers"]["text"])[0]
            for ids, ex in zip(generated, chunk, strict=True)
        )
    return 100 * total / n


def build_reader(name: str, steps: int, batch_size: int, lr: float, seed: int, log) -> FrozenLLM:
    """The `tiny-random` model of the `name` slot (its seeded initialisation), pretrained."""
    tokenizer = tiny_tokenizer(name)
    llm = FrozenLLM(name, tiny_model(name, tokenizer), tokenizer, PromptContract.of(tokenizer))
    pretrain(llm, steps, batch_size, lr, seed + LLM_NAMES.index(name), log)
    return llm


def main(argv: list[str] | None = None) -> None:
    p = Parser(prog="python -m latentwire.readers", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--out", default=str(TINY_READERS), help="directory that gets llama/ and qwen/ (default: the shipped ones)"
    )
    p.add_argument("--steps", type=positive(int), help="optimizer steps (default: STEPS, per reader)")
    p.add_argument("--batch-size", type=positive(int), default=32)
    p.add_argument("--lr", type=positive(float), default=3e-3)
    p.add_argument("--seed", type=int, default=PRETRAIN_SEED)
    p.add_argument("--only", choices=LLM_NAMES)
    args = p.parse_args(argv)

    def log(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    for name in [args.only] if args.only else LLM_NAMES:
        start = time.perf_counter()
        llm = build_reader(name, args.steps or STEPS[name], args.batch_size, args.lr, args.seed, log)
        out = Path(args.out) / name
        llm.model.save_pretrained(out)
        llm.tokenizer.save_pretrained(out)
        print(
            f"{name}: held-out EM {held_out_em(llm):.1f}% on {HELD_OUT_EXAMPLES} examples, "
            f"{time.perf_counter() - start:.0f} s; saved {out}",
            flush=True,
        )


if __name__ == "__main__":
    main_guard(main)
