"""The loss terms: what each one sums and counts, and that the terms left off change nothing."""

import math

import pytest
import torch
import torch.nn.functional as F

import train
from conftest import ALL_TERMS, distilled_collator, full_logits_sums
from latentwire.dataset import IGNORE_INDEX, Collator, PromptDataset, label_positions, synthetic_examples
from latentwire.harness.loop_config import OptimizerConfig
from latentwire.harness.precision import sdpa_backends
from latentwire.head_losses import head_losses
from latentwire.llm import FrozenLLM
from latentwire.model import WireEncoder
from latentwire.objectives import (
    Objectives,
    WireTask,
    first_targets,
    forward_loss_sums,
    kd_divergence,
    llm_term_sums,
    target_counts,
)
from latentwire.settings import load_config

CPU = torch.device("cpu")


def batches(llms, distilled=None, n=2, size=4, seed=31):
    """`distilled`: the Objectives whose distillation targets the batches carry."""
    examples = PromptDataset(synthetic_examples(n * size, seed))
    collate = distilled_collator(llms, examples, distilled) if distilled else Collator.for_llms(llms, 512, 16, 32)
    return [collate([examples[i] for i in range(b * size, (b + 1) * size)]) for b in range(n)]


def test_first_targets_are_each_rows_first_k_labels():
    labels = torch.tensor([[-100, -100, 5, 6, 7, 2, -100], [-100, 9, 2, -100, -100, -100, -100]])
    assert first_targets(labels, 1).long().tolist() == [[0, 0, 1, 0, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0]]
    assert first_targets(labels, 3).long().tolist() == [[0, 0, 1, 1, 1, 0, 0], [0, 1, 1, 0, 0, 0, 0]]
    counts = target_counts(
        {"answers": {"x": {"labels": labels}}},
        Objectives(first_token_weight=1, k_token_weight=1, kd_weight=1, k_tokens=3),
    )
    assert counts.tolist() == [[6, 2, 5, 5]]  # all targets, first tokens, first 3, first 3 (kd)


def test_each_term_sums_what_it_names():
    """Logits as the hidden states of an identity head: each term against its positions, by hand."""
    torch.manual_seed(0)
    logits, teacher = torch.randn(2, 7, 11), torch.randn(2, 7, 11)
    labels = torch.tensor([[-100, -100, 5, 6, 7, 2, -100], [-100, 9, 2, -100, -100, -100, -100]])
    obj = Objectives(first_token_weight=1, k_token_weight=1, kd_weight=1, k_tokens=2, kd_temperature=2.0)
    rows = {"labels": labels, "label_positions": label_positions(labels), "kd_logprobs": F.log_softmax(teacher / 2, -1)}
    answer, first, k, kd = llm_term_sums(logits, torch.eye(11), rows, obj).tolist()
    nll = -F.log_softmax(logits, -1)
    assert answer == pytest.approx(sum(nll[r, t, labels[r, t]].item() for r, t in (labels != -100).nonzero().tolist()))
    assert first == pytest.approx(nll[0, 2, 5].item() + nll[1, 1, 9].item())
    assert k == pytest.approx(first + nll[0, 3, 6].item() + nll[1, 2, 2].item())
    p = F.softmax(teacher / 2, -1)
    kl = (p * (p.log() - F.log_softmax(logits / 2, -1))).sum(-1)
    assert kd == pytest.approx(4 * (kl[0, 2] + kl[0, 3] + kl[1, 1] + kl[1, 2]).item(), rel=1e-5)
    assert kd_divergence(teacher, rows["kd_logprobs"], temperature=2.0).abs().max().item() == pytest.approx(0, abs=1e-6)


def labelled_losses(llm, soft, rows):
    """A loop that has only the answer's cross-entropy, written out: the head at the labelled
    positions, the losses summed."""
    (row, col), labels = rows["label_positions"], rows["labels"]
    real = torch.arange(row.shape[0]) < (labels != IGNORE_INDEX).sum()
    hidden = llm.answer_hidden(soft, rows["lead_ids"], rows["input_ids"])[row, col]
    with llm.head_weight() as head:

        def ce(logits, targets):
            return F.cross_entropy(logits.float(), targets, reduction="none")[:, None]

        return head_losses(hidden, head, ce, labels[row, col].masked_fill(~real, IGNORE_INDEX))[:, 0].sum()


