"""Megatron's fine-tuning tasks (tasks/main.py --task MNLI / RACE) on the built-in BERT: the encoder and pooler of a
rapidtrain BERT checkpoint (--pretrained-checkpoint), dropout and a new linear head over the pooled [CLS] (three
classes for MNLI; one score per option for RACE's four), trained by the Finetuner for --epochs, with Megatron's
accuracy lines for each --valid-data file after every epoch."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from rapidtrain.checkpoint.checkpointer import CheckpointError, read_common
from rapidtrain.checkpoint.compatibility import check_same_model
from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
from rapidtrain.data.tokenizer import build_tokenizer
from rapidtrain.models.bert import BertModel, Pooler
from rapidtrain.models.config import ModelConfig
from rapidtrain.tasks.megatron_data import MNLI_LABELS, collate_task_batch, read_task_files
from rapidtrain.train.finetuner import Finetuner

HEAD_OUTPUTS = {"MNLI": len(MNLI_LABELS), "RACE": 1}  # RACE scores each option; the options are the classes


class BertTaskModel(nn.Module):
    """encoder (the built-in BERT without its pretraining heads) → pooler → dropout → head. Inputs [b, s] give
    logits [b, classes]; inputs [b, options, s] (RACE) give one score per option, [b, options]."""

    def __init__(self, config: ModelConfig, outputs: int, seed: int) -> None:
        super().__init__()
        self.config = config  # the encoder's shape (layers, hidden size), for the log line's FLOPs
        self.encoder = BertModel(dataclasses.replace(config, bert_binary_head=False))
        self.encoder.lm_head = None  # its output is then the final hidden states
        self.encoder.init_weights(seed)
        self.pooler = Pooler(config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.head = nn.Linear(config.hidden_size, outputs)
        generator = torch.Generator().manual_seed(seed + 1)
        for linear in (self.pooler.dense, self.head):  # Megatron's normal init for new linear layers
            nn.init.normal_(linear.weight, std=config.init_method_std, generator=generator)
            nn.init.zeros_(linear.bias)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor, types: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[-1]
        hidden = self.encoder(tokens.reshape(-1, length), attention_mask=padding_mask.reshape(-1, length),
                              tokentype_ids=types.reshape(-1, length))
        logits = self.head(self.dropout(self.pooler(hidden)))
        return logits.reshape(tokens.shape[0], -1)  # RACE: each option's score becomes its class's logit

    def load_pretrained(self, folder: str) -> str:
        """The encoder (and the pooler, when the checkpoint has one) from a rapidtrain BERT checkpoint folder (a
        --save folder or one iter_* folder), read whole in this process; what was loaded, for the log."""
        directory = checkpoint_directory(folder)
        saved = (read_common(directory).get("plan") or {}).get("model")
        check_same_model(saved, json_values(self.config), directory)
        state = consolidated_model_state(directory)
        wanted = self.encoder.state_dict()
        missing = sorted(set(wanted) - set(state))
        if missing:
            raise CheckpointError(f"--pretrained-checkpoint {folder}: {directory} lacks the BERT encoder's "
                                  f"{', '.join(missing[:4])}{' ...' if len(missing) > 4 else ''}; give a checkpoint "
                                  "of rapidtrain's pretrain_bert.py with this model's flags (a BERT pretrained "
                                  "with --bert-no-binary-head needs that flag here too)")
        self.encoder.load_state_dict({name: state[name] for name in wanted})
        pooler = {name.removeprefix("pooler."): state[name] for name in state if name.startswith("pooler.")}
        if pooler:
            self.pooler.load_state_dict(pooler)
        return f"encoder{' and pooler' if pooler else ' (no pooler in it: the pooler is new)'} from {directory}"


def json_values(config: ModelConfig) -> dict[str, Any]:
    """The settings as a checkpoint's plan records them (JSON values), for comparing shapes."""
    return json.loads(json.dumps(dataclasses.asdict(config), default=str))


