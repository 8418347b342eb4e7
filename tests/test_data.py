import contextlib
import json
import os
from fractions import Fraction
from pathlib import Path

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from latentwire.data_store import Selected, hotpot_to_squad
from latentwire.dataset import (
    PAD_BYTE,
    Collator,
    DataSources,
    PromptDataset,
    TrainingSet,
    answer_end_byte,
    answer_text,
    answers_past_cut,
    load_examples,
    mixture_parts,
    prompt_text,
    round_up,
    synthetic_corpus_text,
    synthetic_examples,
)
from latentwire.harness.data_identity import fingerprint
from latentwire.harness.errors import UserError
from latentwire.objectives import Objectives, WireTask, target_counts
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


def test_data_seed_holds_the_examples_while_the_run_s_seed_changes():
    """Runs of several seeds (bench/seed_spread.py) train and are evaluated on the same examples
    with --data-seed; without it the examples follow the run's seed, as they always did."""
    from latentwire.settings import load_config

    def examples(*flags: str) -> tuple[list[dict], list[dict]]:
        cfg = load_config(["--profile", "cpu", *flags])
        sources = DataSources.of(cfg.data, cfg.training.seed)
        return sources.train_examples(16), sources.held_out_examples(16, "synthetic")

    assert examples("--seed", "3", "--data-seed", "0") == examples("--seed", "0") == examples("--data-seed", "0")
    assert examples("--seed", "3") != examples("--seed", "0")


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
    doc = {
        "version": "1.1",
        "data": [
            {
                "title": "T",
                "paragraphs": [
                    {
                        "context": "Ada lives in Paris. Bo lives in Oslo.",
                        "qas": [
                            {
                                "id": "a",
                                "question": "Where does Ada live?",
                                "answers": [{"text": "Paris", "answer_start": 13}],
                            },
                            {
                                "id": "b",
                                "question": "Where does Bo live?",
                                "answers": [{"text": "Oslo", "answer_start": 32}],
                            },
                        ],
                    }
                ],
            }
        ],
    }
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


# --- what the data is: answers past the cut, held-out examples, identity --------------------------


def test_answer_end_is_where_the_encoder_reads_the_answer_s_last_byte():
    """From answer_start where the record has one (the first of two occurrences here is not the
    answer), else the first occurrence; counted in UTF-8 bytes of the prompt (é is two)."""
    context = "Zoé met Ada. Later Ada lives in Paris."
    for starts, at in ((None, context.index("Ada")), ([context.rindex("Ada")], context.rindex("Ada"))):
        answers = {"text": ["Ada"], **({"answer_start": starts} if starts else {})}
        ex = {"context": context, "question": "Who?", "answers": answers}
        prompt = prompt_text(ex).encode()
        end = answer_end_byte(ex)
        assert prompt[end - 3 : end] == b"Ada"
        assert end == len("question: Who?\ncontext: ") + len(context[:at].encode()) + 3  # é: 2 bytes
    assert answer_end_byte({"context": context, "question": "Who?", "answers": {"text": ["Bo"]}}) is None
    # An answer_start that does not point at the answer is searched for instead, as a whole word.
    wrong = {"context": context, "question": "Who?", "answers": {"text": ["Ada"], "answer_start": [900]}}
    assert answer_end_byte(wrong) == answer_end_byte({**wrong, "answers": {"text": ["Ada"]}})
    dry = {"context": "It rained yesterday.", "question": "Dry?", "answers": {"text": ["yes"]}}
    assert answer_end_byte(dry) is None


def long_records(n_reachable: int, n_cut: int) -> list[dict]:
    """Records whose answer (with answer_start) is at the start of a long context, or after 900
    bytes of filler."""
    filler = "Nothing happened that day. " * 34  # 918 bytes
    near = [
        {
            "context": f"Ada{i} lives in Oslo. " + filler,
            "question": f"Where does Ada{i} live?",
            "answers": {"text": ["Oslo"], "answer_start": [len(f"Ada{i} lives in ")]},
        }
        for i in range(n_reachable)
    ]
    far = [
        {
            "context": filler + f"Bo{i} lives in Lima.",
            "question": f"Where does Bo{i} live?",
            "answers": {"text": ["Lima"], "answer_start": [len(filler) + len(f"Bo{i} lives in ")]},
        }
        for i in range(n_cut)
    ]
    return near + far


