"""The model's correctness rules, in-process on the cpu profile's tiny LLMs."""

import pytest
import torch

from conftest import ALL_TERMS, distilled_collator, wrapped_readers
from latentwire.dataset import Collator, PromptDataset, label_positions, synthetic_examples
from latentwire.llm import load_frozen_llm
from latentwire.model import WireEncoder
from latentwire.objectives import Objectives, forward_loss_sums, target_counts
from latentwire.settings import load_config

CPU = torch.device("cpu")
ANSWER_CE = Objectives()
# Every term on; k_tokens 2 is fewer than most answers' targets, so k_token_ce is not answer_ce.


@pytest.fixture(scope="module")
def cfg():
    return load_config(["--profile", "cpu", "--dropout", "0"])


# The byte encoder's two patchings: a fixed grid, and each word starting a patch read by an MLP.
PATCHINGS = {"grid": [], "word patches": ["--word-patches", "true", "--patch-mlp", "true"]}


@pytest.fixture(scope="module", params=list(PATCHINGS))
def patched_cfg(request):
    return load_config(["--profile", "cpu", "--dropout", "0", *PATCHINGS[request.param]])


def build(cfg, seed=0, dtype=torch.float32):
    llms = {n: load_frozen_llm(n, "tiny", dtype, CPU) for n in ("llama", "qwen")}
    torch.manual_seed(seed)
    model = WireEncoder.for_llms(cfg.wire, llms)
    return model, llms


def batch_of(cfg, llms, n=6, pad_multiple=None, max_answer_tokens=None, distilled=False):
    """`distilled`: with the distillation targets of ALL_TERMS."""
    dataset = PromptDataset(synthetic_examples(64, 3))
    settings = (
        cfg.data.max_prompt_bytes,
        max_answer_tokens or cfg.data.max_answer_tokens,
        pad_multiple or cfg.data.pad_multiple,
    )
    if distilled:
        collate = distilled_collator(llms, dataset, ALL_TERMS, *settings, word_patch=cfg.wire.word_patch)
    else:
        collate = Collator.for_llms(llms, *settings, word_patch=cfg.wire.word_patch)
    return collate([dataset[i] for i in range(n)])


def pad_more(batch, extra_bytes, extra_tokens):
    """The same examples with more padding on every padded axis."""
    from latentwire.dataset import PAD_BYTE

    pad = torch.nn.functional.pad
    bytes_ = pad(batch["bytes"], (0, extra_bytes), value=PAD_BYTE)
    out = {"bytes": bytes_, "byte_mask": bytes_ != PAD_BYTE, "answers": {}}
    for name, a in batch["answers"].items():
        out["answers"][name] = {
            "lead_ids": a["lead_ids"],
            "input_ids": pad(a["input_ids"], (0, extra_tokens), value=0),
            "labels": pad(a["labels"], (0, extra_tokens), value=-100),
            "label_positions": a["label_positions"],
            "kd_logprobs": pad(a["kd_logprobs"], (0, 0, 0, extra_tokens)),
        }
    return out


@pytest.mark.parametrize("extra_bytes", [96, 5])  # whole byte patches, and a part of one
def test_padding_never_changes_the_loss(patched_cfg, extra_bytes):
    """Every term, distillation's included: more padding on the right of the rows changes neither a
    count nor a sum (the teacher's own padding: test_distillation)."""
    cfg = patched_cfg
    model, llms = build(cfg)
    batch = batch_of(cfg, llms, distilled=True)
    longer = pad_more(batch, extra_bytes=extra_bytes, extra_tokens=11)
    assert torch.equal(target_counts(batch, ALL_TERMS), target_counts(longer, ALL_TERMS))
    short, long_ = forward_loss_sums(model, llms, batch, ALL_TERMS), forward_loss_sums(model, llms, longer, ALL_TERMS)
    torch.testing.assert_close(long_, short, rtol=1e-5, atol=1e-5)


def test_each_example_is_independent_of_its_batch_mates(patched_cfg):
    """Padding to the longest example of a batch must not change a short example's loss terms."""
    cfg = patched_cfg
    model, llms = build(cfg)
    batch = batch_of(cfg, llms, distilled=True)
    together = forward_loss_sums(model, llms, batch, ALL_TERMS)
    alone = sum(forward_loss_sums(model, llms, slice_batch(batch, i), ALL_TERMS) for i in range(6))
    torch.testing.assert_close(alone, together, rtol=1e-5, atol=1e-4)


