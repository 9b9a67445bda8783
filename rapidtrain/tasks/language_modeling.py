"""masked_lm and casual_lm (perplexity over a `text` column) and seq2seq_lm (`source` → `target`: loss,
perplexity and the unigram token overlap F1 of greedy generations against the targets).

Losses are sums over the labelled tokens with their count, so the trainer averages exactly over the
tokens of the whole global batch. Masking for masked_lm is drawn per sample from (seed, epoch, index):
reproducible after a resume, different each epoch, and fixed for validation.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.distributed as dist

import rapidtrain.tasks.metrics as metrics
from rapidtrain.tasks.base import (
    FeatureDataset,
    FlattenCollator,
    Gather,
    PadCollator,
    Task,
    as_records,
    cross_entropy_per_row,
    cross_entropy_sum,
    model_inputs,
    text_columns,
)

TEXT = (("text",), ("sentence",), ("content",))
PAIRS = (
    ("source", "target"),
    ("input", "output"),
    ("document", "summary"),
    ("text", "summary"),
    ("src", "tgt"),
    ("question", "answer"),
)


def perplexity_of(
    model: Any, loader: Any, gather: Gather, shift: bool, names: tuple[str, ...], extra: dict[str, Any] | None = None
) -> dict[str, float]:
    totals = torch.zeros(2, dtype=torch.float64)
    for batch in loader:
        logits = model(**model_inputs(batch, names), **(extra or {})).logits
        labels = batch["labels"]
        if shift:
            logits, labels = logits[:, :-1], labels[:, 1:]
        sums, counts = cross_entropy_per_row(logits, labels)
        totals += gather(torch.stack([sums.double(), counts.double()], dim=1)).sum(dim=0).cpu()
    loss, ppl = metrics.perplexity(float(totals[0]), float(totals[1]))
    return {"loss": loss, "perplexity": ppl}


class MaskedFeatures(FeatureDataset):
    """Features whose tokens are masked BERT-style (80% [MASK], 10% random, 10% kept) when read."""

    def __init__(self, features: list[dict[str, Any]], tokenizer: Any, mask_prob: float, seed: int) -> None:
        super().__init__(features)
        self.mask_id, self.vocab_size = tokenizer.mask_token_id, len(tokenizer)
        self.special = set(tokenizer.all_special_ids)
        self.mask_prob, self.seed, self.epoch = mask_prob, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __getitem__(self, index: int) -> dict[str, Any]:
        feature = dict(self.features[index])
        ids = np.asarray(feature["input_ids"], dtype=np.int64)
        rng = np.random.default_rng([self.seed, self.epoch, index])
        candidates = np.flatnonzero([i not in self.special for i in ids])
        chosen = (
            rng.choice(candidates, size=max(1, round(self.mask_prob * len(candidates))), replace=False)
            if len(candidates)
            else np.zeros(0, dtype=np.int64)
        )
        labels = np.full_like(ids, -100)
        labels[chosen] = ids[chosen]
        draw = rng.random(len(chosen))
        ids[chosen[draw < 0.8]] = self.mask_id
        randomised = chosen[(draw >= 0.8) & (draw < 0.9)]
        ids[randomised] = rng.integers(0, self.vocab_size, size=len(randomised))
        feature.update(input_ids=ids.tolist(), labels=labels.tolist())
        return feature


class MaskedLM(Task):
    name = "masked_lm"
    auto_class = "AutoModelForMaskedLM"
    best_metric = "perplexity"
    greater_is_better = False
    mask_prob = 0.15

    def prepare(self, splits: dict[str, Any]) -> dict[str, FeatureDataset]:
        if self.tokenizer.mask_token_id is None:
            raise ValueError("masked_lm needs a tokenizer with a mask token ([MASK])")
        column = text_columns(as_records(splits["train"]), TEXT, "masked_lm", "name the text column `text`")[
            0
        ]
        prepared: dict[str, FeatureDataset] = {}
        for name, split in splits.items():
            features = [
                {**self.tokenize(str(r[column])), "index": i} for i, r in enumerate(as_records(split))
            ]
            dataset = MaskedFeatures(features, self.tokenizer, self.mask_prob, self.seed)
            prepared[name] = dataset
        return prepared

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy_sum(model(**model_inputs(batch, self.input_names)).logits, batch["labels"])

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], None]:
        return perplexity_of(model, loader, gather, False, self.input_names), None

    def has_labels(self, dataset: FeatureDataset | None) -> bool:
        return dataset is not None and len(dataset) > 0


class CausalLM(Task):
    name = "casual_lm"
    auto_class = "AutoModelForCausalLM"
    peft_task_type = "CAUSAL_LM"
    best_metric = "perplexity"
    greater_is_better = False
    input_names = ("input_ids", "attention_mask")

    def __init__(self, tokenizer: Any, seq_length: int, dynamic_shape: bool, seed: int,
                 padding_free: bool = False) -> None:
        super().__init__(tokenizer, seq_length, dynamic_shape, seed)
        self.padding_free = padding_free
        if padding_free:
            self.collate = FlattenCollator()
            self.input_names = ("input_ids", "position_ids")

    def call_kwargs(self) -> dict[str, Any]:
        # transformers detects packed sequences only without a cache (masking_utils._preprocess_mask_arguments),
        # and config.use_cache (True by default) makes the model build one even in training. Passed per call, not
        # stored in the config, so an exported model still generates with its cache.
        return {"use_cache": False} if self.padding_free else {}

    def prepare(self, splits: dict[str, Any]) -> dict[str, FeatureDataset]:
        column = text_columns(as_records(splits["train"]), TEXT, "casual_lm", "name the text column `text`")[
            0
        ]
        prepared = {}
        for name, split in splits.items():
            features = []
            for i, record in enumerate(as_records(split)):
                feature = self.tokenize(str(record[column]), return_token_type_ids=False)
                features.append({**feature, "labels": list(feature["input_ids"]), "index": i})
            prepared[name] = FeatureDataset(features)
        return prepared

    def token_count(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"][:, 1:] != -100).sum()  # each token predicts the next

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        logits = model(**model_inputs(batch, self.input_names), **self.call_kwargs()).logits
        return cross_entropy_sum(logits[:, :-1], batch["labels"][:, 1:])

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], None]:
        return perplexity_of(model, loader, gather, True, self.input_names, self.call_kwargs()), None


class Seq2SeqLM(Task):
    name = "seq2seq_lm"
    auto_class = "AutoModelForSeq2SeqLM"
    peft_task_type = "SEQ_2_SEQ_LM"
    best_metric = "token_overlap_f1"
    input_names = ("input_ids", "attention_mask", "labels")

    def __init__(self, tokenizer: Any, seq_length: int, dynamic_shape: bool, seed: int) -> None:
        super().__init__(tokenizer, seq_length, dynamic_shape, seed)
        self.collate = PadCollator(
            self.pad_values(), None if dynamic_shape else self.seq_length, separate=("labels",)
        )

    def prepare(self, splits: dict[str, Any]) -> dict[str, FeatureDataset]:
        source, target = text_columns(
            as_records(splits["train"]), PAIRS, "seq2seq_lm", "name the columns `source` and `target`"
        )
        prepared = {}
        for name, split in splits.items():
            features = []
            for i, record in enumerate(as_records(split)):
                feature = self.tokenize(str(record[source]), return_token_type_ids=False)
                labels = self.tokenize(str(record.get(target) or ""), return_token_type_ids=False)[
                    "input_ids"
                ]
                features.append({**feature, "labels": labels, "index": i})
            prepared[name] = FeatureDataset(features)
        return prepared

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return cross_entropy_sum(model(**model_inputs(batch, self.input_names)).logits, batch["labels"])

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], list]:
        from rapidtrain.parallel.data_parallel import unwrap

        # Any: a transformers model, whose generate() nn.Module's typing does not know.
        generator: Any = unwrap(model[0] if isinstance(model, list) else model)
        special = set(self.tokenizer.all_special_ids)
        totals = torch.zeros(2, dtype=torch.float64)
        scores, generations = [], []
        for batch in loader:
            sums, counts = cross_entropy_per_row(
                model(**model_inputs(batch, self.input_names)).logits, batch["labels"]
            )
            totals += gather(torch.stack([sums.double(), counts.double()], dim=1)).sum(dim=0).cpu()
            generated = generator.generate(
                input_ids=batch["input_ids"],
                attention_mask=batch["attention_mask"],
                max_new_tokens=batch["labels"].shape[1],
                do_sample=False,
                num_beams=1,
                synced_gpus=dist.is_initialized() and dist.get_world_size() > 1,
            )
            local = [
                metrics.overlap_f1(
                    [t for t in g.tolist() if t not in special],
                    [t for t in r.tolist() if t != -100 and t not in special],
                )
                for g, r in zip(generated, batch["labels"], strict=True)
            ]
            scores.append(gather(torch.tensor(local, dtype=torch.float64, device=generated.device)).cpu())
            generations += list(gather(generated).cpu())
        loss, ppl = metrics.perplexity(float(totals[0]), float(totals[1]))
        overlap = torch.cat(scores) if scores else torch.zeros(0)
        texts = [
            self.tokenizer.decode([t for t in g.tolist() if t >= 0], skip_special_tokens=True)
            for g in generations
        ]
        return {
            "loss": loss,
            "perplexity": ppl,
            "token_overlap_f1": float(overlap.mean()) if len(overlap) else 0.0,
        }, texts
