"""What the wire carries: answers generated from it, SQuAD EM/F1, answer NLL, baselines, compression.

    python -m latentwire.evaluate --ckpt RUN/checkpoints/step_00000200 [--dataset squad] [--eval-examples 500]
    torchrun --nproc_per_node=2 -m latentwire.evaluate --ckpt RUN --eval-examples 500   # the same numbers

A run trained with --frozen-sharding fsdp is evaluated under torchrun with its LLMs sharded the same
way (in lockstep, see Plan), so a 70B pair that fits no single GPU is evaluated where it trained.

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

Examples are cut into chunks of `batch_size` consecutive examples and the chunks are dealt to the
ranks round-robin. A chunk is padded and computed the same way whatever the number of ranks, and
per-example results are gathered and reduced in example order, so N processes give exactly the
numbers of one.

This module holds the evaluation (the wire and its controls, chunks, sharding), checkpoint loading
and the command; `generation.py` the prompts, scoring and greedy decoding; `report.py` the
summary, the margins and the JSON / Markdown report.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from .checkpoint import META, WEIGHTS, check_weights, list_checkpoints
from .config import FIELDS, Config, Parser, RunFlags, check_can_create, check_value, field_defaults, positive
from .data import Collator, DataSources, PromptDataset, to_device
from .distributed import process_group
from .errors import UserError, main_guard
from .generation import (answer_ids, continuation_nll, decode_answer, greedy_generate, joint_pick, text_prompts,
                         wire_prompts)
from .llm import build_frozen_llms, held_per_rank, load_weights, shard_frozen_llm
from .model import WireConfig, WireEncoder
from .precision import AMP_DTYPES, frozen_weight_dtype
from .report import build_report, markdown, summarize, write_report
from .squad_metrics import best_em_f1

PAYLOADS = ("bf16", "int8")
# The fields of a checkpoint's meta.json this module reads. Only these are required, so a
# checkpoint written before a field was added to config.FIELDS still evaluates.
READ_FIELDS = ("device", "precision", "dist_timeout_s", "llama", "qwen", "num_latents", "d_z", "encoder_dim",
               "encoder_layers", "encoder_heads", "dropout", "dataset", "seed", "max_prompt_bytes",
               "max_answer_tokens", "pad_multiple", "micro_batch_size", "max_new_tokens")


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

@dataclass(frozen=True)
class Plan:
    """What an evaluation reads of a run's configuration, and how this one runs."""
    batch_size: int
    max_new_tokens: int
    text_baselines: bool
    precision: str  # the autocast dtype, and which payload controls differ under it
    seed: int  # the shuffled control's pairing
    num_latents: int  # the text_cut baseline's token budget
    max_prompt_bytes: int  # the collator's cuts and padding, as in training
    max_answer_tokens: int
    pad_multiple: int
    progress: Callable[[int, int], object] | None = None  # (examples done, of) on this rank, after each chunk
    # Asked before each chunk, on every rank at every chunk position (a collective when distributed):
    # True drops the unfinished evaluation (a preemption signal, heard within one chunk).
    stop: Callable[[], bool] | None = None
    # The LLMs are sharded over the ranks (FSDP): each of their forwards needs every rank, so every
    # rank runs as many chunks (the short ones repeat one, its records dropped) and decodes until
    # all are done.
    lockstep: bool = False

    @classmethod
    def of(cls, config, *, text_baselines: bool, batch_size: int | None = None, max_new_tokens: int | None = None,
           progress=None, lockstep: bool = False, stop=None) -> Plan:
        """From a run's configuration; batch size and generation limit default to the run's."""
        return cls(batch_size=batch_size or config.micro_batch_size,
                   max_new_tokens=max_new_tokens or config.max_new_tokens, text_baselines=text_baselines,
                   precision=config.precision, seed=config.seed, num_latents=config.num_latents,
                   max_prompt_bytes=config.max_prompt_bytes, max_answer_tokens=config.max_answer_tokens,
                   pad_multiple=config.pad_multiple, progress=progress, lockstep=lockstep, stop=stop)


