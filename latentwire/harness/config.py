"""Settings, each declared once: a field of a typed section with its default, help and bounds.

A section is a frozen dataclass owned by the module that reads it (as torchtitan's components own
their configs); each of its fields is a `setting(default, help, ...)`, whose type annotation gives
its kind (`int`, `float`, `bool`, `str`; `X | None` for nullable; `Literal[...]` for a choice).
A run's configuration is a dataclass of sections. From it follow everything else (`Schema.of`):
the profile keys and the command-line flags (the field's name, or its `key`; `--micro-batch-size`
for `micro_batch_size`), the validation (type, choices, bounds, and the configuration's `rules`
that tie fields together), --help, and the flat record meta.json keeps.

Settings have versions. A configuration declares the version of its settings (`version`), which
each checkpoint's meta.json records; a setting added later declares the version that added it and
the value that reproduces what earlier versions did (`since=N, before=value`), one whose values
changed kind declares how the earlier values carry over (`since=N, carried={old: new}`). A
checkpoint of an earlier version is read through those declarations (`Schema.lift`), one of a newer
version is refused (docs/loop.md, "Lifting the loop").

A profile is one key of a JSON file of profiles: the defaults, under what the profiles it
`extends` name, under what it names itself (nanoGPT's defaults-then-overrides). Every value is
checked, so a typo in the JSON or on the command line is a one-line error naming the field, not a
KeyError deep inside the loop.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass
from pathlib import Path
from typing import Callable, Literal

from .errors import UserError

BOUNDS = {"gt": (">", float.__gt__), "ge": (">=", float.__ge__), "lt": ("<", float.__lt__), "le": ("<=", float.__le__)}


def setting(
    default=MISSING,
    help: str = "",
    *,
    key: str | None = None,
    refused: dict | None = None,
    restored: bool = False,
    weights: bool = False,
    since: int | None = None,
    before=MISSING,
    carried: dict | None = None,
    **bounds: float,
):
    """A section's field as a setting: its `default` (none: every profile must name it), its
    `help`, the profile key and flag it goes by where that is not its own name (`key`), values
    refused with a reason (`refused`), its bounds (`gt`, `ge`, `lt`, `le`), whether a resume may
    not change it (`restored`: the checkpoint's state depends on it) and whether the trained
    weights depend on it (`weights`: --init-from compares it). A setting of a later version than
    the first names it (`since`) and says how a checkpoint of an earlier one reads: `before`, the
    value that reproduces what earlier versions did (it did not exist), or `carried`, each earlier
    value's meaning today (its values changed kind)."""
    assert set(bounds) <= set(BOUNDS), f"unknown bounds {sorted(set(bounds) - set(BOUNDS))}"
    assert (since is None) == (before is MISSING and carried is None), "since goes with one of before or carried"
    assert before is MISSING or carried is None, "a setting either was added (before) or changed kind (carried)"
    spec = dict(
        help=help,
        key=key,
        refused=refused or {},
        restored=restored,
        weights=weights,
        bounds=bounds,
        since=since,
        before=() if before is MISSING else (before,),
        carried=carried or {},
    )
    return dataclasses.field(default=default, metadata={"setting": spec})


@dataclass(frozen=True)
class Field:
    """One setting as profiles, flags and meta.json see it, derived from its section's field."""

    key: str  # the profile key and, with dashes, the flag
    section: str  # the configuration's attribute that holds the section
    name: str  # the section's attribute
    kind: type  # int, float, bool or str
    help: str
    default: object  # MISSING: every profile names it
    choices: tuple = ()
    nullable: bool = False
    bounds: tuple = ()  # (("gt", 0.0), ...)
    refused: dict = dataclasses.field(default_factory=dict)  # value -> why it is not (yet) taken
    restored: bool = False
    weights: bool = False
    since: int | None = None  # the settings version that added it, or changed the kind of its values
    before: tuple = ()  # added: (its value in every earlier version,)
    carried: dict = dataclasses.field(default_factory=dict)  # changed kind: earlier value -> today's


def fields_of(section_attr: str, section: type) -> list[Field]:
    """A section's settings, their kinds read from its annotations."""
    hints = typing.get_type_hints(section)
    out = []
    for f in dataclasses.fields(section):
        spec = f.metadata.get("setting")
        assert spec is not None, f"{section.__name__}.{f.name} is not declared with setting()"
        kind, nullable, choices = _kind(hints[f.name])
        out.append(
            Field(
                key=spec["key"] or f.name,
                section=section_attr,
                name=f.name,
                kind=kind,
                help=spec["help"],
                default=f.default,
                choices=choices,
                nullable=nullable,
                bounds=tuple(spec["bounds"].items()),
                refused=spec["refused"],
                restored=spec["restored"],
                weights=spec["weights"],
                since=spec["since"],
                before=spec["before"],
                carried=spec["carried"],
            )
        )
    return out


def _kind(hint) -> tuple[type, bool, tuple]:
    """(kind, nullable, choices) of an annotation: `float`, `float | None`, `Literal["a", "b"]`."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        (inner,) = [a for a in typing.get_args(hint) if a is not type(None)]
        return _kind(inner)[0], True, _kind(inner)[2]
    if typing.get_origin(hint) is Literal:
        choices = typing.get_args(hint)
        return type(choices[0]), False, choices
    assert hint in (int, float, bool, str), f"a setting is int, float, bool or str, not {hint}"
    return hint, False, ()


# What meta.json calls the version of its settings; a meta.json without one was written before
# versions were recorded, under the first version's rules (every later setting read by `lift`,
# whether the checkpoint records it or not).
SETTINGS_VERSION = "settings_version"
FIRST_VERSION = 1


class Schema:
    """A run's settings (key -> Field), their `version`, and `rules(values, where)`, the checks that
    tie fields together (raising UserError), run on every resolved profile and on the final
    settings. --help lists each profile by its `description` field, which a schema therefore has."""

    def __init__(
        self,
        fields: list[Field],
        rules: Callable[[dict, str], None] = lambda values, where: None,
        version: int = FIRST_VERSION,
    ):
        self.fields = {f.key: f for f in fields}
        assert len(self.fields) == len(fields), "two settings share a profile key"
        self.rules, self.version = rules, version
        for f in fields:
            assert f.since is None or FIRST_VERSION < f.since <= version, f"{f.key}: since {f.since}, version {version}"
            for value in f.before:
                self.check_value(f.key, value, f"{f.key}'s value before version {f.since}")

    @classmethod
    def of(
        cls,
        sections: dict[str, type],
        rules: Callable[[dict, str], None] = lambda values, where: None,
        version: int = FIRST_VERSION,
    ):
        """The schema of a configuration made of `sections` (attribute -> section dataclass)."""
        return cls([f for attr, section in sections.items() for f in fields_of(attr, section)], rules, version)

    def lift(self, saved: dict, version: int, where: str) -> dict:
        """The settings a checkpoint of settings `version` recorded (`saved`), as this version reads
        them: each setting added since, missing there, at its value before; each whose values changed
        kind since, carried over. A newer version than this schema's is refused: what its settings
        mean is not known here."""
        if not isinstance(version, int) or isinstance(version, bool):
            raise UserError(f"{where}: {SETTINGS_VERSION} must be a whole number, got {version!r}")
        if version > self.version:
            raise UserError(
                f"{where} was written with settings version {version}, newer than this code's {self.version}: "
                "read it with the code that wrote it, or update this code"
            )
        lifted = dict(saved)
        for key, f in self.fields.items():
            if f.since is None or version >= f.since:
                continue
            if key not in lifted and f.before:
                lifted[key] = f.before[0]
            elif key in lifted and type(lifted[key]) is not f.kind and lifted[key] in f.carried:
                lifted[key] = f.carried[lifted[key]]
        return lifted

    def saved(self, meta: dict, where: str) -> dict:
        """A checkpoint's settings (its meta.json's "config", flat), as this version reads them."""
        config = meta.get("config") if isinstance(meta, dict) else None
        if not isinstance(config, dict):
            raise UserError(f"{where} has no 'config' object")
        return self.lift(config, meta.get(SETTINGS_VERSION, FIRST_VERSION), where)

    def restored(self) -> tuple[str, ...]:
        """The settings a resume may not change: the checkpoint's state depends on them."""
        return tuple(key for key, f in self.fields.items() if f.restored)

    def weight_fields(self) -> tuple[str, ...]:
        """The settings the trained weights depend on (--init-from compares them)."""
        return tuple(key for key, f in self.fields.items() if f.weights)

    def defaults(self) -> dict:
        """The fields that have a default, with it."""
        return {key: f.default for key, f in self.fields.items() if f.default is not MISSING}

    def check_value(self, key: str, value, where: str):
        spec = self.fields[key]
        if value is None:
            if spec.nullable:
                return None
            raise UserError(f"{where}: field {key!r} must not be null")
        if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not spec.kind:
            raise UserError(f"{where}: field {key!r} must be {spec.kind.__name__}, got {value!r}")
        if spec.kind is float and not math.isfinite(value):  # JSON's Infinity/NaN, or --lr inf
            raise UserError(f"{where}: field {key!r} must be a finite number, got {value!r}")
        if value in spec.refused:
            raise UserError(f"{where}: {key} {value!r} {spec.refused[value]}; use one of {', '.join(spec.choices)}")
        if spec.choices and value not in spec.choices:
            raise UserError(f"{where}: field {key!r} must be one of {', '.join(spec.choices)}, got {value!r}")
        for bound, limit in spec.bounds:
            symbol, holds = BOUNDS[bound]
            if not holds(float(value), float(limit)):
                raise UserError(f"{where}: field {key!r} must be {symbol} {limit}, got {value!r}")
        return value

    def resolve(self, named: dict, where: str) -> dict:
        """The defaults under the values `named` (a profile's, or a checkpoint's record), every one
        checked and every rule kept."""
        unknown = [key for key in named if key not in self.fields]
        if unknown:
            raise UserError(f"{where}: unknown field {unknown[0]!r}")
        values = self.defaults() | named
        missing = [key for key in self.fields if key not in values]
        if missing:
            raise UserError(f"{where}: missing field {missing[0]!r}")
        values = {key: self.check_value(key, values[key], where) for key in self.fields}
        self.rules(values, where)
        return values

    def resolve_profile(self, profiles: dict, key: str, path: Path) -> dict:
        """The profile `key` of the file `path` with its `extends` chain applied, every field checked."""
        if key not in profiles:
            raise UserError(f"unknown profile {key!r}; valid profiles: {', '.join(sorted(profiles))}")
        chain, cur = [], key
        while cur is not None:
            if cur in chain:
                raise UserError(f"profile {key!r} in {path}: 'extends' forms a cycle through {cur!r}")
            if cur not in profiles:
                raise UserError(f"profile {chain[-1]!r} in {path}: field 'extends' names unknown profile {cur!r}")
            chain.append(cur)
            cur = profiles[cur].get("extends")
            if cur is not None and not isinstance(cur, str):
                raise UserError(f"profile {chain[-1]!r} in {path}: field 'extends' must be a profile key")
        for name in chain:
            unknown = [field for field in profiles[name] if field != "extends" and field not in self.fields]
            if unknown:
                raise UserError(f"profile {name!r} in {path}: unknown field {unknown[0]!r}")
        named = {}
        for name in reversed(chain):
            named.update({k: v for k, v in profiles[name].items() if k != "extends"})
        return self.resolve(named, f"profile {key!r} in {path}")

    def add_flags(self, parser: argparse.ArgumentParser, shown: dict) -> None:
        """A `--field-name` flag for every field, None unless given; its help shows the value in
        `shown` (a profile's), if any."""
        for key, spec in self.fields.items():
            value = f" ({shown['profile']}: {_as_flag(shown['values'][key])})" if key in shown.get("values", {}) else ""
            parser.add_argument(
                "--" + key.replace("_", "-"),
                dest=key,
                type=_flag_type(spec),
                default=None,
                metavar=_metavar(spec),
                help=(spec.help + value).replace("%", "%%"),
            )  # argparse formats help

    def with_flags(self, values: dict, args: argparse.Namespace) -> dict:
        """A resolved profile's `values` with the flags given in `args` over them, every rule checked."""
        for key in self.fields:
            flag = getattr(args, key)
            if flag is not None:
                values[key] = self.check_value(key, flag, where="--" + key.replace("_", "-"))
        self.rules(values, "the resolved configuration")
        return values

    def describe_profiles(self, path: Path, key: str | None) -> tuple[dict, dict]:
        """Each profile's description, and the resolved values of `key`, as far as they can be read
        (for --help): a bad file or profile is reported when the run starts, not by --help."""
        try:
            profiles = read_profiles(path)
        except UserError:
            return {}, {}
        described = {}
        for name in profiles:
            try:
                described[name] = self.resolve_profile(profiles, name, path)["description"]  # inherited too
            except UserError:
                described[name] = "(does not load: run with it to see why)"
        try:
            return described, {"profile": key, "values": self.resolve_profile(profiles, key, path)} if key else {}
        except UserError:
            return described, {}

    def sections(self, values: dict) -> dict:
        """The sections' keyword arguments (attribute -> {name: value}) from the flat `values`."""
        out: dict[str, dict] = {}
        for key, f in self.fields.items():
            out.setdefault(f.section, {})[f.name] = values[key]
        return out

    def flat(self, config) -> dict:
        """The flat values (profile keys) of a configuration built from this schema, in its order."""
        return {key: getattr(getattr(config, f.section), f.name) for key, f in self.fields.items()}


