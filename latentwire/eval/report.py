"""The evaluation's numbers and its report: per-example records reduced to EM, F1 and NLL, the
wire's margins over its controls, compression and payload, as JSON and a Markdown table."""

from __future__ import annotations

import json
import math
import statistics
from pathlib import Path

from ..dataset import answers_past_cut, prompt_text
from ..llm import describe_prompts
from .settings import EvalSettings

EXAMPLES_IN_MARKDOWN = 5
# The wire "carries information" when its answer NLL is below each control's by more than this
# many standard errors of the paired difference: a bare "lower" can be noise.
SIGNIFICANT_SE = 3


def summarize(records: list[dict]) -> dict[str, float]:
    """`nll_*`: summed NLL over summed targets (training's token-weighted loss); `em_*`, `f1_*`,
    `first_token_*`: the mean over examples, in %."""
    out = {}
    for key in records[0]["tokens"]:
        out[f"nll_{key}"] = sum(r["nll_sum"][key] for r in records) / sum(r["tokens"][key] for r in records)
    for metric in ("em", "f1", "first_token"):
        for key in records[0][metric]:
            out[f"{metric}_{key}"] = 100 * sum(r[metric][key] for r in records) / len(records)
    return out


# --- the report -------------------------------------------------------------------------------


def share_of_text(metrics: dict[str, float], who: str) -> dict[str, float | None]:
    """The wire's EM, F1 and first-token accuracy as a fraction of the full text prompt's, for one
    LLM (or joint): what LatentWire asks, how much of what a reader gets from the text the wire
    carries. None where the text scores 0 (a reader that cannot read has nothing to share)."""
    out = {}
    for metric in ("em", "f1", "first_token"):  # joint has no first token: it picks whole answers
        wire, text = metrics.get(f"{metric}_wire_{who}"), metrics.get(f"{metric}_text_{who}")
        out[metric] = wire / text if wire is not None and text else None
    return out


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


