"""`--data-iterator dynamic-shape`: micro-batches of similar-length samples, padded only to the
batch's longest (rounded up to a multiple of 8) instead of to a fixed --seq-length."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from rapidtrain.data.gpt_dataset import GPTDatasetConfig, open_indexed_dataset, split_document_ranges
from rapidtrain.data.index_cache import DataConfigError
from rapidtrain.data.samplers import SamplerError, check_data_parallel_layout

PAD_MULTIPLE = 8  # tensor cores and vectorized kernels run fastest on multiples of 8


def round_up(length: int, multiple: int = PAD_MULTIPLE) -> int:
    """`length` rounded up to a multiple of `multiple`."""
    return -(-length // multiple) * multiple


class UnpackedDocumentDataset(torch.utils.data.Dataset):
    """One document per sample, truncated to seq_length + 1 tokens (tokens and labels shifted by one).

    Documents with fewer than 2 tokens make no sample and are left out.
    """

    def __init__(self, indexed_dataset, documents: np.ndarray, seq_length: int) -> None:
        self.indexed_dataset = indexed_dataset
        self.seq_length = seq_length
        sizes = np.asarray(indexed_dataset.sequence_lengths)[np.asarray(documents)]
        keep = sizes >= 2
        self.documents = np.asarray(documents)[keep]
        # Tokens per sample: what LengthBucketBatchSampler sorts by.
        self.lengths = np.minimum(sizes[keep], seq_length + 1).astype(np.int64) - 1

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        length = int(self.lengths[idx]) + 1
        sample = np.asarray(self.indexed_dataset.get(int(self.documents[idx]), 0, length), dtype=np.int64)
        return {"tokens": sample[:-1], "labels": sample[1:]}


def build_unpacked_datasets(config: GPTDatasetConfig) -> tuple:
    """(train, valid, test) UnpackedDocumentDatasets of one --data-path prefix; None for an empty split."""
    if len(config.data_prefix) != 1:
        raise DataConfigError(
            "--data-iterator dynamic-shape reads one --data-path prefix, not a weighted blend; "
            "give a single prefix or drop --data-iterator dynamic-shape"
        )
    indexed = open_indexed_dataset(config.data_prefix[0], config.data_impl)
    splits = []
    for begin, end in split_document_ranges(len(indexed), config.split):
        documents = np.arange(begin, end, dtype=np.int64)
        dataset = UnpackedDocumentDataset(indexed, documents, config.seq_length) if end > begin else None
        splits.append(dataset if dataset is not None and len(dataset) else None)
    return tuple(splits)


class LengthBucketBatchSampler:
    """Micro-batches of similar-length samples, shuffled per epoch, DP-aware and resumable.

    Each epoch (seed + epoch): permute the samples, sort each window of `window_steps` global steps
    (micro × dp × window_steps samples) by length, cut it into micro-batches, group dp consecutive
    micro-batches into one step (so the ranks of a step get similar lengths), and shuffle the steps.
    Rank r takes micro-batch r of each step. Leftovers that do not fill a step wait for a later epoch.
    Each `iter()` yields the rest of the current epoch and advances `consumed_samples`.
    """

    def __init__(
        self,
        lengths: Sequence[int] | np.ndarray,
        micro_batch_size: int,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
        seed: int = 0,
        consumed_samples: int = 0,
        window_steps: int = 100,
    ) -> None:
        check_data_parallel_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.lengths = np.asarray(lengths, dtype=np.int64)
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.consumed_samples = consumed_samples
        self.window_steps = window_steps
        if self.steps_per_epoch == 0:
            raise SamplerError(
                f"{len(self.lengths)} samples cannot fill one step of --micro-batch-size {micro_batch_size} "
                f"× {data_parallel_size} data-parallel ranks"
            )

    @property
    def step_size(self) -> int:
        """Samples per global micro-step (micro × dp)."""
        return self.micro_batch_size * self.data_parallel_size

    @property
    def steps_per_epoch(self) -> int:
        return len(self.lengths) // self.step_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // (self.steps_per_epoch * self.step_size)

    def epoch_steps(self, epoch: int) -> np.ndarray:
        """[steps, dp, micro] sample ids of `epoch`, identical on every rank."""
        rng = np.random.RandomState(self.seed + epoch)
        order = rng.permutation(len(self.lengths))[: self.steps_per_epoch * self.step_size]
        window = self.window_steps * self.step_size
        for start in range(0, len(order), window):
            piece = order[start : start + window]
            order[start : start + window] = piece[np.argsort(self.lengths[piece], kind="stable")]
        steps = order.reshape(self.steps_per_epoch, self.data_parallel_size, self.micro_batch_size)
        return steps[rng.permutation(self.steps_per_epoch)]

    def __len__(self) -> int:
        return self.steps_per_epoch - (self.consumed_samples // self.step_size) % self.steps_per_epoch

    def __iter__(self) -> Iterator[list[int]]:
        epoch = self.epoch
        steps = self.epoch_steps(epoch)
        first = (self.consumed_samples // self.step_size) % self.steps_per_epoch
        for step in range(first, self.steps_per_epoch):
            self.consumed_samples = (epoch * self.steps_per_epoch + step + 1) * self.step_size
            yield steps[step, self.data_parallel_rank].tolist()


def _pad(rows: Sequence[np.ndarray], length: int, value: int | float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(np.asarray(row))
    return out


class PretrainingCollator:
    """Pads unpacked pretraining samples to the batch's longest, rounded up to `multiple`.

    Returns tokens, labels, position_ids (int64 [b, L]), loss_mask (float32, 0 on padding and, with
    eod_mask_loss, on end-of-document labels), padding_mask (bool, True on padding) and, when
    `attention_mask` is set, a causal bool [b, 1, L, L] mask with True = masked out (Megatron's sense).
    """

    def __init__(
        self,
        pad_id: int,
        multiple: int = PAD_MULTIPLE,
        eod: int | None = None,
        eod_mask_loss: bool = False,
        attention_mask: bool = False,
    ) -> None:
        if pad_id < 0:
            raise DataConfigError(f"pad id must be a valid token id (>= 0), got {pad_id}; pass the eod id")
        self.pad_id, self.multiple = pad_id, multiple
        self.eod, self.eod_mask_loss, self.attention_mask = eod, eod_mask_loss, attention_mask

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        lengths = [len(s["tokens"]) for s in samples]
        width = round_up(max(lengths), self.multiple)
        tokens = _pad([s["tokens"] for s in samples], width, self.pad_id, torch.int64)
        labels = _pad([s["labels"] for s in samples], width, self.pad_id, torch.int64)
        padding_mask = torch.arange(width)[None, :] >= torch.tensor(lengths)[:, None]
        loss_mask = (~padding_mask).float()
        if self.eod_mask_loss and self.eod is not None:
            loss_mask[labels == self.eod] = 0.0
        batch = {
            "tokens": tokens,
            "labels": labels,
            "loss_mask": loss_mask,
            "position_ids": torch.arange(width).expand(len(samples), width).clone(),
            "padding_mask": padding_mask,
        }
        if self.attention_mask:
            causal = torch.ones(width, width, dtype=torch.bool).tril()
            allowed = causal[None] & ~padding_mask[:, None, :]
            batch["attention_mask"] = ~allowed[:, None]
        return batch


class FinetuneCollator:
    """Pads fine-tuning examples to the batch's longest, rounded up to `multiple`, Hugging Face style.

    An example is a list of token ids or a dict with `input_ids` (and optional `token_type_ids`,
    `labels`). Returns input_ids, attention_mask (int64, 1 on real tokens), token_type_ids when
    given, and labels: a [b] tensor for per-example labels, [b, L] padded with -100 for per-token
    labels, or the input ids with -100 on padding when examples carry no labels (causal LM).
    """

    def __init__(self, pad_id: int, multiple: int = PAD_MULTIPLE, label_pad_id: int = -100) -> None:
        self.pad_id, self.multiple, self.label_pad_id = pad_id, multiple, label_pad_id

    def __call__(self, examples: Sequence) -> dict[str, torch.Tensor]:
        rows = [e if isinstance(e, dict) else {"input_ids": e} for e in examples]
        lengths = [len(r["input_ids"]) for r in rows]
        width = round_up(max(lengths), self.multiple)
        input_ids = _pad([r["input_ids"] for r in rows], width, self.pad_id, torch.int64)
        attention_mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        batch = {"input_ids": input_ids, "attention_mask": attention_mask}
        if "token_type_ids" in rows[0]:
            batch["token_type_ids"] = _pad([r["token_type_ids"] for r in rows], width, 0, torch.int64)
        if "labels" not in rows[0]:
            batch["labels"] = input_ids.masked_fill(attention_mask == 0, self.label_pad_id)
        elif np.ndim(rows[0]["labels"]) == 0:
            batch["labels"] = torch.tensor([r["labels"] for r in rows])
        else:
            batch["labels"] = _pad([r["labels"] for r in rows], width, self.label_pad_id, torch.int64)
        return batch


class BertTrimCollator:
    """BERT samples (padded to --seq-length by the dataset) cut to the batch's longest, rounded up to
    `multiple`: samples are shorter than --seq-length when --short-seq-prob draws a short target or the
    sentences end before it, so the padding columns no sample uses are dropped. Masked positions and the
    attention padding mask keep their meaning; the loss is the same."""

    def __init__(self, multiple: int = PAD_MULTIPLE) -> None:
        self.multiple = multiple

    def __call__(self, samples: Sequence[dict]) -> dict[str, torch.Tensor]:
        batch = torch.utils.data.default_collate(list(samples))
        width = min(round_up(int(batch["padding_mask"].sum(dim=1).max()), self.multiple),
                    batch["padding_mask"].shape[1])
        return {key: value[:, :width] if value.ndim == 2 else value for key, value in batch.items()}
