"""One prompt contract: training's wire rows, the distillation teacher's rows and evaluation's wire
and text prompts put the same tokens around the middle (the wire or the prompt's tokens)."""

import json

import pytest
import torch

from conftest import CHAT_TEMPLATE, FAST, assert_one_line_error, instruct_reader, ok, run_module, run_train, tiny_llms
from latentwire.dataset import Collator, PromptDataset, synthetic_examples
from latentwire.eval import generation as gen
from latentwire.llm import LLM_NAMES, load_frozen_llm
from latentwire.prompting import DEFAULT_ANCHOR, DEFAULT_INSTRUCTION, PromptContract, PromptFormat

CPU = torch.device("cpu")
WIRE = "<wire>"  # stands for the M soft tokens in a row written out as tokens
# name -> (the run's format, the readers whose tokenizer gets CHAT_TEMPLATE)
FORMATS = {
    "default anchor": (PromptFormat(), ()),
    "no anchor": (PromptFormat(anchor=""), ()),
    "chat template": (PromptFormat(anchor="Answer:", chat_template="true"), LLM_NAMES),
    "auto, one instruct reader": (PromptFormat(), ("llama",)),
}


def with_template(llm):
    llm.tokenizer.chat_template = CHAT_TEMPLATE
    return llm


@pytest.fixture(scope="module", params=list(FORMATS))
def llms(request):
    prompt, instruct = FORMATS[request.param]
    llms = tiny_llms()
    for name, llm in llms.items():
        if name in instruct:
            with_template(llm)
        llm.contract = PromptContract.of(llm.tokenizer, prompt)
        assert llm.contract.chat == (name in instruct)
    return llms


def test_training_the_teacher_and_evaluation_read_the_same_tokens_around_the_middle(llms):
    examples = synthetic_examples(4, seed=21)
    batch = Collator.for_llms(llms, 512, 16, 32, teacher=True)([PromptDataset(examples)[i] for i in range(4)])
    for name, llm in llms.items():
        rows, lead, tail = batch["answers"][name], list(llm.contract.lead), list(llm.contract.tail)
        answers = gen.answer_ids(rows)
        for r, example in enumerate(examples):
            after = rows["input_ids"][r, : len(tail) + len(answers[r])].tolist()
            student = rows["lead_ids"][r].tolist() + [WIRE] + after
            teacher = rows["text_ids"][r][rows["text_mask"][r].bool()].tolist() + after
            prompt = llm.tokenizer(gen.prompt_text(example), add_special_tokens=False)["input_ids"]
            assert student == lead + [WIRE] + tail + answers[r]
            assert teacher == lead + prompt + tail + answers[r]
            assert teacher == gen.text_prompt_ids(llm, example, None) + answers[r]  # evaluation's text prompt


@torch.no_grad()
def test_evaluation_wire_prompt_is_the_start_of_the_training_row(llms):
    examples = synthetic_examples(3, seed=22)
    batch = Collator.for_llms(llms, 512, 16, 32)([PromptDataset(examples)[i] for i in range(3)])
    for name, llm in llms.items():
        rows = batch["answers"][name]
        soft = torch.randn(3, 8, llm.hidden_size)
        training = llm.wire_embeds(soft, rows["lead_ids"], rows["input_ids"])
        evaluation = gen.wire_prompts(llm, soft, rows["lead_ids"]).embeds
        assert torch.equal(evaluation, training[:, : evaluation.shape[1]])
        assert evaluation.shape[1] == len(llm.contract.lead) + 8 + len(llm.contract.tail)


