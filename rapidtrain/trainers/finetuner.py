"""Finetuner: Rapidformer's epoch-based template (`--epochs`, or `--train-iters`) for fine-tuning.

Subclass it and provide `train_valid_test_datasets_provider()` → (train, valid, test, collate_fn),
`model_optimizer_lr_scheduler_provider()` → (model, optimizer or None, scheduler or None),
`run_forward_step(batch, model)` → loss (or `(loss_sum, count)` for an exact mean over the global batch's
tokens) and `run_compute_metrics(model, eval_dataloader)` → dict, run after every epoch (`self.gather(t)`
collects a tensor from every data-parallel rank). `train()` runs the loop.

Beyond Rapidformer: gradient accumulation works here too. An epoch's micro-batches are grouped into
global batches of `--global-batch-size / (--micro-batch-size × data-parallel size)` micro-batches; the
epoch's last group may be shorter and still averages exactly over its own samples. The schedule counts
ceil(micro-steps per epoch / accumulation steps) optimizer steps per epoch.

With `--save`, each epoch end writes a resumable checkpoint (`iter_*`, torch.distributed.checkpoint, with
the epoch position as consumed samples) and the model as Hugging Face folders `last/` and, when the
validation metric improved, `best/` (`from_pretrained` loads them). `--load` resumes mid-epoch.
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rapidtrain.metrics import TensorBoardWriter, ThroughputMeter, format_log_line
from rapidtrain.parallel.runner import autocast
from rapidtrain.plan import lr_schedule_settings
from rapidtrain.trainers import composed, export
from rapidtrain.trainers.trainer import IntervalTotals, IterationResult, StopSignal, Trainer

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
        self.tokenizer: Any = None  # saved beside the model when set
        self.best_metric: float | None = None
        self.best_epoch: int | None = None
        self.history: list[dict[str, Any]] = []
        self._eval_loader: composed.ShardedLoader | None = None
        self._saved_now = False

    # ---- hooks a subclass provides ----
    def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
        raise NotImplementedError(
            "Finetuner subclasses implement train_valid_test_datasets_provider() → "
            "(train, valid, test, collate_fn)"
        )

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, Any, Any]:
        raise NotImplementedError(
            "Finetuner subclasses implement model_optimizer_lr_scheduler_provider() → "
            "(model, optimizer or None, scheduler or None)"
        )

    def run_forward_step(self, batch: Any, model: Any) -> Any:  # type: ignore[override]
        """Default: a Hugging Face style model's `model(**batch).loss`."""
        output = model(**batch)
        return output.loss if hasattr(output, "loss") else output["loss"]

    def run_compute_metrics(self, model: Any, eval_dataloader: Any) -> dict[str, Any]:
        """Default: the validation loss (per token when the forward step returns loss sums)."""
        totals = torch.zeros(2, dtype=torch.float64)
        for batch in eval_dataloader:
            value, count = self._as_loss(self.forward_micro_batch(iter([batch])))
            if eval_dataloader.real_rows == 0:  # a padding batch: forward for the collectives, not counted
                continue
            rows = count if count is not None else eval_dataloader.real_rows
            total = value.detach().double().cpu() * (1 if count is not None else rows)
            totals += torch.stack([total, torch.tensor(float(rows), dtype=torch.float64)])
        self.engine.all_reduce_data_parallel(totals)
        return {"loss": float(totals[0] / totals[1].clamp(min=1))}

    def sample_lengths(self, dataset: Any) -> list[int]:
        """Tokens per sample for `--data-iterator dynamic-shape` (length buckets)."""
        try:
            return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        except (KeyError, TypeError) as error:
            raise ValueError(
                "--data-iterator dynamic-shape groups samples by length: the training samples need "
                "an `input_ids` field, or override Finetuner.sample_lengths(dataset)"
            ) from error

    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    def forward_micro_batch(self, batches: Iterator[Any]) -> Any:
        return self.run_forward_step(next(batches), self.model)

    # ---- collecting across ranks ----
    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` of every data-parallel rank concatenated along dim 0 (evaluation padding dropped, so the
        gathered rows of an evaluation batch are the dataset's samples in order, each once)."""
        if self._eval_loader is not None:
            return self._eval_loader.gather(tensor)
        return composed.gather_across_ranks(tensor, self.engine.mesh.group("dp"))

    # ---- setup ----
    def setup(self) -> None:
        a, engine = self.args, self.engine
        self.train_ds, self.valid_ds, self.test_ds, collate_fn = self.train_valid_test_datasets_provider()
        if collate_fn is None and engine.plan.switches.dynamic_shape:
            from rapidtrain.data.dynamic_shape import FinetuneCollator

            collate_fn = FinetuneCollator(self.pad_token_id())
        self.collate_fn = collate_fn
        self.settings = composed.shard_settings(engine)
        self.lengths = self.sample_lengths(self.train_ds) if engine.plan.switches.dynamic_shape else None
        sampler = composed.train_batch_sampler(self.train_ds, self.settings, 0, True, self.lengths)
        self.samples_per_epoch = composed.samples_per_epoch(sampler)
        self.micro_steps_per_epoch = self.samples_per_epoch // (a.micro_batch_size * self.data_parallel_size)
        self.steps_per_epoch = math.ceil(self.micro_steps_per_epoch / engine.plan.batches.accumulation_steps)
        self.total_iterations = engine.total_iterations(self.steps_per_epoch)
        model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        self.export_recipe = export.recipe_of(model)
        self.model, *_ = engine.compose(
            model, optimizer=optimizer, lr_scheduler_fn=self._scheduler_fn(scheduler)
        )
        self.load()
        engine.print_rank0(engine.plan.describe())
        engine.print_rank0(
            f" fine-tuning: {len(self.train_ds)} training samples, {self.steps_per_epoch} steps of "
            f"{engine.plan.batches.global_batch_size} samples per epoch, {self.total_iterations} "
            "steps in all"
        )

    @property
    def data_parallel_size(self) -> int:
        return self.engine.plan.layout.data_parallel_size

    def _scheduler_fn(self, scheduler: Any) -> Any:
        if scheduler is not None:
            return lambda _optimizer: scheduler
        from rapidtrain.optim.lr_schedule import LRScheduler

        settings = lr_schedule_settings(
            self.args, self.engine.plan.batches.global_batch_size, self.total_iterations
        )
        return lambda optimizer: LRScheduler(optimizer, settings)

    # ---- the loop ----
    def train(self) -> dict[str, Any]:
        self.setup()
        a = self.args
        self.writer = TensorBoardWriter(a.tensorboard_dir if self.is_logging_rank else None)
        stop_signal, started = StopSignal(), time.time()
        self.meter, self.totals = ThroughputMeter(self.engine.device), IntervalTotals()
        self.meter.start()
        self.engine.runner.train()
        stopped, started_at = False, self.iteration
        if self.finished():
            self.engine.print_rank0(
                f" nothing to do: the checkpoint is at iteration {self.iteration}, the end"
            )
        try:
            while not self.finished() and not stopped:
                stopped = self.train_epoch(stop_signal, started)
        finally:
            stop_signal.restore()
        results = self.history[-1] if self.history else {}
        if a.save and not self._saved_now and self.iteration != started_at:
            self.save()
        self.writer.close()
        return results

    def finished(self) -> bool:
        if self.args.train_iters is not None:
            return self.iteration >= self.args.train_iters
        return self.epoch >= (self.args.epochs or 1)

    @property
    def epoch(self) -> int:
        """Epochs completed (the one under way is `epoch + 1` in the progress bar)."""
        return self.consumed_samples // self.samples_per_epoch

    def train_epoch(self, stop_signal: StopSignal, started: float) -> bool:
        """The rest of the current epoch; True when the run was asked to stop."""
        accumulation = self.engine.plan.batches.accumulation_steps
        chunk = self.args.micro_batch_size * self.data_parallel_size
        done = (self.consumed_samples % self.samples_per_epoch) // chunk
        loader = composed.train_loader(
            self.train_ds,
            self.collate_fn,
            self.settings,
            self.engine.device,
            self.consumed_samples,
            self.lengths,
        )
        if hasattr(self.train_ds, "set_epoch"):
            self.train_ds.set_epoch(self.epoch)
        bar = self.progress_bar(done)
        iterator, self._saved_now = iter(loader), False
        while done < self.micro_steps_per_epoch and not self.finished():
            fetch_started = time.perf_counter()
            group = [next(iterator) for _ in range(min(accumulation, self.micro_steps_per_epoch - done))]
            result = self.train_step(group)
            result.data_seconds = time.perf_counter() - fetch_started
            done += len(group)
            self.after_step(result, len(group) * chunk, bar)
            if self.should_stop(stop_signal, started):
                bar.close()
                self.engine.print_rank0(
                    f" exiting at iteration {self.iteration} (signal, --exit-interval or "
                    "--exit-duration-in-mins)"
                )
                return True
        bar.close()
        self.end_of_epoch()
        return False

    def progress_bar(self, done_micro_steps: int) -> Any:
        from tqdm.auto import tqdm

        accumulation = self.engine.plan.batches.accumulation_steps
        epochs = f"/{self.args.epochs}" if self.args.train_iters is None else ""
        return tqdm(
            total=self.steps_per_epoch,
            initial=math.ceil(done_micro_steps / accumulation),
            desc=f"epoch {self.epoch + 1}{epochs}",
            disable=not self.is_logging_rank,
            dynamic_ncols=True,
        )

    def after_step(self, result: IterationResult, samples: int, bar: Any) -> None:
        self.iteration += 1
        self.consumed_samples += samples
        self.meter.record(samples, result.tokens)
        self.totals.add(result)
        self.record_loss(result)
        bar.update(1)
        bar.set_postfix(loss=f"{result.loss:.4f}", lr=f"{self.current_lr():.2e}", refresh=False)
        if self.iteration % self.args.log_interval == 0:
            self.log(bar)
        if self.args.save and self.args.save_interval and self.iteration % self.args.save_interval == 0:
            self.save()
            self._saved_now = True
        else:
            self._saved_now = False

    @property
    def is_logging_rank(self) -> bool:
        return self.engine.mesh.data_parallel_rank == 0 and self.engine.mesh.is_last_stage

    def current_lr(self) -> float:
        return float(self.engine.runner.optimizer.param_groups[0]["lr"])

    def log(self, bar: Any) -> None:
        totals, self.totals = self.totals, IntervalTotals()
        interval = self.meter.interval()
        scaler = getattr(self.engine.runner, "scaler", None)
        line = format_log_line(
            iteration=self.iteration,
            train_iters=self.total_iterations,
            consumed_samples=self.consumed_samples,
            seconds_per_iteration=interval.seconds_per_iteration,
            learning_rate=self.current_lr(),
            global_batch_size=self.engine.plan.batches.global_batch_size,
            losses={"loss": totals.loss_sum / max(totals.loss_count, 1)},
            loss_scale=scaler.loss_scale if scaler is not None else 1.0,
            skipped_iterations=totals.skipped,
            nan_iterations=totals.nan,
            world_size=self.engine.plan.layout.world_size,
            extras={"epoch": self.epoch + 1},
        )
        if self.is_logging_rank:
            bar.write(line)
            self.writer.add_scalars(
                {
                    "train/loss": totals.loss_sum / max(totals.loss_count, 1),
                    "train/learning rate": self.current_lr(),
                },
                self.iteration,
            )

    def record_loss(self, result: IterationResult) -> None:
        """Every iteration's exact loss, in PreTrainer's --loss-log-file format (tests/launch.read_losses)."""
        if self.args.loss_log_file and self.is_logging_rank:
            with open(self.args.loss_log_file, "a") as log:
                log.write(f"{self.iteration} {float(result.loss).hex()} {int(result.skipped)}\n")

    # ---- evaluation, best model, saving ----
    def evaluate(self, dataset: Any) -> dict[str, Any]:
        """`run_compute_metrics` over every sample of `dataset` (each rank its share, autocast as in training)."""
        runner = self.engine.runner
        loader = composed.eval_loader(
            dataset,
            self.collate_fn,
            self.settings,
            self.engine.device,
            context=lambda _step: autocast(runner.precision, self.engine.device.type),
        )
        self._eval_loader = loader
        runner.train(False)
        try:
            with torch.no_grad():
                metrics = self.run_compute_metrics(ModelChunks([self.model]), loader)
        finally:
            runner.train(True)
            self._eval_loader = None
        return {name: _plain(value) for name, value in (metrics or {}).items()}

    def end_of_epoch(self) -> None:
        epoch = self.epoch if self.consumed_samples % self.samples_per_epoch == 0 else self.epoch + 1
        metrics = self.evaluate(self.valid_ds) if self.valid_ds is not None and len(self.valid_ds) else {}
        improved = self.record_metrics(epoch, metrics)
        shown = " | ".join(
            f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items()
        )
        self.engine.print_rank0(
            f" epoch {epoch} | iteration {self.iteration} | validation {shown or '(no data)'}"
            + (" | best so far" if improved else "")
        )
        if self.is_logging_rank:
            self.writer.add_scalars(
                {f"validation/{k}": v for k, v in metrics.items() if isinstance(v, float)}, self.iteration
            )
        if self.args.save:
            self.save_models(improved, metrics)
            self.save()
            self._saved_now = True

    def record_metrics(self, epoch: int, metrics: dict[str, Any]) -> bool:
        """Append to the history; True when `metric_for_best_model` improved (or there is no metric)."""
        self.history.append({"epoch": epoch, "iteration": self.iteration, **metrics})
        name = self.metric_for_best_model or next(
            (k for k, v in metrics.items() if isinstance(v, float)), None
        )
        if name is None or name not in metrics:
            return True
        greater = self.greater_is_better
        if greater is None:
            greater = not any(word in name.lower() for word in LOWER_IS_BETTER)
        value = metrics[name]
        better = self.best_metric is None or (
            value > self.best_metric if greater else value < self.best_metric
        )
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
        root = Path(self.args.save)
        for name in ("last", "best") if improved else ("last",):
            written = export.write_model(root / name, state, self.export_recipe, self.tokenizer, files)
            if written is not None:
                self.engine.print_rank0(
                    f" saved the {name} model (epoch {files['eval_results.json']['epoch']}) to {written}"
                )
        if torch.distributed.is_initialized():
            torch.distributed.barrier()

    def checkpoint_extra(self) -> dict[str, Any]:
        return {"best_metric": self.best_metric, "best_epoch": self.best_epoch, "history": self.history}

    def restore_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        self.best_metric = extra.get("best_metric")
        self.best_epoch = extra.get("best_epoch")
        self.history = list(extra.get("history", []))


def _plain(value: Any) -> Any:
    """Metric values as plain Python numbers for printing and JSON (tensors and numpy scalars included)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return float(value.item())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value


class TemplateRun(Finetuner):
    """`Trainer.train()`: the general template's hooks run by this loop (the validation loss is the metric)."""

    def __init__(self, template: Trainer) -> None:
        super().__init__(engine=template.engine)
        self.template = template
        for hook in ("train_valid_test_datasets_provider", "model_optimizer_lr_scheduler_provider"):
            if not callable(getattr(template, hook, None)):
                raise NotImplementedError(
                    f"{type(template).__name__}.train() needs the hook {hook}() (see "
                    "templates/finetuner_template.py for its shape)"
                )

    def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
        return self.template.train_valid_test_datasets_provider()

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, Any, Any]:
        return self.template.model_optimizer_lr_scheduler_provider()

    def forward_micro_batch(self, batches: Iterator[Any]) -> Any:
        return self.template.run_forward_step(batches, self.model)

    def setup(self) -> None:
        super().setup()
        self.template.model = self.model

    def train(self) -> dict[str, Any]:
        try:
            return super().train()
        finally:
            self.template.iteration, self.template.consumed_samples = self.iteration, self.consumed_samples