def slice_batch(batch, i):
    """Example i alone, with no padding after it (word patches keep theirs between words)."""
    from latentwire.dataset import PAD_BYTE

    n = int(batch["byte_mask"][i].nonzero().max()) + 1
    b = {"bytes": batch["bytes"][i : i + 1, :n], "byte_mask": batch["byte_mask"][i : i + 1, :n], "answers": {}}
    for name, a in batch["answers"].items():
        t = int((a["labels"][i] != -100).nonzero().max()) + 1  # up to and including the EOS target
        labels = a["labels"][i : i + 1, :t]
        b["answers"][name] = {
            "lead_ids": a["lead_ids"][i : i + 1],
            "input_ids": a["input_ids"][i : i + 1, : t - 1],
            "labels": labels,
            "label_positions": label_positions(labels),
            "kd_logprobs": a["kd_logprobs"][i : i + 1, :t],
        }
    assert b["byte_mask"][0, -1] and torch.equal(b["bytes"] == PAD_BYTE, ~b["byte_mask"])
    return b


def test_frozen_llms_get_no_grads_but_pass_them_to_the_wire(cfg):
    model, llms = build(cfg)
    forward_loss_sums(model, llms, batch_of(cfg, llms, distilled=True), ALL_TERMS).sum().backward()
    for llm in llms.values():
        assert not llm.model.training
        assert all(not p.requires_grad and p.grad is None for p in llm.model.parameters())
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters())


def test_adapters_emit_the_llm_embedding_scale(cfg):
    model, llms = build(cfg)
    batch = batch_of(cfg, llms)
    soft = model(batch["bytes"], batch["byte_mask"])
    for name, llm in llms.items():
        assert soft[name].shape[-2:] == (cfg.wire.num_latents, llm.hidden_size)
        rms = soft[name].pow(2).mean().sqrt().item()
        assert rms == pytest.approx(llm.embed_rms(), rel=1e-3)