@torch.no_grad()
def test_the_teacher_logits_are_the_readers_own_on_each_unpadded_text_prompt(llms):
    """Left-padded, masked and position-shifted as a batch, each row's kept logits equal the LLM
    reading that example's evaluation text prompt and answer alone."""
    examples = synthetic_examples(5, seed=23)
    batch = Collator.for_llms(llms, 512, 16, 32, teacher=True)([PromptDataset(examples)[i] for i in range(5)])
    for name, llm in llms.items():
        rows = batch["answers"][name]
        assert len(set(rows["text_mask"].sum(1).tolist())) > 1  # the prompts really are padded
        teacher = llm.teacher_logits(rows["text_ids"], rows["text_mask"], rows["input_ids"])
        assert teacher.shape[1] == rows["input_ids"].shape[1] + 1
        for r, (example, answer) in enumerate(zip(examples, gen.answer_ids(rows), strict=True)):
            alone = torch.tensor([gen.text_prompt_ids(llm, example, None) + answer])
            logits = llm.model(input_ids=alone).logits[0, -(len(answer) + 1) :]
            start = len(llm.contract.tail)  # the kept logit that predicts the answer's first token (see the labels)
            torch.testing.assert_close(teacher[r, start : start + len(answer) + 1], logits, rtol=1e-4, atol=1e-4)


def test_the_chat_template_frames_the_middle_and_the_instruction_follows_it():
    llm = with_template(load_frozen_llm("llama", "tiny", torch.float32, CPU))
    tok = llm.tokenizer
    for instruction, after in ((DEFAULT_INSTRUCTION, f"\n\n{DEFAULT_INSTRUCTION}"), ("", "")):
        contract = PromptContract.of(tok, PromptFormat(anchor="Answer:", instruction=instruction))
        assert contract.chat and contract.lead[0] == tok.bos_token_id
        assert tok.decode(contract.lead[1:]) == "<|user|>\n"
        assert tok.decode(contract.tail) == f"{after}<|end|>\n<|assistant|>\nAnswer:"


def test_auto_gives_each_reader_its_own_contract_and_false_the_bare_anchor():
    instruct, plain = (load_frozen_llm(n, "tiny", torch.float32, CPU) for n in LLM_NAMES)
    with_template(instruct)
    bare = PromptContract.of(plain.tokenizer, PromptFormat())
    assert PromptContract.of(instruct.tokenizer, PromptFormat()).chat and not bare.chat
    assert bare.tail == tuple(plain.tokenizer(DEFAULT_ANCHOR, add_special_tokens=False)["input_ids"])
    anchored = PromptContract.of(instruct.tokenizer, PromptFormat(chat_template="false"))
    assert not anchored.chat and anchored.lead == (instruct.tokenizer.bos_token_id,)


def test_a_chat_template_the_tokenizer_lacks_is_a_one_line_error(tmp_path, forked):
    result = forked("train.py", ["--profile", "cpu", "--chat-template", "true", "--out-dir", tmp_path / "run"])
    assert_one_line_error(result, "--chat-template true: the llama (tiny) tokenizer has no chat template")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_an_instruct_llama_beside_a_base_qwen_trains_and_evaluates_each_in_its_own_contract(tmp_path):
    """The opening line, the run's record and evaluation's report say which contract each reader
    got: the Llama (a tokenizer with a chat template) chat, the Qwen (none) the bare anchor."""
    reader = instruct_reader(tmp_path)
    out = tmp_path / "run"
    proc = ok(
        run_train(
            [
                "--profile",
                "cpu",
                *FAST,
                "--llama",
                str(reader),
                "--max-steps",
                "2",
                "--kd-weight",
                "0",
                "--micro-batch-size",
                "4",
                "--grad-accum-steps",
                "1",
                "--out-dir",
                str(out),
            ]
        )
    )
    opening = next(line for line in proc.stdout.splitlines() if line.startswith("prompt: "))
    assert opening.startswith("prompt: llama: its chat template") and "qwen: no chat template" in opening
    evaluation = ok(
        run_module(
            "latentwire.evaluate",
            ["--ckpt", str(out), "--eval-examples", "4", "--batch-size", "4", "--out-dir", str(tmp_path / "eval")],
        )
    )
    report = json.loads(next((tmp_path / "eval").glob("*.json")).read_text())
    assert report["settings"]["chat_template"] == "auto" and report["settings"]["prompts"] == opening[len("prompt: ") :]
    assert "Prompt contracts: llama: its chat template" in evaluation.stdout
