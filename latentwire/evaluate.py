"""What the wire carries: answers generated from it, SQuAD EM/F1, answer NLL, baselines, compression.

    python -m latentwire.evaluate --ckpt RUN/checkpoints/step_00000200 [--dataset squad] [--eval-examples 500]
    torchrun --nproc_per_node=2 -m latentwire.evaluate --ckpt RUN --eval-examples 500   # the same numbers

A run trained with --frozen-sharding fsdp is evaluated under torchrun with its LLMs sharded the same
way (in lockstep, see EvalSettings), so a 70B pair that fits no single GPU is evaluated where it trained.

For each LLM and each input, on the held-out split:
- `wire`: the M soft tokens of the trained wire, fed as in training: `[lead ; soft ; tail]` (the
  prompt contract of latentwire.prompting: BOS where the tokenizer has one, the anchor text), then
  greedy generation (KV cache, stop at EOS or a newline, at most max_new_tokens);
- `text`: the whole prompt as that LLM's tokens in the same contract, `lead + prompt + tail`;
- `text_cut`: the same with the prompt cut to its first M tokens (the wire's token budget);
- `joint`: of the two LLMs' answers, the one with the higher log-probability summed over both LLMs.
Each gets SQuAD exact match and F1 (in %, best over the gold answers) and the answer NLL per token:
the summed cross-entropy of the first gold answer's tokens plus EOS over their count, exactly the
training loss quantity, so the targets are the same for every input and the NLLs compare.
Controls for the wire (NLL only): `zeroed` (the wire is all zeros before the adapters),
`shuffled` (every example gets another example's wire), and the wire sent as `bf16` or `int8`
where that changes what the adapters read (under bf16 autocast they read the wire in bf16
anyway, so a bf16 payload is the wire itself and has no control of its own).

The cpu profile's tiny readers were pretrained to read (84% EM from the text), and
the report gives the wire's share of that text baseline (`report.share_of_text`).

This module is the command: checkpoint loading and the run. `latentwire.eval` holds the rest:
`evaluation.py` the wire and its controls, chunks and sharding; `generation.py` the prompts,
scoring and greedy decoding; `report.py` the summary, the margins and the JSON / Markdown report.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
from torch.distributed.device_mesh import init_device_mesh

from .dataset import DataSources, spans
from .eval.evaluation import evaluate_examples
from .eval.report import build_report, markdown, write_report
from .eval.settings import EvalSettings
from .fp8 import check_fp8
from .harness.checkpoint import load_weights
from .harness.config import Parser, check_can_create, positive
from .harness.distributed import process_group
from .harness.errors import UserError
from .harness.exits import main_guard
from .harness.resume import resolve_checkpoint
from .llm import held_per_rank
from .model import WireEncoder
from .parallelize import frozen_llms
from .settings import read_meta

# --- loading a checkpoint ---------------------------------------------------------------------


def load_wire_encoder(ckpt: Path, cfg, llms: dict, device: torch.device) -> WireEncoder:
    model = WireEncoder.for_llms(cfg.wire, llms)
    load_weights(ckpt, model, "the model of its meta.json")
    return model.to(device)


# --- the command line -------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="python -m latentwire.evaluate",
        description="EM/F1 and answer NLL from a LatentWire checkpoint's wire, with text baselines.",
    )
    p.add_argument("--ckpt", required=True, help="RUN/checkpoints/step_N, or RUN for its newest checkpoint")
    p.add_argument(
        "--dataset",
        help="held-out data: synthetic, squad, hotpot_qa or a local file, or several as NAME:WEIGHT,... "
        "(each reported on its own and together; default: the run's)",
    )
    # Not `--n`: torchrun's own parser reads it as an ambiguous abbreviation of its flags
    # (--nnodes, --nproc-per-node) before the module sees it. train.py's field has this name too.
    p.add_argument("--eval-examples", type=positive(int), default=500, help="number of held-out examples")
    p.add_argument("--batch-size", type=positive(int), help="examples per forward (default: the run's micro-batch)")
    p.add_argument("--max-new-tokens", type=positive(int), help="generation limit (default: the run's)")
    p.add_argument("--device", choices=("cpu", "cuda"), help="default: the run's")
    p.add_argument("--out-dir", help="where the .json and .md go (default: RUN/eval)")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    ckpt = resolve_checkpoint(Path(args.ckpt), "--ckpt")
    cfg, step = read_meta(ckpt)
    device_type = args.device or cfg.card.device
    if device_type == "cuda" and not torch.cuda.is_available():
        raise UserError("the run used CUDA and no GPU is visible; pass --device cpu")
    with process_group(device_type, cfg.training.dist_timeout_s) as di:
        run(args, ckpt, cfg, step, di)


def report_progress(world: int):
    """Generation takes minutes: a line per chunk of rank 0's share, on stderr (stdout is the report)."""
    share = " (rank 0's share)" if world > 1 else ""
    return lambda done, total: print(f"evaluated {done}/{total} examples{share}", file=sys.stderr, flush=True)


def run(args, ckpt: Path, cfg, step, di) -> None:
    sources = DataSources.of(cfg.data, cfg.training.seed)
    dataset = sources.held_out_source(args.dataset)  # --dataset, else the run's eval_dataset or its own split
    out_dir = Path(args.out_dir) if args.out_dir else ckpt.parent.parent / "eval"
    check_can_create(out_dir, "output directory")
    groups = sources.held_out_groups(args.eval_examples, dataset)  # a mixture: each source's share
    examples = [ex for group in groups.values() for ex in group]
    # Built, sharded and read as train.py does; no backward here, so no checkpointing, and eager.
    # A run that sharded its LLMs is evaluated sharded too, over however many ranks this is.
    if cfg.frozen.fp8 != "none":  # the readers the run trained with, which need FP8 tensor cores on a card
        check_fp8(di.device, cfg.numerics.precision, eager_backward=False)  # no backward here
    sharded = cfg.frozen.sharding == "fsdp" and di.is_distributed
    mesh = init_device_mesh(di.device.type, (di.world_size,)) if sharded else None
    llms = frozen_llms(cfg.frozen, cfg.prompt, cfg.numerics.precision, di.device, mesh=mesh)
    if sharded and di.is_main:
        print(
            f"LLMs sharded over {di.world_size} ranks as in training ({held_per_rank(llms)})",
            file=sys.stderr,
            flush=True,
        )
    model = load_wire_encoder(ckpt, cfg, llms, di.device)
    settings = EvalSettings.of(
        cfg,
        text_baselines=True,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        progress=report_progress(di.world_size) if di.is_main else None,
        lockstep=sharded,
    )
    records = evaluate_examples(model, llms, examples, settings, di.device, di.rank, di.world_size)
    if not di.is_main:
        return
    report = build_report(
        ckpt,
        step,
        cfg,
        dataset,
        sources.describe_held_out(dataset),
        examples,
        records,
        llms,
        settings,
        di.world_size,
        spans(groups) if len(groups) > 1 else {},
    )
    paths = write_report(report, out_dir, f"{ckpt.name}_{'_'.join(groups)}_n{len(examples)}")
    print(markdown(report), flush=True)
    print("wrote " + " and ".join(map(str, paths)), flush=True)


if __name__ == "__main__":
    main_guard(main)
