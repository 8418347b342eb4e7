"""Bad input at every entry point (docs/faults.md): exit code 2, one `error: ...` line on
stderr, no traceback, and nothing on disk changed: an existing run directory is byte-identical
afterwards. (tests/test_resume.py's table checks the wording of the common train.py cases.)

One small real run is trained once for the module. Each case gets a fresh copy of it, snapshots
every path (directories included) and every file's bytes under the case's directories (the copy,
its input files, and any other the case writes into), runs one bad command that points at the copy
(as --out-dir, with --resume or --overwrite, as evaluate's --ckpt, or as plan's and find_batch's
output directory where the case is about something else), and compares: a refused command leaves no
file, not even a lock, and no directory behind. A command with no environment or prefix of its own
forks from an interpreter that has already imported torch and the package (tests/preloaded.py); the
rest start from nothing, as users run them. Commands that would replace a run are given --overwrite,
so that a bad input that slips through shows up as a changed run, not as "already holds a run".
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

from conftest import NOBODY, REPO, Preloaded, assert_one_line_error, child_env, ok, run_train

pytestmark = pytest.mark.slow

# The reference run: the fewest steps that leave metrics, TensorBoard events and a checkpoint.
REF_ARGS = [
    "--profile",
    "cpu",
    "--num-examples",
    "64",
    "--max-steps",
    "2",
    "--micro-batch-size",
    "4",
    "--grad-accum-steps",
    "1",
    "--num-workers",
    "0",
]
CKPT = "checkpoints/step_00000002"
GOOD = {"context": "Ada lives in Paris.", "question": "Where does Ada live?", "answers": {"text": ["Paris"]}}
NO_QUESTION = {"context": GOOD["context"], "answers": GOOD["answers"]}
NO_CONTEXT = {"question": GOOD["question"], "answers": GOOD["answers"]}
NO_ANSWERS = {"context": GOOD["context"], "question": GOOD["question"]}
EMPTY_ANSWERS = {**GOOD, "answers": {"text": []}}
CUT_ANSWER = {**GOOD, "context": "Nothing happened. " * 40 + GOOD["context"]}  # the answer at byte ~760
TIMEOUT_S = 300


@pytest.fixture(scope="module")
def reference_run(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("reference") / "run"
    ok(run_train([*REF_ARGS, "--out-dir", str(out)]))
    assert (out / CKPT / "trainable.safetensors").is_file() and (out / "metrics.jsonl").is_file()
    return out


@pytest.fixture(scope="module")
def hf_cache(tmp_path_factory) -> Path:
    """The datasets json/parquet readers write an Arrow cache: not in the home directory, not in a run."""
    return tmp_path_factory.mktemp("hf_datasets_cache")


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory) -> dict[str, Path]:
    """Local model directories that cannot load, each in its own way."""
    from latentwire.llm_sources import TINY_SPECS, tiny_tokenizer

    root = tmp_path_factory.mktemp("models")
    dirs = {name: root / name for name in ("empty", "unknown_type", "config_not_json", "no_weights", "garbage_weights")}
    for path in dirs.values():
        path.mkdir()
    llama_config = json.dumps({"model_type": "llama", **TINY_SPECS["llama"]})
    (dirs["unknown_type"] / "config.json").write_text(
        json.dumps({"model_type": "no_such_architecture", "hidden_size": 64, "vocab_size": 1000})
    )
    (dirs["config_not_json"] / "config.json").write_text('{"model_type": "llama",')
    for name in ("no_weights", "garbage_weights"):
        (dirs[name] / "config.json").write_text(llama_config)
        tiny_tokenizer("llama").save_pretrained(str(dirs[name]))
    (dirs["garbage_weights"] / "model.safetensors").write_bytes(b"\x00not a safetensors file" * 10)
    return dirs


# --- one case -------------------------------------------------------------------------------------


@dataclass
class Ctx:
    run: Path  # a fresh copy of the reference run
    tmp: Path  # scratch for input files, outside the run
    models: dict[str, Path]
    watched: list[Path]  # what the snapshot covers: the run and every directory a command is told to write in
    lock: Callable[[], object] = lambda: None  # after the snapshot, before the command
    # after the command, in order: the first makes the run readable again for the snapshot
    cleanup: list[Callable[[], object]] = field(default_factory=list)

    def write(self, name: str, content: str | bytes) -> str:
        path = self.tmp / name
        path.write_bytes(content if isinstance(content, bytes) else content.encode())
        return str(path)

    def jsonl(self, name: str, records: list) -> str:
        return self.write(name, "".join(json.dumps(r) + "\n" for r in records))

    def parquet(self, name: str, records: list[dict]) -> str:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = self.tmp / name
        pq.write_table(pa.Table.from_pylist(records), path)
        return str(path)

    def profiles(self, mutate: Callable[[dict], object]) -> str:
        """hw_profiles.json with one change."""
        profiles = json.loads((REPO / "hw_profiles.json").read_text())
        mutate(profiles)
        return self.write("hw_profiles.json", json.dumps(profiles))  # allow_nan: inf is written as Infinity

    def ckpt_file(self, name: str) -> Path:
        return self.run / CKPT / name

    def garbage(self, name: str) -> None:
        self.ckpt_file(name).write_bytes(b"\x00garbage" * 64)

    def leave_only_a_partial_checkpoint(self) -> None:
        """The only checkpoint renamed to the temporary name a save killed midway leaves."""
        (self.run / CKPT).rename(self.run / "checkpoints" / ".step_00000002.tmp")

    def truncate(self, name: str) -> None:
        path = self.ckpt_file(name)
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])

    def meta(self, **config) -> None:
        path = self.ckpt_file("meta.json")
        meta = json.loads(path.read_text())
        meta["config"].update(config)
        path.write_text(json.dumps(meta, indent=2))

    def newer_settings(self) -> dict:
        """The checkpoint's meta.json claims the settings version after this code's: the error
        names both."""
        from latentwire.harness.config import SETTINGS_VERSION
        from latentwire.settings import Config

        path = self.ckpt_file("meta.json")
        path.write_text(json.dumps({**json.loads(path.read_text()), SETTINGS_VERSION: Config.version + 1}))
        return {"says": f"settings version {Config.version + 1}, newer than this code's {Config.version}"}

    def reshape_queries(self) -> None:
        """The wire's learned queries saved with half the soft tokens (as if trained with another
        --num-latents), the rest of the checkpoint and its meta.json unchanged."""
        from safetensors.torch import load_file, save_file

        path = self.ckpt_file("trainable.safetensors")
        state = load_file(str(path))
        queries = state["pooler.queries"]
        state["pooler.queries"] = queries[: queries.shape[0] // 2].clone()
        save_file(state, str(path))


def snapshot(roots: list[Path]) -> dict[str, bytes | None]:
    """Every path under the roots (directories as None) and every file's bytes."""
    return {
        str(p.relative_to(root.parent)): None if p.is_dir() else p.read_bytes()
        for root in roots
        for p in sorted(root.rglob("*"))
    }


