"""Pai-Megatron-Patch's raw JSON datasets (`--dataset LLama-Pretrain-Raw`, `LLama-SFT`): instruction/output records
tokenized when the run starts, the prompt masked out of the loss, each sample padded to --max-padding-length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rapidtrain.core.errors import UserError

# Pai's kinds read by its LLama raw dataset: the pretraining kind pads to one token more (its batches shift by one).
RAW_JSON_KINDS = ("LLama-Pretrain-Raw", "LLama-SFT")
PROMPT_KEYS = ("instruction", "input")  # joined, as Pai's JSON-SFT reads them
ANSWER_KEYS = ("output", "content", "response")


class RawJsonError(UserError, ValueError):
    """A raw JSON file cannot be read as instruction/output records: the message names the file and the record."""


def read_records(path: str) -> list[dict[str, Any]]:
    """The records of a JSON array, or of JSON lines (one object a line)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as error:
        raise RawJsonError(f"--train-data-path {path}: cannot read it ({error.strerror or error})") from None
    try:
        records = json.loads(text) if text.lstrip().startswith("[") else [
            json.loads(line) for line in text.splitlines() if line.strip()]
    except json.JSONDecodeError as error:
        raise RawJsonError(f"{path}: not a JSON array nor JSON lines ({error})") from None
    if not records or not all(isinstance(record, dict) for record in records):
        raise RawJsonError(f"{path}: expected records like {{\"instruction\": ..., \"input\": ..., \"output\": ...}}")
    return records


def prompt_and_answer(record: dict[str, Any], where: str) -> tuple[str, str]:
    prompt = "".join(str(record.get(key) or "") for key in PROMPT_KEYS)
    answer = next((record[key] for key in ANSWER_KEYS if key in record), None)
    if answer is None:
        raise RawJsonError(f"{where}: no answer; a record needs one of {', '.join(ANSWER_KEYS)}")
    return prompt, str(answer)


def encode(prompt: str, answer: str, tokenizer: Any, length: int) -> tuple[list[int], int] | None:
    """(ids of prompt + answer + end-of-document, prompt length), or None when they exceed `length` (Pai drops
    a sample its truncation cut the end-of-document token from). The whole text is tokenized once, as Pai does,
    so a tokenizer that adds a start token adds it once."""
    prompt_length = len(tokenizer.tokenize(prompt)) if prompt else 0
    ids = list(tokenizer.tokenize(prompt + answer)) + [tokenizer.eod]
    return (ids, prompt_length) if len(ids) <= length else None


def encode_file(path: str, tokenizer: Any, length: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(token ids [n, length] padded with end-of-document ids, loss-carrying positions [n, length], records
    dropped as too long). Only the answer and its end-of-document token carry loss."""
    if tokenizer.eod is None:
        raise RawJsonError(f"{path}: the tokenizer has no end-of-document token to end each answer with")
    rows, masks, dropped = [], [], 0
    for index, record in enumerate(read_records(path)):
        encoded = encode(*prompt_and_answer(record, f"{path} record {index + 1}"), tokenizer, length)
        if encoded is None:
            dropped += 1
            continue
        ids, prompt_length = encoded
        row = np.full(length, tokenizer.eod, dtype=np.int64)
        row[:len(ids)] = ids
        mask = np.zeros(length, dtype=np.float32)
        mask[prompt_length:len(ids)] = 1.0
        rows.append(row)
        masks.append(mask)
    if not rows:
        raise RawJsonError(f"{path}: every record is longer than --max-padding-length ({length} tokens with the "
                           "shift); raise it")
    return np.stack(rows), np.stack(masks), dropped


@dataclass(frozen=True)
class SampleLayout:
    """How a raw JSON row becomes a sample: packed conversations' resets (Megatron's --reset-position-ids,
    --reset-attention-mask, the latter as document ids for FlexAttention), and the samples one pass over the
    rows takes (an epoch-based run drops the pass's last incomplete global batch; None: every row)."""

    reset_position_ids: bool = False
    reset_attention_mask: bool = False
    document_ids: bool = False
    samples_per_pass: int | None = None


class RawJsonDataset:
    """`num_samples` samples cycling over the encoded rows, reshuffled each pass (seeded): GPT batches whose
    loss mask keeps the answer tokens only. A map-style dataset (torch's DataLoader takes it as it is); `dropped`
    counts the records longer than the padded length. `segments` (packed rows) numbers each position's
    conversation."""

    def __init__(self, ids: np.ndarray, loss_positions: np.ndarray, num_samples: int, seed: int,
                 dropped: int = 0, segments: np.ndarray | None = None, layout: SampleLayout | None = None) -> None:
        self.ids, self.loss_positions, self.dropped, self.segments = ids, loss_positions, dropped, segments
        self.layout = layout = layout or SampleLayout()
        self.per_pass = layout.samples_per_pass or len(ids)
        self.num_samples, self.seed = max(int(num_samples), self.per_pass), seed
        self._orders: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.num_samples

    def _record(self, idx: int) -> int:
        epoch, position = divmod(idx, self.per_pass)
        if epoch not in self._orders:
            self._orders[epoch] = np.random.RandomState(self.seed + epoch).permutation(len(self.ids))
        return int(self._orders[epoch][position])

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        record = self._record(idx)
        ids, mask = self.ids[record], self.loss_positions[record]
        sample = {"tokens": ids[:-1], "labels": ids[1:], "loss_mask": mask[1:],
                  "position_ids": np.arange(len(ids) - 1, dtype=np.int64)}
        if self.segments is not None:
            sample.update(segment_inputs(self.segments[record][:-1], self.layout))
        return sample


def segment_inputs(segments: np.ndarray, layout: SampleLayout) -> dict[str, np.ndarray]:
    """Positions counted from each conversation's start, and attention kept within it (Megatron's resets, from the
    packing's own boundaries rather than end-of-document tokens: a chat template's end token need not be last)."""
    out: dict[str, np.ndarray] = {}
    positions = np.arange(len(segments), dtype=np.int64)
    if layout.reset_position_ids:
        starts = np.maximum.accumulate(np.where(np.diff(segments, prepend=-1) != 0, positions, 0))
        out["position_ids"] = positions - starts
    if layout.reset_attention_mask and layout.document_ids:
        out["document_ids"] = segments.astype(np.int64)
    elif layout.reset_attention_mask:
        allowed = (positions[None, :] <= positions[:, None]) & (segments[None, :] == segments[:, None])
        out["attention_mask"] = ~allowed[None]
    return out
