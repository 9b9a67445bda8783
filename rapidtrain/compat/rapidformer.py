"""PAI-Rapidformer's Megatron-model API over rapidtrain: its GPTModel (which hands the MoE balancing losses to
the forward step), the GPTFinetuner template of its GPT-MoE examples, and the text-line GPTDataset they read.

`from rapidtrain.rapidformer import GPTModel, GPTDataset` and `from rapidtrain import RapidformerEngine,
get_args, GPTFinetuner, PreTrainer` replace Rapidformer's imports.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidtrain.compat.megatron import GPTModel as MegatronGPTModel
from rapidtrain.core.errors import UserError
from rapidtrain.models.moe import moe_layers
from rapidtrain.parallel.runner import as_loss
from rapidtrain.train.finetuner import Finetuner


class GPTModel(MegatronGPTModel):
    """Rapidformer's GPTModel: `model(tokens, position_ids, attention_mask, labels=labels)` returns
    `(per-token loss, *balancing losses)`, one unweighted load-balancing loss per MoE layer in training (None in
    evaluation); the forward step weights them (--moe-loss-coeff) and adds them to its loss, so rapidtrain adds
    nothing of its own. A dense model returns a 1-tuple."""

    def __init__(self, num_tokentypes: int = 0, parallel_output: bool = True, pre_process: bool = True,
                 post_process: bool = True, **kwargs: Any) -> None:
        super().__init__(num_tokentypes, parallel_output, pre_process, post_process, **kwargs)
        for layer in moe_layers(self).values():
            layer.returns_aux_loss = True

    def forward(self, *args: Any, **kwargs: Any) -> tuple[Any, ...]:  # type: ignore[override]
        layers = list(moe_layers(self).values())
        for layer in layers:
            layer.last_aux_loss = None
        output = super().forward(*args, **kwargs)
        return (output, *(layer.last_aux_loss for layer in layers))


class GPTFinetuner(Finetuner):
    """Rapidformer's GPT fine-tuning template: epochs over map-style datasets of {"text": ids} samples with a
    built-in (Megatron-shaped) GPT, Megatron's forward-step contract (`run_forward_step(batch, model)` returns
    `(output_tensor, loss_func)`, the loss function `(loss, {"lm loss": ...})`), validation by the language-model
    loss and its perplexity. Start it from a pretrained checkpoint with --pretrained-model-name-or-path (or --load)
    and --finetune."""

    def run_compute_metrics(self, model: Any, eval_dataloader: Any) -> dict[str, Any]:
        """The validation set's mean language-model loss (what the loss function reports as "lm loss", else its
        loss), and the perplexity of it."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        for batch in eval_dataloader:
            value, count, reported = as_loss(self.forward_step(iter([batch]), self.model))
            rows = eval_dataloader.real_rows
            if rows == 0:  # a padding batch: forward for the collectives, not counted
                continue
            if "lm loss" in reported:
                value = reported["lm loss"][0] / reported["lm loss"][1]
            elif count is not None:
                value = value / count.clamp(min=1)
            totals += torch.stack([value.detach().double().reshape(()).to(totals.device) * rows,
                                   torch.tensor(float(rows), dtype=torch.float64, device=totals.device)])
        self.engine.all_reduce_data_parallel(totals)
        loss = float(totals[0] / totals[1].clamp(min=1))
        return {"lm loss": loss, "lm loss PPL": math.exp(min(20.0, loss))}


class GPTDataset(torch.utils.data.Dataset):
    """Rapidformer's fine-tuning text: one sample per non-empty line of the files, tokenized with an end of
    document appended, cut or padded (with end-of-document tokens) to --seq-length + 1: {"text": ids}."""

    def __init__(self, datapaths: Sequence[str] | str, tokenizer: Any, seq_length: int) -> None:
        paths = [datapaths] if isinstance(datapaths, str | Path) else list(datapaths or [])
        if not paths:
            raise UserError("GPTDataset: no data files (give --train-data / --valid-data FILE ...).")
        self.eod, self.length = tokenizer.eod, seq_length + 1
        self.samples: list[list[int]] = []
        for path in paths:
            try:
                lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
            except (OSError, UnicodeDecodeError) as error:
                raise UserError(f"GPTDataset: cannot read {path} ({getattr(error, 'strerror', None) or error}); "
                                "--train-data and --valid-data name UTF-8 text files, one sample per line.") from None
            self.samples += [_tokenized(tokenizer, line.strip(), path) + [self.eod] for line in lines if line.strip()]
        if not self.samples:
            raise UserError(f"GPTDataset: {', '.join(map(str, paths))} holds no text lines.")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        ids = self.samples[idx][: self.length]
        return {"text": np.array(ids + [self.eod] * (self.length - len(ids)), dtype=np.int64)}


def _tokenized(tokenizer: Any, text: str, path: str | Path) -> list[int]:
    try:
        return list(tokenizer.tokenize(text))
    except ValueError as error:  # NullTokenizer's complaint about text that is not token ids
        raise UserError(f"GPTDataset: {path}: {error}") from None


