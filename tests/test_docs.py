"""What docs/loop.md says of the code, held to it: its tables of settings and flags are generated
from their declarations (rewrite them with `python tests/test_docs.py`), and its map of the modules
names every module of the package and none that is not there."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import MISSING
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
LOOP_MD = REPO / "docs" / "loop.md"
BEGIN = "<!-- generated from the declarations by `python tests/test_docs.py`: edit them, not this -->"
END = "<!-- end of the generated tables -->"


def cell(text: str) -> str:
    """Text as one cell of a Markdown table: one line, its bars and tags (`<app>`) escaped."""
    return " ".join(str(text).split()).replace("|", "\\|").replace("<", "&lt;")


def shown(value) -> str:
    """A default as a profile (JSON) or the flag takes it."""
    if value is MISSING:
        return "(every profile names it)"
    return "`" + (value or "''" if isinstance(value, str) else json.dumps(value)) + "`"


def takes(f) -> str:
    """What values a setting takes: its kind, choices and bounds."""
    symbols = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    if f.choices:
        what = "one of " + ", ".join(f.choices)
    elif f.kind is bool:
        what = "true or false"
    else:
        what = {int: "an integer", float: "a number", str: "text"}[f.kind]
        what += "".join(f" {symbols[bound]} {limit:g}" for bound, limit in f.bounds)
    return what + (", or null" if f.nullable else "")


def refused_by(f) -> str:
    """What refuses a change of the setting: a resume (restored), --init-from (the weights' shape)."""
    return ", ".join(by for by, fixed in (("resume", f.restored), ("init-from", f.weights)) if fixed)


def settings_table(fields) -> list[str]:
    rows = ["| setting | section | default | takes | a change refused by | what it is |", "|---|---|---|---|---|---|"]
    for f in fields:
        cells = [f"`{f.key}`", f.section, shown(f.default), takes(f), refused_by(f), f.help]
        rows.append("| " + " | ".join(map(cell, cells)) + " |")
    return rows


def flags_table() -> list[str]:
    from latentwire.harness.loop_config import invocation_flags

    rows = ["| flag | what it does |", "|---|---|"]
    for f in invocation_flags():
        rows.append(f"| `--{f.name.replace('_', '-')}` | {cell(f.metadata['flag']['help'])} |")
    return rows


def generated_tables() -> str:
    """The tables docs/loop.md holds between BEGIN and END, from the declarations."""
    from latentwire.harness.loop_config import LoopConfig
    from latentwire.settings import Config

    loop = LoopConfig.schema().fields
    model = [f for key, f in Config.schema().fields.items() if key not in loop]
    return "\n".join(
        [
            BEGIN,
            "",
            "The loop's settings (`harness.loop_config.LoopConfig`, the harness's sections), what any model",
            "trained by `train.py` has:",
            "",
            *settings_table(loop.values()),
            "",
            "The invocation's flags (`harness.loop_config.Invocation`), which no profile names and no",
            "checkpoint records:",
            "",
            *flags_table(),
            "",
            "LatentWire's settings (`latentwire.settings.Config`, its sections beside the loop's):",
            "",
            *settings_table(model),
            "",
            END,
        ]
    )


def documented_tables(text: str) -> str:
    return text[text.index(BEGIN) : text.index(END) + len(END)]


def test_the_settings_tables_are_the_declarations():
    """Every setting and flag declared is in docs/loop.md, as its declaration says (a new one, or a
    changed default or help, fails here until `python tests/test_docs.py` rewrites the tables)."""
    assert documented_tables(LOOP_MD.read_text()) == generated_tables(), "run: python tests/test_docs.py"


def test_the_tables_name_every_setting_once():
    from latentwire.settings import Config

    keys = re.findall(r"^\| `(\w+)` \|", generated_tables(), re.M)
    assert sorted(keys) == sorted(Config.schema().fields) and len(keys) == len(set(keys))


def mapped_paths(text: str) -> list[str]:
    """The paths docs/loop.md's module map names: one entry a line, a folder's entries indented two
    more than it, a description after each (a wrapped one indented to the descriptions' column)."""
    block = re.search(r"What each holds:\n\n```\n(.*?)```", text, re.S).group(1).splitlines()
    column = len(re.match(r"\S+\s+", block[0]).group(0))
    paths, folders = [], []
    for line in block:
        depth = len(line) - len(line.lstrip())
        if depth >= column:  # a description's second line
            continue
        folders = folders[: depth // 2]
        name = line.split()[0]
        paths.append("/".join([*folders, name.rstrip("/")]))
        if name.endswith("/"):
            folders.append(name.rstrip("/"))
    return paths


def test_the_module_map_names_every_module_and_no_other():
    """Each module of the package (the harness's tests aside, which the map names as a folder) is in
    docs/loop.md's map of what each holds, and each path the map names exists."""
    paths = mapped_paths(LOOP_MD.read_text())
    modules = {
        str(p.relative_to(REPO))
        for p in (REPO / "latentwire").rglob("*.py")
        if p.name != "__init__.py" and "tests" not in p.relative_to(REPO).parts
    }
    assert sorted(modules - set(paths)) == []
    assert [p for p in paths if not (REPO / p).exists()] == []


def test_the_map_is_read_as_a_tree():
    block = ["a.py      one", "b/        two", "  c.py    three,", "          wrapped", "d/        four"]
    text = "What each holds:\n\n```\n" + "\n".join(block) + "\n```"
    assert mapped_paths(text) == ["a.py", "b", "b/c.py", "d"]


if __name__ == "__main__":
    sys.path.insert(0, str(REPO))
    text = LOOP_MD.read_text()
    LOOP_MD.write_text(text.replace(documented_tables(text), generated_tables()))
    print(f"rewrote the generated tables of {LOOP_MD}")
