"""Examples, prompts and batches.

An example is a dict in SQuAD's field layout: `{"context", "question", "answers": {"text": [...]}}`.
It comes from the built-in synthetic set, a hub dataset (`squad`, `hotpot_qa`), or a local
`.json` / `.jsonl` / `.parquet` file, or from several of them by weight (a mixture). Every record
is checked, so that a bad file is a one-line `UserError` naming the file and the field, not a
KeyError inside a DataLoader worker: a file's or hub dataset's once per content, as it is stored
memory-mapped (latentwire.data_store), from where each rank reads its examples by index.

The encoder reads the prompt as raw UTF-8 bytes; each frozen LLM reads only the answer tokens
of its own tokenizer. `Collator` builds both, padded to few distinct shapes.
"""

from __future__ import annotations

import bisect
import itertools
import random
import re
from collections.abc import Sequence
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

import numpy as np
import torch

from .data_store import (
    HUB_SOURCES,
    Selected,
    StoredExamples,
    cache_root,
    cached_selection,
    remembered,
    stored_file,
    stored_hub,
)
from .harness.config import setting
from .harness.data import Mixture
from .harness.data_identity import data_identity, fingerprint, mixture_identity
from .harness.errors import UserError

PAD_BYTE = 256  # byte values are 0..255, so the encoder's byte embedding has 257 rows
IGNORE_INDEX = -100  # cross_entropy's default ignore_index
ANSWER_PAD_MULTIPLE = 8
HELD_OUT_SEED_OFFSET = 1_000_003
HUB_DATASETS = tuple(HUB_SOURCES)
CHUNK = 1 << 18  # stored examples counted this many at a time
LOCAL_SUFFIXES = (".json", ".jsonl", ".parquet")


# --- the built-in synthetic reading-comprehension set -------------------------------------


@dataclass(frozen=True)
class _Attribute:
    statement: str  # one context sentence, formatted with name and value
    question: str  # formatted with name
    values: tuple[str, ...]


NAMES = (
    "Maria",
    "James",
    "Aisha",
    "Chen",
    "Olga",
    "Pedro",
    "Fatima",
    "Liam",
    "Yuki",
    "Omar",
    "Sofia",
    "Ivan",
    "Priya",
    "Lucas",
    "Amara",
    "Noah",
    "Elena",
    "Hassan",
    "Mia",
    "Diego",
    "Hana",
    "Felix",
    "Zara",
    "Mateo",
    "Ingrid",
    "Kofi",
    "Lena",
    "Ravi",
    "Chloe",
    "Tariq",
    "Nina",
    "Oscar",
    "Leila",
    "Hugo",
    "Sara",
    "Arjun",
    "Greta",
    "Jonas",
    "Rosa",
    "Malik",
)

# Small vocabularies and one fixed sentence per attribute keep the task learnable by a tiny
# model in a few hundred steps; the answer still depends on which person and which attribute
# the question names, so the prompt really matters.
ATTRIBUTES = (
    _Attribute(
        "{name} lives in {value}.",
        "Which city does {name} live in?",
        (
            "Paris",
            "Tokyo",
            "Lima",
            "Cairo",
            "Oslo",
            "Berlin",
            "Madrid",
            "Toronto",
            "Sydney",
            "Nairobi",
            "Dublin",
            "Seoul",
            "Lisbon",
            "Vienna",
            "Mumbai",
            "Chicago",
            "Prague",
            "Denver",
            "Athens",
            "Bogota",
        ),
    ),
    _Attribute(
        "{name}'s favourite colour is {value}.",
        "What is {name}'s favourite colour?",
        (
            "red",
            "blue",
            "green",
            "yellow",
            "purple",
            "orange",
            "pink",
            "brown",
            "black",
            "white",
            "grey",
            "gold",
            "silver",
            "teal",
        ),
    ),
    _Attribute(
        "{name} has a pet {value}.",
        "What pet does {name} have?",
        (
            "cat",
            "dog",
            "parrot",
            "rabbit",
            "hamster",
            "turtle",
            "goldfish",
            "horse",
            "snake",
            "lizard",
            "ferret",
            "pony",
        ),
    ),
    _Attribute(
        "{name} works as a {value}.",
        "What is {name}'s job?",
        (
            "doctor",
            "teacher",
            "baker",
            "pilot",
            "nurse",
            "lawyer",
            "farmer",
            "chef",
            "dentist",
            "painter",
            "plumber",
            "writer",
            "singer",
            "banker",
            "tailor",
            "carpenter",
            "sailor",
            "judge",
            "barber",
            "librarian",
        ),
    ),
    _Attribute("{name} is {value} years old.", "How old is {name}?", tuple(str(age) for age in range(20, 50))),
    _Attribute(
        "{name} plays {value}.",
        "Which sport does {name} play?",
        ("tennis", "football", "golf", "hockey", "rugby", "cricket", "volleyball", "baseball", "badminton", "squash"),
    ),
)