def test_answers_past_the_cut_are_counted_dropped_on_request_and_refused_when_all_are(tmp_path):
    path = write_jsonl(tmp_path / "long.jsonl", long_records(6, 14))
    assert answers_past_cut(load_examples(path, "train", 100, 0), 512).count(True) == 14
    sources = DataSources(path, None, 0.1, seed=0)  # 2 of the 20 held out
    kept = TrainingSet.load(sources, 100, 512, drop_cut_answers=False)
    past = answers_past_cut(kept.examples, 512).count(True)
    assert (kept.loaded, kept.past_cut, kept.dropped) == (18, past, 0) and past >= 12
    assert kept.summary(512).startswith(
        f"{past} of 18 training examples ({100 * past / 18:.1f}%) have their answer "
        "past max_prompt_bytes=512; --drop-cut-answers true drops them"
    )
    dropped = TrainingSet.load(sources, 100, 512, drop_cut_answers=True)
    assert dropped.dropped == past and not any(answers_past_cut(dropped.examples, 512))
    assert dropped.facts([18 - past]) == {
        "train_examples": 18 - past,
        "train_answers_past_cut": past,
        "train_examples_dropped": past,
    }
    assert TrainingSet.load(sources, 100, 4096, drop_cut_answers=True).past_cut == 0
    all_cut = write_jsonl(tmp_path / "cut.jsonl", long_records(0, 20))
    with pytest.raises(UserError, match=r"every answer of .*cut.jsonl .* lies past max_prompt_bytes=512 \(18 of 18\)"):
        TrainingSet.load(DataSources(all_cut, None, 0.1, seed=0), 100, 512, drop_cut_answers=True)


def test_a_local_file_holds_out_a_seeded_part_that_training_never_sees(tmp_path):
    records = [dict(RECORDS[0], question=f"q{i}") for i in range(50)]
    path = write_jsonl(tmp_path / "file.jsonl", records)
    sources = DataSources(path, None, 0.1, seed=3)
    train, held = sources.train_examples(100), sources.held_out_examples(100, sources.held_out_source())
    assert len(held) == 5 and len(train) == 45
    assert sorted(ex["question"] for ex in [*train, *held]) == sorted(r["question"] for r in records)
    assert all(ex in held for ex in sources.held_out_examples(2, path))  # fewer asked for: some of the same
    assert held == DataSources(path, None, 0.1, seed=3).held_out_examples(100, path)  # the same at evaluation
    assert held != DataSources(path, None, 0.1, seed=4).held_out_examples(100, path)
    assert sources.describe_held_out(path) == (
        f"a seeded 10% of {path} (at least one example) that training never sees"
    )
    # Named held-out examples: all of the training file trains, all of the other file is held out.
    other = write_jsonl(tmp_path / "other.jsonl", RECORDS)
    named = DataSources(path, other, 0.1, seed=3)
    assert len(named.train_examples(100)) == 50 and named.held_out_examples(100, named.held_out_source()) == RECORDS
    assert named.describe_held_out(path) == f"{path}, which the run trained on"
    assert DataSources("squad", None, 0.1, 0).describe_held_out("squad") == "squad's validation split"
    with pytest.raises(UserError, match="is the training file itself"):
        DataSources(path, str(tmp_path / "." / "file.jsonl"), 0.1, seed=3)
    one = write_jsonl(tmp_path / "one.jsonl", RECORDS[:1])
    small = DataSources(one, None, 0.1, 0)  # nothing can be held out: neither split loads
    for load in (lambda: small.train_examples(10), lambda: small.held_out_examples(10, one)):
        with pytest.raises(UserError, match="too few to hold any out"):
            load()


def test_the_fingerprint_changes_with_any_example_and_their_order():
    examples = synthetic_examples(20, seed=0)
    assert fingerprint(examples) == fingerprint(synthetic_examples(20, seed=0))
    changed = [*examples[:-1], dict(examples[-1], question=examples[-1]["question"] + " ")]
    assert (
        len({fingerprint(examples), fingerprint(changed), fingerprint(examples[::-1]), fingerprint(examples[:-1])}) == 4
    )


