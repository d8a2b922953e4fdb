"""Exact match and token F1 between a predicted and a gold answer, with SQuAD's answer normalization
(lower case, no punctuation, no articles, whitespace collapsed), so "the Kalo." matches "Kalo"."""

from __future__ import annotations

import re
import string
from collections import Counter

_PUNCTUATION = str.maketrans("", "", string.punctuation)


def normalize(text: str) -> list[str]:
    text = text.lower().translate(_PUNCTUATION)
    return re.sub(r"\b(a|an|the)\b", " ", text).split()


def exact_match(prediction: str, gold: str) -> float:
    return float(normalize(prediction) == normalize(gold))


def token_f1(prediction: str, gold: str) -> float:
    predicted, expected = normalize(prediction), normalize(gold)
    common = sum((Counter(predicted) & Counter(expected)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(expected)
    return 2 * precision * recall / (precision + recall)
