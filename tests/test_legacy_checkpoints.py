"""Checkpoints of every earlier settings version (tests/fixtures/checkpoints, each written by the
commit that defined its version) evaluate, resume and extend under today's code, as PyTorch
Lightning tests its legacy checkpoints; the version in latentwire/settings.py is held to them, so
a setting changed without a new version (and its declaration) fails here."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from conftest import REPO, Preloaded, ok, read_metrics
from latentwire.harness.config import FIRST_VERSION, SETTINGS_VERSION, Field, Schema, flag_and_value
from latentwire.harness.errors import UserError
from latentwire.settings import Config

FIXTURES = REPO / "tests" / "fixtures" / "checkpoints"


def version(fixture: Path) -> int:
    """A fixture's settings version, from its name: v<N>_<commit>."""
    return int(fixture.name.split("_")[0].removeprefix("v"))


FIXTURES_BY_VERSION = sorted(FIXTURES.iterdir(), key=version)


@pytest.fixture(scope="module")
def commands():
    """Each command forked from an interpreter that has made its imports (tests/preloaded.py), one
    at a time: three for each fixture, each seconds of work after 2-3 s of imports."""
    server = Preloaded({})
    yield server
    server.close()


def meta(fixture: Path) -> dict:
    (ckpt,) = (fixture / "checkpoints").iterdir()
    return json.loads((ckpt / "meta.json").read_text())


def test_the_settings_version_is_the_newest_fixture_s_and_every_setting_says_since_when():
    """A setting added, removed or of another kind than the newest fixture records fails here until
    the version is bumped, the setting declares `since` that version and how an earlier checkpoint
    reads it, and a fixture of the new version is written (tests/fixtures/README.md)."""
    schema, newest = Config.schema(), FIXTURES_BY_VERSION[-1]
    assert version(newest) == Config.version, (
        f"Config.version is {Config.version}, the newest fixture {newest.name}: write the fixture of "
        "the new version (tests/fixtures/README.md)"
    )
    recorded = {key: value for key, value in meta(newest)["config"].items() if key != "profile"}
    assert recorded.keys() == schema.fields.keys(), (
        f"settings since {newest.name}: added {sorted(schema.fields.keys() - recorded.keys())}, removed "
        f"{sorted(recorded.keys() - schema.fields.keys())}: bump Config.version and declare each's since"
    )
    for key, value in recorded.items():  # of the kind it was: a change of kind is a new version too
        schema.check_value(key, value, f"{newest.name}'s {key}")
    for fixture in FIXTURES_BY_VERSION:
        saved = meta(fixture)
        assert saved.get(SETTINGS_VERSION, FIRST_VERSION) <= version(fixture), fixture.name
        absent = schema.fields.keys() - saved["config"].keys()
        undeclared = [key for key in absent if not (schema.fields[key].since or 0) > version(fixture)]
        assert not undeclared, f"{fixture.name} has no {undeclared}, which declare no since after its version"


def test_an_earlier_version_reads_as_it_ran_and_a_newer_one_is_refused():
    """A setting added since reads at its value before; one whose values changed kind carries each
    over; a checkpoint that records the newer setting keeps it; a newer version is refused."""
    schema = Schema(
        [
            Field(key="policy", section="s", name="policy", kind=str, help="", default="none", since=3,
                  carried={False: "none", True: "full"}),
            Field(key="buckets", section="s", name="buckets", kind=int, help="", default=4096, since=3, before=(0,)),
        ],
        version=3,
    )  # fmt: skip
    assert schema.lift({"policy": True}, 1, "ckpt") == {"policy": "full", "buckets": 0}
    assert schema.lift({"policy": "selective", "buckets": 8}, 1, "ckpt") == {"policy": "selective", "buckets": 8}
    assert schema.saved({"config": {"policy": False}}, "ckpt") == {"policy": "none", "buckets": 0}  # unversioned: 1
    assert schema.lift({"policy": False}, 3, "ckpt") == {"policy": False}  # version 3 had them: not lifted
    with pytest.raises(UserError, match="ckpt was written with settings version 4, newer than this code's 3"):
        schema.saved({"config": {}, SETTINGS_VERSION: 4}, "ckpt")


@pytest.mark.slow
@pytest.mark.parametrize("fixture", FIXTURES_BY_VERSION, ids=lambda f: f.name)
def test_a_checkpoint_of_every_version_evaluates_resumes_and_extends(fixture, commands, tmp_path):
    """Evaluated from its own meta.json; resumed with its own command for its last two steps, its
    shape and data kept (the profile's settings it predates not forced on it), the new checkpoint
    recording today's version; and a new run started from its weights, given its shape's flags."""
    command, run = json.loads((fixture / "command.json").read_text()), tmp_path / "run"
    shutil.copytree(fixture, run)
    report = tmp_path / "eval"
    ok(commands.run("latentwire.evaluate", ["--ckpt", str(run), "--eval-examples", "4", "--max-new-tokens", "2",
                                            "--out-dir", str(report)], tmp_path))  # fmt: skip
    assert len(list(report.glob("*.json"))) == 1

    saved = Config.schema().saved(meta(fixture), fixture.name)
    ok(commands.run("train.py", [*command, "--out-dir", str(run), "--resume"], tmp_path))
    assert [m["step"] for m in read_metrics(run)] == [1, 2, 3, 4]
    resumed = meta(run)
    assert resumed["step"] == 4 and resumed[SETTINGS_VERSION] == Config.version
    shape = Config.schema().weight_fields()
    assert {key: resumed["config"][key] for key in shape} == {key: saved[key] for key in shape}

    shape_flags = [part for key in shape for part in flag_and_value(key, saved[key]).split(" ", 1)]
    new = tmp_path / "new"
    extend = [*command, *shape_flags, "--init-from", str(fixture), "--max-steps", "1", "--out-dir", str(new)]
    proc = ok(commands.run("train.py", extend, tmp_path))
    assert f"init: the trainable weights of {fixture}" in proc.stdout