def test_hotpot_conversion_joins_paragraph_sentences(monkeypatch):
    """...and a hub dataset, as datasets caches it, is stored so, each split of it on its own."""
    import datasets

    import latentwire.data_store as store

    record = {
        "question": "Who?",
        "answer": "Ada",
        "context": {"title": ["A", "B"], "sentences": [["Ada was born.", " She wrote."], ["Bo ran."]]},
    }
    squad = {"context": "Ada was born. She wrote.\nBo ran.", "question": "Who?", "answers": {"text": ["Ada"]}}
    assert hotpot_to_squad(record) == squad
    hub = {"validation": [record], "train": [{**record, "question": "Who, then?"}]}
    monkeypatch.setattr(store, "load_hub", lambda name, split: datasets.Dataset.from_list(hub[split]))
    assert load_examples("hotpot_qa", "validation", 10, seed=0) == [squad]
    assert load_examples("hotpot_qa", "train", 10, seed=0) == [{**squad, "question": "Who, then?"}]


def legacy_records() -> list[dict]:
    """A file of 50 synthetic examples, most with their answer_start (as the identities below were
    recorded by the code of before the store, commit 2fcbf60)."""
    records = []
    for i, ex in enumerate(synthetic_examples(50, 3)):
        answer = ex["answers"]["text"][0]
        starts = {} if i % 7 == 0 else {"answer_start": [ex["context"].index(answer)]}
        records.append({"id": str(i), **ex, "answers": {"text": [answer], **starts}})
    return records


@pytest.mark.parametrize(
    "dataset, seed, n, max_bytes, drop, examples, recorded",
    [
        ("synthetic", 0, 64, 512, False, 64, "28cff8ad70890ca5"),  # the cpu profile's set, as a run records it
        ("file", 0, 100, 4096, False, 45, "2c1cc12ef372ed87"),
        ("file", 5, 20, 4096, False, 20, "fa4340156eba5e43"),  # a seeded subset
        ("file", 0, 100, 100, True, 25, "28cbf3c25e8d3a01"),  # answers past the cut dropped
    ],
)
def test_a_single_source_is_the_data_earlier_versions_recorded(
    tmp_path, dataset, seed, n, max_bytes, drop, examples, recorded
):
    """A checkpoint's meta.json "data" from before the store names the same data as today's identity
    of the same source (harness.data_identity.same_data), so it resumes on it."""
    from latentwire.harness.data_identity import same_data

    name = dataset if dataset == "synthetic" else write_jsonl(tmp_path / "f.jsonl", legacy_records())
    identity = TrainingSet.load(DataSources(name, None, 0.1, seed), n, max_bytes, drop).identity()
    fraction = 0.0 if dataset == "synthetic" else 0.1
    old = {"dataset": name, "examples": examples, "fingerprint": recorded, "held_out_fraction": fraction}
    assert identity == {**old, "dataset": identity["dataset"]} and same_data(old, identity)


def count_checks(monkeypatch) -> list[int]:
    """How many records latentwire.dataset.check_example checks from now on."""
    import latentwire.dataset as dataset

    calls, check = [0], dataset.check_example
    monkeypatch.setattr(dataset, "check_example", lambda *args: calls.__setitem__(0, calls[0] + 1) or check(*args))
    return calls


def test_a_file_is_checked_once_per_content_and_read_by_index_from_its_store(tmp_path, monkeypatch):
    """The first start converts and checks every record; a later start (a requeue, another split, a
    copy of the file elsewhere) reads the verdict and checks none; a changed file is checked again.
    The examples are read from the memory-mapped store, as loaded before it."""
    checks, path = count_checks(monkeypatch), tmp_path / "f.jsonl"
    write_jsonl(path, legacy_records())

    def load(name=str(path), fraction=0.1):
        return TrainingSet.load(DataSources(name, None, fraction, 0), 100, 4096, False)

    first = load()
    assert checks[0] == 50 and first.identity()["fingerprint"] == "2c1cc12ef372ed87"
    assert isinstance(first.examples, Selected) and list(first.examples) == [first.examples[i] for i in range(45)]
    checks[0] = 0
    assert load().identity() == first.identity() and checks[0] == 0
    assert len(load(fraction=0.2).examples) == 40 and checks[0] == 0
    copy = tmp_path / "elsewhere" / "copy.jsonl"
    copy.parent.mkdir()
    copy.write_bytes(path.read_bytes())
    assert load(str(copy)).identity()["fingerprint"] == first.identity()["fingerprint"] and checks[0] == 0
    write_jsonl(path, legacy_records()[:-1])  # the same path, changed
    assert len(load().examples) == 44 and checks[0] == 49


