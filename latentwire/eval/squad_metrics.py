"""SQuAD exact match and F1, as the official SQuAD v1.1 evaluation script computes them.

Both compare answers after normalisation (lower case, no punctuation, no articles a/an/the,
single spaces) and take the best score over all gold answers of an example. The v1.1 rule applies
to every dataset here (SQuAD v1.1, local files in SQuAD's layout, the synthetic set, and HotpotQA,
whose official script adds one rule not applied here: a yes/no answer that differs scores 0): none
of them has unanswerable questions, which is what SQuAD v2.0's rule (two empty answers score F1 1)
is for.
"""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCTUATION = set(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")


def normalize_answer(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize_answer(prediction) == normalize_answer(gold))


def f1(prediction: str, gold: str) -> float:
    pred_tokens = normalize_answer(prediction).split()
    gold_tokens = normalize_answer(gold).split()
    # A gold answer that normalises to nothing (e.g. "The") scores F1 0 against every prediction,
    # an identical one too (exact match still counts it): v1.1 has no special case for it.
    common = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(pred_tokens), common / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def best_em_f1(prediction: str, golds: list[str]) -> tuple[float, float]:
    """EM and F1 of one prediction against the best-matching gold answer of each metric."""
    return max(exact_match(prediction, g) for g in golds), max(f1(prediction, g) for g in golds)
