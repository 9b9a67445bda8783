"""Pretraining inputs checked before any work: the tokenizer's files load, every --data-path prefix has a
readable .bin/.idx pair that holds tokens, and a sample of its token ids fits the padded vocabulary.

`check_pretraining_inputs` takes the data and tokenizer settings only; the launcher calls it before torchrun
starts and a run before its model is built, so a wrong path or tokenizer ends in one message, not a traceback
minutes later.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from rapidtrain.data.blending import parse_data_path
from rapidtrain.data.gpt_dataset import open_indexed_dataset
from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer


@dataclass(frozen=True)
class DataSummary:
    prefix: str
    documents: int
    tokens: int


def check_pretraining_inputs(data_path: Sequence[str] | None, data_impl: str,
                             tokenizer: TokenizerSettings | None) -> list[DataSummary]:
    """Raise a UserError naming the flag or file when an input is missing or unusable; else summarize the data.

    With no --data-path (the demo corpus) only the tokenizer, if given, is checked.
    """
    padded_vocab = None
    if tokenizer is not None and tokenizer.tokenizer_type is not None:
        padded_vocab = tokenizer.padded_vocab_size_of(build_tokenizer(tokenizer))
    return check_data_files(data_path, data_impl, padded_vocab)


def check_data_files(data_path: Sequence[str] | None, data_impl: str, padded_vocab: int | None) -> list[DataSummary]:
    """Each --data-path prefix opens as indexed data with tokens (ids below `padded_vocab` when given); a UserError
    names the file and the fix otherwise. `rapidtrain plan` asks this with the plan's vocabulary."""
    if not data_path:
        return []
    summaries = []
    for prefix in parse_data_path(data_path)[0]:
        dataset = open_indexed_dataset(prefix, data_impl, padded_vocab)
        tokens = int(np.sum(np.asarray(dataset.sequence_lengths), dtype=np.int64))
        summaries.append(DataSummary(prefix, len(dataset.document_indices) - 1, tokens))
    return summaries