def _synthetic_example(rng: random.Random) -> dict:
    people = rng.sample(NAMES, rng.randint(2, 3))
    facts = [
        (name, attr, rng.choice(attr.values)) for name in people for attr in rng.sample(ATTRIBUTES, rng.randint(1, 2))
    ]
    rng.shuffle(facts)  # so the position of a person's facts says nothing about the answer
    name, attr, value = rng.choice(facts)
    return {
        "context": " ".join(a.statement.format(name=n, value=v) for n, a, v in facts),
        "question": attr.question.format(name=name),
        "answers": {"text": [value]},
    }


def synthetic_examples(n: int, seed: int) -> list[dict]:
    """`n` procedurally generated examples; the answer is always a span of the context."""
    rng = random.Random(seed)
    return [_synthetic_example(rng) for _ in range(n)]


def synthetic_corpus_text(n: int = 2000, seed: int = 12345) -> list[str]:
    """Plain text lines (contexts, questions, answers) to train the tiny local tokenizers on."""
    return [line for ex in synthetic_examples(n, seed) for line in (ex["context"], ex["question"], answer_text(ex))]


# --- sources and mixtures -----------------------------------------------------------------------


# NAME:WEIGHT, the weight a decimal number
WEIGHTED = re.compile(r"(.+):(\d+(?:\.\d*)?|\.\d+)")


def mixture_parts(spec: str) -> list[tuple[str, Fraction]]:
    """The sources a dataset setting names, with their weights: one source (`synthetic`, `squad`,
    `hotpot_qa` or a file, weight 1), or a mixture, `NAME:WEIGHT,NAME:WEIGHT,...` (weights are
    relative: `squad:0.7,hotpot_qa:0.3` or `squad:7,hotpot_qa:3`). A file that exists is one
    source, whatever its name holds."""
    if Path(spec).exists() or ("," not in spec and not WEIGHTED.fullmatch(spec)):
        return [(spec, Fraction(1))]
    parts = []
    for part in (p.strip() for p in spec.split(",")):
        found = WEIGHTED.fullmatch(part)
        if found is None:
            raise UserError(
                f"dataset {spec!r}: {part!r} has no weight; a mixture names each source with its weight, "
                "NAME:WEIGHT,NAME:WEIGHT,... (squad:0.7,hotpot_qa:0.3)"
            )
        name, weight = found.group(1), Fraction(found.group(2))
        if weight <= 0:
            raise UserError(f"dataset {spec!r}: the weight of {name} must be positive")
        if any(same_dataset(name, other) for other, _ in parts):
            raise UserError(f"dataset {spec!r} names {name} twice")
        parts.append((name, weight))
    return parts


def source_labels(names: list[str]) -> list[str]:
    """What reports call each source: a file by its name without the suffix, unless two share it."""
    short = [Path(n).stem if is_local(n) else n for n in names]
    return short if len(set(short)) == len(short) else names


def split_by_weight(n: int, weights: list[Fraction]) -> list[int]:
    """`n` divided in proportion to `weights` (the largest remainders rounded up), at least one each."""
    exact = [n * w / sum(weights) for w in weights]
    counts = [int(e) for e in exact]
    for i in sorted(range(len(exact)), key=lambda i: counts[i] - exact[i])[: n - sum(counts)]:
        counts[i] += 1
    return [max(c, 1) for c in counts]


def is_local(dataset: str) -> bool:
    return dataset.endswith(LOCAL_SUFFIXES)


def held_out_count(n: int, fraction: float) -> int:
    """How many of a local file's `n` examples are held out: the fraction, rounded, at least one
    and never all of them."""
    return min(max(round(n * fraction), 1), n - 1)


def split_indices(n: int, split: str, fraction: float, seed: int, size: int) -> np.ndarray:
    """The indices of a source's `split` in file order: of a file with a held-out `fraction`, its
    seeded held-out part ('validation', the same for every size) or the rest ('train'); then a
    seeded subset of `size` where the split is larger (hub datasets are ordered by article, so not
    the first ones). Drawn as the Python lists of examples were, so a run samples what it did."""
    indices = np.arange(n)
    if fraction:
        held = np.zeros(n, dtype=bool)
        held[random.Random(seed + HELD_OUT_SEED_OFFSET).sample(range(n), held_out_count(n, fraction))] = True
        indices = np.flatnonzero(held != (split == "train"))
    if len(indices) > size:
        indices = indices[sorted(random.Random(seed).sample(range(len(indices)), size))]
    return indices


def same_dataset(a: str, b: str) -> bool:
    """Whether two dataset names mean the same examples: a local file by the file it names."""
    return Path(a).resolve() == Path(b).resolve() if is_local(a) and is_local(b) else a == b