def unwatched(args: list[str], watched: list[Path]) -> list[str]:
    """The directories and files a command is told to write that no snapshot covers."""
    writes = ("--out-dir", "--json", "--compile-cache")
    named = [value for flag, value in zip(args[:-1], args[1:], strict=True) if flag in writes]
    return [path for path in named if not any(Path(path).is_relative_to(root) for root in watched)]


def changes(before: dict, after: dict) -> str:
    added, removed = sorted(after.keys() - before.keys()), sorted(before.keys() - after.keys())
    changed = sorted(k for k in before.keys() & after.keys() if before[k] != after[k])
    return "; ".join(
        f"{what} {paths[:4]}{' ...' if len(paths) > 4 else ''}"
        for what, paths in (("added", added), ("removed", removed), ("changed", changed))
        if paths
    )


def base_args(entry: str, run: Path) -> list[str]:
    """What every case of an entry point starts from; the case's own flags come after and win."""
    if entry == "train" or entry.startswith("launch"):
        return [*REF_ARGS, "--out-dir", str(run)]
    if entry == "plan":
        return ["--profile", "cpu", "--out-dir", str(run), "--json", str(run / "plan.json")]
    if entry == "find_batch":  # one trial of one step, should a bad input get through
        return [
            "--profile",
            "cpu",
            "--out-dir",
            str(run),
            "--micro-batch-size",
            "1",
            "--max-micro-batch",
            "1",
            "--steps",
            "1",
        ]
    if entry == "evaluate":  # the report would go to RUN/eval
        return ["--ckpt", str(run), "--eval-examples", "8", "--batch-size", "8", "--max-new-tokens", "4"]
    raise ValueError(entry)


