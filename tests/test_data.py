import json

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from latentwire.errors import UserError
from latentwire.data import (
    PAD_BYTE, Collator, PromptDataset, answer_text, hotpot_to_squad,
    load_examples, prompt_text, synthetic_corpus_text, synthetic_examples,
)
from latentwire.objectives import Objectives, target_counts
from latentwire.prompting import PromptContract, PromptFormat

torch.set_num_threads(1)

RECORDS = [
    {"context": "Ada lives in Paris.", "question": "Where does Ada live?", "answers": {"text": ["Paris"]}},
    {"context": "Bo is 31 years old.", "question": "How old is Bo?", "answers": {"text": [" 31 ", "31"]}},
]


@pytest.fixture(autouse=True)
def datasets_cache_in_tmp(tmp_path, monkeypatch):
    # The datasets json/parquet readers write an Arrow cache; keep it out of the home directory.
    import datasets
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf_cache")


def make_tokenizer(with_bos: bool) -> PreTrainedTokenizerFast:
    specials = {"unk_token": "<unk>", "eos_token": "</s>"}
    if with_bos:
        specials.update(bos_token="<s>", pad_token="<pad>")
    tok = Tokenizer(models.WordLevel(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=list(specials.values()), show_progress=False)
    tok.train_from_iterator(synthetic_corpus_text(n=200), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, **specials)


@pytest.fixture(scope="module")
def tokenizers():
    return {"llama": make_tokenizer(with_bos=True), "qwen": make_tokenizer(with_bos=False)}


# --- synthetic data -----------------------------------------------------------------------

def test_synthetic_is_deterministic_per_seed():
    assert synthetic_examples(64, seed=3) == synthetic_examples(64, seed=3)
    assert synthetic_examples(64, seed=3) != synthetic_examples(64, seed=4)


def test_synthetic_examples_are_distinct_short_ascii_spans():
    examples = synthetic_examples(8192, seed=0)
    pairs = {(ex["context"], ex["question"]) for ex in examples}
    assert len(pairs) >= 0.95 * len(examples)
    for ex in examples:
        assert answer_text(ex) in ex["context"]
        assert ex["context"].isascii() and 30 <= len(ex["context"]) <= 200  # short: the encoder must find the fact


def test_synthetic_split_uses_a_different_seed():
    train = load_examples("synthetic", "train", 32, seed=0)
    held_out = load_examples("synthetic", "validation", 32, seed=0)
    assert train == synthetic_examples(32, 0)
    assert held_out != train and len(held_out) == 32


def test_corpus_text_holds_contexts_questions_and_answers():
    lines = synthetic_corpus_text(n=10, seed=1)
    ex = synthetic_examples(10, 1)[0]
    assert lines[:3] == [ex["context"], ex["question"], answer_text(ex)]


# --- local files --------------------------------------------------------------------------

def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_file(tmp_path, suffix, records):
    path = tmp_path / f"data{suffix}"
    if suffix == ".jsonl":
        return write_jsonl(path, records)
    if suffix == ".json":
        path.write_text(json.dumps(records))
        return str(path)
    import datasets
    datasets.Dataset.from_list(records).to_parquet(str(path))
    return str(path)


@pytest.mark.parametrize("suffix", [".json", ".jsonl", ".parquet"])
def test_local_files_load_in_squad_layout(tmp_path, suffix):
    path = write_file(tmp_path, suffix, [dict(r, id=str(i)) for i, r in enumerate(RECORDS)])
    examples = load_examples(path, "validation", 100, seed=0)
    assert examples == [{k: r[k] for k in ("context", "question", "answers")} for r in RECORDS]
    assert answer_text(examples[1]) == "31"


def test_json_lines_in_a_json_file(tmp_path):
    path = write_jsonl(tmp_path / "lines.json", RECORDS)
    assert len(load_examples(path, "train", 100, seed=0)) == 2


def test_single_record_json(tmp_path):
    path = tmp_path / "one.json"
    path.write_text(json.dumps(RECORDS[0]))
    assert load_examples(str(path), "train", 100, seed=0) == [RECORDS[0]]


def test_nested_squad_json(tmp_path):
    doc = {"version": "1.1", "data": [{"title": "T", "paragraphs": [
        {"context": "Ada lives in Paris. Bo lives in Oslo.", "qas": [
            {"id": "a", "question": "Where does Ada live?", "answers": [{"text": "Paris", "answer_start": 13}]},
            {"id": "b", "question": "Where does Bo live?", "answers": [{"text": "Oslo", "answer_start": 32}]},
        ]}]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(doc))
    examples = load_examples(str(path), "train", 100, seed=0)
    assert [answer_text(ex) for ex in examples] == ["Paris", "Oslo"]
    assert examples[1]["question"] == "Where does Bo live?"


def test_num_examples_caps_a_local_dataset_with_a_seeded_subset(tmp_path):
    records = [dict(RECORDS[0], question=f"q{i}") for i in range(20)]
    path = write_jsonl(tmp_path / "many.jsonl", records)
    subset = load_examples(path, "train", 5, seed=1)
    assert len(subset) == 5 and subset == load_examples(path, "train", 5, seed=1)


def test_hotpot_conversion_joins_paragraph_sentences():
    record = {"question": "Who?", "answer": "Ada",
              "context": {"title": ["A", "B"], "sentences": [["Ada was born.", " She wrote."], ["Bo ran."]]}}
    assert hotpot_to_squad(record) == {
        "context": "Ada was born. She wrote.\nBo ran.", "question": "Who?", "answers": {"text": ["Ada"]}}


# --- bad input ----------------------------------------------------------------------------

def test_missing_file_names_the_path(tmp_path):
    path = str(tmp_path / "nope.jsonl")
    with pytest.raises(UserError, match="nope.jsonl"):
        load_examples(path, "train", 10, seed=0)


def test_unknown_dataset_lists_accepted_names():
    with pytest.raises(UserError, match="synthetic, squad, hotpot_qa"):
        load_examples("imagenet", "train", 10, seed=0)


@pytest.mark.parametrize("name, text", [("empty.json", "[]"), ("empty.jsonl", ""), ("blank.jsonl", "\n\n")])
def test_empty_text_file(tmp_path, name, text):
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(UserError, match=f"{name} has no examples"):
        load_examples(str(path), "train", 10, seed=0)


def test_empty_parquet_file(tmp_path):
    import datasets
    path = str(tmp_path / "empty.parquet")
    datasets.Dataset.from_list(RECORDS).select([]).to_parquet(path)
    with pytest.raises(UserError, match="empty.parquet has no examples"):
        load_examples(path, "train", 10, seed=0)


@pytest.mark.parametrize("name, content", [("broken.jsonl", b"{not json\n"), ("broken.parquet", b"PAR1 nope")])
def test_unreadable_file(tmp_path, name, content):
    path = tmp_path / name
    path.write_bytes(content)
    with pytest.raises(UserError, match=f"could not read dataset file .*{name}"):
        load_examples(str(path), "train", 10, seed=0)


def test_existing_file_of_another_type(tmp_path):
    path = tmp_path / "data.csv"
    path.write_text("context,question\n")
    with pytest.raises(UserError, match=r"data\.csv must end in \.json"):
        load_examples(str(path), "train", 10, seed=0)


@pytest.mark.parametrize("bad, field", [
    ({"question": "q", "answers": {"text": ["a"]}}, "'context'"),
    ({"context": "c", "answers": {"text": ["a"]}}, "'question'"),
    ({"context": "c", "question": "q"}, "'answers.text'"),
    ({"context": "c", "question": "q", "answers": {"answer_start": [0]}}, "'answers.text'"),
    ({"context": "c", "question": "q", "answers": {"text": []}}, "'answers.text'"),
    ({"context": "c", "question": "q", "answers": {"text": ["  "]}}, "'answers.text'"),
])
def test_bad_record_names_field_and_file(tmp_path, bad, field):
    path = write_jsonl(tmp_path / "bad.jsonl", [bad])
    with pytest.raises(UserError, match=rf"bad\.jsonl.*{field}"):
        load_examples(path, "train", 10, seed=0)


def test_bad_record_in_nested_squad_names_field(tmp_path):
    doc = {"data": [{"paragraphs": [{"context": "c", "qas": [{"question": "q", "answers": []}]}]}]}
    path = tmp_path / "squad.json"
    path.write_text(json.dumps(doc))
    with pytest.raises(UserError, match=r"squad\.json.*'answers\.text'"):
        load_examples(str(path), "train", 10, seed=0)


# --- prompts and batches ------------------------------------------------------------------

def test_prompt_dataset_items():
    ds = PromptDataset(RECORDS)
    item = ds[1]
    assert len(ds) == 2
    assert item == {"prompt": b"question: How old is Bo?\ncontext: Bo is 31 years old.", "answer": "31", "index": 1}
    assert item["prompt"].decode() == prompt_text(RECORDS[1])


# Words of the corpus the word-level test tokenizers know: a two-token tail.
ANCHOR = "What is"


def contracts_of(tokenizers, anchor=ANCHOR):
    return {name: PromptContract.of(tok, PromptFormat(anchor)) for name, tok in tokenizers.items()}


def collate(tokenizers, examples, teacher=False, **overrides):
    settings = dict(max_prompt_bytes=512, max_answer_tokens=16, pad_multiple=32) | overrides
    ds = PromptDataset(examples)
    return Collator(tokenizers, contracts_of(tokenizers), teacher=teacher, **settings)([ds[i] for i in range(len(ds))]), ds


def test_collate_bytes_are_padded_to_a_multiple(tokenizers):
    examples = synthetic_examples(5, seed=2)
    batch, ds = collate(tokenizers, examples)
    lengths = [len(ds[i]["prompt"]) for i in range(5)]
    assert batch["bytes"].dtype == torch.long and batch["byte_mask"].dtype == torch.bool
    assert batch["bytes"].shape == (5, -(-max(lengths) // 32) * 32)
    assert batch["byte_mask"].sum(1).tolist() == lengths
    assert (batch["bytes"][~batch["byte_mask"]] == PAD_BYTE).all()
    assert bytes(batch["bytes"][0, :lengths[0]].tolist()) == ds[0]["prompt"]
    assert batch["index"].tolist() == [0, 1, 2, 3, 4]


def test_collate_truncates_prompts(tokenizers):
    batch, ds = collate(tokenizers, synthetic_examples(3, seed=2), max_prompt_bytes=50, pad_multiple=32)
    assert batch["bytes"].shape == (3, 64)  # 50 rounded up to the pad multiple
    assert batch["byte_mask"].sum(1).tolist() == [50, 50, 50]
    assert bytes(batch["bytes"][1, :50].tolist()) == ds[1]["prompt"][:50]


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_collate_answer_labels(tokenizers, name):
    """[lead ; wire ; tail + answer]: the lead (BOS, Llama only) before the wire, the tail (the anchor)
    before the answer and never a target, the EOS the last answer token's target, padding ignored."""
    tok = tokenizers[name]
    examples = synthetic_examples(6, seed=5)
    batch, _ = collate(tokenizers, examples)
    rows = batch["answers"][name]
    input_ids, labels = rows["input_ids"], rows["labels"]
    lead = [tok.bos_token_id] if name == "llama" else []
    tail = tok(ANCHOR, add_special_tokens=False)["input_ids"]
    pad_id = tok.pad_token_id if name == "llama" else tok.eos_token_id
    answers = [tok(answer_text(ex), add_special_tokens=False)["input_ids"] for ex in examples]
    T = input_ids.shape[1]
    assert len(tail) == 2 and rows["lead_ids"].tolist() == [lead] * 6
    assert T % 8 == 0 and T >= len(tail) + max(map(len, answers)) and labels.shape == (6, T + 1)
    for row, answer in enumerate(answers):
        ids = tail + answer
        assert input_ids[row].tolist() == ids + [pad_id] * (T - len(ids))
        assert labels[row].tolist() == [-100] * len(tail) + answer + [tok.eos_token_id] + [-100] * (T - len(ids))
    counts = target_counts(batch, Objectives())[list(batch["answers"]).index(name)]
    assert counts.tolist() == [sum(len(a) + 1 for a in answers)]
    assert "text_ids" not in rows  # no teacher asked for: the prompt is not tokenised


@pytest.mark.parametrize("name", ["llama", "qwen"])
def test_collate_teacher_prompts_end_where_the_answer_rows_begin(tokenizers, name):
    """The teacher's [lead ; prompt] is padded on the left, so each row's prompt ends at the last
    column and the input_ids (tail + answer) follow it directly, as the wire does."""
    tok = tokenizers[name]
    examples = synthetic_examples(5, seed=6)
    batch, ds = collate(tokenizers, examples, teacher=True, max_prompt_bytes=90)
    rows = batch["answers"][name]
    lead = [tok.bos_token_id] if name == "llama" else []
    assert rows["text_ids"].shape == rows["text_mask"].shape and rows["text_ids"].shape[1] % 8 == 0
    for row in range(5):
        real = rows["text_mask"][row].bool()
        prompt = ds[row]["prompt"][:90].decode()  # the bytes the encoder reads
        assert rows["text_ids"][row][real].tolist() == lead + tok(prompt, add_special_tokens=False)["input_ids"]
        assert real[-1] and (real.long().diff() >= 0).all()  # padding only on the left


def test_collate_truncates_answers(tokenizers):
    long_answer = dict(RECORDS[0], answers={"text": ["Paris is a city in Paris with a pet cat"]})
    batch, _ = collate(tokenizers, [long_answer], max_answer_tokens=3)
    llama, qwen = batch["answers"]["llama"], batch["answers"]["qwen"]
    assert (llama["input_ids"][0] != tokenizers["llama"].pad_token_id).sum() == 2 + 3  # tail + 3
    assert list(batch["answers"]) == ["llama", "qwen"]
    assert target_counts(batch, Objectives()).tolist() == [[4], [4]]  # 3 answer tokens + EOS
    assert qwen["labels"][0, 2 + 3] == tokenizers["qwen"].eos_token_id  # after the 2 tail tokens


def test_collator_rejects_a_tokenizer_without_eos(tokenizers):
    tok = make_tokenizer(with_bos=True)
    tok.eos_token = None
    with pytest.raises(UserError, match="no EOS"):
        Collator({"llama": tok}, contracts_of({"llama": tok}), 64, 8, 8)