def load_examples(
    dataset: str, split: str, num_examples: int, seed: int, held_out_fraction: float = 0.0, cache: str | None = None
) -> list[dict]:
    """Examples of one source ('synthetic', 'squad', 'hotpot_qa' or a local file path), as dicts.

    `num_examples` is the size of the synthetic set and an upper bound for the others (a seeded
    subset is taken when the dataset is larger). A local file has no splits of its own: with
    `held_out_fraction` > 0 a seeded part of it is the 'validation' split and the rest 'train';
    with 0 the file is either split.
    """
    sources = DataSources(dataset, None, held_out_fraction, seed, cache)
    return list(sources.select(dataset, split, num_examples)[0])


@dataclass(frozen=True)
class DataConfig:
    """The profile's data fields: which examples, and how they are cut and padded."""

    dataset: str = setting(
        "synthetic",
        "'synthetic', 'squad', 'hotpot_qa' or a local .json/.jsonl/.parquet; several, with weights: "
        "NAME:WEIGHT,NAME:WEIGHT (squad:0.7,hotpot_qa:0.3)",
    )
    eval_dataset: str | None = setting(
        None,
        "held-out examples: 'synthetic', 'squad', 'hotpot_qa' or a local file, or several with weights "
        "(null: each training source's own validation split; of a local file, a seeded "
        "held_out_fraction of it)",
    )
    held_out_fraction: float = setting(
        0.1, "part of a local dataset file held out from training when no eval_dataset is named", gt=0, lt=1
    )
    drop_cut_answers: bool = setting(
        False, "drop training examples whose answer lies past max_prompt_bytes (the encoder never sees it)"
    )
    num_examples: int = setting(
        100000, "size of the synthetic training set; of another source, a seeded subset of at most this many", gt=0
    )
    max_prompt_bytes: int = setting(4096, "prompts are cut to this many UTF-8 bytes", gt=0)
    max_answer_tokens: int = setting(32, "answers are cut to this many tokens", gt=0)
    pad_multiple: int = setting(256, "pad lengths to a multiple of this (few shapes for compile)", gt=0)
    seed: int | None = setting(
        None,
        "seed of the examples: the synthetic set, a dataset's sample and a file's "
        "held-out part (null: seed), so runs of several seeds can train and be evaluated "
        "on the same examples",
        key="data_seed",
        ge=0,
        since=4,
        before=None,
    )
    cache: str | None = setting(
        None,
        "where dataset files and hub datasets are kept converted and checked, memory-mapped by every "
        "rank (null: in datasets' own cache, HF_DATASETS_CACHE)",
        key="data_cache",
        since=5,
        before=None,
    )


