"""A training set's identity, which each checkpoint records: a data position means something only
in the same examples, so a resume on other data is refused (harness.resume) unless --new-data
starts a fresh epoch of it."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable


def fingerprint(examples: Iterable) -> str:
    """A short hash of JSON-able examples as loaded (content and order)."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps(ex, sort_keys=True).encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]


def data_identity(dataset: str, examples: int, fingerprint: str, **facts) -> dict:
    """What a checkpoint records of its training set: its name, how many examples and their
    fingerprint (and any other `facts` the model's data has)."""
    return {"dataset": dataset, "examples": examples, "fingerprint": fingerprint, **facts}


def mixture_identity(parts: list[dict], weights: list[str]) -> dict:
    """The identity of a mixture of training sets (each part's identity) drawn by `weights`: other
    parts, another order of them, or other weights are other data."""
    whole = fingerprint(
        [[part["examples"], part["fingerprint"], weight] for part, weight in zip(parts, weights, strict=True)]
    )
    return data_identity(
        ",".join(f"{part['dataset']}:{weight}" for part, weight in zip(parts, weights, strict=True)),
        sum(part["examples"] for part in parts),
        whole,
        sources=[{**part, "weight": weight} for part, weight in zip(parts, weights, strict=True)],
    )


def same_data(a: dict, b: dict) -> bool:
    """Two identities are the same examples in the same order, wherever the file now lies."""
    return (a["examples"], a["fingerprint"]) == (b["examples"], b["fingerprint"])


def describe_data(identity: dict) -> str:
    return f"{identity['dataset']} ({identity['examples']} examples, fingerprint {identity['fingerprint']})"
