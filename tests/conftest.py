"""Shared helpers: run train.py (one process or a real 2-process torchrun on gloo) and read what
it wrote."""

from __future__ import annotations

import fcntl
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from latentwire.objectives import Objectives

REPO = Path(__file__).resolve().parent.parent

# Small and quick, but the real loop: every test that trains starts from these.
FAST = ["--num-examples", "512", "--num-workers", "0", "--log-every", "1"]
# The reference numerics of the correctness rules.
EXACT = ["--precision", "fp32", "--dropout", "0", "--compile", "false"]
# The run the resume and preemption tests split and compare.
RUN = ["--profile", "cpu", *EXACT, *FAST, "--micro-batch-size", "4", "--grad-accum-steps", "2"]
# 20 steps on one process, and the same global batch on two ranks under torchrun.
TWENTY = {1: [*RUN, "--max-steps", "20"], 2: [*RUN, "--max-steps", "20", "--micro-batch-size", "2"]}

NOBODY = 65534  # the user a root test runs a command as, where root would be allowed anything
# Every extra loss term on at once, as train.py's flags and as the Objectives they make; k_tokens 2
# is fewer than most answers' targets.
ALL_TERMS_FLAGS = ["--first-token-weight", "0.5", "--k-token-weight", "0.5", "--k-tokens", "2", "--kd-weight", "1"]
ALL_TERMS = Objectives(first_token_weight=0.5, k_token_weight=0.5, kd_weight=1.0, k_tokens=2)
# A minimal chat template, as an instruct model's tokenizer ships one: BOS, a user turn, the
# assistant's header.
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|user|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def instruct_reader(tmp_path: Path) -> Path:
    """The tiny Llama reader's directory with CHAT_TEMPLATE beside its tokenizer: to the product,
    a local instruct model."""
    import shutil

    from latentwire.llm_sources import tiny_reader

    reader = tmp_path / "instruct_llama"
    shutil.copytree(tiny_reader("llama"), reader)
    (reader / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return reader


def distilled_collator(
    llms: dict,
    dataset,
    objectives: Objectives,
    max_prompt_bytes: int = 512,
    max_answer_tokens: int = 16,
    pad_multiple: int = 32,
    batch_size: int | None = None,
    word_patch: int = 0,
):
    """A collator whose batches carry the distillation teacher's targets for every example of
    `dataset`, computed as train.py computes them (one process, teacher batches of `batch_size`)."""
    from latentwire.dataset import Collator
    from latentwire.distillation import teacher_targets

    teacher = Collator.for_llms(llms, max_prompt_bytes, max_answer_tokens, pad_multiple, teacher=True)
    targets = teacher_targets(
        llms,
        dataset,
        teacher,
        list(range(len(dataset))),
        k=objectives.k_tokens,
        temperature=objectives.kd_temperature,
        top_k=objectives.kd_top_k,
        batch_size=batch_size or len(dataset),
        device=torch.device("cpu"),
        rank=0,
        world=1,
    )
    return Collator.for_llms(
        llms, max_prompt_bytes, max_answer_tokens, pad_multiple, kd_targets=targets, word_patch=word_patch
    )


def full_logits_sums(model, llms, batch, objectives):
    """The straightforward reference: every kept position's logits, copied to fp32, and each term a
    masked sum over all of them (the step before the head ran at the labels only)."""
    import torch.nn.functional as F

    from latentwire.dataset import IGNORE_INDEX

    soft, tau, sums = model(batch["bytes"], batch["byte_mask"]), objectives.kd_temperature, []
    for name, llm in llms.items():
        rows = batch["answers"][name]
        logits = llm.model(
            inputs_embeds=llm.wire_embeds(soft[name], rows["lead_ids"], rows["input_ids"]),
            use_cache=False,
            logits_to_keep=rows["input_ids"].shape[1] + 1,
        ).logits.float()
        terms = []
        for term in objectives.terms:
            mask = objectives.targets(rows["labels"], term)
            if term == "kd":
                target = rows["kd_logprobs"]
                kl = (target.exp() * (target - F.log_softmax(logits / tau, -1))).sum(-1)
                terms.append((kl * mask).sum() * tau**2)
            else:
                labels = rows["labels"].masked_fill(~mask, IGNORE_INDEX)
                terms.append(F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum"))
        sums.append(torch.stack(terms))
    return torch.stack(sums)


# A Llama architecture small enough to draw in a test, for `random:`.
SMALL_LLAMA = dict(
    model_type="llama",
    vocab_size=4096,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
)


@pytest.fixture(autouse=True)
def one_thread():
    torch.set_num_threads(1)


def tiny_llms() -> dict:
    """The two tiny readers shipped in the repo, in fp32 on the CPU, as the tests read them."""
    from latentwire.llm import load_frozen_llm
    from latentwire.llm_sources import LLM_NAMES

    return {n: load_frozen_llm(n, "tiny", torch.float32, torch.device("cpu")) for n in LLM_NAMES}


@pytest.fixture(scope="module")
def llms():
    """tiny_llms(), once per test module (a module may change what they read around the wire)."""
    return tiny_llms()


@pytest.fixture(scope="session")
def saved_reader(tmp_path_factory):
    """The tiny Qwen reader saved as a hub checkpoint is (safetensors, config, tokenizer)."""
    from latentwire.llm_sources import tiny_model, tiny_tokenizer

    path = tmp_path_factory.mktemp("reader")
    tokenizer = tiny_tokenizer("qwen")
    tiny_model("qwen", tokenizer).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_readers():
    """tiny_llms(), loaded once for the session: for tests that change nothing of them (a test that
    wraps them wraps a copy, `wrapped_readers`)."""
    return tiny_llms()


def wrapped_readers(readers: dict, policy: str) -> dict:
    """A copy of `readers` whose decoder layers are checkpointed by `policy`, as train.py wraps them."""
    import copy
    from dataclasses import replace

    from latentwire.harness.recompute import checkpoint_options
    from latentwire.parallelize import checkpoint_decoder_layers

    llms = {n: replace(llm, model=copy.deepcopy(llm.model)) for n, llm in readers.items()}
    if policy != "none":
        for llm in llms.values():
            checkpoint_decoder_layers(llm, checkpoint_options(policy))
    return llms


@pytest.fixture(scope="session")
def default_cpu_run(tmp_path_factory, worker_id):
    """`torchrun --nproc_per_node=2 train.py --profile cpu`, unchanged but for out_dir: run once a
    session, read by the smoke and the evaluation tests. Under pytest-xdist the worker that asks
    first runs it while the other waits on the lock (its three minutes take both cores), then both
    read the same run, from the directory the session's workers share."""
    base = tmp_path_factory.getbasetemp()
    shared = base if worker_id == "master" else base.parent
    with open(shared / "default_cpu_run.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        done = shared / "default_cpu_run.done"
        if not done.exists():
            out = tmp_path_factory.mktemp("cpu") / "run"
            ok(run_train(["--profile", "cpu", "--out-dir", str(out)], nproc=2))
            done.write_text(str(out))
        return Path(done.read_text())


def processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line mentions `text` (a run's out_dir: its ranks, their loader
    workers); a zombie's command line is empty."""
    pids = []
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and text.encode() in (entry / "cmdline").read_bytes():
                pids.append(int(entry.name))
        except OSError:  # gone meanwhile
            pass
    return pids


def rank_pid(text: str, rank: int) -> int:
    """The pid of the rank `rank` of the run whose command line mentions `text`."""
    for pid in processes_mentioning(text):
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in environ:  # a whole entry: LOCAL_RANK=... is another
            return pid
    raise AssertionError(f"no rank {rank} mentions {text}")


def exit_and_leftovers(proc: subprocess.Popen, marker: str, timeout: int = 120) -> tuple[str, str, list[int]]:
    """Wait for `proc` to exit while a thread reads each of its pipes, and list the processes that
    still mention `marker` at that moment. (communicate() would wait for processes it left behind:
    they hold its pipes open.)"""
    import threading

    output = {}
    readers = [
        threading.Thread(target=lambda name, pipe: output.__setitem__(name, pipe.read()), args=item)
        for item in (("stdout", proc.stdout), ("stderr", proc.stderr))
    ]
    for reader in readers:
        reader.start()
    proc.wait(timeout=timeout)
    left = processes_mentioning(marker)
    for reader in readers:
        reader.join(timeout=timeout)
    return output["stdout"], output["stderr"], left


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1", **extra)
    return env


def run_train(
    args: list[str], nproc: int = 1, timeout: int = 600, torchrun: bool | None = None, **env
) -> subprocess.CompletedProcess:
    """train.py as users run it: `python train.py` for one process, `torchrun` for more (or for one,
    with `torchrun`)."""
    if not (nproc > 1 if torchrun is None else torchrun):
        cmd = [sys.executable, str(REPO / "train.py")]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc_per_node={nproc}",
            str(REPO / "train.py"),
        ]
    return subprocess.run(cmd + args, cwd=REPO, env=child_env(**env), capture_output=True, text=True, timeout=timeout)


def run_module(
    module: str, args: list[str], timeout: int = 300, elsewhere: Path | None = None
) -> subprocess.CompletedProcess:
    """`python -m module` from the repository, or from the directory `elsewhere` with the checkout
    on PYTHONPATH and a train.py there that is not the project's (a command that imported `train`
    would take it, and stop)."""
    env, cwd = child_env(), REPO
    if elsewhere is not None:
        (elsewhere / "train.py").write_text('raise SystemExit("error: the train.py of the working directory")\n')
        env, cwd = child_env(PYTHONPATH=str(REPO)), elsewhere
    return subprocess.run(
        [sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


class Preloaded:
    """tests/preloaded.py: commands forked from an interpreter that has made their imports, one at
    a time, all in the environment it was started with."""

    def __init__(self, env: dict, timeout: int = 300):
        self.timeout = timeout
        self.proc = subprocess.Popen(
            [sys.executable, str(REPO / "tests" / "preloaded.py")],
            cwd=REPO,
            env=child_env(**env),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )

    def run(self, target: str, args: list[str], outputs: Path) -> subprocess.CompletedProcess:
        out, err = outputs / "stdout", outputs / "stderr"
        self.proc.stdin.write(
            json.dumps(
                {
                    "target": target,
                    "args": args,
                    "cwd": str(REPO),
                    "stdout": str(out),
                    "stderr": str(err),
                    "timeout": self.timeout,
                }
            )
            + "\n"
        )
        self.proc.stdin.flush()
        said = self.proc.stdout.readline()
        assert said, f"tests/preloaded.py exited with code {self.proc.wait()}"
        return subprocess.CompletedProcess([target, *args], int(said), out.read_text(), err.read_text())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


@pytest.fixture(scope="session")
def forked(tmp_path_factory):
    """`forked(target, args)`: `python train.py ARGS` (target "train.py") or `python -m TARGET ARGS`
    from the repository, in run_train's environment, forked from a Preloaded interpreter: for the
    commands that stop in their checks (a refusal, nothing to do), whose 3-4 s would otherwise be
    mostly imports. One interpreter a session (a worker's, under pytest-xdist)."""
    server, printed = Preloaded({}), tmp_path_factory.mktemp("forked")
    yield lambda target, args: server.run(target, [str(a) for a in args], printed)
    server.close()


def evaluate_cli(ckpt, out_dir, nproc=1, n=32):
    """`python -m latentwire.evaluate`, or under torchrun with `nproc` ranks."""
    args = [
        "--ckpt",
        str(ckpt),
        "--eval-examples",
        str(n),
        "--batch-size",
        "8",
        "--max-new-tokens",
        "6",
        "--out-dir",
        str(out_dir),
    ]
    if nproc == 1:
        return ok(run_module("latentwire.evaluate", args))
    return ok(
        run_module(
            "torch.distributed.run", ["--standalone", f"--nproc_per_node={nproc}", "-m", "latentwire.evaluate", *args]
        )
    )


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-5000:]}"
    )
    return proc


def read_metrics(out_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]


def final_weights(out_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    ckpts = sorted((Path(out_dir) / "checkpoints").glob("step_*"))
    return load_file(str(ckpts[-1] / "trainable.safetensors"))


def max_rel_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """Largest max|a - b| / max|a| over the tensors: element-wise, against each tensor's scale.
    (This holds only because no parameter has a gradient that is mathematically zero, such as a
    key bias: Adam would turn its rounding noise into full-size updates that differ per split.)"""
    assert a.keys() == b.keys()
    return max(((a[k] - b[k]).abs().max() / a[k].abs().max().clamp_min(1e-12)).item() for k in a)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Non-zero exit, a single `error: ...` line on stderr and no traceback."""
    assert proc.returncode != 0, proc.stdout
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert "Traceback" not in proc.stderr, proc.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    for fragment in fragments:
        assert fragment in lines[0], lines[0]
    return lines[0]


@pytest.fixture(scope="session")
def straight(tmp_path_factory):
    """`straight(nproc)`: the unbroken run of TWENTY[nproc], made once and shared by the tests
    that split the same run (stopped, signalled, resumed) and compare."""
    runs = {}

    def get(nproc: int):
        if nproc not in runs:
            runs[nproc] = tmp_path_factory.mktemp(f"straight{nproc}") / "run"
            ok(run_train([*TWENTY[nproc], "--out-dir", str(runs[nproc])], nproc=nproc))
        return runs[nproc]

    return get


def wait_for_step(out, step, proc, timeout=300):
    """Until `out`'s metrics log `step` (the event a signal test waits for), while `proc` runs."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        path = out / "metrics.jsonl"
        if path.exists() and any(json.loads(line)["step"] >= step for line in path.read_text().splitlines() if line):
            return
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    raise AssertionError(f"step {step} not reached")


def wait_for_path(path: Path, proc, timeout=300):
    """Until `path` exists (a checkpoint's directory: the event a kill test waits for), while `proc` runs."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path} did not appear"
        time.sleep(0.2)


def assert_same_run(straight, resumed, from_step):
    a, b = final_weights(straight), final_weights(resumed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)  # bitwise

    def losses(out):
        return [(m["step"], m["loss"], m["grad_norm"]) for m in read_metrics(out)]

    assert losses(resumed) == losses(straight)  # every step once, the resumed ones identical
    last = read_metrics(straight)[-1]["step"]
    assert [m["step"] for m in read_metrics(resumed)][from_step:] == list(range(from_step + 1, last + 1))


@pytest.fixture(scope="session")
def torchao_site(tmp_path_factory) -> str:
    """Where torchao, the optional dependency of --frozen-fp8, imports from for the tests that need
    it: this environment if it has it (""), else a directory pip installs requirements-fp8.txt into
    for the session, on this process's path and for a child's PYTHONPATH. Not the environment's own:
    transformers imports torchao in every process that finds it (0.8 s each), which the rest of the
    suite would pay. Skipped where pip cannot fetch it (offline)."""
    if importlib.util.find_spec("torchao"):
        return ""
    site = tmp_path_factory.mktemp("torchao")
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "-q",
            "--no-deps",
            "--target",
            str(site),
            "-r",
            str(REPO / "requirements-fp8.txt"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if proc.returncode != 0:
        pytest.skip(f"torchao could not be installed: {(proc.stderr.strip().splitlines() or ['?'])[-1]}")
    sys.path.insert(0, str(site))
    return str(site)