class MegatronTaskFinetuner(Finetuner):
    """Megatron's tasks/main.py on the Finetuner: its task files, the built-in BERT with a task head, the summed
    cross entropy over the global batch, and accuracy on each --valid-data file after every epoch."""

    loss_name = "lm loss"  # the name Megatron's task log line gives the cross entropy
    metric_for_best_model = "accuracy"
    greater_is_better = True

    def __init__(self, engine: Any) -> None:
        super().__init__(engine)
        assert self.plan.tokenizer is not None and self.plan.model is not None  # the entry's defaults give both
        self.task = self.plan.task
        self.tokenizer = build_tokenizer(self.plan.tokenizer)
        self.token_count = lambda batch: len(batch["label"])  # samples carry the loss: known without a host read
        self.valid_names: list[str] = []

    def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
        data = self.plan.data
        train = read_task_files(self.task, data.train_data, self.tokenizer, data.seq_length, "--train-data")
        valid = read_task_files(self.task, data.valid_data, self.tokenizer, data.seq_length, "--valid-data")
        self.valid_names = valid.names
        self.engine.print_rank0(f" {self.task}: {len(train):,} training samples from {' '.join(data.train_data)}; "
                                + ", ".join(f"{name} {sum(s['source'] == i for s in valid.samples):,}"
                                            for i, name in enumerate(valid.names)) + " for validation")
        return train, valid, None, collate_task_batch

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, None, None]:
        plan = self.plan
        assert plan.model is not None
        model = BertTaskModel(plan.model, HEAD_OUTPUTS[self.task], plan.data.seed)
        pretrained = plan.checkpoint.pretrained_checkpoint
        if pretrained and not self._resuming():
            loaded = model.load_pretrained(pretrained)
            self.engine.print_rank0(f" {self.task}: started from the pretrained BERT: {loaded}; the head is new")
        elif not pretrained:
            self.engine.print_rank0(f" {self.task}: no --pretrained-checkpoint: the BERT starts from its "
                                    "initialisation")
        return model, None, None

    def _resuming(self) -> bool:
        """--load names a checkpoint of this task run (Megatron loads the pretrained BERT only at iteration 0)."""
        load = self.plan.checkpoint.load
        return load is not None and (Path(load) / "latest_checkpointed_iteration.txt").exists()

    def run_forward_step(self, batch: Any, model: Any) -> Any:
        logits = model(batch["text"], batch["padding_mask"], batch["types"])
        return F.cross_entropy(logits.float(), batch["label"], reduction="sum"), len(batch["label"])

    def run_compute_metrics(self, model: Any, eval_dataloader: Any) -> dict[str, Any]:
        """Correct answers per --valid-data file and overall, printed as Megatron prints them."""
        predicted, gold, sources = [], [], []
        for batch in eval_dataloader:
            logits = model(batch["text"], batch["padding_mask"], batch["types"])
            predicted.append(self.gather(logits.argmax(dim=-1)))
            gold.append(self.gather(batch["label"]))
            sources.append(self.gather(batch["source"]))
        right = (torch.cat(predicted) == torch.cat(gold)).cpu()
        source = torch.cat(sources).cpu()
        epoch = self._epoch_index()
        results: dict[str, Any] = {}
        for index, name in enumerate(self.valid_names):
            mine = source == index
            correct, total = int(right[mine].sum()), int(mine.sum())
            self.engine.print_rank0(f" > |epoch: {epoch}| metrics for {name}: correct / total = {correct} / {total} "
                                    f"= {100 * correct / max(total, 1):.4f} %")
            results[f"accuracy {name}"] = correct / max(total, 1)
        correct, total = int(right.sum()), len(right)
        self.engine.print_rank0(f" >> |epoch: {epoch}| overall: correct / total = {correct} / {total} = "
                                f"{100 * correct / max(total, 1):.4f} %")
        return {"accuracy": correct / max(total, 1), **results}

    def _epoch_index(self) -> int:
        """Megatron's epoch number in its accuracy lines: counted from 0, the epoch just finished at its end."""
        at_end = self.samples_per_epoch and self.consumed_samples % self.samples_per_epoch == 0
        return max(self.epoch - 1, 0) if at_end else self.epoch