def test_tiny_llms_are_the_same_every_time_and_different_from_each_other():
    a, b = load_frozen_llm("llama", "tiny", torch.float32, CPU), load_frozen_llm("llama", "tiny", torch.float32, CPU)
    q = load_frozen_llm("qwen", "tiny", torch.float32, CPU)
    for pa, pb in zip(a.model.parameters(), b.model.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert a.hidden_size != q.hidden_size and len(a.tokenizer) != len(q.tokenizer)
    assert a.contract.lead == (a.tokenizer.bos_token_id,) and q.contract.lead == ()


def wire_gradients(cfg, readers: dict, policy: str) -> dict[str, torch.Tensor]:
    """The gradients of the trainable weights and of the wire each reader reads (the input gradient
    through its frozen layers), the readers' decoder layers checkpointed by `policy`."""
    llms = wrapped_readers(readers, policy)
    torch.manual_seed(0)
    model = WireEncoder.for_llms(cfg.wire, llms)
    wire = {}

    def keep_wire(module, args, soft):
        for name, tokens in soft.items():
            tokens.retain_grad()
            wire[f"wire.{name}"] = tokens

    model.register_forward_hook(keep_wire)
    forward_loss_sums(model, llms, batch_of(cfg, llms), ANSWER_CE).sum().backward()
    return {**{n: p.grad for n, p in model.named_parameters()}, **{n: t.grad for n, t in wire.items()}}


@pytest.fixture(scope="module")
def kept_gradients(cfg, tiny_readers):
    return wire_gradients(cfg, tiny_readers, "none")


@pytest.mark.parametrize("policy", ["selective", "full"])
def test_activation_checkpointing_gives_the_same_gradients(cfg, tiny_readers, kept_gradients, policy):
    """Recomputing runs the same fp32 operations on the same values: the same gradients but for the
    order a kernel sums in, which the recompute's fresh buffers may change (their alignment picks
    the CPU's matmul path). Reassociating a sum of K terms moves it by at most K x eps of the sum of
    their magnitudes; K is at most the readers' widest reduction, and each gradient's largest
    magnitude stands for that sum."""
    widest = max(
        max(llm.model.config.intermediate_size, llm.model.config.hidden_size, llm.model.config.vocab_size)
        for llm in tiny_readers.values()
    )
    bound = widest * torch.finfo(torch.float32).eps
    got = wire_gradients(cfg, tiny_readers, policy)
    assert got.keys() == kept_gradients.keys() and {"wire.llama", "wire.qwen"} <= got.keys()
    for name, want in kept_gradients.items():
        torch.testing.assert_close(got[name], want, rtol=bound, atol=bound * want.abs().max().item(), msg=name)


def test_activation_checkpointing_wraps_every_decoder_layer(tiny_readers):
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper

    for llm in wrapped_readers(tiny_readers, "selective").values():
        layers = llm.model.get_decoder().layers
        assert len(layers) == llm.model.config.num_hidden_layers
        assert all(isinstance(layer, CheckpointWrapper) for layer in layers)


@pytest.mark.slow
def test_hot_path_compiles_without_graph_breaks(cfg):
    import torch._dynamo

    model, llms = build(cfg)
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(forward_loss_sums)(model, llms, batch_of(cfg, llms), ANSWER_CE)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1


def test_rotary_scores_depend_only_on_the_distance_between_positions():
    """The byte encoder's positions: shifting a query and a key by the same number of patches
    leaves their score as it was, and a rotation keeps each vector's length."""
    from latentwire.model import rotary_tables, rotate

    torch.manual_seed(0)
    q, k = torch.randn(16), torch.randn(16)
    tables = rotary_tables(40, 16, CPU)

    def at(x, pos):  # x at every one of 40 positions ([batch, heads, positions, head_dim]), rotated, read at pos
        return rotate(x.expand(1, 1, 40, 16), tables)[0, 0, pos]

    near, far = at(q, 3) @ at(k, 10), at(q, 30) @ at(k, 37)
    torch.testing.assert_close(near, far, rtol=1e-5, atol=1e-5)
    assert not torch.isclose(near, at(q, 3) @ at(k, 4), atol=1e-2)
    torch.testing.assert_close(at(q, 25).norm(), q.norm())


def test_the_hashed_patch_code_gives_each_age_a_row_of_its_own():
    """--patch-hash-buckets: a patch's row depends on its bytes alone, in range, and the ages a
    linear patch code tells apart by one summand (" 23" and " 24", word-patched) get rows of their own."""
    from latentwire.dataset import PAD_BYTE
    from latentwire.model import patch_hashes

    ages = torch.tensor([[32, ord(str(age)[0]), ord(str(age)[1]), PAD_BYTE] for age in range(20, 50)])
    rows = patch_hashes(ages[None], 4096)[0]
    assert rows.shape == (30,) and len(set(rows.tolist())) == 30 and 0 <= rows.min() and rows.max() < 4096
    assert torch.equal(patch_hashes(torch.stack([ages.flip(0), ages]), 4096), torch.stack([rows.flip(0), rows]))


def test_queries_that_read_the_question_start_as_the_plain_ones_and_read_its_first_line(cfg):
    """--question-queries: the pooler's queries start from the mean feature of the prompt's first
    line (its question; word-patched, its words' patches exactly), projected by weights that start
    at zero, so training starts from the plain pooler's wire; trained, the wire depends on them."""
    from dataclasses import replace

    from latentwire.dataset import prompt_text, round_up

    model, llms = build(replace(cfg, wire=replace(cfg.wire, question_queries=False)))
    asking = WireEncoder.for_llms(replace(cfg.wire, question_queries=True), llms)
    missing, unexpected = asking.load_state_dict(model.state_dict(), strict=False)
    assert sorted(missing) == ["pooler.question.bias", "pooler.question.weight"] and not unexpected
    batch = batch_of(cfg, llms)
    wire = model.wire(batch["bytes"], batch["byte_mask"])
    assert torch.equal(asking.wire(batch["bytes"], batch["byte_mask"]), wire)
    questions = [prompt_text(e).split("\n")[0].encode() for e in synthetic_examples(64, 3)[:6]]
    patches = [sum(round_up(len(w), 4) // 4 for w in q.replace(b" ", b"\0 ").split(b"\0")) for q in questions]
    assert asking.question_patches(batch["bytes"], batch["byte_mask"]).sum(1).tolist() == patches
    torch.nn.init.normal_(asking.pooler.question.weight)
    assert not torch.allclose(asking.wire(batch["bytes"], batch["byte_mask"]), wire)