@dataclass(frozen=True)
class DataSources:
    """Where a run's training and held-out examples come from: one source or a weighted mixture
    (`mixture_parts`). The synthetic set and the hub datasets have a held-out split of their own. A
    local file has none: unless `eval_dataset` names the held-out examples, a seeded
    `held_out_fraction` of each training file is held out, and training never sees it. Files and
    hub datasets are read from their converted copies in `cache` (latentwire.data_store)."""

    dataset: str
    eval_dataset: str | None
    held_out_fraction: float
    seed: int
    cache: str | None = None

    def __post_init__(self):
        training = [name for name, _ in mixture_parts(self.dataset)]
        for name, _ in mixture_parts(self.eval_dataset) if self.eval_dataset is not None else []:
            if is_local(name) and any(is_local(t) and same_dataset(name, t) for t in training):
                raise UserError(
                    f"eval_dataset {name} is the training file itself: leave it unset, and a "
                    "seeded held_out_fraction of the file is held out from training"
                )

    @classmethod
    def of(cls, data: DataConfig, seed: int) -> DataSources:
        """The sources of a run whose seed is `seed`: its examples follow data_seed where it is set."""
        return cls(
            data.dataset,
            data.eval_dataset,
            data.held_out_fraction,
            seed if data.seed is None else data.seed,
            data.cache,
        )

    def fraction_held_out(self, source: str) -> float:
        """The part of `source` held out from training: the held_out_fraction of a training file
        when no eval_dataset is named; 0 where all of a source is one split (another file, and the
        hub's and the synthetic set, whose held-out examples are a split of their own)."""
        training_file = is_local(source) and any(same_dataset(source, t) for t, _ in mixture_parts(self.dataset))
        return self.held_out_fraction if self.eval_dataset is None and training_file else 0.0

    def select(self, source: str, split: str, n: int) -> tuple[Sequence[dict], str | None]:
        """At most `n` examples of one source's `split` (a seeded subset of a larger one), and their
        fingerprint where the store keeps it (None: the synthetic set, made here)."""
        if source == "synthetic":
            return synthetic_examples(n, self.seed if split == "train" else self.seed + HELD_OUT_SEED_OFFSET), None
        stored, fraction = self.stored(source, split), self.fraction_held_out(source)
        held = held_out_count(len(stored), fraction) if fraction else 0
        if fraction and not held:
            raise UserError(
                f"dataset {source} has {len(stored)} example, too few to hold any out: name held-out "
                "examples (train.py --eval-dataset, evaluate --dataset)"
            )
        size = min(n, len(stored) - held if split == "train" else held or len(stored))  # no fraction: all
        spec = {"split": split, "held_out_fraction": fraction, "seed": self.seed, "num_examples": size}
        return cached_selection(stored, spec, lambda: split_indices(len(stored), split, fraction, self.seed, size))

    def stored(self, source: str, split: str) -> StoredExamples:
        """A file's or a hub dataset's examples, converted and checked on first sight (data_store)."""
        if source in HUB_DATASETS:
            return stored_hub(source, "train" if split == "train" else "validation", cache_root(self.cache), checked)
        if is_local(source):
            return stored_file(Path(source), cache_root(self.cache), checked)
        if Path(source).exists():
            raise UserError(f"dataset file {source} must end in {', '.join(LOCAL_SUFFIXES)}")
        raise UserError(
            f"unknown dataset {source!r}; use synthetic, {', '.join(HUB_DATASETS)} "
            f"or a path to a {'/'.join(LOCAL_SUFFIXES)} file"
        )

    def train_examples(self, n: int) -> Sequence[dict]:
        """The training examples of every source as loaded (none dropped), one after another."""
        return concatenated([self.select(name, "train", n)[0] for name, _ in mixture_parts(self.dataset)])

    def held_out_source(self, override: str | None = None) -> str:
        return override or self.eval_dataset or self.dataset

    def held_out_groups(self, n: int, spec: str) -> dict[str, list[dict]]:
        """The held-out examples of each source `spec` names, by its label: of a mixture, `n` split
        by the weights."""
        parts = mixture_parts(spec)
        counts = split_by_weight(n, [w for _, w in parts]) if len(parts) > 1 else [n]
        labels = source_labels([name for name, _ in parts])
        return {
            label: list(self.select(name, "validation", k)[0])
            for (name, _), label, k in zip(parts, labels, counts, strict=True)
        }

    def held_out_examples(self, n: int, spec: str) -> list[dict]:
        return [ex for group in self.held_out_groups(n, spec).values() for ex in group]

    def describe_held_out(self, spec: str) -> str:
        return "; ".join(self.describe_source_held_out(name) for name, _ in mixture_parts(spec))

    def describe_source_held_out(self, source: str) -> str:
        if source == "synthetic":
            return "synthetic examples of another seed"
        if source in HUB_DATASETS:
            return f"{source}'s validation split"
        if self.fraction_held_out(source):
            return f"a seeded {self.held_out_fraction:.0%} of {source} (at least one example) that training never sees"
        trained = any(same_dataset(source, t) for t, _ in mixture_parts(self.dataset))
        return f"{source}, which the run trained on" if trained else source


@dataclass(frozen=True)
class TrainingPart:
    """One source's training examples as the sampler indexes them, where they come from (`source`,
    of which `held_out_fraction` is held out), its weight in the mixture, and what loading them
    found: how many of the loaded ones have their answer past the prompt's cut, how many of those
    were dropped, and the fingerprint of those kept."""

    source: str
    weight: Fraction
    examples: Sequence[dict]
    held_out_fraction: float
    loaded: int
    past_cut: int
    dropped: int
    fingerprint: str

    @classmethod
    def load(
        cls,
        sources: DataSources,
        source: str,
        weight: Fraction,
        num_examples: int,
        max_prompt_bytes: int,
        drop_cut_answers: bool,
    ) -> TrainingPart:
        examples, found = sources.select(source, "train", num_examples)
        fraction = sources.fraction_held_out(source)
        if found is None:  # made here: checked here
            past = answers_past_cut(examples, max_prompt_bytes)
            check_answers_reachable(past.count(True), past.count(False), len(past), source, max_prompt_bytes)
            kept = [ex for ex, cut in zip(examples, past, strict=True) if not (drop_cut_answers and cut)]
            return cls(
                source,
                weight,
                kept,
                fraction,
                len(examples),
                past.count(True),
                len(examples) - len(kept),
                fingerprint(kept),
            )
        key = f"past_and_within_max_prompt_bytes={max_prompt_bytes}"
        past, within = remembered(examples, key, lambda: past_cut_counts(examples, max_prompt_bytes))
        check_answers_reachable(past, within, len(examples), source, max_prompt_bytes)
        kept = examples
        if drop_cut_answers and past:
            spec = {**examples.spec, "dropped_past": max_prompt_bytes}
            kept, found = cached_selection(examples.examples, spec, lambda: within_cut(examples, max_prompt_bytes))
        return cls(source, weight, kept, fraction, len(examples), past, len(examples) - len(kept), found)

    def identity(self) -> dict:
        """What a checkpoint records of these examples (harness.resume compares two)."""
        name = str(Path(self.source).resolve()) if is_local(self.source) else self.source
        return data_identity(name, len(self.examples), self.fingerprint, held_out_fraction=self.held_out_fraction)