def build_report(
    ckpt: Path,
    step,
    cfg,
    dataset: str,
    held_out: str,
    examples: list[dict],
    records: list[dict],
    llms: dict,
    settings: EvalSettings,
    world: int,
    groups: dict[str, range] | None = None,
) -> dict:
    """`held_out` says where the examples come from (data.DataSources.describe_held_out); `groups`,
    where each source of a mixture lies among them, for its own metrics."""
    metrics = summarize(records)
    margins = {
        name: {control: control_margin(records, control, name) for control in ("zeroed", "shuffled")} for name in llms
    }
    return {
        "checkpoint": str(ckpt),
        "step": step,
        "profile": cfg.invocation.profile,
        "dataset": dataset,
        "split": "validation",
        "held_out": held_out,
        "examples": len(examples),
        "answers_past_cut": answers_past_cut(examples, cfg.data.max_prompt_bytes).count(True),
        "max_prompt_bytes": cfg.data.max_prompt_bytes,
        "world_size": world,
        "settings": {
            "num_latents": cfg.wire.num_latents,
            "d_z": cfg.wire.d_z,
            "batch_size": settings.batch_size,
            "max_new_tokens": settings.max_new_tokens,
            "anchor_text": cfg.prompt.anchor,
            "chat_template": cfg.prompt.chat_template,
            "answer_instruction": cfg.prompt.instruction,
            "prompts": describe_prompts(llms),
        },
        "metrics": metrics,
        "by_source": {
            label: {"examples": len(span), "metrics": summarize(records[span.start : span.stop])}
            for label, span in (groups or {}).items()
        },
        "wire_vs_controls": margins,
        "wire_carries_information": {
            name: all(m["margin"] > SIGNIFICANT_SE * m["se"] for m in by_control.values())
            for name, by_control in margins.items()
        },
        "wire_share_of_text": (
            {who: share_of_text(metrics, who) for who in (*llms, "joint")} if settings.text_baselines else {}
        ),
        "compression": compression(llms, examples, cfg.wire.num_latents),
        "payload_bytes": payload_bytes(cfg.wire.num_latents, cfg.wire.d_z),
        "answers": [
            {
                "index": r["index"],
                "question": examples[r["index"]]["question"],
                "gold": examples[r["index"]]["answers"]["text"],
                **r["answer"],
            }
            for r in records
        ],
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
        f"Checkpoint `{report['checkpoint']}`, {report['examples']} examples: {report['held_out']}; M = {M} wire "
        f"tokens. {report['answers_past_cut']} of them have their answer past max_prompt_bytes="
        f"{report['max_prompt_bytes']}, where the encoder cannot read it. Prompt contracts: "
        f"{report['settings']['prompts']}.",
        "",
        "## Answers",
        "",
        "EM and F1 in % (SQuAD-normalised, best over the gold answers); answer NLL in nats per target "
        "token (the first gold answer + EOS, as in training). Joint: of the LLMs' answers, the one with "
        "the higher log-probability summed over both LLMs.",
        "",
        "| input | LLM | EM | F1 | first token | answer NLL |",
        "|---|---|---:|---:|---:|---:|",
    ]
    inputs = (
        ("wire", f"wire, {M} soft tokens"),
        ("text", f"text, full prompt ({tokens} tokens)"),
        ("text_cut", f"text, prompt cut to {M} tokens"),
    )
    for key, label in inputs:
        for who in (*names, "joint"):
            first, nll = (
                (f"{m[f'first_token_{key}_{who}']:.1f}", f"{m[f'nll_{key}_{who}']:.3f}") if who != "joint" else ("", "")
            )
            lines.append(
                f"| {label} | {who} | {m[f'em_{key}_{who}']:.1f} | {m[f'f1_{key}_{who}']:.1f} | {first} | {nll} |"
            )
    lines += by_source_table(report, names)
    lines += [
        "",
        "## The wire's share of the text baseline",
        "",
        f"The wire's score over the full text prompt's, per reader: how much of what the reader gets from "
        f"the text the {M} soft tokens carry, at the compression beside it. First token: the answer's "
        "first token is the reader's most likely next token (teacher-forced).",
        "",
        "| LLM | EM share | F1 share | first-token share | compression (prompt tokens / M) |",
        "|---|---:|---:|---:|---:|",
        *(share_row(report, who) for who in (*names, "joint")),
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
        *(
            f"| {_cell(a['question'])} | {_cell(' / '.join(a['gold']))} | "
            + " | ".join(_cell(a[f"wire_{w}"]) for w in (*names, "joint"))
            + " |"
            for a in report["answers"][:EXAMPLES_IN_MARKDOWN]
        ),
    ]
    return "\n".join(lines) + "\n"


def by_source_table(report: dict, names: list[str]) -> list[str]:
    """Of a mixture, the wire's and the text's EM and F1 on each source's examples on their own."""
    if not report["by_source"]:
        return []
    who = (*names, "joint")
    return [
        "",
        "### By source",
        "",
        "| source | examples | " + " | ".join(f"wire EM / F1 {w} | text EM / F1 {w}" for w in who) + " |",
        "|---|---:|" + "---:|---:|" * len(who),
        *(
            f"| {label} | {s['examples']} | "
            + " | ".join(
                f"{s['metrics'][f'em_{key}_{w}']:.1f} / {s['metrics'][f'f1_{key}_{w}']:.1f}"
                for w in who
                for key in ("wire", "text")
            )
            + " |"
            for label, s in report["by_source"].items()
        ),
    ]


def share_row(report: dict, who: str) -> str:
    share, c = report["wire_share_of_text"][who], report["compression"]
    cells = " | ".join("" if share[k] is None else f"{100 * share[k]:.0f}%" for k in ("em", "f1", "first_token"))
    compressed = f"{c[f'compression_{who}']:.1f}x" if f"compression_{who}" in c else ""
    return f"| {who} | {cells} | {compressed} |"


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


def payload_bytes(num_latents: int, d_z: int) -> dict[str, int]:
    """Bytes on the wire per example (the wire is shared by all LLMs; adapters run at the receiver)."""
    values = num_latents * d_z
    return {"fp32": 4 * values, "bf16": 2 * values, "int8": values + 4 * num_latents}