def python_target(entry: str) -> str:
    """What Python runs for an entry point other than the launcher: a script or a module."""
    return "train.py" if entry == "train" else f"latentwire.{entry}"


def invoke(entry: str, args: list[str], cwd: Path, env: dict, prefix: list[str]) -> subprocess.CompletedProcess:
    if entry.startswith("launch"):
        cmd = [str(REPO / "launch.sh")]
        env = {"PYTHON": sys.executable, "NPROC_PER_NODE": entry[len("launch") :], **env}
    elif entry == "train":
        cmd = [sys.executable, str(REPO / python_target(entry))]
    else:
        cmd = [sys.executable, "-m", python_target(entry)]
    return subprocess.run(
        [*prefix, *cmd, *args],
        cwd=cwd if entry.startswith("launch") else REPO,
        env=child_env(**env),
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )


# --- the cases ------------------------------------------------------------------------------------
# Each is (entry point, build): build(ctx) prepares inputs (and may damage the run copy before the
# snapshot; it may move the run) and returns the flags after base_args, or a dict with "args" and
# optionally "env", "prefix" and "says" (what the error line must contain). Entry points: train
# (python train.py), launch1 / launch2 (./launch.sh --profile cpu with NPROC_PER_NODE=1 / 2), plan,
# find_batch, evaluate (python -m latentwire.<entry>).

OW = "--overwrite"


def locked_parent(searchable: bool, holds: str = "out_dir") -> Callable[[Ctx], dict]:
    """A directory this user may not write (searchable) or not even look into, holding the out_dir
    or (holds="ckpt") the run evaluate reads. root may go anywhere, so as root the command runs as
    nobody below a directory root owns, of mode 555 or 700; as another user the directory is its
    own, of mode 555 or 000. It is locked after the run's snapshot is taken and unlocked before
    the snapshot is compared."""

    def build(c: Ctx) -> dict:
        root = os.geteuid() == 0
        top = Path(tempfile.mkdtemp(prefix="latentwire-locked-"))
        top.chmod(0o755)
        locked = top / "locked"
        locked.mkdir()
        # the run where this user can read it (evaluate reads it), or not even look into it
        c.run = Path(shutil.move(c.run, (locked if holds == "ckpt" else top) / "run"))
        c.lock = lambda: locked.chmod(0o555 if searchable else 0o700 if root else 0o000)
        c.watched.append(top)
        c.cleanup += [lambda: locked.chmod(0o755), lambda: shutil.rmtree(top, ignore_errors=True)]
        spec = {
            "args": ["--out-dir", str(locked / "deeper" / "run")] if holds == "out_dir" else [],
            "says": "cannot be created" if holds == "out_dir" else "cannot be read",
        }
        if root:
            spec.update(
                env={"HOME": str(top)}, prefix=["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups"]
            )
        return spec

    return build


def profiles(mutate: Callable[[dict], object]) -> Callable[[Ctx], list[str]]:
    """A train/launch case: --overwrite with hw_profiles.json changed by `mutate`."""
    return lambda c: [OW, "--hw-profiles", c.profiles(mutate)]


def dataset(name: str, content: str | bytes | list) -> Callable[[Ctx], list[str]]:
    """A train/launch case: --overwrite with --dataset a file of this content (a list: one JSON record a line)."""
    return lambda c: [OW, "--dataset", c.jsonl(name, content) if isinstance(content, list) else c.write(name, content)]


def llm(flag: str, model: str, prefix: str = "") -> Callable[[Ctx], list[str]]:
    """A train/launch case: --overwrite with --llama or --qwen one of the model_dirs."""
    return lambda c: [OW, f"--{flag}", prefix + str(c.models[model])]


