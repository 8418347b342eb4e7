"""Examples of a dataset file or a hub dataset, converted once into an Arrow file that every process
maps into memory, with the verdict of their checks beside it.

Turning a file into Python dicts cost each rank memory and start-up time in proportion to its size
(docs/performance.md, "A rank's memory against the dataset's size"). Kept as `datasets` keeps a hub
dataset, in Arrow's stream format (`datasets.Dataset.from_file` opens it), the examples are read by
index from a memory map: the ranks of a node share one copy through the page cache, and a rank
holds only the rows it is reading. A file is converted once per content (a copy elsewhere, or a
requeued job, finds it), and each record's checks run during that conversion alone: what they
found is stored with it.

Under the cache's directory (`--data-cache`, else datasets' own cache, HF_DATASETS_CACHE):

    .lock                           held by the one process that converts or selects, while the others wait
    paths/<hash of a path>.json     the file's size, times and inode when its content hash was taken
    <entry>/examples.arrow          the examples, checked, in SQuAD's layout
    <entry>/answer_end.npy          where each first answer ends in the encoder's prompt (-1: not found)
    <entry>/verdict.json            how many examples passed: written last, so an entry holding it is whole
    <entry>/selections/<key>.*      a seeded part of the entry (a split, a subset), its indices and fingerprint

An entry is made in a temporary directory, put on the disk and renamed into place, under the
cache's lock (`.lock`), so ranks starting together convert once and a killed conversion (or a node
that lost power) leaves nothing that reads as an entry.
"""

from __future__ import annotations

import fcntl
import hashlib
import io
import json
import os
import shutil
import tempfile
from array import array
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from .harness.checkpoint import on_disk
from .harness.data_identity import fingerprint
from .harness.errors import UserError

FORMAT = 1  # of an entry; part of its name, so a change of layout makes new entries
EXAMPLES, ANSWER_END, VERDICT = "examples.arrow", "answer_end.npy", "verdict.json"
# Rows per Arrow record batch: few batches, since opening the stream reads every batch's header
# (a random read each where the page cache has dropped them), and a batch's strings far below
# Arrow's 2 GiB offsets.
BATCH_ROWS = 1 << 16
TAKE_ROWS = 8192  # rows turned into Python objects at a time
HUB_SOURCES = {"squad": ("rajpurkar/squad", None), "hotpot_qa": ("hotpotqa/hotpot_qa", "distractor")}


def cache_root(directory: str | None) -> Path:
    """Where converted sources live: the directory the user names, else inside datasets' own cache."""
    if directory is not None:
        return Path(directory)
    import datasets.config

    return Path(datasets.config.HF_DATASETS_CACHE) / "latentwire"


# --- one converted source, read by index ------------------------------------------------------