class PETDataset(torch.utils.data.Dataset):
    """Rapidformer's prompt (PET) samples for a GPT: tab-separated rows whose columns are named by `input_schema`
    ('sent,label,sid'), each turned into the text `pattern` spells ('sent,这句话表达的主题是,label': a part that
    names a column is that column's value, the label column is its word from `label_desc`, any other part is
    literal), tokenized with an end of document, cut or padded with it to `seq_length` + 1: {"text": ids,
    "label": index of the row's label in `label_enumerate_values`}.

    Rapidformer's own signature is taken too: `PETDataset(task_name, split, datapaths, tokenizer, seq_length,
    input_schema, pattern, label_map)` (`label_map`: each label value → its word, or None for the values as they
    are), as EasyNLP's ZeroCLUE scripts call it."""

    def __init__(self, datapaths: Sequence[str] | str, tokenizer: Any, *rest: Any) -> None:
        if isinstance(tokenizer, str):  # Rapidformer's order: (task, split, datapaths, tokenizer, length, ...)
            datapaths, tokenizer, seq_length, input_schema, pattern, label_map = rest
            label_map = dict(label_map or {})
            label_desc, label_enumerate_values = ",".join(label_map.values()), ",".join(label_map)
        else:
            seq_length, input_schema, pattern, label_desc, label_enumerate_values = rest
        self._build(datapaths, tokenizer, seq_length, input_schema, pattern, label_desc, label_enumerate_values)

    def _build(self, datapaths: Sequence[str] | str, tokenizer: Any, seq_length: int, input_schema: str,
               pattern: str, label_desc: str, label_enumerate_values: str) -> None:
        values, words = label_enumerate_values.split(","), label_desc.split(",")
        if len(values) != len(words):
            raise UserError(f"PETDataset: --label_enumerate_values has {len(values)} labels and --label_desc "
                            f"{len(words)} words; give one word per label")
        self.word_of, self.index_of = dict(zip(values, words, strict=True)), {v: i for i, v in enumerate(values)}
        self.columns, self.parts = input_schema.split(","), pattern.split(",")
        self.tokenizer, self.length = tokenizer, seq_length + 1
        paths = [datapaths] if isinstance(datapaths, str | Path) else list(datapaths or [])
        self.samples = [sample for path in paths for sample in self._read(path)]
        if not self.samples:
            raise UserError(f"PETDataset: {', '.join(map(str, paths))} holds no rows.")

    def _read(self, path: str | Path) -> list[dict[str, np.ndarray | int]]:
        try:
            lines = Path(path).read_text(encoding="utf-8-sig").splitlines()
        except (OSError, UnicodeDecodeError) as error:
            raise UserError(f"PETDataset: cannot read {path} ({getattr(error, 'strerror', None) or error}); "
                            "give a UTF-8 text file.") from None
        return [self._sample(dict(zip(self.columns, line.split("\t"), strict=False))) for line in lines if line]

    def _sample(self, row: dict[str, str]) -> dict[str, np.ndarray | int]:
        label = row.get("label", "")
        text = "".join(self.word_of.get(label, label) if part == "label" else row.get(part, part)
                       for part in self.parts)
        eod = self.tokenizer.eod
        ids = (self.tokenizer.tokenize(text) + [eod])[: self.length]
        return {"text": np.array(ids + [eod] * (self.length - len(ids)), dtype=np.int64),
                "label": self.index_of.get(label, -1)}

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | int]:
        return self.samples[idx]


class HuggingFaceBertSamples(torch.utils.data.Dataset):
    """Megatron BERT samples in Hugging Face BertForPreTraining's keywords: input_ids, token_type_ids,
    attention_mask, labels (-100 where no token is masked) and next_sentence_label (1: B is a random sentence)."""

    def __init__(self, samples: Any) -> None:  # a BERT sample dataset (map-style, sized)
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray | np.int64]:
        sample = self.samples[idx]
        return {"input_ids": sample["text"], "token_type_ids": sample["types"],
                "attention_mask": sample["padding_mask"], "labels": np.where(sample["labels"] < 0, -100,
                                                                              sample["labels"]),
                "next_sentence_label": sample["is_random"]}


def build_pretrain_huggingface_bert_datasets(
    data_prefix: Sequence[str] | str, data_impl: str, splits_string: str,
    train_valid_test_num_samples: Sequence[int], max_seq_length: int, masked_lm_prob: float = 0.15,
    short_seq_prob: float = 0.1, seed: int = 1234, skip_warmup: bool = True, binary_head: bool = True,
    **unused: Any,
) -> tuple[Any, Any, Any]:
    """Rapidformer's BERT pretraining data for a Hugging Face BERT: Megatron's masked-LM (and sentence-pair)
    samples of --data-path, made with the --tokenizer-type / --vocab-file tokenizer, in HF's keywords."""
    from rapidtrain.compat.megatron import get_tokenizer
    from rapidtrain.data.bert_dataset import BERTDatasetConfig, build_bert_datasets
    from rapidtrain.data.blending import parse_data_path
    from rapidtrain.data.indexed import warm_up

    prefixes = [data_prefix] if isinstance(data_prefix, str) else list(data_prefix)
    if not skip_warmup:
        for prefix in parse_data_path(prefixes)[0]:
            warm_up(prefix)
    tokenizer = get_tokenizer()
    # Masked tokens are replaced by random ids of the vocabulary file itself: a Hugging Face BERT has no rows for
    # the [BOS]/[EOS] Megatron's tokenizer appends.
    vocab_size = getattr(tokenizer, "file_vocab_size", tokenizer.vocab_size)
    config = BERTDatasetConfig(data_prefix=prefixes, split=splits_string, seq_length=max_seq_length, seed=seed,
                               vocab_size=vocab_size, cls_id=tokenizer.cls, sep_id=tokenizer.sep,
                               mask_id=tokenizer.mask, pad_id=tokenizer.pad, mask_prob=masked_lm_prob,
                               short_seq_prob=short_seq_prob, binary_head=binary_head, data_impl=data_impl)
    splits = build_bert_datasets(config, list(train_valid_test_num_samples))
    train, valid, test = (HuggingFaceBertSamples(d) if d is not None else None for d in splits)
    return train, valid, test