CASES = {
    # --- hardware profile files (--hw-profiles FILE, --profile KEY) --------------------------------
    "train-profiles-not-json": ("train", lambda c: [OW, "--hw-profiles", c.write("p.json", '{"cpu": {"a": 1,}}')]),
    "train-profiles-field-wrong-type": ("train", profiles(lambda p: p["cpu"].update(micro_batch_size="8"))),
    "train-profiles-unknown-field": ("train", profiles(lambda p: p["cpu"].update(learning_rate=0.1))),
    "train-profiles-missing-file": ("train", lambda c: [OW, "--hw-profiles", str(c.tmp / "no_such_profiles.json")]),
    "train-profiles-is-a-directory": ("train", lambda c: [OW, "--hw-profiles", str(c.tmp)]),
    "train-profiles-lr-Infinity": ("train", profiles(lambda p: p["cpu"].update(lr=float("inf")))),
    "train-profiles-extends-cycle": ("train", profiles(lambda p: p["cpu"].update(extends="cpu"))),
    "plan-profiles-not-json": ("plan", lambda c: ["--hw-profiles", c.write("p.json", "not json at all")]),
    "find_batch-profiles-field-wrong-type": (
        "find_batch",
        lambda c: ["--hw-profiles", c.profiles(lambda p: p["cpu"].update(compile="yes"))],
    ),
    "launch2-profiles-not-json": ("launch2", lambda c: [OW, "--hw-profiles", c.write("p.json", '{"cpu": ')]),
    # --- flag values -----------------------------------------------------------------------------
    "train-max-steps-negative": ("train", lambda c: [OW, "--max-steps", "-5"]),
    "train-lr-nan": ("train", lambda c: [OW, "--lr", "nan"]),
    "train-weight-decay-inf": ("train", lambda c: [OW, "--weight-decay", "inf"]),
    "train-max-grad-norm-inf": ("train", lambda c: [OW, "--max-grad-norm", "inf"]),
    "train-micro-batch-size-not-int": ("train", lambda c: [OW, "--micro-batch-size", "2.5"]),
    "train-unknown-flag": ("train", lambda c: [OW, "--learning-rate", "0.001"]),
    "train-frozen-sharding-unknown": ("train", lambda c: [OW, "--frozen-sharding", "zero3"]),
    "launch2-frozen-sharding-tied-embeddings": (
        "launch2",
        lambda c: {
            "says": "ties its input and output embeddings",
            "args": [
                OW,
                "--frozen-sharding",
                "fsdp",
                "--llama",
                "random:"
                + c.write(
                    "tied.json",
                    json.dumps(
                        {
                            "model_type": "llama",
                            "hidden_size": 64,
                            "intermediate_size": 128,
                            "num_hidden_layers": 1,
                            "num_attention_heads": 2,
                            "num_key_value_heads": 1,
                            "vocab_size": 1024,
                            "tie_word_embeddings": True,
                        }
                    ),
                ),
            ],
        },
    ),
    "plan-num-gpus-zero": ("plan", lambda c: ["--num-gpus", "0"]),
    "plan-lr-inf": ("plan", lambda c: ["--lr", "inf"]),
    "find_batch-cap-gb-inf": ("find_batch", lambda c: ["--cap-gb", "inf"]),
    "find_batch-steps-negative": ("find_batch", lambda c: ["--steps", "-1"]),
    "find_batch-frozen-sharding-fsdp": ("find_batch", lambda c: ["--frozen-sharding", "fsdp"]),
    "train-frozen-fp8-eager": (
        "train",
        lambda c: {
            "says": "third GEMM",
            "args": [OW, "--frozen-fp8", "tensorwise", "--precision", "bf16", "--compile", "false"],
        },
    ),
    "plan-frozen-fp8-with-fsdp": (
        "plan",
        lambda c: {
            "says": "frozen_fp8 with frozen_sharding fsdp",
            "args": [
                "--frozen-fp8",
                "rowwise",
                "--precision",
                "bf16",
                "--compile",
                "true",
                "--frozen-sharding",
                "fsdp",
            ],
        },
    ),
    "evaluate-meta-frozen-fp8-in-fp32": (
        "evaluate",
        lambda c: c.meta(frozen_fp8="rowwise") or {"says": "--precision bf16", "args": []},
    ),
    "evaluate-eval-examples-zero": ("evaluate", lambda c: ["--eval-examples", "0"]),
    "evaluate-device-unknown": ("evaluate", lambda c: ["--device", "tpu"]),
    "launch2-micro-batch-size-zero": ("launch2", lambda c: [OW, "--micro-batch-size", "0"]),
    "launch-nproc-per-node-not-a-number": ("launch1", lambda c: {"args": [OW], "env": {"NPROC_PER_NODE": "x"}}),
    # --- dataset files (--dataset PATH) ----------------------------------------------------------
    "train-data-empty-json": ("train", dataset("d.json", "")),
    "train-data-empty-parquet": ("train", dataset("d.parquet", b"")),
    "train-data-not-utf8-jsonl": ("train", dataset("d.jsonl", b'{"context": "\xff\xfe\xfd"}\n')),
    "train-data-json-number": ("train", dataset("d.json", "42")),
    "train-data-json-list-of-strings": ("train", dataset("d.json", json.dumps(["a", "b"] * 40))),
    "train-data-jsonl-numbers": ("train", dataset("d.jsonl", "1\n2\n3\n")),
    "train-data-parquet-missing-answers": (
        "train",
        lambda c: [OW, "--dataset", c.parquet("d.parquet", [NO_ANSWERS] * 40)],
    ),
    "train-data-json-empty-answers": ("train", dataset("d.json", json.dumps([GOOD] * 40 + [EMPTY_ANSWERS]))),
    "train-data-wrong-suffix": ("train", dataset("d.csv", "context,question\n")),
    "train-data-cache-is-a-file": (
        "train",
        lambda c: {
            "says": "cannot write the dataset cache",
            "args": [*dataset("d.jsonl", [GOOD] * 40)(c), "--data-cache", str(c.run / "metrics.jsonl" / "cache")],
        },
    ),
    "train-data-mixture-part-without-weight": (
        "train",
        lambda c: {
            "says": "has no weight",
            "args": [OW, "--dataset", f"{c.jsonl('d.jsonl', [GOOD] * 40)}:0.7,{c.jsonl('e.jsonl', [GOOD] * 40)}"],
        },
    ),
    "train-data-mixture-bad-record-in-its-second-file": (
        "train",
        lambda c: {
            "says": "e.jsonl: example 3 has no field 'context'",
            "args": [
                OW,
                "--dataset",
                f"{c.jsonl('d.jsonl', [GOOD] * 40)}:0.7,{c.jsonl('e.jsonl', [GOOD] * 3 + [NO_CONTEXT])}:0.3",
            ],
        },
    ),
    "evaluate-data-missing-context": ("evaluate", lambda c: ["--dataset", c.jsonl("d.jsonl", [NO_CONTEXT] * 8)]),
    "launch2-data-smaller-than-global-batch-overwrite": ("launch2", dataset("d.jsonl", [GOOD] * 6)),
    # Fewer examples than ranks: refused before distillation's teacher pass deals them out.
    "launch2-data-fewer-examples-than-ranks": (
        "launch2",
        lambda c: {"says": "smaller than one global batch", "args": [OW, "--num-examples", "1", "--kd-weight", "1"]},
    ),
    "train-data-every-answer-past-the-cut": (
        "train",
        lambda c: {
            "says": "lies past max_prompt_bytes=512 (36 of 36)",
            "args": dataset("d.jsonl", [CUT_ANSWER] * 40)(c),
        },
    ),
    "train-eval-dataset-is-the-training-file": (
        "train",
        lambda c: {
            "says": "is the training file itself",
            "args": [OW, "--dataset", c.jsonl("d.jsonl", [GOOD] * 40), "--eval-dataset", str(c.tmp / "." / "d.jsonl")],
        },
    ),
    "train-held-out-fraction-one": ("train", lambda c: [OW, "--held-out-fraction", "1"]),
    "train-new-data-without-resume": ("train", lambda c: {"says": "needs --resume", "args": [OW, "--new-data"]}),
    # --- model directories (--llama / --qwen DIR) -------------------------------------------------
    "train-llama-config-not-json": ("train", llm("llama", "config_not_json")),
    "train-llama-tokenizer-but-no-weights": ("train", llm("llama", "no_weights")),
    "train-llama-garbage-weights": ("train", llm("llama", "garbage_weights")),
    "train-llama-random-unknown-model-type": ("train", llm("llama", "unknown_type", prefix="random:")),
    "train-llama-random-buffer-not-computable": (
        "train",
        lambda c: {
            "says": "embed_tokens.embed_scale is in no checkpoint",
            "args": [
                OW,
                "--llama",
                "random:"
                + c.write(
                    "gemma3.json",
                    json.dumps(
                        {
                            "model_type": "gemma3_text",
                            "hidden_size": 64,
                            "intermediate_size": 128,
                            "num_hidden_layers": 1,
                            "head_dim": 16,
                            "num_attention_heads": 4,
                            "num_key_value_heads": 2,
                            "vocab_size": 2048,
                            "pad_token_id": 0,
                        }
                    ),
                ),
            ],
        },
    ),
    "plan-llama-unknown-model-type": ("plan", lambda c: ["--llama", str(c.models["unknown_type"])]),
    "find_batch-llama-empty-dir": ("find_batch", lambda c: ["--llama", str(c.models["empty"])]),
    "evaluate-meta-llama-unknown-model-type": ("evaluate", lambda c: c.meta(llama=str(c.models["unknown_type"])) or []),
    # --- checkpoints (--resume, evaluate --ckpt) ---------------------------------------------------
    "train-resume-truncated-weights": ("train", lambda c: c.truncate("trainable.safetensors") or ["--resume"]),
    "train-resume-truncated-train-state": ("train", lambda c: c.truncate("train_state.pt") or ["--resume"]),
    "train-resume-garbage-meta": ("train", lambda c: c.garbage("meta.json") or ["--resume"]),
    "train-resume-wrong-tensor-shapes": ("train", lambda c: c.reshape_queries() or ["--resume"]),
    "evaluate-ckpt-truncated-weights": ("evaluate", lambda c: c.truncate("trainable.safetensors") or []),
    "evaluate-ckpt-wrong-tensor-shapes": ("evaluate", lambda c: c.reshape_queries() or []),
    "evaluate-ckpt-garbage-meta": ("evaluate", lambda c: c.garbage("meta.json") or []),
    "evaluate-ckpt-meta-field-wrong-type": ("evaluate", lambda c: c.meta(d_z="64") or []),
    "evaluate-ckpt-no-complete-checkpoint": ("evaluate", lambda c: c.leave_only_a_partial_checkpoint() or []),
    "launch2-resume-garbage-weights": ("launch2", lambda c: c.garbage("trainable.safetensors") or ["--resume"]),
    "train-resume-newer-settings-version": ("train", lambda c: {**c.newer_settings(), "args": ["--resume"]}),
    "evaluate-ckpt-newer-settings-version": ("evaluate", lambda c: {**c.newer_settings(), "args": []}),
    "train-init-from-newer-settings-version": (
        "train",
        lambda c: {**c.newer_settings(), "args": ["--init-from", str(c.run), "--out-dir", str(c.run / "new")]},
    ),
    # --- out_dir ---------------------------------------------------------------------------------
    "train-out-dir-is-a-file": ("train", lambda c: [OW, "--out-dir", str(c.run / "metrics.jsonl")]),
    "train-init-from-another-shape": (
        "train",
        lambda c: {
            "args": [OW, "--init-from", str(c.run), "--num-latents", "8"],
            "says": "num_latents 16 (this run: 8)",
        },
    ),
    "train-init-from-other-readers": (
        "train",
        lambda c: {
            "args": [OW, "--init-from", str(c.run), "--qwen", "tiny-random"],
            "says": "qwen tiny (this run: tiny-random)",
        },
    ),
    "train-compile-cache-is-a-file": (
        "train",
        lambda c: [OW, "--compile", "true", "--compile-cache", str(c.run / "metrics.jsonl" / "cache")],
    ),
    "train-out-dir-parent-not-writable": ("train", locked_parent(searchable=True)),
    "train-out-dir-parent-not-searchable": ("train", locked_parent(searchable=False)),
    "evaluate-out-dir-parent-not-searchable": ("evaluate", locked_parent(searchable=False)),
    "evaluate-ckpt-not-searchable": ("evaluate", locked_parent(searchable=False, holds="ckpt")),
    "train-overwrite-and-resume": ("train", lambda c: [OW, "--resume"]),
    "train-resume-fresh-out-dir": ("train", lambda c: ["--resume", "--out-dir", str(c.run / "fresh" / "run")]),
    "train-resume-empty-out-dir": (
        "train",
        lambda c: (c.run / "empty").mkdir() or ["--resume", "--out-dir", str(c.run / "empty")],
    ),
    "find_batch-out-dir-is-a-file": ("find_batch", lambda c: ["--out-dir", str(c.run / "metrics.jsonl")]),
    "evaluate-out-dir-is-a-file": ("evaluate", lambda c: ["--out-dir", str(c.run / "metrics.jsonl")]),
}


