"""question_answering: extractive, SQuAD-style records (`question`, `context`, `answers` with `text` and
`answer_start`), scored by exact match and F1 after SQuAD's normalisation.

Each example is one feature: the question and as much of the context as fits in --seq-length (no sliding
window); an answer cut off by the truncation is trained as "no answer" (the first token) and cannot be
predicted, so keep --seq-length above the contexts' length.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

import rapidtrain.tasks.metrics as metrics
from rapidtrain.tasks.base import FeatureDataset, Gather, Task, as_records, model_inputs

MAX_ANSWER_TOKENS = 30


def answers_of(record: dict[str, Any]) -> tuple[list[str], list[int]]:
    answers = record.get("answers") or {}
    if isinstance(answers, list):  # [{"text": ..., "answer_start": ...}, ...]
        return [a["text"] for a in answers], [int(a["answer_start"]) for a in answers]
    return list(answers.get("text", [])), [int(s) for s in answers.get("answer_start", [])]


class QuestionAnswering(Task):
    name = "question_answering"
    auto_class = "AutoModelForQuestionAnswering"
    peft_task_type = "QUESTION_ANS"
    best_metric = "f1"

    def prepare(self, splits: dict[str, Any]) -> dict[str, FeatureDataset]:
        self.examples: dict[int, dict[str, Any]] = {}  # id(dataset) → per-feature context, offsets, answers
        prepared = {}
        for name, split in splits.items():
            records = as_records(split)
            if records and not {"question", "context"} <= records[0].keys():
                raise ValueError(
                    f"question_answering reads `question`, `context` and `answers`; the {name} data has "
                    f"columns {', '.join(records[0])}"
                )
            features, extras = (
                zip(*(self.feature(i, r) for i, r in enumerate(records)), strict=True)
                if records
                else ((), ())
            )
            dataset = FeatureDataset(list(features))
            self.examples[id(dataset)] = {"extras": list(extras)}
            prepared[name] = dataset
        return prepared

    def feature(self, index: int, record: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
        encoding = self.tokenizer(
            record["question"],
            record["context"],
            truncation="only_second",
            max_length=self.seq_length,
            return_offsets_mapping=True,
        )
        sequence_ids = encoding.sequence_ids()
        offsets = [
            tuple(o) if s == 1 else None
            for o, s in zip(encoding["offset_mapping"], sequence_ids, strict=True)
        ]
        texts, starts = answers_of(record)
        start_token = end_token = 0
        if texts:
            first, last = starts[0], starts[0] + len(texts[0])
            inside = [i for i, o in enumerate(offsets) if o is not None and o[0] < last and o[1] > first]
            head, tail = (offsets[inside[0]], offsets[inside[-1]]) if inside else (None, None)
            if head is not None and tail is not None and head[0] <= first and tail[1] >= last:
                start_token, end_token = inside[0], inside[-1]
        feature = {k: v for k, v in encoding.items() if k != "offset_mapping"}
        feature.update(start_positions=start_token, end_positions=end_token, index=index)
        return feature, {"context": record["context"], "offsets": offsets, "answers": texts}

    def token_count(self, batch: dict[str, torch.Tensor]) -> int:
        return batch["start_positions"].numel()

    def forward(self, batch: dict[str, torch.Tensor], model: Any) -> tuple[torch.Tensor, torch.Tensor]:
        output = model(**model_inputs(batch, self.input_names))
        start = F.cross_entropy(output.start_logits.float(), batch["start_positions"], reduction="sum")
        end = F.cross_entropy(output.end_logits.float(), batch["end_positions"], reduction="sum")
        return (start + end) / 2, torch.tensor(batch["start_positions"].numel())

    def best_span(
        self, start_logits: torch.Tensor, end_logits: torch.Tensor, offsets: list
    ) -> tuple[int, int]:
        """Character span of the best-scoring context span of at most MAX_ANSWER_TOKENS tokens ((0, 0): none)."""
        length = min(len(offsets), start_logits.numel())
        allowed = torch.tensor([o is not None for o in offsets[:length]])
        if not allowed.any():
            return 0, 0
        scores = start_logits[:length, None].float() + end_logits[None, :length].float()
        positions = torch.arange(length)
        valid = (
            allowed[:, None]
            & allowed[None, :]
            & (positions[None, :] >= positions[:, None])
            & (positions[None, :] - positions[:, None] < MAX_ANSWER_TOKENS)
        )
        best = int(scores.masked_fill(~valid, float("-inf")).flatten().argmax())
        first, last = divmod(best, length)
        return offsets[first][0], offsets[last][1]

    def evaluate(self, model: Any, loader: Any, gather: Gather) -> tuple[dict[str, float], list]:
        extras = self.examples[id(loader.dataset)]["extras"]
        rows = []
        for batch in loader:
            output = model(**model_inputs(batch, self.input_names))
            local = []
            for row, index in enumerate(batch["index"].tolist()):
                extra = extras[index]
                start, end = self.best_span(
                    output.start_logits[row].cpu(), output.end_logits[row].cpu(), extra["offsets"]
                )
                exact, f1 = metrics.squad_scores(extra["context"][start:end], extra["answers"])
                local.append([index, exact, f1, start, end])
            rows.append(gather(torch.tensor(local, dtype=torch.float64, device=batch["index"].device)).cpu())
        table = torch.cat(rows) if rows else torch.zeros(0, 5, dtype=torch.float64)
        results = {
            "exact_match": float(table[:, 1].mean()) if len(table) else 0.0,
            "f1": float(table[:, 2].mean()) if len(table) else 0.0,
        }
        answers = [extras[int(i)]["context"][int(s) : int(e)] for i, _, _, s, e in table.tolist()]
        return results, answers

    def has_labels(self, dataset: FeatureDataset | None) -> bool:
        return dataset is not None and any(e["answers"] for e in self.examples[id(dataset)]["extras"])