def test_where_the_cache_cannot_be_locked_two_ranks_converting_at_once_read_one_store(tmp_path, monkeypatch):
    """Without a lock (Lustre mounted without flock, NFS without its lock daemon) ranks starting
    together may convert the same file at once: the one that renames second finds the other's
    entry whole and reads it (before: "cannot write the dataset cache", exit 2), and leaves no
    copy of its own behind."""
    from latentwire import data_store
    from latentwire.dataset import checked

    path, root, meanwhile = Path(write_jsonl(tmp_path / "f.jsonl", synthetic_examples(20, 1))), tmp_path / "cache", []
    convert = data_store.convert

    def while_another_rank_converts_too(records, source, check, work):
        convert(records, source, check, work)
        if not meanwhile:  # the other rank, which renames its conversion first
            meanwhile.append(None)
            meanwhile.append(data_store.stored_file(path, root, check))

    monkeypatch.setattr(data_store, "locked", lambda root: contextlib.nullcontext())
    monkeypatch.setattr(data_store, "convert", while_another_rank_converts_too)
    mine = data_store.stored_file(path, root, checked)
    assert mine.entry == meanwhile[1].entry and list(mine) == list(meanwhile[1]) and len(mine) == 20
    assert [p.name for p in root.iterdir() if p.name.startswith(".")] == []


def test_a_cache_that_cannot_be_locked_for_a_new_selection_is_one_line(tmp_path):
    """A converted cache made read-only (here its lock is not a file: root is not refused a read-only
    directory) and a new selection of it to write: one line naming the cache, not a traceback."""
    from latentwire.data_store import cached_selection, stored_file
    from latentwire.dataset import checked

    examples = stored_file(Path(write_jsonl(tmp_path / "f.jsonl", synthetic_examples(20, 1))), tmp_path, checked)
    (tmp_path / ".lock").unlink(missing_ok=True)
    (tmp_path / ".lock").mkdir()
    with pytest.raises(UserError, match=r"cannot write the dataset cache .*name another with --data-cache"):
        cached_selection(examples, {"seed": 1}, lambda: np.arange(5))


def test_a_store_is_on_disk_before_it_is_named_and_a_damaged_one_is_one_line(tmp_path, monkeypatch):
    """Each of an entry's files, and its directory, reach the disk (fsync) before the rename that
    makes it an entry, which can reach the disk first; an entry damaged all the same (a disk's
    fault, a hand's) is one line naming it, not Arrow's traceback."""
    from latentwire import data_store
    from latentwire.dataset import checked

    synced, renamed, fsync = [], [], os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(Path(os.readlink(f"/proc/self/fd/{fd}"))) or fsync(fd))
    rename = Path.rename
    monkeypatch.setattr(Path, "rename", lambda work, entry: renamed.append((work, set(synced))) or rename(work, entry))
    path = Path(write_jsonl(tmp_path / "f.jsonl", synthetic_examples(20, 1)))
    entry = data_store.stored_file(path, tmp_path / "cache", checked).entry
    [(work, before)] = renamed
    assert before == {work, *(work / name for name in (data_store.EXAMPLES, data_store.ANSWER_END, data_store.VERDICT))}
    (entry / data_store.EXAMPLES).write_bytes(b"")
    with pytest.raises(UserError, match=rf"the dataset cache's {entry} cannot be read \(.*\): delete it"):
        data_store.stored_file(path, tmp_path / "cache", checked)


def two_files(tmp_path) -> tuple[str, str]:
    return (
        write_jsonl(tmp_path / "a.jsonl", synthetic_examples(40, 1)),
        write_jsonl(tmp_path / "b.jsonl", synthetic_examples(30, 2)),
    )


def global_batches_of(training: TrainingSet, seed: int, world: int, micro: int, steps: int, start=(0, 0)) -> list:
    """The sorted dataset indices of each of `steps` global batches (2 micro-batches a rank) that
    `world` ranks draw from `start` (epoch, examples done), as train.py's sampler deals them."""
    from torch.utils.data import DataLoader

    from latentwire.harness.data import ShardSampler, global_batches

    per_rank = []
    for rank in range(world):
        sampler = ShardSampler(training.draws(seed), num_replicas=world, rank=rank)
        loader = DataLoader(range(len(training.examples)), batch_size=micro, sampler=sampler, drop_last=True)
        batches = global_batches(loader, sampler, 2, *start, micro * 2 * world)
        per_rank.append([[i for b in next(batches)[2] for i in b.tolist()] for _ in range(steps)])
    return [sorted(sum(step, [])) for step in zip(*per_rank, strict=True)]