def evaluate_chunk(model: WireEncoder, llms: dict, examples: list[dict], indices: range, partners: list[int],
                   collate: Collator, plan: Plan, device: torch.device) -> list[dict]:
    """Per-example records of one chunk: NLL sums and target counts, answers, EM and F1, keyed by
    `{input}_{llm}`."""
    dataset = PromptDataset(examples)
    batch = to_device(collate([dataset[i] for i in indices]), device)
    partner = to_device(collate([dataset[partners[i]] for i in indices]), device)
    targets = {name: answer_ids(batch["answers"][name]) for name in llms}
    golds = [examples[i]["answers"]["text"] for i in indices]
    records = [{"index": i, "nll_sum": {}, "tokens": {}, "first_token": {}, "em": {}, "f1": {}, "answer": {}}
               for i in indices]

    z = model.wire(batch["bytes"], batch["byte_mask"])
    wires = {"wire": z, "zeroed": torch.zeros_like(z), "shuffled": model.wire(partner["bytes"], partner["byte_mask"]),
             **{p: payload_roundtrip(z, p) for p in payload_controls(plan.precision)}}
    for key, wire in wires.items():
        prompts = {name: wire_prompts(llm, model.adapters[name](wire), batch["answers"][name]["lead_ids"])
                   for name, llm in llms.items()}
        add_nll(records, key, llms, prompts, targets)
        if key == "wire":
            add_answers(records, key, llms, prompts, golds, plan)

    if plan.text_baselines:
        chunk = [examples[i] for i in indices]
        for key, cut in (("text", None), ("text_cut", plan.num_latents)):
            prompts = {name: text_prompts(llm, chunk, cut) for name, llm in llms.items()}
            add_nll(records, key, llms, prompts, targets)
            add_answers(records, key, llms, prompts, golds, plan)
    return records


def add_nll(records: list[dict], key: str, llms: dict, prompts: dict, targets: dict) -> None:
    for name, llm in llms.items():
        sums, counts, first_hits = continuation_nll(llm, prompts[name], targets[name])
        for record, s, c, hit in zip(records, sums, counts, first_hits, strict=True):
            record["nll_sum"][f"{key}_{name}"], record["tokens"][f"{key}_{name}"] = s, c
            record["first_token"][f"{key}_{name}"] = float(hit)


