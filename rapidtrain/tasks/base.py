"""What every black-box task shares: local Hugging Face models and tokenizers (never the hub), LoRA,
feature datasets, padding, and exact loss sums for the trainer's global-batch normalisation."""

from __future__ import annotations

import pickle
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rapidtrain.core.errors import UserError
from rapidtrain.data.dynamic_shape import round_up
from rapidtrain.models.hf_config import refuse_pickled_weights, refuse_remote_code

Records = list[dict[str, Any]]
Gather = Callable[[torch.Tensor], torch.Tensor]


class ModelFolderError(UserError, FileNotFoundError):
    """--pretrained-model-name-or-path does not name a usable local Hugging Face folder."""


def _check_folder(path: str | None) -> Path:
    if not path:
        raise ModelFolderError(
            "the black-box fine-tuning tasks need --pretrained-model-name-or-path DIR: a local "
            "Hugging Face model folder (config.json, weights, tokenizer files)."
        )
    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ModelFolderError(
            f"--pretrained-model-name-or-path {path}: no config.json in a local folder of that name. rapidtrain "
            'never downloads from the hub; on a machine with network run `python -c "import transformers as t; '
            f"m = '{path}'; t.AutoModel.from_pretrained(m).save_pretrained('DIR'); "
            "t.AutoTokenizer.from_pretrained(m).save_pretrained('DIR')\"`, copy DIR here and pass it."
        )
    refuse_remote_code(folder)
    return folder


def quiet_transformers() -> None:
    """No download progress bars, and only warnings and errors (the load report of new heads stays)."""
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_warning()


def load_tokenizer(path: str | None, need_fast: bool = False) -> Any:
    from transformers import AutoTokenizer

    folder = _check_folder(path)
    tokenizer = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    if need_fast and not getattr(tokenizer, "is_fast", False):
        raise ModelFolderError(
            f"--pretrained-model-name-or-path {path}: this task maps tokens back to words and "
            "characters, which needs a fast tokenizer (tokenizer.json); save one there."
        )
    return tokenizer


def load_model(auto_class: str, path: str | None, quantization: Any = None, device: Any = None,
               **kwargs: Any) -> torch.nn.Module:
    """`transformers.<auto_class>.from_pretrained(path, local_files_only=True)` in fp32 (the master weights;
    mixed precision comes from autocast or DeepSpeed, not from the checkpoint's dtype). With `quantization` (a
    BitsAndBytesConfig) the linear layers load quantised, placed on `device` (a quantised model cannot be moved
    whole afterwards)."""
    import transformers

    folder = _check_folder(path)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        if device is not None and torch.device(device).type == "cuda":
            kwargs["device_map"] = {"": torch.device(device).index or 0}
    try:
        return getattr(transformers, auto_class).from_pretrained(
            str(folder), local_files_only=True, dtype=torch.float32, **kwargs
        )
    except pickle.UnpicklingError as error:  # a pytorch_model.bin holding more than tensors
        raise refuse_pickled_weights(folder, error) from None


class FeatureDataset(torch.utils.data.Dataset):
    """Tokenised features (dicts of ids and scalars), with each sample's length for dynamic shape."""

    def __init__(self, features: Records) -> None:
        self.features = features
        self.lengths = [len(f["input_ids"]) for f in features]

    def __len__(self) -> int:
        return len(self.features)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.features[index]


class PadCollator:
    """Stacks features into tensors. List fields are right-padded to `fixed_length` (fixed shapes), or, for
    dynamic shape, to the batch's longest rounded up to a multiple of 8; fields in `separate` (seq2seq
    labels) get their own width. `pad_values` gives each field's padding (labels: -100, ignored by losses)."""

    def __init__(
        self, pad_values: dict[str, int], fixed_length: int | None, separate: Sequence[str] = ()
    ) -> None:
        self.pad_values = pad_values
        self.fixed_length = fixed_length
        self.separate = tuple(separate)

    def _width(self, rows: list[Sequence]) -> int:
        longest = max((len(r) for r in rows), default=1)
        return max(self.fixed_length or 0, longest) if self.fixed_length else round_up(max(longest, 1))

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        list_fields = [k for k, v in features[0].items() if isinstance(v, list | tuple | np.ndarray)]
        shared = self._width([f[k] for k in list_fields if k not in self.separate for f in features])
        batch: dict[str, torch.Tensor] = {}
        for key, first in features[0].items():
            values = [f[key] for f in features]
            if key in list_fields:
                width = self._width(values) if key in self.separate else shared
                padded = torch.full((len(values), width), self.pad_values.get(key, 0), dtype=torch.int64)
                for row, value in enumerate(values):
                    padded[row, : len(value)] = torch.as_tensor(np.asarray(value, dtype=np.int64))
                batch[key] = padded
            elif isinstance(first, bool | int | np.integer):
                batch[key] = torch.tensor(values, dtype=torch.int64)
            elif isinstance(first, float | np.floating):
                batch[key] = torch.tensor(values, dtype=torch.float32)
        return batch