class StoredExamples(Sequence):
    """A converted source's examples, each read from the memory map when it is asked for, as a dict
    in SQuAD's layout (`answers.answer_start` only where the record had a usable one). Pickled by
    its directory: a process it is sent to maps the same file."""

    def __init__(self, entry: Path):
        import pyarrow as pa

        self.entry = entry
        try:
            self.table = pa.ipc.open_stream(pa.memory_map(str(entry / EXAMPLES))).read_all()
        except (OSError, pa.ArrowException) as e:  # a disk's fault, or a hand's: it was written whole
            raise UserError(
                f"the dataset cache's {entry} cannot be read ({first_line(e)}): delete it, or name another cache "
                "with --data-cache"
            ) from None
        self.columns = [self.table.column(name) for name in ("context", "question", "answers_text", "answer_start")]

    def __len__(self) -> int:
        return self.table.num_rows

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < len(self):
            raise IndexError(index)
        return example(*(column[index].as_py() for column in self.columns))

    def rows(self, indices: np.ndarray) -> Iterator[dict]:
        """The examples at `indices` (increasing), taken a stored batch at a time (much faster than
        by index): a take from the whole table would first join its batches into one copy."""
        batches = self.table.to_batches()
        starts = np.cumsum([0] + [len(b) for b in batches])
        which = np.searchsorted(starts, indices, side="right") - 1  # each index's batch, increasing
        for at in np.unique(which):
            run = np.asarray(indices[np.searchsorted(which, at) : np.searchsorted(which, at, side="right")])
            for part in np.array_split(run, -(-len(run) // TAKE_ROWS)):
                for row in batches[at].take(part - starts[at]).to_pylist():
                    yield example(row["context"], row["question"], row["answers_text"], row["answer_start"])

    def answer_ends(self) -> np.ndarray:
        return np.load(self.entry / ANSWER_END, mmap_mode="r")

    def __reduce__(self):
        return StoredExamples, (self.entry,)


def example(context: str, question: str, texts: list[str], starts: list[int] | None) -> dict:
    answers = {"text": texts} if starts is None else {"text": texts, "answer_start": starts}
    return {"context": context, "question": question, "answers": answers}


class Selected(Sequence):
    """Some of a converted source's examples, by the indices of a cached selection (memory-mapped
    too), and the `spec` that chose them."""

    def __init__(self, examples: StoredExamples, indices_file: Path, spec: dict):
        self.examples, self.indices_file, self.spec = examples, indices_file, spec
        self.indices = np.load(indices_file, mmap_mode="r")

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, index: int) -> dict:
        return self.examples[int(self.indices[index])]

    def __iter__(self) -> Iterator[dict]:
        return self.examples.rows(self.indices)

    def __reduce__(self):
        return Selected, (self.examples, self.indices_file, self.spec)


# --- converting a source once -------------------------------------------------------------------


def stored_file(path: Path, root: Path, check: Callable[[object, int, str], tuple[dict, int]]) -> StoredExamples:
    """A local file's examples, converted on first sight of its content. `check(record, index,
    source)` gives the record's example and where its answer ends, or raises UserError naming it."""
    if not path.is_file():
        raise UserError(f"dataset file {path} does not exist")
    stamp, known = file_stamp(path), None
    index = root / "paths" / f"{digest(stamp['path'])}.json"
    try:
        saved = json.loads(index.read_text(encoding="utf-8"))
        known = saved["content"] if saved["stamp"] == stamp else None
    except (OSError, ValueError, KeyError, TypeError):  # not seen, or an index from elsewhere
        pass
    try:
        content = known or file_digest(path)
    except OSError as e:
        raise UserError(f"could not read dataset file {path}: {e.strerror}") from None
    kind = "parquet" if path.suffix == ".parquet" else "json"
    entry = convert_once(root / f"v{FORMAT}-{kind}-{content}", lambda: local_records(path), str(path), check)
    if known is None:  # only for a file that converted: a bad one leaves no trace
        write_atomically(index, json.dumps({"stamp": stamp, "content": content}).encode())
    return StoredExamples(entry)


def stored_hub(name: str, split: str, root: Path, check) -> StoredExamples:
    """A hub dataset's split (`squad`, `hotpot_qa`'s distractor setting), read from datasets' own
    cache (downloaded once), converted to SQuAD's layout once per version of that cache."""
    ds = load_hub(name, split)
    files = [(f["filename"], os.path.getsize(f["filename"])) for f in ds.cache_files]
    entry = root / f"v{FORMAT}-{name}-{split}-{digest(json.dumps(files))}"
    records = (lambda: map(hotpot_to_squad, ds)) if name == "hotpot_qa" else (lambda: iter(ds))
    return StoredExamples(convert_once(entry, records, f"{name} ({split})", check))


def convert_once(entry: Path, records: Callable[[], Iterable], source: str, check) -> Path:
    """`entry`, made from `records()` unless it is there already (another rank's, another run's)."""
    if (entry / VERDICT).is_file():
        return entry
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        with locked(entry.parent):
            if not (entry / VERDICT).is_file():
                work = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
                try:
                    convert(records(), source, check, work)
                    rename_unless_made(work, entry)
                finally:
                    shutil.rmtree(work, ignore_errors=True)  # gone once renamed
    except OSError as e:  # reading the records is local_records' to say
        raise cannot_write(entry.parent, e) from None
    return entry


def rename_unless_made(work: Path, entry: Path) -> None:
    """`work` renamed `entry`, unless another process made `entry` whole first (where the cache
    cannot be locked): the same content, so its copy serves."""
    try:
        work.rename(entry)
    except OSError:
        if not (entry / VERDICT).is_file():
            raise


@contextmanager
def locked(root: Path):
    """The cache locked while one process converts or selects, so that the others wait for what it
    writes. A lock file, not the directory: flock on NFS locks only files open for writing. Where a
    filesystem cannot lock at all (Lustre without flock, NFS without its lock daemon), two
    processes may do the same work, each written whole. A cache that cannot be written is one line."""
    try:
        f = open(root / ".lock", "a")
    except OSError as e:
        raise cannot_write(root, e) from None
    with f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes
        except OSError:
            pass
        yield


def convert(records: Iterable, source: str, check, work: Path) -> None:
    """Every record checked (the first bad one raises), written in Arrow batches, with where each
    answer ends and, last, the verdict."""
    import pyarrow as pa

    schema = pa.schema(
        [
            ("context", pa.string()),
            ("question", pa.string()),
            ("answers_text", pa.list_(pa.string())),
            ("answer_start", pa.list_(pa.int64())),
        ]
    )
    ends, batch = array("q"), {name: [] for name in schema.names}
    with pa.OSFile(str(work / EXAMPLES), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for i, record in enumerate(records):
            ex, end = check(record, i, source)
            for name, value in zip(
                schema.names,
                (ex["context"], ex["question"], ex["answers"]["text"], ex["answers"].get("answer_start")),
                strict=True,
            ):
                batch[name].append(value)
            ends.append(end)
            if len(ends) % BATCH_ROWS == 0:
                writer.write_batch(pa.RecordBatch.from_pydict(batch, schema=schema))
                batch = {name: [] for name in schema.names}
        if batch["context"]:
            writer.write_batch(pa.RecordBatch.from_pydict(batch, schema=schema))
    if not ends:
        raise UserError(f"dataset {source} has no examples")
    np.save(work / ANSWER_END, np.frombuffer(ends, dtype=np.int64))
    located = int((np.frombuffer(ends, dtype=np.int64) >= 0).sum())
    (work / VERDICT).write_text(json.dumps({"source": source, "examples": len(ends), "answers_located": located}))
    on_disk(work)  # else after a power loss an entry could read as whole (its verdict there) over empty files


# --- a seeded part of a source, cached ------------------------------------------------------------


def cached_selection(examples: StoredExamples, spec: dict, choose: Callable[[], np.ndarray]) -> tuple[Selected, str]:
    """The part of `examples` that `spec` (its split, seed, size, ...) names, and its fingerprint:
    `choose()` picks its indices once, and a later run with the same spec reads them back."""
    where = examples.entry / "selections"
    name = digest(json.dumps(spec, sort_keys=True))
    indices_file, facts_file = where / f"{name}.npy", where / f"{name}.json"
    if not facts_file.is_file():
        with locked(examples.entry.parent):  # one rank computes it, the others wait and read it
            if not facts_file.is_file():
                indices = choose()
                found = fingerprint(examples.rows(indices))
                npy = io.BytesIO()
                np.save(npy, indices)
                write_atomically(indices_file, npy.getvalue())
                write_atomically(facts_file, json.dumps({"spec": spec, "fingerprint": found}).encode())
    return Selected(examples, indices_file, spec), json.loads(facts_file.read_text())["fingerprint"]


def remembered(selected: Selected, key: str, compute: Callable[[], object]):
    """A fact about a selection (a count under some setting, say), computed once and kept with it."""
    facts_file = selected.indices_file.with_suffix(".json")
    saved = json.loads(facts_file.read_text())
    if key not in saved.setdefault("facts", {}):
        saved["facts"][key] = compute()
        write_atomically(facts_file, json.dumps(saved).encode())
    return saved["facts"][key]


# --- small helpers --------------------------------------------------------------------------------


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def file_stamp(path: Path) -> dict:
    """What changes when a file does: its size, times and inode (datasets keys local files so too)."""
    st = path.stat()
    return {
        "path": str(path.resolve()),
        "size": st.st_size,
        "mtime_ns": st.st_mtime_ns,
        "ctime_ns": st.st_ctime_ns,
        "inode": st.st_ino,
    }


def file_digest(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()[:32]


def write_atomically(path: Path, data: bytes) -> None:
    """`data` in `path`, whole or not at all."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            f.write(data)
        os.replace(f.name, path)
    except OSError as e:
        raise cannot_write(path.parent, e) from None


def cannot_write(where: Path, error: OSError) -> UserError:
    return UserError(f"cannot write the dataset cache {where} ({error.strerror}): name another with --data-cache")


# --- reading records ----------------------------------------------------------------------------


def local_records(path: Path) -> Iterator:
    """The records of a .json (a list, one record, a nested SQuAD v1.1 document, or JSON Lines),
    .jsonl or .parquet file, one at a time; a file that does not parse is one UserError naming it."""
    try:
        yield from _records(path)
    except UserError:
        raise
    except Exception as e:  # json and pyarrow raise many types for one cause: a bad file
        raise UserError(f"could not read dataset file {path}: {first_line(e)}") from None


def first_line(error: Exception) -> str:
    return (str(error).strip().splitlines() or [type(error).__name__])[0]


def _records(path: Path) -> Iterator:
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=BATCH_ROWS):
            yield from batch.to_pylist()
        return
    if path.suffix == ".json":
        records = _json_document(path)
        if records is not None:
            yield from records
            return
    with path.open(encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise UserError(f"could not read dataset file {path}: line {number}: {e}") from None


def _json_document(path: Path) -> list | None:
    """Records of a .json file holding one JSON document, or None for JSON Lines."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError:
        return None
    if isinstance(doc, dict) and "data" in doc:
        return _flatten_nested_squad(doc, path)
    return doc if isinstance(doc, list) else [doc]


def _flatten_nested_squad(doc: dict, path: Path) -> list[dict]:
    """One record per question of an original SQuAD v1.1 file (`{"data": [...]}`)."""
    try:
        return [
            {
                "context": paragraph.get("context"),
                "question": qa.get("question"),
                "answers": {
                    "text": [a.get("text") for a in qa.get("answers", [])],
                    "answer_start": [a.get("answer_start") for a in qa.get("answers", [])],
                },
            }
            for article in doc["data"]
            for paragraph in article["paragraphs"]
            for qa in paragraph["qas"]
        ]
    except (KeyError, TypeError, AttributeError):
        raise UserError(
            f"{path}: nested SQuAD JSON must be data[].paragraphs[].qas[] with context, question and answers[].text"
        ) from None


def load_hub(name: str, split: str):
    """A hub dataset's split as datasets caches it (memory-mapped Arrow)."""
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity(datasets.logging.CRITICAL)  # its failures become one `error:` line
    repo, config = HUB_SOURCES[name]
    try:
        return datasets.load_dataset(repo, config, split=split)
    except OSError as e:  # offline (ConnectionError), not cached, a vanished cache directory
        raise UserError(
            f"cannot load dataset {name}: {str(e).splitlines()[0]}; it downloads once from the "
            "Hugging Face Hub, then reads the local cache (or pass a local .json/.jsonl/.parquet file)"
        ) from None


def hotpot_to_squad(record: dict) -> dict:
    """One HotpotQA record in SQuAD's layout; its paragraphs become the context."""
    # HotpotQA sentences keep their leading spaces, so a paragraph is their plain concatenation.
    paragraphs = ("".join(sentences).strip() for sentences in record["context"]["sentences"])
    return {
        "context": "\n".join(paragraphs),
        "question": record["question"],
        "answers": {"text": [record["answer"]]},
    }
