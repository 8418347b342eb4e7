"""train.py as people read it and copy it: short functions, few comments per line of code, the
block table of docs/loop.md in the file's order, and the loop lifted onto another model as
docs/loop.md ("Lifting the loop") says."""

import ast
import io
import json
import re
import shutil
import subprocess
import sys
import tokenize

import pytest
from test_imports import PROJECT_WORDS

from conftest import REPO, child_env, ok

TRAIN_PY = (REPO / "train.py").read_text()
MAX_FUNCTION_LINES = 120
MAX_COMMENT_RATIO = 0.35


def docstring_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and node.body:
            first = node.body[0]
            if (
                isinstance(first, ast.Expr)
                and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)
            ):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def comment_and_code_lines(source: str) -> tuple[set[int], set[int]]:
    """(lines that are only a comment or a docstring, lines of code)."""
    comments, code = set(), set()
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            comments.add(tok.start[0])
        elif tok.type not in (tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENDMARKER):
            code.update(range(tok.start[0], tok.end[0] + 1))
    docs = docstring_lines(ast.parse(source))
    code -= docs
    return (comments - code) | docs, code


def test_no_function_of_train_py_is_longer_than_a_screenful_or_two():
    lengths = {
        node.name: node.end_lineno - node.lineno + 1
        for node in ast.walk(ast.parse(TRAIN_PY))
        if isinstance(node, ast.FunctionDef)
    }
    assert max(lengths.values()) <= MAX_FUNCTION_LINES, lengths


def test_train_py_says_why_in_few_lines():
    comments, code = comment_and_code_lines(TRAIN_PY)
    assert len(comments) <= MAX_COMMENT_RATIO * len(code), (len(comments), len(code))


def test_the_counts_are_measured_on_real_source():
    comments, code = comment_and_code_lines('"""Doc\nstring."""\n# a comment\nx = 1  # why\ny = (\n    2)\n')
    assert (sorted(comments), sorted(code)) == ([1, 2, 3], [4, 5, 6])


def block_titles(source: str) -> list[str]:
    """Each labelled block's title: `# --- Title: why` (or `# --- Title ---`)."""
    return [
        re.match(r"\s*# --- (.*?)(?::|\s-{2,}|$)", line).group(1).strip()
        for line in source.splitlines()
        if re.match(r"\s*# --- ", line)
    ]


def test_each_block_says_why_in_at_most_three_lines():
    """A labelled block is a title line and at most three lines of why; the long story lives in
    the module that does the work."""
    lines = TRAIN_PY.splitlines()
    long = []
    for i, line in enumerate(lines):
        if re.match(r"\s*# --- ", line):
            why = 0
            while i + 1 + why < len(lines) and re.match(r"\s*#(?! ---)", lines[i + 1 + why]):
                why += 1
            if why > 3:
                long.append(line.strip())
    assert not long, long


def test_docs_list_the_blocks_of_train_py_in_its_order():
    table = re.search(
        r"\| block in `train.py` \| why \|\n\|---\|---\|\n((?:\|.*\n)+)", (REPO / "docs" / "loop.md").read_text()
    ).group(1)
    documented = [row.split("|")[1].strip() for row in table.splitlines()]
    assert documented == block_titles(TRAIN_PY)


def prose(source: str) -> list[tuple[int, str]]:
    """(line, text) of each comment and docstring."""
    said = [
        (t.start[0], t.string)
        for t in tokenize.generate_tokens(io.StringIO(source).readline)
        if t.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef)) and ast.get_docstring(node, clean=False):
            said.append((node.body[0].lineno, ast.get_docstring(node, clean=False)))
    return said


def test_train_py_says_nothing_a_copy_would_have_to_edit():
    """A copy keeps train.py's comments and docstrings as they are: they name no part of LatentWire,
    none of this project's profiles, and no tool, page or bench a copy has not."""
    profiles = json.loads((REPO / "hw_profiles.json").read_text())
    keys = "|".join(map(re.escape, profiles))  # as written: CPU is a CPU, not the profile cpu
    ours = re.compile(rf"(?<![\w-])({keys})(?![\w-])|find_batch|docs/|bench/")
    said = [(line, m.group(0)) for line, text in prose(TRAIN_PY) for m in PROJECT_WORDS.finditer(text)]
    said += [(line, m.group(0)) for line, text in prose(TRAIN_PY) for m in ours.finditer(text)]
    assert said == []