def reference_step(model, llms, micro_batches, optimizer):
    """The loop before it had any other term, written out: each LLM's summed answer cross-entropy
    over the global batch's answer tokens, averaged over the LLMs, then clipping and the update."""
    n = (
        torch.stack(
            [
                torch.stack([(b["answers"][name]["labels"] != IGNORE_INDEX).sum() for name in llms])
                for b in micro_batches
            ]
        )
        .sum(0)
        .float()
    )
    for batch in micro_batches:
        soft = model(batch["bytes"], batch["byte_mask"])
        sums = torch.stack([labelled_losses(llm, soft[name], batch["answers"][name]) for name, llm in llms.items()])
        (sums / n).mean().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def harness_step(model, llms, micro_batches, optimizer, objectives):
    task = WireTask(llms, objectives, num_latents=0)
    n = torch.stack([task.counts(b) for b in micro_batches]).sum(0).float()
    train.train_step(
        model,
        task,
        micro_batches,
        n_targets=n,
        amp_dtype=None,
        attention_backends=sdpa_backends(None, torch.float32)[0],
        scaler=torch.amp.GradScaler("cpu", enabled=False),
        optimizer=optimizer,
        max_grad_norm=1.0,
        world_size=1,
        no_sync=train.nullcontext,
    )
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def test_terms_at_weight_zero_leave_the_step_bitwise_as_the_answer_loss_alone(llms, monkeypatch):
    """Every extra term off (weight 0, whatever its k and temperature): the harness's step gives the
    very bits of a loop that has only the answer's cross-entropy, and no teacher runs."""

    def no_teacher(*args, **kwargs):
        raise AssertionError("a teacher pass with distillation off")

    monkeypatch.setattr(FrozenLLM, "teacher_logits", no_teacher)
    cfg = load_config(
        [
            "--profile",
            "cpu",
            "--dropout",
            "0",
            "--first-token-weight",
            "0",
            "--k-token-weight",
            "0",
            "--kd-weight",
            "0",
            "--k-tokens",
            "1",
            "--kd-temperature",
            "3",
        ]
    )
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
    assert not torch.equal(
        weights[0]["pooler.queries"], WireEncoder.for_llms(cfg.wire, llms).state_dict()["pooler.queries"]
    )  # the steps moved the weights


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


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 8 positions (chunk_rows' least): a micro-batch's labels span several."""
    import latentwire.head_losses

    monkeypatch.setattr(latentwire.head_losses, "HEAD_CHUNK_ELEMENTS", 1)
    return 8


def test_the_head_at_the_labels_in_chunks_equals_the_full_logits(llms, small_chunks):
    """Every term and the wire's gradients, against the reference that takes every kept position's
    logits, in fp32. Both compute a position's values from the same hidden state with the same
    operations, but for the order of three sums: the head's dot products (H terms), the vocabulary's
    log-sum-exp (V) and a term's sum over its positions (N). Reordering a sum of n terms moves it by
    at most gamma_n = n u / (1 - n u) of the sum of their magnitudes (u = 2^-24), so every term is
    within gamma_{H+V+N} of the reference, and the gradients, made from those values by the same
    backward through the same layers, likewise."""
    cfg = load_config(["--profile", "cpu", "--dropout", "0"])
    torch.manual_seed(0)
    model = WireEncoder.for_llms(cfg.wire, llms)
    batch = batches(llms, distilled=ALL_TERMS, n=1, size=12)[0]
    positions = max(rows["label_positions"].shape[1] for rows in batch["answers"].values())
    assert positions > 2 * small_chunks  # several chunks, the last one part padding
    results = []
    for sums_of in (forward_loss_sums, full_logits_sums):
        model.zero_grad()
        sums = sums_of(model, llms, batch, ALL_TERMS)
        sums.sum().backward()
        results.append((sums.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (sums, grads), (ref_sums, ref_grads) = results
    n = max(llm.hidden_size + llm.model.config.vocab_size for llm in llms.values()) + positions
    gamma = n * 2**-24 / (1 - n * 2**-24)
    torch.testing.assert_close(sums, ref_sums, rtol=gamma, atol=0)
    for name, ref in ref_grads.items():
        torch.testing.assert_close(grads[name], ref, rtol=gamma, atol=gamma * ref.abs().max().item())


def test_the_head_runs_at_the_labels_a_chunk_at_a_time_and_takes_no_weight_gradient(llms, small_chunks):
    """Every matmul against a head makes the logits of at most a chunk of positions, all of them
    together exactly the labelled positions (padded to their multiple), and no matmul makes a
    head-shaped gradient: the frozen head's weight gets none. No tensor of logits beyond a chunk's
    is ever made, in fp32 or not (the teacher's targets, gathered at the same positions, aside)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class Outputs(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.seen += [(func, tuple(t.shape)) for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
            return out

    cfg = load_config(["--profile", "cpu", "--dropout", "0"])
    model = WireEncoder.for_llms(cfg.wire, llms)
    batch = batches(llms, distilled=ALL_TERMS, n=1, size=12)[0]
    with Outputs() as outputs:
        forward_loss_sums(model, llms, batch, ALL_TERMS).sum().backward()
    aten = torch.ops.aten
    matmuls = (aten.mm.default, aten.addmm.default, aten.bmm.default)
    for name, llm in llms.items():
        vocab, hidden = llm.model.config.vocab_size, llm.hidden_size
        logits = [math.prod(shape[:-1]) for func, shape in outputs.seen if func in matmuls and shape[-1] == vocab]
        assert sum(logits) == batch["answers"][name]["label_positions"].shape[1]
        assert max(logits) == small_chunks
        # every [..., vocab] tensor, the head's weight and its views aside
        assert all(
            math.prod(shape[:-1]) <= small_chunks
            for func, shape in outputs.seen
            if shape and shape[-1] == vocab and hidden not in shape and func != aten.index.Tensor
        )
        assert not any(sorted(shape[-2:]) == sorted((vocab, hidden)) for func, shape in outputs.seen if func in matmuls)
