"""The task files of Megatron's tasks/main.py, read into BERT samples: GLUE's MNLI tab-separated files (train.tsv,
dev_matched.tsv, ...) and RACE's folders of passages (one JSON object a line in *.txt files, with questions, four
options each and the answers as letters). A sample is `[CLS] a [SEP] b [SEP]` padded to --seq-length, token types 0
for a and 1 for b, as Megatron builds them; a RACE sample holds one such row per option."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidtrain.core.errors import UserError
from rapidtrain.data.tokenizer import Tokenizer

MNLI_LABELS = {"contradiction": 0, "entailment": 1, "neutral": 2}  # Megatron's ids for GLUE's MNLI labels
MNLI_TEST_COLUMNS = 10  # a test file has no label column: its rows get Megatron's test label, contradiction
RACE_CHOICES = 4
RACE_MAX_QA_TOKENS = 128  # Megatron cuts question + option to this many tokens before the passage


class TaskDataError(UserError, ValueError):
    """A --train-data / --valid-data file that is not the task's format."""


def clean_text(text: str) -> str:
    """Megatron's clean-up of task text: one space for any run of white space, no space before a sentence's dot."""
    text = re.sub(r"\s+", " ", text.replace("\n", " "))
    for _ in range(3):
        text = text.replace(" . ", ". ")
    return text


def special_ids(tokenizer: Tokenizer) -> tuple[int, int, int]:
    """[CLS], [SEP] and [PAD] of a BERT tokenizer; another tokenizer has no such ids."""
    if tokenizer.cls is None or tokenizer.sep is None or tokenizer.pad is None:
        raise TaskDataError(f"--tokenizer-type: {type(tokenizer).__name__} has no [CLS], [SEP] and [PAD] ids; "
                            "Megatron's tasks read BERT's WordPiece (BertWordPieceLowerCase or BertWordPieceCase)")
    return tokenizer.cls, tokenizer.sep, tokenizer.pad


def pair_row(first: Sequence[int], second: Sequence[int] | None, seq_length: int,
             tokenizer: Tokenizer) -> tuple[list[int], list[int], list[int]]:
    """(ids, token types, padding mask) of `[CLS] first [SEP] second [SEP]`, cut to `seq_length` (keeping a closing
    [SEP]) and padded to it."""
    cls, sep, pad = special_ids(tokenizer)
    ids = [cls, *first, sep]
    types = [0] * len(ids)
    if second is not None:
        ids += list(second)
        types += [1] * len(second)
    trimmed = len(ids) >= seq_length
    if trimmed:
        ids, types = ids[: seq_length - 1], types[: seq_length - 1]
    if second is not None or trimmed:
        ids.append(sep)
        types.append(0 if second is None else 1)
    padding = seq_length - len(ids)
    return ids + [pad] * padding, types + [0] * padding, [1] * len(ids) + [0] * padding


def _sample(rows: list[tuple[list[int], list[int], list[int]]], label: int, source: int) -> dict[str, Any]:
    """One sample: a row (MNLI) or one row per option (RACE), with its label and the file it came from."""
    ids, types, mask = ([row[i] for row in rows] for i in range(3))
    def as_array(values: list) -> np.ndarray:
        return np.asarray(values[0] if len(rows) == 1 else values, dtype=np.int64)

    return {"text": as_array(ids), "types": as_array(types), "padding_mask": as_array(mask), "label": label,
            "source": source}


def _task_file(path: str, flag: str, folder: bool = False) -> Path:
    found = Path(path)
    if not (found.is_dir() if folder else found.is_file()):
        kind = "folder of RACE *.txt files" if folder else "file"
        raise TaskDataError(f"{flag} {path}: no such {kind}. Give the task's data as Megatron's tasks/main.py reads "
                            "it (MNLI: GLUE's train.tsv / dev_matched.tsv; RACE: folders such as RACE/train/middle).")
    return found


