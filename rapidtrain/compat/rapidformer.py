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
            except OSError as error:
                raise UserError(f"GPTDataset: cannot read {path} ({error.strerror or error}); --train-data and "
                                "--valid-data name text files, one sample per line.") from None
            self.samples += [tokenizer.tokenize(line.strip()) + [self.eod] for line in lines if line.strip()]
        if not self.samples:
            raise UserError(f"GPTDataset: {', '.join(map(str, paths))} holds no text lines.")

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, idx: int) -> dict[str, np.ndarray]:
        ids = self.samples[idx][: self.length]
        return {"text": np.array(ids + [self.eod] * (self.length - len(ids)), dtype=np.int64)}
