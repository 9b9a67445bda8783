"""The tasks' metrics, computed by rapidtrain itself (no `evaluate`/seqeval download): accuracy and F1,
entity-level F1 over BIO/IOBES tags, SQuAD exact match and F1, unigram token overlap, perplexity."""

from __future__ import annotations

import math
import re
import string
from collections import Counter
from collections.abc import Sequence

import torch


def accuracy(predictions: torch.Tensor, labels: torch.Tensor) -> float:
    keep = labels != -100
    return float((predictions[keep] == labels[keep]).float().mean()) if keep.any() else 0.0


def f1_score(predictions: torch.Tensor, labels: torch.Tensor, num_labels: int) -> float:
    """Binary tasks: F1 of label 1 (GLUE's convention for MRPC/QQP); more labels: macro F1 over the labels."""
    keep = labels != -100
    predictions, labels = predictions[keep], labels[keep]
    classes = [1] if num_labels == 2 else range(num_labels)
    scores = []
    for label in classes:
        true_positive = float(((predictions == label) & (labels == label)).sum())
        predicted, actual = float((predictions == label).sum()), float((labels == label).sum())
        scores.append(2 * true_positive / (predicted + actual) if predicted + actual else 0.0)
    return sum(scores) / len(scores) if scores else 0.0


# ---- entity-level F1 (CoNLL's rule: an entity counts only with its exact type and span) ----


def _split_tag(tag: str) -> tuple[str, str]:
    """("B", "PER") for B-PER; a tag without prefix (IO scheme) continues an entity of its type."""
    if tag in ("O", ""):
        return "O", ""
    if len(tag) < 2 or tag[1] not in "-_" or tag[0].upper() not in "BIES":
        return "I", tag
    return tag[0].upper(), tag[2:]


def entities(tags: Sequence[str]) -> set[tuple[str, int, int]]:
    """(type, first word, last word) of every entity in a BIO (IOB1/IOB2) or IOBES tag sequence.

    An entity starts at B-/S-, or at I-/E- after O or another type; it ends before O, B-/S- or another type,
    and right after E-/S-."""
    found: set[tuple[str, int, int]] = set()
    current: tuple[str, int] | None = None
    for index, tag in enumerate([*tags, "O"]):
        prefix, kind = _split_tag(tag)
        continues = current is not None and prefix in ("I", "E") and kind == current[0]
        if current is not None and not continues:
            found.add((current[0], current[1], index - 1))
            current = None
        if prefix != "O" and current is None:
            current = (kind, index)
        if prefix in ("E", "S") and current is not None:
            found.add((current[0], current[1], index))
            current = None
    return found


def entity_counts(predicted: Sequence[str], gold: Sequence[str]) -> tuple[int, int, int]:
    """(correct entities, predicted entities, gold entities) of one sequence."""
    p, g = entities(predicted), entities(gold)
    return len(p & g), len(p), len(g)


def precision_recall_f1(correct: float, predicted: float, gold: float) -> dict[str, float]:
    precision = correct / predicted if predicted else 0.0
    recall = correct / gold if gold else 0.0
    f1 = 2 * precision * recall / (precision + recall) if precision + recall else 0.0
    return {"precision": precision, "recall": recall, "f1": f1}


# ---- SQuAD ----


def normalize_answer(text: str) -> str:
    """SQuAD's normalisation: lower case, no punctuation, no articles, single spaces."""
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def overlap_f1(predicted: Sequence, reference: Sequence) -> float:
    """F1 of the multiset overlap of two token sequences (SQuAD's F1, ROUGE-1's F); 1 when both are empty."""
    if not predicted or not reference:
        return float(len(predicted) == len(reference))
    common = sum((Counter(predicted) & Counter(reference)).values())
    if common == 0:
        return 0.0
    precision, recall = common / len(predicted), common / len(reference)
    return 2 * precision * recall / (precision + recall)


def squad_scores(prediction: str, answers: Sequence[str]) -> tuple[float, float]:
    """(exact match, F1) of a predicted answer against the best of the gold answers."""
    if not answers:
        answers = [""]
    predicted = normalize_answer(prediction)
    exact = max(float(predicted == normalize_answer(a)) for a in answers)
    f1 = max(overlap_f1(predicted.split(), normalize_answer(a).split()) for a in answers)
    return exact, f1


def perplexity(loss_sum: float, count: float) -> tuple[float, float]:
    """(mean loss per token, its exponential); the exponent is capped at 50 to stay finite."""
    mean = loss_sum / max(count, 1.0)
    return mean, math.exp(min(mean, 50.0))
