"""Settings from hardware profiles and the command line, for any model.

A profile is one key of a JSON file of profiles. It may `extend` another profile and override some
of its fields. Every field is checked against the caller's `Schema` (name, type, allowed values,
and the rules that tie fields together), so that a typo in the JSON or on the command line is a
one-line error naming the field, not a KeyError deep inside the loop. Every field is also a
command-line flag of the same name with dashes (`micro_batch_size` -> `--micro-batch-size`).

The resolved settings are typed: frozen dataclasses, one per concern, each defined by the module
that reads it (as torchtitan's components own their configs), built from the flat fields
(`sections_of`); a section may read a field under another name (its `FLAT_NAMES`). Profiles, flags
and a checkpoint's meta.json keep the flat names.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import textwrap
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import UserError

REQUIRED = object()


@dataclass(frozen=True)
class Field:
    kind: type  # int, float, bool or str
    help: str
    choices: tuple = ()
    nullable: bool = False
    positive: bool = False  # > 0 (numbers only)
    non_negative: bool = False  # >= 0 (numbers only)
    refused: dict = dataclasses.field(default_factory=dict)  # value -> why it is not (yet) taken
    default: object = REQUIRED  # a field with a default may be left out of a profile; the rest must be given


class Schema:
    """A run's fields (name -> Field) and `rules(values, where)`, the checks that tie fields
    together (raising UserError), run on every resolved profile and on the final settings. --help
    lists each profile by its `description` field, which a schema therefore has."""

    def __init__(self, fields: dict[str, Field], rules: Callable[[dict, str], None] = lambda values, where: None):
        self.fields, self.rules = fields, rules

    def defaults(self) -> dict:
        """The fields that have a default, with it."""
        return {name: spec.default for name, spec in self.fields.items() if spec.default is not REQUIRED}

    def check_value(self, field: str, value, where: str):
        spec = self.fields[field]
        if value is None:
            if spec.nullable:
                return None
            raise UserError(f"{where}: field {field!r} must not be null")
        if spec.kind is float and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not spec.kind:
            raise UserError(f"{where}: field {field!r} must be {spec.kind.__name__}, got {value!r}")
        if spec.kind is float and not math.isfinite(value):  # JSON's Infinity/NaN, or --lr inf
            raise UserError(f"{where}: field {field!r} must be a finite number, got {value!r}")
        if value in spec.refused:
            raise UserError(f"{where}: {field} {value!r} {spec.refused[value]}; use one of {', '.join(spec.choices)}")
        if spec.choices and value not in spec.choices:
            raise UserError(f"{where}: field {field!r} must be one of {', '.join(spec.choices)}, got {value!r}")
        if spec.positive and not value > 0:
            raise UserError(f"{where}: field {field!r} must be > 0, got {value!r}")
        if spec.non_negative and not value >= 0:
            raise UserError(f"{where}: field {field!r} must be >= 0, got {value!r}")
        return value

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
        merged = self.defaults()
        for name in reversed(chain):
            merged.update({k: v for k, v in profiles[name].items() if k != "extends"})
        for name in chain:
            for field in profiles[name]:
                if field != "extends" and field not in self.fields:
                    raise UserError(f"profile {name!r} in {path}: unknown field {field!r}")
        missing = [f for f in self.fields if f not in merged]
        if missing:
            raise UserError(f"profile {key!r} in {path}: missing field {missing[0]!r}")
        for field, value in merged.items():
            merged[field] = self.check_value(field, value, where=f"profile {key!r} in {path}")
        self.rules(merged, f"profile {key!r}")
        return merged

    def add_flags(self, parser: argparse.ArgumentParser, shown: dict) -> None:
        """A `--field-name` flag for every field, None unless given; its help shows the value in
        `shown` (a profile's), if any."""
        for name, spec in self.fields.items():
            value = (f" ({shown['profile']}: {_as_flag(shown['values'][name])})" if name in shown.get("values", {})
                     else "")
            parser.add_argument("--" + name.replace("_", "-"), dest=name, type=_flag_type(spec), default=None,
                                metavar=_metavar(spec),
                                help=(spec.help + value).replace("%", "%%"))  # argparse formats help

    def with_flags(self, values: dict, args: argparse.Namespace) -> dict:
        """A resolved profile's `values` with the flags given in `args` over them, every rule checked."""
        for name in self.fields:
            flag = getattr(args, name)
            if flag is not None:
                values[name] = self.check_value(name, flag, where="--" + name.replace("_", "-"))
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
    return "\n".join(textwrap.fill(description, 100, initial_indent=f"  {key:<10} ", subsequent_indent=" " * 13)
                     for key, description in described.items())


# --- typed sections -----------------------------------------------------------------------------

def flat_names(section: type) -> dict[str, str]:
    """A section's fields and the flat field each is read from."""
    renamed = getattr(section, "FLAT_NAMES", {})
    return {f.name: renamed.get(f.name, f.name) for f in dataclasses.fields(section)}


def sections_of(sections: dict[str, type], values: dict) -> dict:
    """Each section (attribute -> dataclass) built from the flat `values`."""
    return {attr: section(**{name: values[flat] for name, flat in flat_names(section).items()})
            for attr, section in sections.items()}


def flat_of(obj, sections: dict[str, type]) -> dict:
    """The flat fields of an object whose attributes are `sections`."""
    return {flat: getattr(getattr(obj, attr), name)
            for attr, section in sections.items() for name, flat in flat_names(section).items()}


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


def _metavar(spec: Field) -> str:
    if spec.choices:
        return "{" + ",".join(spec.choices) + "}"
    return "{true,false}" if spec.kind is bool else spec.kind.__name__.upper()
