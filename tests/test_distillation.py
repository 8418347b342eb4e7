"""Distillation targets computed once per example: the same terms as a teacher run in the step,
independent of the teacher's batching, folded into top-k buckets alike on both sides, and rebuilt
by a resumed run."""

import pytest
import torch

from conftest import ALL_TERMS, ALL_TERMS_FLAGS, RUN, assert_same_run, distilled_collator, ok, run_train
from latentwire.dataset import Collator, PromptDataset, synthetic_examples
from latentwire.distillation import TeacherTargets, softened, target_width, teacher_targets, top_k_buckets
from latentwire.model import WireConfig, WireEncoder
from latentwire.objectives import forward_loss_sums, kd_divergence

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def dataset():
    return PromptDataset(synthetic_examples(6, 5))


def test_a_step_with_cached_targets_equals_one_that_runs_its_teacher(llms, dataset):
    """The targets computed before training, in a teacher batch of the step's own examples, give
    bitwise the loss terms of a step that runs the teacher itself and softens all of its logits
    (the loop before the cache)."""
    items = [dataset[i] for i in range(len(dataset))]
    cached = distilled_collator(llms, dataset, ALL_TERMS, batch_size=len(dataset))(items)
    in_step = Collator.for_llms(llms, 512, 16, 32, teacher=True)(items)
    with torch.no_grad():
        for name, llm in llms.items():
            rows = in_step["answers"][name]
            teacher = llm.teacher_logits(rows["text_ids"], rows["text_mask"], rows["input_ids"])
            rows["kd_logprobs"] = softened(teacher, ALL_TERMS.kd_temperature)
    torch.manual_seed(0)
    model = WireEncoder.for_llms(WireConfig(8, 64, 64, 2, 4, 4, 0.0), llms)
    assert torch.equal(
        forward_loss_sums(model, llms, cached, ALL_TERMS), forward_loss_sums(model, llms, in_step, ALL_TERMS)
    )


def test_targets_do_not_depend_on_the_teacher_s_batch(llms, dataset):
    """Each example alone (no padding) and all in one left-padded batch: the same targets, to the
    rounding of fp32 attention over a different number of masked keys (the padding tests' bound)."""
    teacher = Collator.for_llms(llms, 512, 16, 32, teacher=True)
    targets = {
        size: teacher_targets(
            llms,
            dataset,
            teacher,
            list(range(len(dataset))),
            k=3,
            temperature=2.0,
            top_k=64,
            batch_size=size,
            device=CPU,
            rank=0,
            world=1,
        )
        for size in (1, len(dataset))
    }
    for name in llms:
        assert targets[1][name].ids is None  # a tiny reader's full rows fit: exact, no buckets
        torch.testing.assert_close(
            targets[1][name].logprobs, targets[len(dataset)][name].logprobs, rtol=1e-5, atol=1e-5
        )


def test_top_k_buckets_fold_the_student_as_the_teacher():
    """With the rest's bucket holding one token, the folded KL is the full one; with fewer buckets
    it is the KL of a coarser view of both distributions, which can only be smaller (the log-sum
    inequality), and grows as k does. A teacher with no mass outside its top k gives a finite term."""
    torch.manual_seed(0)
    vocab, temperature = 50, 2.0
    student, teacher = torch.randn(3, 5, vocab) * 3, torch.randn(3, 5, vocab) * 3
    full = softened(teacher, temperature)
    exact = kd_divergence(student, full, temperature=temperature).sum().item()

    def folded(k, target=full):
        return kd_divergence(student, *top_k_buckets(target, k), temperature=temperature).sum().item()

    assert folded(vocab - 1) == pytest.approx(exact, rel=1e-5)
    coarse = [folded(k) for k in (1, 4, 16, 48)]
    assert coarse == sorted(coarse) and coarse[-1] <= exact * (1 + 1e-6) and coarse[0] < 0.9 * exact
    one_hot = torch.full((3, 5, vocab), float("-inf")).index_fill(-1, torch.tensor([7]), 0.0)
    assert torch.isfinite(torch.tensor(folded(1, one_hot)))


def test_rows_sit_at_the_first_answer_positions():
    """The collator places an example's k targets after its LLM's tail, zeros elsewhere, and cuts
    them where the rows end."""
    logprobs = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    targets = TeacherTargets(logprobs, None, None)
    rows = targets.rows(torch.tensor([1, 0]), tail=2, width=6)["kd_logprobs"]
    assert rows.shape == (2, 6, 4) and torch.equal(rows[:, 2:5], logprobs[[1, 0]])
    assert not rows[:, :2].any() and not rows[:, 5:].any()
    short = targets.rows(torch.tensor([0]), tail=2, width=4)["kd_logprobs"]
    assert torch.equal(short[0, 2:], logprobs[0, :2])


def test_full_rows_where_they_fit_and_top_k_where_the_vocabulary_is_large():
    assert target_width(examples=8192, k=4, vocab=879, top_k=64) == 879  # the cpu profile's readers: 115 MB
    assert target_width(examples=87599, k=4, vocab=128256, top_k=64) == 64  # SQuAD x Llama-3: 180 GB as rows


@pytest.mark.slow
def test_a_resumed_run_rebuilds_its_targets_and_continues_bitwise(tmp_path):
    """Nothing of the targets is saved: a resumed run computes them again, the same ones, and
    trains on bitwise as the unbroken run did."""
    args = [*RUN, *ALL_TERMS_FLAGS, "--max-steps", "6"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    ok(run_train([*args, "--out-dir", str(straight)]))
    ok(run_train([*args, "--out-dir", str(split), "--stop-at-step", "3"]))
    proc = ok(run_train([*args, "--out-dir", str(split), "--resume"]))
    assert "distillation targets of 48 examples (the 48 of 512 that this run's steps draw)" in proc.stdout
    assert_same_run(straight, split, 3)
