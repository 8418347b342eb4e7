"""The loss terms: what each one sums and counts, and that the terms left off change nothing."""
import pytest
import torch
import torch.nn.functional as F

import train
from latentwire.settings import load_config
from latentwire.harness.loop_config import OptimizerConfig
from latentwire.dataset import IGNORE_INDEX, Collator, PromptDataset, synthetic_examples
from latentwire.llm import LLM_NAMES, FrozenLLM, load_frozen_llm
from latentwire.model import WireEncoder
from latentwire.objectives import (Objectives, WireTask, first_targets, forward_loss_sums, kd_sum, llm_term_sums,
                                   target_counts)
from latentwire.harness.precision import sdpa_backends

from conftest import distilled_collator

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def llms():
    return {n: load_frozen_llm(n, "tiny", torch.float32, CPU) for n in LLM_NAMES}


def batches(llms, distilled=None, n=2, size=4, seed=31):
    """`distilled`: the Objectives whose distillation targets the batches carry."""
    examples = PromptDataset(synthetic_examples(n * size, seed))
    collate = distilled_collator(llms, examples, distilled) if distilled else Collator.for_llms(llms, 512, 16, 32)
    return [collate([examples[i] for i in range(b * size, (b + 1) * size)]) for b in range(n)]


def test_first_targets_are_each_rows_first_k_labels():
    labels = torch.tensor([[-100, -100, 5, 6, 7, 2, -100], [-100, 9, 2, -100, -100, -100, -100]])
    assert first_targets(labels, 1).long().tolist() == [[0, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0]]
    assert first_targets(labels, 3).long().tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    counts = target_counts({"answers": {"x": {"labels": labels}}},
                           Objectives(first_token_weight=1, k_token_weight=1, kd_weight=1, k_tokens=3))
    assert counts.tolist() == [[6, 2, 5, 5]]  # all targets, first tokens, first 3, first 3 (kd)


def test_each_term_sums_what_it_names():
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 7, 11), torch.randn(2, 7, 11)
    labels = torch.tensor([[-100, -100, 5, 6, 7, 2, -100], [-100, 9, 2, -100, -100, -100, -100]])
    obj = Objectives(first_token_weight=1, k_token_weight=1, kd_weight=1, k_tokens=2, kd_temperature=2.0)
    rows = {"labels": labels, "kd_logprobs": F.log_softmax(teacher / 2, -1)}
    answer, first, k, kd = llm_term_sums(logits, rows, obj).tolist()
    nll = -F.log_softmax(logits, -1)
    assert answer == pytest.approx(sum(nll[r, t, labels[r, t]].item() for r, t in (labels != -100).nonzero().tolist()))
    assert first == pytest.approx(nll[0, 2, 5].item() + nll[1, 1, 9].item())
    assert k == pytest.approx(first + nll[0, 3, 6].item() + nll[1, 2, 2].item())
    p = F.softmax(teacher / 2, -1)
    kl = (p * (p.log() - F.log_softmax(logits / 2, -1))).sum(-1)
    assert kd == pytest.approx(4 * (kl[0, 2] + kl[0, 3] + kl[1, 1] + kl[1, 2]).item(), rel=1e-5)
    assert kd_sum(teacher, rows, labels != IGNORE_INDEX, 2.0).item() == pytest.approx(0, abs=1e-5)


def reference_step(model, llms, micro_batches, optimizer):
    """The loop before it had any other term, written out: each LLM's summed answer cross-entropy
    over the global batch's answer tokens, averaged over the LLMs, then clipping and the update."""
    n = torch.stack([torch.stack([(b["answers"][name]["labels"] != IGNORE_INDEX).sum() for name in llms])
                     for b in micro_batches]).sum(0).float()
    for batch in micro_batches:
        soft = model(batch["bytes"], batch["byte_mask"])
        sums = torch.stack([F.cross_entropy(
            llm.answer_logits(soft[name], rows["lead_ids"], rows["input_ids"]).flatten(0, 1).float(),
            rows["labels"].flatten(), ignore_index=IGNORE_INDEX, reduction="sum")
            for name, llm in llms.items() for rows in [batch["answers"][name]]])
        (sums / n).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def harness_step(model, llms, micro_batches, optimizer, objectives):
    task = WireTask(llms, objectives, num_latents=0)
    n = torch.stack([task.counts(b) for b in micro_batches]).sum(0).float()
    train.train_step(model, task, micro_batches, n_targets=n, amp_dtype=None,
                     attention_backends=sdpa_backends(None, torch.float32)[0],
                     scaler=torch.amp.GradScaler("cpu", enabled=False), optimizer=optimizer, max_grad_norm=1.0,
                     world_size=1, no_sync=train.nullcontext)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_terms_at_weight_zero_leave_the_step_bitwise_as_the_answer_loss_alone(llms, monkeypatch):
    """Every extra term off (weight 0, whatever its k and temperature): the harness's step gives the
    very bits of a loop that has only the answer's cross-entropy, and no teacher runs."""
    def no_teacher(*args, **kwargs):
        raise AssertionError("a teacher pass with distillation off")

    monkeypatch.setattr(FrozenLLM, "teacher_logits", no_teacher)
    cfg = load_config(["--profile", "cpu", "--dropout", "0", "--first-token-weight", "0", "--k-token-weight", "0",
                       "--kd-weight", "0", "--k-tokens", "1", "--kd-temperature", "3"])
    objectives = cfg.objectives
    assert objectives.terms == ("answer_ce",) and not objectives.teacher
    weights = []
    for step in (reference_step, lambda *a: harness_step(*a, objectives)):
        torch.manual_seed(0)
        model = WireEncoder.for_llms(cfg.wire, llms)
        adam = OptimizerConfig(lr=1e-3, weight_decay=0.01, beta1=0.9, beta2=0.95, eps=1e-8)
        optimizer = train.adamw(model, adam, "cpu")
        for micro_batches in (batches(llms, seed=31), batches(llms, seed=32)):
            step(model, llms, micro_batches, optimizer)
        weights.append(model.state_dict())
    assert all(torch.equal(weights[0][k], weights[1][k]) for k in weights[0])
    assert not torch.equal(weights[0]["pooler.queries"], WireEncoder.for_llms(cfg.wire, llms).state_dict()[
        "pooler.queries"])  # the steps moved the weights


def test_the_teacher_gets_no_gradient_and_its_term_moves_the_wire(llms):
    cfg = load_config(["--profile", "cpu", "--dropout", "0"])
    torch.manual_seed(0)
    model = WireEncoder.for_llms(cfg.wire, llms)
    kd_only = Objectives(kd_weight=1.0)
    batch = batches(llms, distilled=kd_only, n=1)[0]
    sums = forward_loss_sums(model, llms, batch, kd_only)
    assert sums.shape == (2, 2) and (sums[:, 1] > 0).all()
    sums[:, 1].sum().backward()
    assert all(p.grad is None for llm in llms.values() for p in llm.model.parameters())
    assert model.encoder.byte_embed.weight.grad.abs().sum() > 0
