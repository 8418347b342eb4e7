"""The package's shape, read from its imports (every one: top-level, inside functions, under
TYPE_CHECKING): no module reaches itself again through its imports, and the arrows run one way,
from the entry points (train.py and the `python -m` commands) through the tools (the memory
planner, the evaluation) to the library, never back; and the harness under it all stands alone."""

import ast
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO, child_env, ok

# What users run: each may import anything below it but another entry point.
ENTRY_POINTS = {
    "train",
    "latentwire.evaluate",
    "latentwire.plan",
    "latentwire.find_batch",
    "latentwire.readers",
    "latentwire.harness.launch",
}
# Above the library: the tools train.py and the commands use, and LatentWire's recipe (what train.py
# asks of the model), which uses the evaluation. The library never imports them.
TOOL_PACKAGES = ("latentwire.planner", "latentwire.eval", "latentwire.recipe")
# Modules run by their path (runpy), which no import statement shows: the module that runs one, and
# the module it runs. The commands plan and measure train.py's own step, read from the script beside
# the package; an arrow up to an entry point, the only one, taken as an import below.
BY_PATH = {"latentwire.planner.script": "train"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """train.py and the package, without the harness's own tests (its toy loop imports `harness`)."""
    package = [p for p in sorted((REPO / "latentwire").rglob("*.py")) if "tests" not in p.relative_to(REPO).parts]
    return {module_name(p): p for p in [REPO / "train.py", *package]}


def imported(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` imports (`from .x import y` counts x, and x.y if y is one;
    importing a.b.c runs the packages a and a.b first, so they count too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    parents = {".".join(m.split(".")[:i]) for m in found for i in range(1, m.count(".") + 1)}
    return {m for m in found | parents if m in known and m != name and not name.startswith(m + ".")}


def import_graph() -> dict[str, set[str]]:
    """Each module's imports, and what it runs by its path (BY_PATH)."""
    found = modules()
    graph = {name: imported(name, path, set(found)) for name, path in found.items()}
    for runner, run in BY_PATH.items():
        graph[runner].add(run)
    return graph


def runs_by_path(path: Path) -> bool:
    """Whether the module imports runpy, which runs a module or a file without importing it."""
    return any(
        (isinstance(node, ast.Import) and "runpy" in [a.name for a in node.names])
        or (isinstance(node, ast.ImportFrom) and node.module == "runpy")
        for node in ast.walk(ast.parse(path.read_text()))
    )


def is_tool(name: str) -> bool:
    return any(name == p or name.startswith(p + ".") for p in TOOL_PACKAGES)


def test_the_entry_points_are_the_modules_users_run():
    runnable = {name for name, path in modules().items() if '__name__ == "__main__"' in path.read_text()}
    assert runnable == ENTRY_POINTS


def test_the_graph_is_read_from_every_kind_of_import():
    graph = import_graph()
    assert "latentwire.recipe" in graph["train"] and "latentwire.harness.errors" in graph["latentwire.settings"]
    assert {"latentwire.planner", "latentwire.eval", "latentwire.llm_sources"} <= graph.keys()


def test_every_module_that_runs_another_by_its_path_is_declared():
    """A module run by its path is an import the graph cannot read, so each runner is declared
    (BY_PATH) and the graph takes its arrow: a new runpy is a new arrow to declare."""
    assert {name for name, path in modules().items() if runs_by_path(path)} == set(BY_PATH)


def test_train_py_reaches_the_model_through_its_recipe_alone():
    """Besides the harness, train.py imports the recipe alone: the one name a copy of the loop
    changes (docs/loop.md, "Lifting the loop")."""
    project = {
        m for m in import_graph()["train"] if m.startswith("latentwire.") and not m.startswith("latentwire.harness")
    }
    assert project == {"latentwire.recipe"}


def test_no_module_imports_itself_round_a_circle():
    graph, circles = import_graph(), []

    def visit(node, path):
        for nxt in sorted(graph[node]):
            if nxt in path:
                circles.append(" -> ".join(path[path.index(nxt) :] + [nxt]))
            elif nxt not in done:
                visit(nxt, path + [nxt])
        done.add(node)

    done = set()
    for start in sorted(graph):
        if start not in done:
            visit(start, [start])
    assert not circles, circles


def test_the_library_imports_no_tool_and_no_tool_an_entry_point():
    graph = import_graph()
    wrong = []
    for name, targets in graph.items():
        for target in targets:
            if BY_PATH.get(name) == target:
                continue
            if name in ENTRY_POINTS:
                if target in ENTRY_POINTS:
                    wrong.append(f"{name} -> {target}")
                continue
            if target in ENTRY_POINTS or (is_tool(target) and not is_tool(name)):
                wrong.append(f"{name} -> {target}")
    assert not wrong, wrong


HARNESS = REPO / "latentwire" / "harness"
# Words for what the harness must not know of: LatentWire's parts.
PROJECT_WORDS = re.compile(
    r"\b(llms?|llama|qwen|latentwire|wire|latents?|adapters?|readers?|prompts?|teacher|"
    r"encoder|soft tokens?)\b",
    re.IGNORECASE,
)


def harness_files() -> list[Path]:
    return sorted(p for p in HARNESS.rglob("*") if p.suffix in (".py", ".json"))


def test_the_harness_imports_nothing_of_the_project():
    """Its modules import each other relatively, its toy loop imports `harness`: a folder that
    copies alone."""
    wrong = []
    for path in harness_files():
        if path.suffix != ".py":
            continue
        depth = len(path.relative_to(HARNESS).parts)  # 1 for harness/x.py: `from .` is as far as it may go
        for node in ast.walk(ast.parse(path.read_text())):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom) and not node.level
                else []
            )
            if isinstance(node, ast.ImportFrom) and node.level > depth:
                wrong.append(f"{path.name}: from {'.' * node.level}{node.module or ''}")
            wrong += [f"{path.name}: {n}" for n in names if n.split(".")[0] in ("latentwire", "train", "bench")]
    assert not wrong, wrong


def test_the_harness_names_no_part_of_latentwire():
    said = [
        f"{p.relative_to(HARNESS)}:{i}: {m.group(0)}"
        for p in harness_files()
        for i, line in enumerate(p.read_text().splitlines(), 1)
        for m in PROJECT_WORDS.finditer(line)
    ]
    assert not said, said


# The harness's public names that neither train.py, the template nor the harness itself uses: each
# with what any model would want it for (LatentWire's package, its commands or bench/ use it).
USED_BESIDE_THE_LOOP = {
    "HostReads": "counting a loop's host syncs: how its tests hold it to one per step",
    "summarize_trace": "a profiler trace the run wrote (profiler true), read back as a few lines",
    "format_trace_summary": "the same, as text",
    "read_snapshot": "a memory snapshot the run wrote (memory_snapshot true), read back as data",
    "live_at_peak": "the same, replayed to its peak",
    "by_site": "the same, the blocks live at its peak by the lines that allocated them",
    "positive": "an argparse type for the numbers of a model's own commands (evaluation, planning)",
    "process_group": "a model's own commands joining the ranks torchrun starts, as train.py joins them",
    "recomputed_matmuls": "what selective activation checkpointing recomputes: a model's HFU counts it",
    "stable_shapes": "dynamo's settings around a compiled forward whose input sizes vary, which the recipe owns",
    "draws_per_source": "how many of a run's draws each source of a Mixture gives: what a run reports of its mix",
    "mixture_identity": "what a checkpoint records of a Mixture's sources and weights, so a resume refuses others",
}


def public_names(path: Path) -> set[str]:
    """The names a module defines at its top level, but those with a leading underscore."""
    defined = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
    return {name for name in defined if not name.startswith("_")}


def names_used(path: Path) -> set[str]:
    """The names a module reads: as names, as attributes, and those it imports."""
    used = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load):
            used.add(node.id)
        elif isinstance(node, ast.Attribute):
            used.add(node.attr)
        elif isinstance(node, ast.alias):
            used.add(node.name.rpartition(".")[2])
    return used


def test_every_public_name_of_the_harness_is_used_by_the_loop_the_template_or_the_harness():
    """The harness holds what any model's loop uses: each public name is used by train.py, the
    template recipe or the harness itself, or listed (USED_BESIDE_THE_LOOP) with why any model
    would want it. The template's own names are the copier's, not the harness's."""
    modules = [p for p in sorted(HARNESS.glob("*.py")) if p.name not in ("__init__.py", "template.py")]
    defined = set().union(*map(public_names, modules))
    used = set().union(*map(names_used, [REPO / "train.py", HARNESS / "template.py", *modules]))
    assert defined - used == USED_BESIDE_THE_LOOP.keys()


# The distribution (pip's name) of each module the harness imports from outside the standard library.
DISTRIBUTIONS = {
    "torch": "torch",
    "numpy": "numpy",
    "safetensors": "safetensors",
    "tensorboard": "tensorboard",  # also what torch.utils.tensorboard imports
    "tqdm": "tqdm",
    "pynvml": "nvidia-ml-py",
    "pytest": "pytest",
}


def harness_needs() -> set[str]:
    """The top-level modules from outside the standard library that the harness (its tests
    included) imports, and what torch imports on its behalf."""
    needs = set()
    for path in harness_files():
        if path.suffix != ".py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module]
            else:
                continue
            needs.update(n.split(".")[0] for n in names)
            needs.update("tensorboard" for n in names if n == "torch.utils.tensorboard")
    return needs - set(sys.stdlib_module_names) - {"harness", "toy_train"}


def test_the_harness_requirements_name_what_it_imports():
    """harness/requirements.txt, what a copy of the harness installs, pins each distribution the
    harness imports (or names it as optional) and nothing else, and the project's requirements
    install it as it is."""
    import importlib.metadata

    lines = (HARNESS / "requirements.txt").read_text().splitlines()
    pinned = {line.split("==")[0] for line in lines if "==" in line and not line.startswith("#")}
    optional = {m.group(1) for line in lines if (m := re.match(r"# optional[^:]*: ([\w.-]+)", line))}
    needs = harness_needs()
    assert needs <= DISTRIBUTIONS.keys(), needs - DISTRIBUTIONS.keys()
    assert pinned | optional == {DISTRIBUTIONS[m] for m in needs}
    installed = importlib.metadata.packages_distributions()
    assert all(DISTRIBUTIONS[m] in installed[m] for m in needs & installed.keys())
    assert "-r latentwire/harness/requirements.txt" in (REPO / "requirements.txt").read_text().splitlines()


@pytest.mark.slow
def test_the_harness_copied_alone_runs_its_own_tests(tmp_path):
    """latentwire/harness/ copied into an empty directory: its own tests (the toy loop's exact
    accumulation over micro-batches and ranks, one host sync per step, bitwise resume, a stop
    signal saved with exit 75; a checkpoint read as data) pass there, where nothing of the
    project can be imported."""
    shutil.copytree(HARNESS, tmp_path / "harness", ignore=shutil.ignore_patterns("__pycache__"))
    env = {k: v for k, v in child_env().items() if k != "PYTHONPATH"}
    proc = ok(
        subprocess.run(
            [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "harness/tests"],
            cwd=tmp_path,
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    )
    assert re.search(r"\b\d+ passed", proc.stdout) and "skipped" not in proc.stdout, proc.stdout[-2000:]