def offline_env(hf_cache: Path) -> dict:
    return {"HF_DATASETS_CACHE": str(hf_cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def run_case(
    entry: str, build, root: Path, reference_run: Path, model_dirs: dict, hf_cache: Path, servers: queue.Queue
) -> str:
    """One case in its own directory `root`: what went wrong, or "" if nothing did. A plain command
    (no environment or prefix of its own, not the launcher) runs on one of the preloaded `servers`;
    what it prints goes beside `root`, out of the snapshot."""
    run, scratch, printed = root / "run", root / "inputs", root.with_name(root.name + ".printed")
    shutil.copytree(reference_run, run)
    scratch.mkdir()
    printed.mkdir()
    ctx = Ctx(run, scratch, model_dirs, watched=[root])
    spec = build(ctx)
    spec = spec if isinstance(spec, dict) else {"args": spec}
    env = {**offline_env(hf_cache), **spec.get("env", {})}
    plain = not (spec.get("env") or spec.get("prefix") or entry.startswith("launch"))
    args = [*base_args(entry, ctx.run), *spec["args"]]  # the build may have moved the run
    before = snapshot(ctx.watched)
    try:
        ctx.lock()
        if plain:
            server = servers.get()
            try:
                proc = server.run(python_target(entry), args, printed)
            finally:
                servers.put(server)
        else:
            proc = invoke(entry, args, scratch, env, spec.get("prefix", []))
        for undo in ctx.cleanup[:1]:
            undo()
        changed = changes(before, snapshot(ctx.watched))
    finally:
        for undo in ctx.cleanup:  # again if the command failed: each is harmless twice
            undo()

    problems = [f"{path} is outside what the snapshot covers" for path in unwatched(args, ctx.watched)]
    if spec.get("says", "") not in proc.stderr:
        problems.append(f"the error does not say {spec['says']!r}")
    if changed:
        problems.append(f"the run directory changed: {changed}")
    if proc.returncode != 2:
        problems.append(f"exit code {proc.returncode}, expected 2")
    try:
        assert_one_line_error(proc)
    except AssertionError:
        problems.append("stderr is not exactly one `error: ...` line without a traceback")
    return "; ".join(problems) + f"\n--- stderr (tail) ---\n{proc.stderr[-3000:]}" if problems else ""


@pytest.fixture(scope="module")
def results(reference_run, model_dirs, hf_cache, tmp_path_factory) -> dict[str, str]:
    """Every case, two at a time: the cases are single-threaded processes (OMP_NUM_THREADS=1), so
    on CI's two cores that nearly halves the wall time (4.7 to 2.6 minutes here). The plain ones
    fork from two preloaded interpreters, which spares each its 2-3 s of imports (142 s to 51 s)."""
    root = tmp_path_factory.mktemp("cases")
    servers = queue.Queue()
    for _ in range(2):
        servers.put(Preloaded(offline_env(hf_cache), TIMEOUT_S))
    try:
        with ThreadPoolExecutor(max_workers=2) as pool:
            futures = {
                name: pool.submit(run_case, entry, build, root / name, reference_run, model_dirs, hf_cache, servers)
                for name, (entry, build) in CASES.items()
            }
            return {name: future.result() for name, future in futures.items()}
    finally:
        while not servers.empty():
            servers.get().close()


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line_and_leaves_the_run_untouched(case, results):
    assert not results[case], results[case]