def test_a_mixture_of_two_files_draws_each_by_its_weight_the_same_on_any_world_size(tmp_path):
    """a:0.7,b:0.3 over 36 + 27 training examples: every global batch of 20 (two periods of 10)
    holds 14 of a and 6 of b, on one rank and on two; across epochs; from the middle of one too."""
    a, b = two_files(tmp_path)
    training = TrainingSet.load(DataSources(f"{a}:0.7,{b}:0.3", None, 0.1, seed=0), 1000, 4096, False)
    assert [len(p.examples) for p in training.parts] == [36, 27] and len(training.examples) == 63
    one = global_batches_of(training, 5, world=1, micro=10, steps=7)  # 3 steps an epoch
    assert one == global_batches_of(training, 5, world=2, micro=5, steps=7)
    assert all(sum(i < 36 for i in step) == 14 for step in one)
    assert global_batches_of(training, 5, world=2, micro=5, steps=3, start=(1, 20)) == one[4:]
    from latentwire.harness.data import draws_per_source

    drawn = draws_per_source(training.draws(5), world=1, micro=10, accum=2, steps=7)
    assert drawn == [98, 42]
    assert training.facts(drawn)["train_sources"] == {
        "a": {"examples": 36, "weight": 0.7, "share_of_draws": 0.7},
        "b": {"examples": 27, "weight": 0.3, "share_of_draws": 0.3},
    }


def test_a_mixture_names_each_source_with_a_weight_and_holds_each_one_s_examples_out(tmp_path):
    a, b = two_files(tmp_path)
    assert mixture_parts(f"{a}:0.7, {b}:0.3") == [(a, Fraction(7, 10)), (b, Fraction(3, 10))]
    assert mixture_parts("squad") == [("squad", 1)] and mixture_parts("squad:2") == [("squad", 2)]
    odd = write_jsonl(tmp_path / "x,y:1.jsonl", RECORDS)  # a file that exists is one source
    assert mixture_parts(odd) == [(odd, 1)]
    for spec, says in (
        (f"{a}:0.7,{b}", "has no weight"),
        (f"{a}:0.5,{a}:0.5", "names .* twice"),
        (f"{a}:0,{b}:1", "must be positive"),
    ):
        with pytest.raises(UserError, match=says):
            mixture_parts(spec)
    with pytest.raises(UserError, match="is the training file itself"):
        DataSources(f"{a}:1,{b}:1", b, 0.1, 0)
    sources = DataSources(f"{a}:0.7,synthetic:0.3", None, 0.1, 0)
    groups = sources.held_out_groups(10, sources.held_out_source())
    assert {k: len(v) for k, v in groups.items()} == {"a": 4, "synthetic": 3}  # 7 asked of a, which holds out 4
    assert groups["synthetic"] == load_examples("synthetic", "validation", 3, 0)
    assert sources.describe_held_out(sources.held_out_source()) == (
        f"a seeded 10% of {a} (at least one example) that training never sees; synthetic examples of another seed"
    )
    identity = TrainingSet.load(sources, 100, 4096, False).identity()
    assert [s["weight"] for s in identity["sources"]] == ["7/10", "3/10"] and identity["examples"] == 136
    other = TrainingSet.load(DataSources(f"{a}:0.6,synthetic:0.4", None, 0.1, 0), 100, 4096, False).identity()
    assert other["fingerprint"] != identity["fingerprint"]


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


@pytest.mark.parametrize(
    "bad, field",
    [
        ({"question": "q", "answers": {"text": ["a"]}}, "'context'"),
        ({"context": "c", "answers": {"text": ["a"]}}, "'question'"),
        ({"context": "c", "question": "q"}, "'answers.text'"),
        ({"context": "c", "question": "q", "answers": {"answer_start": [0]}}, "'answers.text'"),
        ({"context": "c", "question": "q", "answers": {"text": []}}, "'answers.text'"),
        ({"context": "c", "question": "q", "answers": {"text": ["  "]}}, "'answers.text'"),
    ],
)
def test_bad_record_names_field_and_file(tmp_path, bad, field):
    """...after the good records before it; nothing of the file is stored."""
    path = write_jsonl(tmp_path / "bad.jsonl", [RECORDS[0], bad])
    with pytest.raises(UserError, match=rf"bad\.jsonl: example 1.*{field}"):
        load_examples(path, "train", 10, seed=0)
    assert [p.name for p in (tmp_path / "hf_cache" / "latentwire").iterdir()] == [".lock"]


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
    collate = Collator(tokenizers, contracts_of(tokenizers), teacher=teacher, **settings)
    return collate([ds[i] for i in range(len(ds))]), ds


