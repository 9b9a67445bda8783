"""Pai-Megatron-Patch's SFT idxmap data (`--dataset MMAP --train-mode finetune`, made by Pai's
toolkits/sft_data_preprocessing): Megatron indexed data whose every document is one sample of 2 x --seq-length ids,
the input tokens and then their labels. In the input half a conversation's last token is stored negative (-id - 1),
marking where the next one starts; in the label half -100 marks a position without loss (prompts, padding).

Pai reads it through Megatron's GPTDataset with the sequence length doubled: since every document is exactly that
long, each sample is one document. Its loss is the per-sequence average: each row's answer tokens weigh 1 / (their
count), or, packed (--reset-position-ids), each conversation's within its row; the loop's sum / sum of weights is
then the mean over sequences."""

from __future__ import annotations

from typing import Any

import numpy as np

from rapidtrain.data.raw_json import SampleLayout, segment_inputs

IGNORED_LABEL = -100  # Pai's (and Hugging Face's) label of a position without loss


def sft_sample(row: np.ndarray, seq_length: int, layout: SampleLayout) -> dict[str, np.ndarray]:
    """One GPT batch row from a document of 2 x `seq_length` ids (tokens, then labels)."""
    if len(row) < 2 * seq_length:
        raise ValueError(f"an SFT idxmap sample holds {len(row)} ids, not 2 x --seq-length = {2 * seq_length}: was "
                         "the data built with this --seq-length?")
    tokens = np.array(row[:seq_length], dtype=np.int64)
    labels = np.array(row[seq_length:2 * seq_length], dtype=np.int64)
    ends = tokens < 0
    tokens[ends] = -tokens[ends] - 1
    targets = labels != IGNORED_LABEL
    labels[~targets] = 0  # any real id: the loss mask drops these positions
    # conversation number of each position: a new one starts after each marked end
    segments = np.concatenate(([0], np.cumsum(ends)[:-1])).astype(np.int64)
    weights = targets.astype(np.float32)
    packed = layout.reset_position_ids or layout.reset_attention_mask
    for segment in np.unique(segments) if packed else (None,):
        where = slice(None) if segment is None else segments == segment
        total = weights[where].sum()
        if total:
            weights[where] /= total
    sample = {"tokens": tokens, "labels": labels, "loss_mask": weights,
              "position_ids": np.arange(seq_length, dtype=np.int64)}
    if packed:
        sample.update(segment_inputs(segments, layout))
    return sample


class IdxmapSftDataset:
    """Pai's SFT idxmap samples over GPT samples of 2 x --seq-length tokens (a GPTDataset, or a blend of them, of
    that length: one document a sample)."""

    def __init__(self, documents: Any, seq_length: int, layout: SampleLayout) -> None:
        self.documents, self.seq_length, self.layout = documents, seq_length, layout

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        # a GPT sample's tokens are its first 2 x seq_length ids: the document (a blend hands them on as they are)
        return sft_sample(self.documents[idx]["tokens"], self.seq_length, self.layout)
