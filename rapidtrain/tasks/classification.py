"""sequence_classification (accuracy, F1) and token_classification (entity-level F1) on local data.

Sequence classification reads GLUE-style columns (sentence1/sentence2, sentence, question/sentence,
premise/hypothesis, text, ...) and a `label` column of integers or names; token classification reads
`tokens` (a list of words) and `ner_tags` (BIO or IOBES tags, as names or as ClassLabel ids).
"""

from __future__ import annotations

from typing import Any

import torch

import rapidtrain.tasks.metrics as metrics
from rapidtrain.tasks.base import (
    FeatureDataset,
    Gather,
    Task,
    as_records,
    class_label_names,
    cross_entropy_sum,
    model_inputs,
    text_columns,
)

TEXT_COLUMNS = (
    ("sentence1", "sentence2"),
    ("question1", "question2"),
    ("question", "sentence"),
    ("premise", "hypothesis"),
    ("sentence",),
    ("text",),
)
UNLABELLED = (-1, -100, None, "")  # GLUE test files carry -1


class LabelVocabulary:
    """Label names ↔ ids: from ClassLabel names, from integer labels (their own names), or from strings."""

    def __init__(self, names: list[str], from_ids: bool) -> None:
        self.names = names
        self.from_ids = from_ids
        self.ids = {name: i for i, name in enumerate(names)}

    @staticmethod
    def build(values: list[Any], names: list[str] | None, first: str | None = None) -> LabelVocabulary:
        if names:
            return LabelVocabulary(names, True)
        present = [v for v in values if v not in UNLABELLED]
        if all(isinstance(v, int) for v in present):
            return LabelVocabulary([str(i) for i in range(max(present, default=0) + 1)], True)
        unique = sorted({str(v) for v in present} - ({first} if first else set()))
        return LabelVocabulary(([first] if first else []) + unique, False)

    def id_of(self, value: Any) -> int:
        if value in UNLABELLED:
            return -100
        if self.from_ids:
            if not isinstance(value, int) or not 0 <= value < len(self.names):
                raise ValueError(
                    f"label {value!r} is outside the {len(self.names)} labels of the training data"
                )
            return value
        if str(value) not in self.ids:
            raise ValueError(f"label {value!r} does not occur in the training data ({', '.join(self.names)})")
        return self.ids[str(value)]

    def config(self) -> dict[str, Any]:
        return {
            "num_labels": len(self.names),
            "id2label": dict(enumerate(self.names)),
            "label2id": {n: i for i, n in enumerate(self.names)},
        }


class SequenceClassification(Task):
    name = "sequence_classification"
    auto_class = "AutoModelForSequenceClassification"
    peft_task_type = "SEQ_CLS"
    best_metric = "accuracy"

    def prepare(self, splits: dict[str, Any]) -> dict[str, FeatureDataset]:
        train = as_records(splits["train"])
        self.label_column = "label" if "label" in train[0] else "labels"
        if self.label_column not in train[0]:
            raise ValueError(
                f"sequence_classification: the training data has no `label` column (columns: "
                f"{', '.join(train[0])}); name the class column `label`"
            )
        self.columns = text_columns(
            train, TEXT_COLUMNS, "sequence_classification", "name the text column `sentence`"
        )
        self.labels = LabelVocabulary.build(
            [r[self.label_column] for r in train], class_label_names(splits["train"], self.label_column)
        )
        return {
            name: FeatureDataset([self.feature(i, r) for i, r in enumerate(as_records(split))])
            for name, split in splits.items()
        }

    def feature(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        texts = [str(record[c]) for c in self.columns]
        feature: dict[str, Any] = self.tokenize(*texts)
        feature["labels"] = self.labels.id_of(record.get(self.label_column))
        feature["index"] = index
        return feature

    def model_kwargs(self) -> dict[str, Any]:
        return {**self.labels.config(), "ignore_mismatched_sizes": True}

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(**model_inputs(batch, self.input_names)).logits
        return cross_entropy_sum(logits, batch["labels"])

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], list]:
        predictions, labels = [], []
        for batch in loader:
            logits = model(**model_inputs(batch, self.input_names)).logits
            predictions.append(gather(logits.argmax(dim=-1)))
            labels.append(gather(batch["labels"]))
        predicted, gold = torch.cat(predictions).cpu(), torch.cat(labels).cpu()
        results = {
            "accuracy": metrics.accuracy(predicted, gold),
            "f1": metrics.f1_score(predicted, gold, len(self.labels.names)),
        }
        return results, [self.labels.names[int(p)] for p in predicted]