@dataclass(frozen=True)
class TrainingSet:
    """A run's training examples, one part per source, as the sampler indexes them: the parts one
    after another, drawn by their weights (harness.data.Mixture)."""

    parts: tuple[TrainingPart, ...]

    @classmethod
    def load(
        cls, sources: DataSources, num_examples: int, max_prompt_bytes: int, drop_cut_answers: bool
    ) -> TrainingSet:
        """Each source's training examples: at most `num_examples` of each."""
        return cls(
            tuple(
                TrainingPart.load(sources, name, weight, num_examples, max_prompt_bytes, drop_cut_answers)
                for name, weight in mixture_parts(sources.dataset)
            )
        )

    @property
    def examples(self) -> Sequence[dict]:
        return concatenated([part.examples for part in self.parts])

    @property
    def loaded(self) -> int:
        return sum(part.loaded for part in self.parts)

    @property
    def past_cut(self) -> int:
        return sum(part.past_cut for part in self.parts)

    @property
    def dropped(self) -> int:
        return sum(part.dropped for part in self.parts)

    def draws(self, seed: int) -> Mixture:
        return Mixture([len(part.examples) for part in self.parts], [part.weight for part in self.parts], seed)

    def summary(self, max_prompt_bytes: int) -> str:
        k, n = self.past_cut, self.loaded
        line = (
            f"{k} of {n} training examples ({100 * k / n:.1f}%) have their answer past "
            f"max_prompt_bytes={max_prompt_bytes}"
        )
        return line + (
            f"; dropped, {len(self.examples)} left"
            if self.dropped
            else "; --drop-cut-answers true drops them"
            if k
            else ""
        )

    def sources(self, drawn: list[int]) -> dict[str, dict]:
        """Of a mixture, per source: its examples, its weight and its share of the examples the run's
        steps draw (`drawn`: how many of them each source gives)."""
        labels = source_labels([part.source for part in self.parts])
        weights = sum(part.weight for part in self.parts)
        return {
            label: {
                "examples": len(part.examples),
                "weight": float(part.weight / weights),
                "share_of_draws": count / sum(drawn),
            }
            for label, part, count in zip(labels, self.parts, drawn, strict=True)
        }

    def facts(self, drawn: list[int]) -> dict:
        """For the run's first metrics record; of a mixture, each source's too (`sources`)."""
        facts = {
            "train_examples": len(self.examples),
            "train_answers_past_cut": self.past_cut,
            "train_examples_dropped": self.dropped,
        }
        return facts | ({"train_sources": self.sources(drawn)} if len(self.parts) > 1 else {})

    def identity(self) -> dict:
        """What a checkpoint records of its training data (harness.resume compares two): a single
        source's as it always was; a mixture's covers every source and weight."""
        if len(self.parts) == 1:
            return self.parts[0].identity()
        shares = [str(m) for m in self.draws(0).shares]
        return mixture_identity([part.identity() for part in self.parts], shares)


def describe_mixture(sources: dict[str, dict]) -> str:
    """A mixture's sources (TrainingSet.sources) in a line: what each gives and draws."""
    return "; ".join(
        f"{label}: {s['examples']} examples, weight {s['weight']:.3g}, {s['share_of_draws']:.1%} of the draws"
        for label, s in sources.items()
    )


def spans(groups: dict[str, list]) -> dict[str, range]:
    """Where each group lies in the groups one after another."""
    ends = list(itertools.accumulate(map(len, groups.values()), initial=0))
    return {label: range(ends[i], ends[i + 1]) for i, label in enumerate(groups)}


class Concatenated(Sequence):
    """Several sequences of examples, one after another, read by index."""

    def __init__(self, parts: list[Sequence[dict]]):
        self.parts = parts
        self.offsets = list(itertools.accumulate(map(len, parts), initial=0))

    def __len__(self) -> int:
        return self.offsets[-1]

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        part = bisect.bisect_right(self.offsets, index) - 1
        return self.parts[part][index - self.offsets[part]]


def concatenated(parts: list[Sequence[dict]]) -> Sequence[dict]:
    return parts[0] if len(parts) == 1 else Concatenated(parts)