def read_profiles(path: Path) -> dict:
    try:
        with open(path) as f:
            raw = json.load(f)
    except FileNotFoundError:
        raise UserError(f"hardware profile file {path} does not exist") from None
    except json.JSONDecodeError as e:
        raise UserError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    except UnicodeDecodeError:
        raise UserError(f"{path} is not UTF-8 text") from None
    except OSError as e:  # a directory, no permission
        raise UserError(f"cannot read hardware profile file {path}: {e.strerror}") from None
    if not isinstance(raw, dict) or not all(isinstance(v, dict) for v in raw.values()):
        raise UserError(f"{path} must map profile keys to objects of fields")
    return raw


def profile_listing(described: dict) -> str:
    """--help's list of profiles: each key with its description, wrapped."""
    return "\n".join(
        textwrap.fill(description, 100, initial_indent=f"  {key:<10} ", subsequent_indent=" " * 13)
        for key, description in described.items()
    )


# --- the command line -----------------------------------------------------------------------------


class Parser(argparse.ArgumentParser):
    """Every entry point's parser: a bad flag is one `error:` line (exit 2, not argparse's usage
    dump), and flags are never matched by prefix (`--max-step 3` is refused, not --max-steps)."""

    def __init__(self, **kwargs):
        super().__init__(allow_abbrev=False, **kwargs)

    def error(self, message):
        raise UserError(message)


