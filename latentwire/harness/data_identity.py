"""A training set's identity, which each checkpoint records: a data position means something only
in the same examples, so a resume on other data is refused (harness.resume) unless --new-data
starts a fresh epoch of it."""

from __future__ import annotations

import hashlib
import json


def fingerprint(examples: list) -> str:
    """A short hash of JSON-able examples as loaded (content and order)."""
    digest = hashlib.sha256()
    for ex in examples:
        digest.update(json.dumps(ex, sort_keys=True).encode("utf-8") + b"\n")
    return digest.hexdigest()[:16]


def data_identity(dataset: str, examples: list, **facts) -> dict:
    """What a checkpoint records of its training set: its name, size and fingerprint (and any other
    `facts` the model's data has)."""
    return {"dataset": dataset, "examples": len(examples), "fingerprint": fingerprint(examples), **facts}


def same_data(a: dict, b: dict) -> bool:
    """Two identities are the same examples in the same order, wherever the file now lies."""
    return (a["examples"], a["fingerprint"]) == (b["examples"], b["fingerprint"])


def describe_data(identity: dict) -> str:
    return f"{identity['dataset']} ({identity['examples']} examples, fingerprint {identity['fingerprint']})"
