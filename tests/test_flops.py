"""The analytic FLOP count that MFU uses, against torch.utils.flop_counter.FlopCounterMode."""

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from conftest import distilled_collator, wrapped_readers
from latentwire.dataset import IGNORE_INDEX, Collator, PromptDataset, input_lengths, synthetic_examples
from latentwire.flops import FlopModel, register_cpu_attention_flops
from latentwire.model import WireEncoder
from latentwire.objectives import Objectives, forward_loss_sums
from latentwire.settings import load_config

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def setup(tiny_readers):
    register_cpu_attention_flops()
    cfg = load_config(["--profile", "cpu"])
    return cfg, tiny_readers, WireEncoder.for_llms(cfg.wire, tiny_readers)


def counted(model, llms, batch, objectives) -> int:
    with FlopCounterMode(display=False) as counter:
        forward_loss_sums(model, llms, batch, objectives).sum().backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("batch_size, pad_multiple, kd", [(16, 32, False), (3, 128, False), (5, 32, True)])
def test_analytic_flops_match_flop_counter(setup, batch_size, pad_multiple, kd):
    """With distillation the step runs no teacher (its targets come with the batch): the count of
    the distillation term's own arithmetic stays within the tolerance."""
    cfg, llms, model = setup
    objectives = Objectives(kd_weight=1.0 if kd else 0.0)
    dataset = PromptDataset(synthetic_examples(64, batch_size))
    settings = (cfg.data.max_prompt_bytes, cfg.data.max_answer_tokens, pad_multiple)
    collate = distilled_collator(llms, dataset, objectives, *settings) if kd else Collator.for_llms(llms, *settings)
    batch = collate([dataset[i] for i in range(batch_size)])
    analytic = FlopModel.of(model, {n: llm.model for n, llm in llms.items()}, cfg.wire).step_flops([batch])
    measured = counted(model, llms, batch, objectives)
    assert analytic == pytest.approx(measured, rel=0.05)


def test_cpu_attention_is_counted(setup):
    """Without the registered formula, FlopCounterMode would miss every CPU attention."""
    cfg, llms, model = setup
    items = [PromptDataset(synthetic_examples(8, 0))[i] for i in range(4)]
    batch = Collator.for_llms(llms, cfg.data.max_prompt_bytes, 16, 32)(items)
    with FlopCounterMode(display=False) as counter:
        forward_loss_sums(model, llms, batch, Objectives()).sum().backward()
    ops = {str(op) for op in counter.get_flop_counts()["Global"]}
    assert {
        "aten._scaled_dot_product_flash_attention_for_cpu",
        "aten._scaled_dot_product_flash_attention_for_cpu_backward",
    } <= ops


def test_frozen_llms_cost_no_weight_gradients(setup):
    """The frozen-aware count: letting an LLM's weights require grad adds 2 x params per position."""
    cfg, llms, model = setup
    items = [PromptDataset(synthetic_examples(8, 1))[i] for i in range(4)]
    batch = Collator.for_llms(llms, cfg.data.max_prompt_bytes, 16, 32)(items)
    frozen = counted(model, llms, batch, Objectives())
    layers = llms["qwen"].model.get_decoder().layers
    layers.requires_grad_(True)
    try:
        unfrozen = counted(model, llms, batch, Objectives())
    finally:
        layers.requires_grad_(False)
    from latentwire.flops import linear_params

    positions = batch["bytes"].shape[0] * (cfg.wire.num_latents + batch["answers"]["qwen"]["input_ids"].shape[1])
    assert unfrozen - frozen == pytest.approx(2 * linear_params(layers) * positions, rel=0.01)


@pytest.mark.parametrize("policy", ["full", "selective"])
def test_hardware_flops_count_the_recompute_of_checkpointed_layers(setup, tiny_readers, policy):
    """HFU's count: checkpointed decoder layers run their forward again in backward, whole (full) or
    the matmuls whose outputs were not kept (selective), which FlopCounterMode sees; the analytic
    count adds exactly that, and MFU's count does not."""
    cfg, llms, model = setup
    items = [PromptDataset(synthetic_examples(8, 2))[i] for i in range(4)]
    batch = Collator.for_llms(llms, cfg.data.max_prompt_bytes, 16, 32)(items)
    plain = counted(model, llms, batch, Objectives())
    recomputed = counted(model, wrapped_readers(tiny_readers, policy), batch, Objectives())
    shapes = {name: llm.model for name, llm in llms.items()}
    flops = FlopModel.of(model, shapes, cfg.wire, recompute=policy)
    assert flops.step_hardware_flops([batch]) - flops.step_flops([batch]) == pytest.approx(recomputed - plain, rel=1e-3)
    assert FlopModel.of(model, shapes, cfg.wire).step_hardware_flops([batch]) == flops.step_flops([batch])
    if policy == "selective":  # every second matmul and no attention: less than half of full's recompute
        full = FlopModel.of(model, shapes, cfg.wire, recompute="full")
        assert 2 * (recomputed - plain) < full.step_hardware_flops([batch]) - full.step_flops([batch])


def alone(batch: dict, i: int) -> dict:
    """Row i of a batch by itself, cut where it ends: no padding anywhere, the head at its labels."""
    real = int(batch["byte_mask"][i].sum())
    row = {"bytes": batch["bytes"][i : i + 1, :real], "byte_mask": batch["byte_mask"][i : i + 1, :real], "answers": {}}
    for name, rows in batch["answers"].items():
        inputs = int(input_lengths(rows["labels"][i : i + 1]))
        labels = rows["labels"][i : i + 1, : inputs + 1]
        row["answers"][name] = {
            "lead_ids": rows["lead_ids"][i : i + 1],
            "input_ids": rows["input_ids"][i : i + 1, :inputs],
            "labels": labels,
            "label_positions": torch.stack((labels != IGNORE_INDEX).nonzero(as_tuple=True)),
        }
    return row


def test_useful_flops_are_each_row_alone_without_its_padding(setup):
    """mfu_useful's count, made on the device from the batch's real lengths: exactly what each row
    would cost alone, cut where it ends, its head at its real labels; the padded count is more."""
    cfg, llms, model = setup
    items = [PromptDataset(synthetic_examples(8, 4))[i] for i in range(6)]
    batch = Collator.for_llms(llms, cfg.data.max_prompt_bytes, 16, 32)(items)
    flops = FlopModel.of(model, {n: llm.model for n, llm in llms.items()}, cfg.wire)
    useful = flops.useful_flops([batch])
    assert useful.dtype == torch.int64 and useful.item() == sum(flops.step_flops([alone(batch, i)]) for i in range(6))
    assert useful.item() < 0.9 * flops.step_flops([batch])