class TokenClassification(Task):
    name = "token_classification"
    auto_class = "AutoModelForTokenClassification"
    peft_task_type = "TOKEN_CLS"
    best_metric = "f1"

    def prepare(self, splits: dict[str, Any]) -> dict[str, FeatureDataset]:
        train = as_records(splits["train"])
        self.tag_column = next((c for c in ("ner_tags", "tags", "labels", "pos_tags") if c in train[0]), None)
        if "tokens" not in train[0] or self.tag_column is None:
            raise ValueError(
                "token_classification reads `tokens` (a list of words) and `ner_tags` (one tag per word)"
                f"; the training data has columns {', '.join(train[0])}"
            )
        values = [t for r in train for t in r[self.tag_column]]
        self.labels = LabelVocabulary.build(
            values, class_label_names(splits["train"], self.tag_column), first="O"
        )
        if self.labels.from_ids and all(name.isdigit() for name in self.labels.names):
            raise ValueError(
                f"token_classification: `{self.tag_column}` holds numbers without tag names, so "
                "entities cannot be found; write the tags as names (B-PER, I-PER, O) or save the data "
                "with a datasets ClassLabel feature"
            )
        return {
            name: FeatureDataset([self.feature(i, r) for i, r in enumerate(as_records(split))])
            for name, split in splits.items()
        }

    def feature(self, index: int, record: dict[str, Any]) -> dict[str, Any]:
        words = [str(w) for w in record["tokens"]]
        encoding = self.tokenizer(
            words, is_split_into_words=True, truncation=True, max_length=self.seq_length
        )
        assert self.tag_column is not None  # prepare() found it before making features
        tags = record.get(self.tag_column) or []
        labels, previous = [], None
        for word in encoding.word_ids():
            first = word is not None and word != previous and word < len(tags)
            labels.append(self.labels.id_of(tags[word]) if first else -100)  # words are scored by first piece
            previous = word
        return {**dict(encoding), "labels": labels, "index": index}

    def model_kwargs(self) -> dict[str, Any]:
        return {**self.labels.config(), "ignore_mismatched_sizes": True}

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(**model_inputs(batch, self.input_names)).logits
        return cross_entropy_sum(logits, batch["labels"])

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], list]:
        predicted_rows, gold_rows = [], []
        for batch in loader:
            logits = model(**model_inputs(batch, self.input_names)).logits
            predictions = logits.argmax(dim=-1).masked_fill(batch["labels"] == -100, -100)
            predicted_rows += list(gather(predictions).cpu())
            gold_rows += list(gather(batch["labels"]).cpu())
        counts = torch.zeros(3)
        correct_tags = total_tags = 0
        tag_sequences = []
        for predicted, gold in zip(predicted_rows, gold_rows, strict=True):
            keep = gold != -100
            names_p = [self.labels.names[int(i)] for i in predicted[keep]]
            names_g = [self.labels.names[int(i)] for i in gold[keep]]
            counts += torch.tensor(metrics.entity_counts(names_p, names_g), dtype=torch.float32)
            correct_tags += int((predicted[keep] == gold[keep]).sum())
            total_tags += int(keep.sum())
            tag_sequences.append(names_p)
        results = metrics.precision_recall_f1(*counts.tolist())
        results["accuracy"] = correct_tags / max(total_tags, 1)
        return results, tag_sequences