def read_mnli(path: str, tokenizer: Tokenizer, seq_length: int, source: int = 0,
              flag: str = "--train-data") -> list[dict[str, Any]]:
    """GLUE's MNLI file: a header row, then the pair in columns 8 and 9 and the label in the last column."""
    lines = _task_file(path, flag).read_text(encoding="utf-8").splitlines()
    if not lines:
        raise TaskDataError(f"{flag} {path}: the file is empty; MNLI files start with GLUE's header row")
    is_test = len(lines[0].split("\t")) == MNLI_TEST_COLUMNS
    samples = []
    for number, line in enumerate(lines[1:], start=2):
        row = line.strip().split("\t")
        if len(row) < MNLI_TEST_COLUMNS:
            raise TaskDataError(f"{flag} {path}, line {number}: {len(row)} tab-separated columns; MNLI rows have "
                                "the sentence pair in columns 9 and 10 and the label last (GLUE's layout)")
        first, second = clean_text(row[8].strip()), clean_text(row[9].strip())
        label = "contradiction" if is_test else row[-1].strip()
        if label not in MNLI_LABELS or not first or not second:
            raise TaskDataError(f"{flag} {path}, line {number}: label {label!r} and an empty sentence are not MNLI; "
                                f"labels are {', '.join(MNLI_LABELS)}")
        row_ids = pair_row(tokenizer.tokenize(first), tokenizer.tokenize(second), seq_length, tokenizer)
        samples.append(_sample([row_ids], MNLI_LABELS[label], source))
    return samples


def read_race(path: str, tokenizer: Tokenizer, seq_length: int, source: int = 0,
              flag: str = "--train-data") -> list[dict[str, Any]]:
    """A RACE folder: each *.txt file holds passages, one JSON object a line; a question's options are each joined
    to it (filling its blank `_`, else after it) and paired with the passage."""
    files = sorted(_task_file(path, flag, folder=True).glob("*.txt"))
    if not files:
        raise TaskDataError(f"{flag} {path}: no *.txt files in the folder; RACE's passages are JSON lines in them")
    samples = []
    for file in files:
        for number, line in enumerate(file.read_text(encoding="utf-8").splitlines(), start=1):
            if line.strip():
                samples += _race_passage(line, f"{file}, line {number}", tokenizer, seq_length, source)
    return samples


def _race_passage(line: str, where: str, tokenizer: Tokenizer, seq_length: int, source: int) -> list[dict]:
    try:
        passage = json.loads(line)
        article, questions = passage["article"], passage["questions"]
        options, answers = passage["options"], passage["answers"]
    except (json.JSONDecodeError, KeyError, TypeError) as error:
        raise TaskDataError(f"{where}: not a RACE passage ({error}); each line is JSON with article, questions, "
                            "options and answers") from None
    if not len(questions) == len(options) == len(answers):
        raise TaskDataError(f"{where}: {len(questions)} questions, {len(options)} option lists and {len(answers)} "
                            "answers; RACE gives one of each per question")
    context = tokenizer.tokenize(clean_text(article))
    samples = []
    for question, choices, answer in zip(questions, options, answers, strict=True):
        label = ord(str(answer)[:1] or "?") - ord("A")
        if len(choices) != RACE_CHOICES or not 0 <= label < RACE_CHOICES:
            raise TaskDataError(f"{where}: a question with {len(choices)} options and answer {answer!r}; RACE has "
                                f"{RACE_CHOICES} options and answers A-D")
        rows = []
        for choice in choices:
            qa = question.replace("_", choice) if "_" in question else f"{question} {choice}"
            qa_ids = tokenizer.tokenize(clean_text(qa))[:RACE_MAX_QA_TOKENS]
            rows.append(pair_row(qa_ids, context, seq_length, tokenizer))
        samples.append(_sample(rows, label, source))
    return samples


def file_name(task: str, path: str) -> str:
    """How Megatron names a validation file in its accuracy lines: dev_matched.tsv → dev-matched, RACE/dev/middle →
    dev-middle."""
    found = Path(path)
    if task == "RACE":
        return "-".join(found.parts[-2:])
    return found.name.removesuffix(".tsv").replace("_", "-")


class TaskSamples(torch.utils.data.Dataset):
    """A task's samples from one or more files; `names` are the files' names, by each sample's `source`."""

    def __init__(self, samples: list[dict[str, Any]], names: list[str]) -> None:
        self.samples = samples
        self.names = names

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


def read_task_files(task: str, paths: Sequence[str], tokenizer: Tokenizer, seq_length: int,
                    flag: str) -> TaskSamples:
    """Every file's samples, each tagged with its file's position in `paths`."""
    read = read_race if task == "RACE" else read_mnli
    samples = [s for source, path in enumerate(paths) for s in read(path, tokenizer, seq_length, source, flag)]
    return TaskSamples(samples, [file_name(task, path) for path in paths])


def collate_task_batch(samples: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
    return {key: torch.as_tensor(np.stack([np.asarray(s[key]) for s in samples])) for key in samples[0]}