def test_collate_bytes_are_padded_to_a_multiple(tokenizers):
    examples = synthetic_examples(5, seed=2)
    batch, ds = collate(tokenizers, examples)
    lengths = [len(ds[i]["prompt"]) for i in range(5)]
    assert batch["bytes"].dtype == torch.long and batch["byte_mask"].dtype == torch.bool
    assert batch["bytes"].shape == (5, -(-max(lengths) // 32) * 32)
    assert batch["byte_mask"].sum(1).tolist() == lengths
    assert (batch["bytes"][~batch["byte_mask"]] == PAD_BYTE).all()
    assert bytes(batch["bytes"][0, : lengths[0]].tolist()) == ds[0]["prompt"]
    assert batch["index"].tolist() == [0, 1, 2, 3, 4]


def test_word_patches_start_every_word_at_a_patch_and_keep_its_bytes(tokenizers):
    """Each word (a space or newline and the bytes up to the next) starts at a multiple of the
    patch, padded (and masked) after; the real bytes in order are the cut prompt; a word's patches
    are the same wherever it sits."""
    batch, ds = collate(tokenizers, synthetic_examples(4, seed=2), max_prompt_bytes=200, word_patch=4)
    patches = {}
    for row in range(4):
        ids, mask = batch["bytes"][row], batch["byte_mask"][row]
        assert bytes(ids[mask].tolist()) == ds[row]["prompt"][:200]
        assert (ids[~mask] == PAD_BYTE).all()
        starts = [k for k in mask.nonzero().flatten().tolist() if ids[k] in (ord(" "), ord("\n"))]
        assert starts and all(k % 4 == 0 for k in starts)
        for k in starts:
            end = next((j for j in starts if j > k), int(mask.nonzero().max()) + 1)
            word = bytes(ids[k:end][mask[k:end]].tolist())
            padded = round_up(end - k, 4)
            patches.setdefault(word, set()).add(tuple(ids[k : k + padded].tolist()))
    assert all(len(seen) == 1 for seen in patches.values())
    assert any(word.strip().isdigit() for word in patches)  # an age among them


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
    labelled = [[row, len(tail) + k] for row, answer in enumerate(answers) for k in range(len(answer) + 1)]
    at = rows["label_positions"]  # where the loss runs the head: every target, then (0, 0) to a multiple of 8
    assert at.shape[1] == round_up(len(labelled), 8)
    assert at.T.tolist() == labelled + [[0, 0]] * (at.shape[1] - len(labelled))
    assert "text_ids" not in rows  # no teacher asked for: the prompt is not tokenised


def test_tokens_are_what_the_readers_read_without_the_padding(tokenizers):
    """tokens_per_s's count, by hand from the tokenizers: for every row and reader its lead (the
    Llama's BOS), the wire and the tail and answer tokens; not the EOS, a target only, nor the
    padding. target_tokens_per_s's: the answer tokens and the EOS."""
    examples, wire = synthetic_examples(6, seed=5), 7
    batch, _ = collate(tokenizers, examples)
    answers = {
        name: [len(tok(answer_text(ex), add_special_tokens=False)["input_ids"]) for ex in examples]
        for name, tok in tokenizers.items()
    }
    tails = {name: len(tok(ANCHOR, add_special_tokens=False)["input_ids"]) for name, tok in tokenizers.items()}
    by_hand = sum((name == "llama") + wire + tails[name] + n for name in tokenizers for n in answers[name])
    task = WireTask(dict.fromkeys(tokenizers), Objectives(), num_latents=wire)
    assert task.tokens(batch).item() == by_hand
    targets = sum(n + 1 for lengths in answers.values() for n in lengths)
    assert task.target_tokens(target_counts(batch, Objectives())).item() == targets


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