def add_answers(records: list[dict], key: str, llms: dict, prompts: dict, golds: list[list[str]], plan: Plan) -> None:
    answers = {name: [decode_answer(llm.tokenizer, ids) for ids in
                      greedy_generate(llm, prompts[name], plan.max_new_tokens, stop_together=plan.lockstep)]
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


def gather_records(local: list[dict], world: int) -> list[dict]:
    """Every rank's records on every rank, in example order (`world` ranks share the examples)."""
    if world == 1:
        return local
    parts = [None] * dist.get_world_size()
    dist.all_gather_object(parts, local)
    return sorted((r for part in parts for r in part), key=lambda r: r["index"])


def evaluate_examples(model: WireEncoder, llms: dict, examples: list[dict], plan: Plan, device: torch.device,
                      rank: int, world: int) -> list[dict] | None:
    """Per-example records of all `examples`, on every rank, or None when `plan.stop` stopped it. A
    collective when distributed."""
    collate = Collator.for_llms(llms, plan.max_prompt_bytes, plan.max_answer_tokens, plan.pad_multiple)
    partners = cyclic_derangement(len(examples), plan.seed)
    amp_dtype = AMP_DTYPES[plan.precision]
    was_training = model.training
    model.eval()  # no dropout: the wire is what the trained encoder writes, deterministically
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            chunks, local = rank_chunks(len(examples), plan.batch_size, rank, world), []
            most = rank_chunks(len(examples), plan.batch_size, 0, world)  # rank 0 is dealt the most
            for i in range(len(most)):
                if plan.stop and plan.stop():
                    return None
                if i >= len(chunks) and not plan.lockstep:
                    continue  # this rank's share is done; it still answers stop() with the others
                chunk = chunks[i] if i < len(chunks) else most[0]  # lockstep: a chunk run again, dropped
                records = evaluate_chunk(model, llms, examples, chunk, partners, collate, plan, device)
                local += records if i < len(chunks) else []
                if plan.progress:
                    plan.progress(len(local), sum(map(len, chunks)))
    finally:
        model.train(was_training)
    return gather_records(local, world)


def evaluate_wire(model: WireEncoder, llms: dict, examples: list[dict], plan: Plan, device: torch.device,
                  rank: int, world: int) -> dict[str, float] | None:
    """The periodic evaluation of train.py: the wire's answers (EM/F1 per LLM and joint) and answer
    NLL, with the controls of `wire_controls`; flat `eval_*` scalars, equal on every rank, or None
    when `plan.stop` stopped it. A collective: every rank calls it. Pass the bare model, not its
    DDP wrapper."""
    records = evaluate_examples(model, llms, examples, plan, device, rank, world)
    return None if records is None else {f"eval_{k}": v for k, v in summarize(records).items()}


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
    # Fields added after the checkpoint was written take their defaults, as an older profile's do,
    # but for one: a run from before held_out_fraction trained on all of a local file.
    values = field_defaults() | {"held_out_fraction": 0.0}
    values |= {name: check_value(name, value, where=str(where)) for name, value in config.items() if name in FIELDS}
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


# --- the command line -------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="python -m latentwire.evaluate",
                description="EM/F1 and answer NLL from a LatentWire checkpoint's wire, with text baselines.")
    p.add_argument("--ckpt", required=True, help="RUN/checkpoints/step_N, or RUN for its newest checkpoint")
    p.add_argument("--dataset", help="held-out data: synthetic, squad, hotpot_qa or a local file (default: the run's)")
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
    sources = DataSources.of(cfg)
    dataset = sources.held_out_source(args.dataset)  # --dataset, else the run's eval_dataset or its own split
    out_dir = Path(args.out_dir) if args.out_dir else ckpt.parent.parent / "eval"
    check_can_create(out_dir, "output directory")
    examples = sources.held_out_examples(args.eval_examples, dataset)
    llms = build_frozen_llms(cfg, frozen_weight_dtype(cfg.precision))
    # A run that sharded its LLMs is evaluated sharded too, over however many ranks this is.
    sharded = cfg.frozen_sharding == "fsdp" and di.is_distributed
    if sharded:
        mesh = init_device_mesh(di.device.type, (di.world_size,))
        for llm in llms.values():
            shard_frozen_llm(llm, mesh)
    for llm in llms.values():
        load_weights(llm, di.device)
    if sharded and di.is_main:
        print(f"LLMs sharded over {di.world_size} ranks as in training ({held_per_rank(llms)})", file=sys.stderr, flush=True)
    model = load_wire_encoder(ckpt, cfg, llms, di.device)
    plan = Plan.of(cfg, text_baselines=True, batch_size=args.batch_size, max_new_tokens=args.max_new_tokens,
                   progress=report_progress(di.world_size) if di.is_main else None, lockstep=sharded)
    records = evaluate_examples(model, llms, examples, plan, di.device, di.rank, di.world_size)
    if not di.is_main:
        return
    report = build_report(ckpt, step, cfg, dataset, sources.describe_held_out(dataset), examples, records, llms, plan,
                          di.world_size)
    paths = write_report(report, out_dir, f"{ckpt.name}_{Path(dataset).stem}_n{len(examples)}")
    print(markdown(report), flush=True)
    print("wrote " + " and ".join(map(str, paths)), flush=True)


if __name__ == "__main__":
    main_guard(main)
