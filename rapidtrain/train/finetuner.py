"""Finetuner: Rapidformer's epoch-based template (`--epochs`, or `--train-iters`) for fine-tuning.

Subclass it and provide `train_valid_test_datasets_provider()` → (train, valid, test, collate_fn),
`model_optimizer_lr_scheduler_provider()` → (model, optimizer or None, scheduler or None),
`run_forward_step(batch, model)` → loss (or `(loss_sum, count)` for an exact mean over the global batch's
tokens) and `run_compute_metrics(model, eval_dataloader)` → dict, run after every epoch (`self.gather(t)`
collects a tensor from every data-parallel rank). `train()` runs the shared loop (train/trainer.py).

Beyond Rapidformer: gradient accumulation works here too. An epoch's micro-batches are grouped into
global batches of `--global-batch-size / (--micro-batch-size × data-parallel size)` micro-batches; the
epoch's last group may be shorter and still averages exactly over its own samples. The schedule counts
ceil(micro-steps per epoch / accumulation steps) optimizer steps per epoch.

With `--save`, each epoch end writes a resumable checkpoint (`iter_*`, torch.distributed.checkpoint, with
the epoch position as consumed samples) and the model as Hugging Face folders `last/` and, when the
validation metric improved, `best/` (`from_pretrained` loads them). `--load` resumes mid-epoch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rapidtrain.data.loaders import move_to_device
from rapidtrain.train import export
from rapidtrain.train.trainer import Trainer

LOWER_IS_BETTER = ("loss", "perplexity", "ppl", "error")


class ModelChunks(list):
    """Megatron hands hooks a list of model chunks, so Rapidformer's metric hooks write `model = model[0]`;
    this list of one also behaves as the model itself (`model(**batch)`, `model.eval()`)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self[0](*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self[0], name)


class Finetuner(Trainer):
    """Epoch-based fine-tuning; the metric named `metric_for_best_model` (default: the first one returned)
    chooses the best model, higher is better unless its name says loss, perplexity or error."""

    metric_for_best_model: str | None = None
    greater_is_better: bool | None = None

    def __init__(self, engine: Any = None, **engine_kwargs: Any) -> None:
        super().__init__(engine, **engine_kwargs)
        self.tokenizer = None  # saved beside the model when set
        self.flops_counts: Any = None  # the model's matrix-product sizes (prepare_model), for TFLOP/s and MFU
        self.best_metric: float | None = None
        self.best_epoch: int | None = None
        self.export_recipe: Any = None
        self.checkpointer.pretrained_model_only = True  # fine-tuning starts from a pretrained model's weights

    def run_forward_step(self, batch: Any, model: Any) -> Any:
        """Default: a Hugging Face style model's `model(**batch).loss`."""
        output = model(**batch)
        return output.loss if hasattr(output, "loss") else output["loss"]

    def forward_step(self, batches: Iterator[Any], model: Any) -> Any:
        """Rapidformer's Finetuner hands its hook the batch itself, on the device."""
        return self.run_forward_step(move_to_device(next(batches), self.engine.device), model)

    def metrics_model(self) -> Any:
        return ModelChunks([self.model])

    def prepare_model(self, model: Any) -> None:
        self.export_recipe = export.recipe_of(model)
        self.flops_counts = training_flop_counts(model)

    def flops_per_iteration(self, interval: Any = None) -> float | None:
        """Training FLOPs of the interval's average iteration (for TFLOP/s and, with --peak-tflops, MFU): 6 per
        weight of every matrix product and token, and 12 · layers · hidden · sequence per token for attention."""
        counts = self.flops_counts
        if counts is None or interval is None or not interval.iterations or not interval.samples:
            return None
        matrix_weights, layers, hidden = counts
        sequence = interval.tokens / interval.samples
        per_token = 6 * matrix_weights + 12 * layers * hidden * sequence
        return per_token * interval.tokens / interval.iterations

    # ---- evaluation, best model, saving ----
    def end_of_epoch(self) -> None:
        epoch = self.epoch
        metrics = self.evaluate(self.valid_ds) if self.valid_ds is not None and len(self.valid_ds) else {}
        improved = self.record_metrics(epoch, metrics)
        shown = " | ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items())
        self.engine.print_rank0(f" epoch {epoch} | iteration {self.iteration} | validation {shown or '(no data)'}"
                                + (" | best so far" if improved else ""))
        if self.is_logging_rank:
            self.writer.add_scalars({f"validation/{k}": v for k, v in metrics.items() if isinstance(v, float)},
                                    self.iteration)
        if self.checkpointer.enabled:
            self.save_models(improved, metrics)
            self.checkpointer.request()

    def record_metrics(self, epoch: int, metrics: dict[str, Any]) -> bool:
        """Append to the history; True when `metric_for_best_model` improved (or there is no metric)."""
        self.history.append({"epoch": epoch, "iteration": self.iteration, **metrics})
        name = self.metric_for_best_model or next((k for k, v in metrics.items() if isinstance(v, float)), None)
        if name is None or name not in metrics:
            return True
        greater = self.greater_is_better
        if greater is None:
            greater = not any(word in name.lower() for word in LOWER_IS_BETTER)
        value = metrics[name]
        better = self.best_metric is None or (value > self.best_metric if greater else value < self.best_metric)
        if better:
            self.best_metric, self.best_epoch = value, epoch
        return better

    def export_files(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """Files written beside each saved model (name → JSON content); subclasses add predictions."""
        return {
            "eval_results.json": {
                "epoch": self.history[-1]["epoch"] if self.history else 0,
                "iteration": self.iteration,
                "validation": metrics,
                "history": self.history,
            }
        }

    def save_models(self, improved: bool, metrics: dict[str, Any]) -> None:
        """`last/` (and `best/` when improved) under --save, as `from_pretrained` folders."""
        state = export.full_model_state(self.engine.runner)  # every rank: gathers are collective
        files = self.export_files(metrics)
        root = Path(self.plan.checkpoint.save or ".")
        for name in ("last", "best") if improved else ("last",):
            written = export.write_model(root / name, state, self.export_recipe, self.tokenizer, files)
            if written is not None:
                self.engine.print_rank0(
                    f" saved the {name} model (epoch {files['eval_results.json']['epoch']}) to {written}")
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"best_metric": self.best_metric, "best_epoch": self.best_epoch, "history": self.history}

    def restore_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        self.best_metric = extra.get("best_metric")
        self.best_epoch = extra.get("best_epoch")
        self.history = list(extra.get("history", []))


def training_flop_counts(model: Any) -> tuple[int, int, int] | None:
    """(weights of the model's matrix products, layers, hidden size) for its FLOPs; None when unknown.

    Each linear layer counts once per use, so a head tied to the embedding counts as the matrix product it is;
    embedding lookups are not products. Layers and hidden size come from the Hugging Face config (or the
    built-in model's), for the attention scores."""
    from torch import nn

    weights = sum(m.weight.numel() for m in model.modules()
                  if isinstance(m, nn.Linear) or type(m).__name__ in ("Conv1D", "OutputLayer"))
    config = getattr(model, "config", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None) \
        or getattr(config, "num_layers", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    if not weights or not layers or not hidden:
        return None
    return int(weights), int(layers), int(hidden)