def checked(record, index: int, source: str) -> tuple[dict, int]:
    """A record as data_store stores it: the example (check_example) and where its answer ends in
    the prompt, -1 where it is not found."""
    example = check_example(record, index, source)
    end = answer_end_byte(example)
    return example, -1 if end is None else end


def check_example(record: dict, index: int, source: str) -> dict:
    """The example in canonical form, or a UserError naming the bad field and the source."""
    where = f"{source}: example {index}"
    if not isinstance(record, dict):
        raise UserError(f"{where} is not an object with fields context, question and answers")
    for field in ("context", "question"):
        if record.get(field) is None:
            raise UserError(f"{where} has no field {field!r}")
        if not isinstance(record[field], str):
            raise UserError(f"{where}: field {field!r} must be a string")
    answers = record.get("answers")
    texts = answers.get("text") if isinstance(answers, dict) else None
    if texts is None:
        raise UserError(f"{where} has no field 'answers.text'")
    if not isinstance(texts, list) or not texts:
        raise UserError(f"{where}: field 'answers.text' must be a non-empty list of answers")
    if not all(isinstance(text, str) for text in texts):
        raise UserError(f"{where}: field 'answers.text' must be a list of strings")
    if not texts[0].strip():
        raise UserError(f"{where}: the first answer in 'answers.text' is blank")
    kept = {"text": list(texts)}
    starts = answers.get("answer_start")
    # Where each answer starts in the context, in characters (SQuAD's layout): it says whether the
    # prompt limit cuts an answer off. Optional; a malformed one is ignored, the text is searched.
    if (
        isinstance(starts, list)
        and len(starts) == len(texts)
        and all(type(s) is int and abs(s) < 2**63 for s in starts)
    ):
        kept["answer_start"] = list(starts)
    return {"context": record["context"], "question": record["question"], "answers": kept}


# --- answers the prompt limit cuts off ----------------------------------------------------------


def answer_end_byte(example: dict) -> int | None:
    """Where the first answer (the training target) ends in the encoder's prompt, in UTF-8 bytes:
    from its `answer_start` where that points at the answer, else where it first occurs in the
    context as a whole word ('yes' is not in 'yesterday'); None where it does not occur."""
    context, answer = example["context"], example["answers"]["text"][0]
    starts = example["answers"].get("answer_start")
    start = starts[0] if starts else -1
    if start < 0 or context[start : start + len(answer)] != answer:
        answer = answer.strip()
        found = re.search(rf"(?<!\w){re.escape(answer)}(?!\w)", context)
        if found is None:
            return None
        start = found.start()
    prompt = prompt_text(example)
    context_at = len(prompt) - len(context)  # the context ends the prompt
    return len(prompt[: context_at + start + len(answer)].encode("utf-8"))


def answers_past_cut(examples: Sequence[dict], max_prompt_bytes: int) -> list[bool | None]:
    """Per example: whether its answer lies past the prompt's cut at `max_prompt_bytes` (the wire
    cannot carry it), None where the answer's place is unknown."""
    ends = (answer_end_byte(ex) for ex in examples)
    return [None if end is None else end > max_prompt_bytes for end in ends]


def past_cut_counts(examples: Selected, max_prompt_bytes: int) -> tuple[int, int]:
    """How many of stored `examples` have their answer past the prompt's cut, and how many within
    it, from the ends their conversion found (a chunk at a time: no copy of a column)."""
    ends, past, within = examples.examples.answer_ends(), 0, 0
    for start in range(0, len(examples), CHUNK):
        chunk = ends[np.asarray(examples.indices[start : start + CHUNK])]
        past += int((chunk > max_prompt_bytes).sum())
        within += int(((chunk >= 0) & (chunk <= max_prompt_bytes)).sum())
    return past, within


def within_cut(examples: Selected, max_prompt_bytes: int) -> np.ndarray:
    """The indices of stored `examples` whose answer is not past the cut (or not found)."""
    return np.asarray(examples.indices)[examples.examples.answer_ends()[examples.indices] <= max_prompt_bytes]


def check_answers_reachable(past: int, within: int, examples: int, source: str, max_prompt_bytes: int) -> None:
    """Refuse a training set in which no located answer is within the prompt's cut."""
    if past and not within:
        raise UserError(
            f"every answer of {source} that can be located lies past max_prompt_bytes="
            f"{max_prompt_bytes} ({past} of {examples}): the encoder would never see one; "
            "raise --max-prompt-bytes"
        )


# --- prompts and batches ------------------------------------------------------------------


def prompt_text(example: dict) -> str:
    return f"question: {example['question']}\ncontext: {example['context']}"


def answer_text(example: dict) -> str:
    return example["answers"]["text"][0].strip()