class FlattenCollator:
    """Padding-free packing (--padding-free; Hugging Face's DataCollatorWithFlattening): a micro-batch's sequences
    back to back in ONE row, `position_ids` restarting at 0 for each, no attention mask (transformers' mask builders
    then find the sequences from the position ids and keep attention within each), and the label of each
    sequence's first token set to -100 so that no token is trained to predict the next sequence's start."""

    def __call__(self, features: Sequence[dict[str, Any]]) -> dict[str, torch.Tensor]:
        ids, positions, labels = [], [], []
        for feature in features:
            tokens = torch.as_tensor(np.asarray(feature["input_ids"], dtype=np.int64))
            target = torch.as_tensor(np.asarray(feature.get("labels", feature["input_ids"]), dtype=np.int64)).clone()
            target[:1] = -100  # the causal shift pairs this label with the previous sequence's last token
            ids.append(tokens)
            positions.append(torch.arange(len(tokens), dtype=torch.int64))
            labels.append(target)
        batch = {"input_ids": torch.cat(ids)[None], "position_ids": torch.cat(positions)[None],
                 "labels": torch.cat(labels)[None]}
        for key, first in features[0].items():
            if isinstance(first, bool | int | np.integer):
                batch[key] = torch.tensor([f[key] for f in features], dtype=torch.int64)
        return batch


def cross_entropy_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(sum of the loss over labels that are not -100, how many): the trainer divides by the global batch's count."""
    loss = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum"
    )
    return loss, (labels != -100).sum()


def cross_entropy_per_row(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per example: (loss sum over its labelled tokens, their number), for perplexity over a whole split."""
    per_token = F.cross_entropy(logits.float().transpose(1, 2), labels, ignore_index=-100, reduction="none")
    return per_token.sum(dim=1), (labels != -100).sum(dim=1)


def model_inputs(batch: dict[str, torch.Tensor], names: Sequence[str]) -> dict[str, torch.Tensor]:
    return {name: batch[name] for name in names if name in batch}


def text_columns(
    records: Records, candidates: Sequence[tuple[str, ...]], what: str, flag_hint: str
) -> tuple[str, ...]:
    """The first candidate whose columns all exist; else the first string columns of the data."""
    if not records:
        raise ValueError(f"the {what} data has no rows")
    columns = records[0].keys()
    for names in candidates:
        if all(name in columns for name in names):
            return names
    strings = tuple(k for k, v in records[0].items() if isinstance(v, str))
    if not strings:
        raise ValueError(f"no text column found for {what} among {sorted(columns)}; {flag_hint}")
    return strings[: len(candidates[0])]


class Task:
    """One black-box task: features from records, the Auto class, the loss, the metrics after each epoch."""

    name = ""
    auto_class = ""
    peft_task_type: str | None = None
    best_metric = ""
    greater_is_better = True
    input_names: tuple[str, ...] = ("input_ids", "attention_mask", "token_type_ids")

    def __init__(self, tokenizer: Any, seq_length: int, dynamic_shape: bool, seed: int) -> None:
        self.tokenizer = tokenizer
        self.seq_length = min(seq_length, getattr(tokenizer, "model_max_length", seq_length) or seq_length)
        self.dynamic_shape = dynamic_shape
        self.seed = seed
        self.collate: Callable[[Sequence[dict[str, Any]]], dict[str, torch.Tensor]] = PadCollator(
            self.pad_values(), None if dynamic_shape else self.seq_length)

    def pad_values(self) -> dict[str, int]:
        return {
            "input_ids": self.tokenizer.pad_token_id or 0,
            "attention_mask": 0,
            "token_type_ids": 0,
            "labels": -100,
        }

    def prepare(self, splits: dict[str, Records]) -> dict[str, FeatureDataset]:
        raise NotImplementedError

    def model_kwargs(self) -> dict[str, Any]:
        return {}

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def token_count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor | int:
        """Loss-carrying labels of a host batch, as a tensor (the loop divides by it, never reads it) or a count
        known without reading a tensor."""
        return (batch["labels"] != -100).sum()

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], list | None]:
        raise NotImplementedError

    def has_labels(self, dataset: FeatureDataset | None) -> bool:
        return dataset is not None and any(
            np.any(np.asarray(f.get("labels", -100)) != -100) for f in dataset.features
        )

    def tokenize(self, *texts: Any, **kwargs: Any) -> dict[str, list[int]]:
        return dict(self.tokenizer(*texts, truncation=True, max_length=self.seq_length, **kwargs))


def as_records(split: Any) -> Records:
    """A split as a list of dicts (from a list already, or from a datasets.Dataset)."""
    return split if isinstance(split, list) else [dict(row) for row in split]


def class_label_names(split: Any, column: str) -> list[str] | None:
    """Label names of a datasets ClassLabel column (or a Sequence of them), when the split has them."""
    features = getattr(split, "features", None)
    if not features or column not in features:
        return None
    feature = features[column]
    feature = getattr(feature, "feature", feature)  # Sequence(ClassLabel)
    names = getattr(feature, "names", None)
    return list(names) if names else None