def positive(kind):
    """An argparse type: a finite number of `kind` above 0."""

    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a {kind.__name__}, got {text!r}") from None
        if not (value > 0 and math.isfinite(value)):
            raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
        return value

    return parse


def check_can_create(path: Path, what: str) -> None:
    """`path` is a directory, or can be made one: checked before any work, not when it is written."""
    try:
        existing = next(p for p in (path, *path.absolute().parents) if p.exists())
    except OSError as e:  # a parent this user may not search
        raise UserError(f"{what} {path} cannot be created: {e.strerror}") from None
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        raise UserError(f"{what} {path} cannot be created: {existing} is not a writable directory")


def parse_bool(text: str) -> bool:
    low = text.lower()
    if low in ("true", "1", "yes", "on"):
        return True
    if low in ("false", "0", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true or false, got {text!r}")


def _flag_type(spec: Field):
    if spec.kind is bool:
        return parse_bool
    if spec.nullable:
        return lambda s: None if s.lower() in ("null", "none") else spec.kind(s)
    return spec.kind


def _as_flag(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)  # true, false, null as the flags take them


def flag_and_value(key: str, value) -> str:
    """A setting as the command line gives it: `--patch-hash-buckets 0`."""
    return f"--{key.replace('_', '-')} {_as_flag(value)}"


def _metavar(spec: Field) -> str:
    if spec.choices:
        return "{" + ",".join(spec.choices) + "}"
    return "{true,false}" if spec.kind is bool else spec.kind.__name__.upper()