class PromptDataset(torch.utils.data.Dataset):
    def __init__(self, examples: Sequence[dict]):
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def __getitem__(self, index: int) -> dict:
        example = self.examples[index]
        return {"prompt": prompt_text(example).encode("utf-8"), "answer": answer_text(example), "index": index}


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class SpecialIds:
    """The ids an LLM's rows are built from besides the answer: its prompt contract's lead and tail
    (latentwire.prompting), the EOS target and the padding."""

    lead: list[int]
    tail: list[int]
    eos: int
    pad: int

    @classmethod
    def of(cls, tok, contract) -> "SpecialIds":
        pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
        return cls(list(contract.lead), list(contract.tail), tok.eos_token_id, pad)


class Collator:
    """Pads prompt bytes for the encoder and, for each LLM, the tokens around the wire with the
    answer's labels; with `teacher`, also the prompt as that LLM's tokens, for the distillation
    teacher; with `kd_targets`, the teacher's targets of each example (latentwire.distillation).

    Row layout (latentwire.prompting): the LLM reads `[lead ; M soft tokens ; input_ids]` where
    input_ids is the tail (the anchor) then the answer, and keeps the last T+1 logits. The logit
    at the last soft token predicts input_ids[0], so labels[k] is the target of the k-th kept
    position: the tail's tokens are never targets, and the EOS is the target of the last answer
    token. Padding is on the right, so a causal LLM's real positions never attend to it, and its
    labels are -100, so it never reaches the loss; `label_positions` lists the labelled positions,
    the only ones whose logits the loss computes. The teacher's `text_ids` ([lead ; prompt]) are
    padded on the left instead, so that followed by the same input_ids its kept logits are the
    same positions as the wire's.
    """

    def __init__(
        self,
        tokenizers: dict,
        contracts: dict,
        max_prompt_bytes: int,
        max_answer_tokens: int,
        pad_multiple: int,
        teacher: bool = False,
        kd_targets: dict | None = None,
        word_patch: int = 0,
    ):
        for name, tok in tokenizers.items():
            if tok.eos_token_id is None:
                raise UserError(f"the {name} tokenizer has no EOS token")
        self.tokenizers = tokenizers
        # Special ids read once: a transformers tokenizer resolves each attribute read through
        # several Python calls, which per row would cost as much as the tokenisation.
        self.special_ids = {name: SpecialIds.of(tok, contracts[name]) for name, tok in tokenizers.items()}
        self.max_prompt_bytes = max_prompt_bytes
        self.max_answer_tokens = max_answer_tokens
        self.pad_multiple = pad_multiple
        self.teacher = teacher
        self.kd_targets = kd_targets
        self.word_patch = word_patch

    @classmethod
    def for_llms(
        cls,
        llms: dict,
        max_prompt_bytes: int,
        max_answer_tokens: int,
        pad_multiple: int,
        teacher: bool = False,
        kd_targets: dict | None = None,
        word_patch: int = 0,
    ) -> Collator:
        """Rows for each frozen LLM by its own tokenizer and prompt contract."""
        return cls(
            {name: llm.tokenizer for name, llm in llms.items()},
            {name: llm.contract for name, llm in llms.items()},
            max_prompt_bytes,
            max_answer_tokens,
            pad_multiple,
            teacher,
            kd_targets,
            word_patch,
        )

    def __call__(self, items: list[dict]) -> dict:
        prompts = [item["prompt"][: self.max_prompt_bytes] for item in items]
        byte_ids, byte_mask = self._collate_bytes(prompts)
        # The teacher reads what the encoder reads: the prompt cut at the same byte.
        texts = [p.decode("utf-8", errors="ignore") for p in prompts] if self.teacher else None
        answers = [item["answer"] for item in items]
        index = torch.tensor([item["index"] for item in items], dtype=torch.long)
        rows = {
            name: self._collate_llm(tok, self.special_ids[name], answers, texts)
            for name, tok in self.tokenizers.items()
        }
        for name, targets in (self.kd_targets or {}).items():  # distillation's, at the answer positions
            rows[name] |= targets.rows(index, len(self.special_ids[name].tail), rows[name]["labels"].shape[1])
        return {"bytes": byte_ids, "byte_mask": byte_mask, "answers": rows, "index": index}

    # Every collation builds each output with one tensor constructor over padded rows: per-row
    # tensor writes cost more than the tokenisation itself and would show up as data wait.

    def _collate_bytes(self, prompts: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        # prompt_text is never empty, so every row has at least one real byte to attend to.
        if self.word_patch:
            return self._collate_word_patches(prompts)
        length = round_up(max(len(p) for p in prompts), self.pad_multiple)
        raw = torch.frombuffer(bytearray(b"".join(p.ljust(length, b"\0") for p in prompts)), dtype=torch.uint8)
        byte_mask = torch.arange(length) < torch.tensor([len(p) for p in prompts])[:, None]
        byte_ids = raw.view(len(prompts), length).long().masked_fill_(~byte_mask, PAD_BYTE)
        return byte_ids, byte_mask

    def _collate_word_patches(self, prompts: list[bytes]) -> tuple[torch.Tensor, torch.Tensor]:
        """Bytes with every word starting a patch of `word_patch` bytes: each word (a space or
        newline and the bytes up to the next) is padded to whole patches. On a fixed grid the same
        word lands in any of patch_bytes alignments, and a short one like an age ("23") in patches
        that share it with its neighbours or split it; aligned, a word is always the same patches.
        The padding inside a row is masked like the padding after it; every patch starts with a
        real byte, so the encoder's patch mask (a patch is real when its first byte is) holds."""
        words = [[w for w in re.split(rb"(?=[ \n])", prompt) if w] for prompt in prompts]

        def patched(row: list[bytes], real_only: bool) -> bytes:
            return b"".join(
                (b"\1" * len(w) if real_only else w).ljust(round_up(len(w), self.word_patch), b"\0") for w in row
            )

        ids, real = ([patched(row, real_only) for row in words] for real_only in (False, True))
        length = round_up(max(map(len, ids)), self.pad_multiple)
        byte_ids, byte_mask = (
            torch.frombuffer(bytearray(b"".join(r.ljust(length, b"\0") for r in rows)), dtype=torch.uint8).view(
                len(prompts), length
            )
            for rows in (ids, real)
        )
        return byte_ids.long().masked_fill_(~byte_mask.bool(), PAD_BYTE), byte_mask.bool()

    def _collate_llm(self, tok, special: SpecialIds, answers: list[str], texts: list[str] | None) -> dict:
        tail, eos, pad = special.tail, [special.eos], special.pad
        token_ids = [ids[: self.max_answer_tokens] for ids in answer_token_ids(tok, answers)]
        length = round_up(max(len(tail) + len(ids) for ids in token_ids), ANSWER_PAD_MULTIPLE)
        inputs = [tail + ids for ids in token_ids]
        targets = [[IGNORE_INDEX] * len(tail) + ids + eos for ids in token_ids]
        rows = {
            "lead_ids": torch.tensor([special.lead] * len(answers), dtype=torch.long).view(len(answers), -1),
            "input_ids": torch.tensor([row + [pad] * (length - len(row)) for row in inputs]),
            "labels": torch.tensor([row + [IGNORE_INDEX] * (length + 1 - len(row)) for row in targets]),
        }
        rows["label_positions"] = label_positions(rows["labels"])
        if texts is not None:
            prompts = [special.lead + ids for ids in tok(texts, add_special_tokens=False)["input_ids"]]
            width = round_up(max(map(len, prompts)), ANSWER_PAD_MULTIPLE)
            rows["text_ids"] = torch.tensor([[pad] * (width - len(row)) + row for row in prompts])
            rows["text_mask"] = torch.tensor([[0] * (width - len(row)) + [1] * len(row) for row in prompts])
        return rows


def label_positions(labels: torch.Tensor) -> torch.Tensor:
    """[2, n] the (row, column) of each label that is not IGNORE_INDEX, row by row, then padding
    (`padded_positions`): where the loss runs an LLM's head (latentwire.objectives), the first
    `labels`' count of them real. Found here, on the host, where the batch is built: on the
    device, a count that only the device knows would cost the step a host sync."""
    return padded_positions(torch.stack((labels != IGNORE_INDEX).nonzero(as_tuple=True)))


def padded_positions(at: torch.Tensor) -> torch.Tensor:
    """[2, n] positions, then (0, 0) up to a multiple of ANSWER_PAD_MULTIPLE. The multiple keeps
    the head's GEMMs in whole tensor-core tiles; nothing compiled sees this count (the head and the
    loss run between the compiled regions), so a larger one would buy no fewer compiles."""
    return torch.nn.functional.pad(at, (0, round_up(at.shape[1], ANSWER_PAD_MULTIPLE) - at.shape[1]))


def input_lengths(labels: torch.Tensor) -> torch.Tensor:
    """Each row's real input tokens (the tail and the answer, not the padding), from its labels, on
    their device (no sync): column k holds the target read at input k-1 (column 0, at the wire's
    last position; `Collator`), so the EOS target's column is the count."""
    columns = torch.arange(labels.shape[1], device=labels.device)
    return ((labels != IGNORE_INDEX) * columns).amax(-1)


def answer_token_ids(tok, answers: list[str]) -> list[list[int]]:
    """Each answer's tokens, as the wire's training targets them. The answer follows the wire as a
    new word: with its leading space, BPE vocabularies (trained on running text, where words start
    with a space) give whole-word tokens."""
    return tok([" " + a for a in answers], add_special_tokens=False)["input_ids"]