# --- Lifting the loop ---------------------------------------------------------------------------------

LIFT = REPO / "tests" / "lift"
TEMPLATE = REPO / "latentwire" / "harness" / "template.py"
MAX_TEMPLATE_LINES = 40


def lifted(source: str) -> str:
    """train.py as docs/loop.md says to lift it: the harness imported as the copied folder, and the
    template's recipe named in place of LatentWire's."""
    source = source.replace("from latentwire.harness.", "from harness.")
    return source.replace(
        "from latentwire.recipe import LatentWire as Recipe", "from harness.template import Regression as Recipe"
    )


def lines_beyond_imports(source: str) -> list[str]:
    imports = {
        line
        for node in ast.walk(ast.parse(source))
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for line in range(node.lineno, node.end_lineno + 1)
    }
    return [line for i, line in enumerate(source.splitlines(), 1) if i not in imports]


def profile_keys(path, key: str) -> int:
    return len(json.loads(path.read_text())[key])


# What a copier writes, counted: shown in the test's id (pytest -v) and stated in docs/loop.md.
COUNTS = {
    "lines": len(comment_and_code_lines(TEMPLATE.read_text())[1]),
    "cpu keys": profile_keys(REPO / "hw_profiles.json", "cpu"),
    "toy keys": profile_keys(LIFT / "hw_profiles.json", "toy"),
}


@pytest.mark.parametrize("counts", [COUNTS], ids=[", ".join(f"{what} {n}" for what, n in COUNTS.items())])
def test_lifting_changes_only_the_import_lines_and_the_recipe_and_profile_are_small(counts):
    """A copy changes train.py's import lines and nothing else; the recipe it then names is the
    harness's template, at most MAX_TEMPLATE_LINES lines of code (its template recipe lines); a
    profile names its card and what differs from the defaults (the cpu and the toy profile's keys).
    docs/loop.md states the counts."""
    copy = lifted(TRAIN_PY)
    assert lines_beyond_imports(copy) == lines_beyond_imports(TRAIN_PY)
    _, code = comment_and_code_lines(copy)
    assert not [line for i, line in enumerate(copy.splitlines(), 1) if i in code and "latentwire" in line]
    assert counts["lines"] <= MAX_TEMPLATE_LINES, counts
    doc = " ".join((REPO / "docs" / "loop.md").read_text().split())
    said = {
        "lines": f"{counts['lines']} lines of code",
        "cpu keys": f"hw_profiles.json {counts['cpu keys']} keys",
        "toy keys": f"has {counts['toy keys']} keys",
    }
    assert [phrase for phrase in said.values() if phrase not in doc] == []


@pytest.mark.slow
def test_the_loop_lifted_onto_another_model_trains_it_on_two_ranks(tmp_path):
    """train.py beside latentwire/harness/ copied unchanged but for its import lines, and one
    profile, where nothing of LatentWire can be imported: the template recipe trains on 2 gloo
    ranks, logs every step and saves a checkpoint of its model."""
    shutil.copytree(REPO / "latentwire" / "harness", tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(LIFT / "hw_profiles.json", tmp_path)
    (tmp_path / "train.py").write_text(lifted(TRAIN_PY))
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    proc = ok(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "train.py",
                "--profile",
                "toy",
                "--out-dir",
                "out",
            ],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4, 5, 6]
    assert all(r["loss"] == r["loss"] for r in records) and records[-1]["loss"] < records[0]["loss"]
    assert all(r["mfu"] is None and r["tflops_per_gpu"] is None for r in records)  # the template counts no FLOPs
    assert "global batch 4 x 1 x 2 = 8, 97 trainable parameters" in proc.stdout, proc.stdout
    assert (tmp_path / "out" / "checkpoints" / "step_00000006" / "trainable.safetensors").is_file()
