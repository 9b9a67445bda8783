"""The training loop every template shares, written once: one iteration = one global batch = one optimizer
step; then the log line (to the console and the writers: TensorBoard, W&B, MLflow), the template's own work
(evaluation, epoch ends), the checkpointer (which also publishes a finished background save), the profiler's
step, the stop check.

`Trainer` is also Rapidformer's general template: `train_valid_test_datasets_provider()` → (train, valid,
test, collate_fn) of map-style datasets, `model_optimizer_lr_scheduler_provider()`, and
`run_forward_step(data_iterator, model)`; it trains for --epochs (or --train-iters) with the validation loss
after each epoch. `Finetuner` adds per-epoch metrics, the best model and export; `PreTrainer` replaces the
data with Megatron's sample stream and evaluates over --eval-iters.

Loss normalisation: a forward step may return a mean loss (each micro-batch then weighs the same,
Megatron's classic rule) or `(loss_sum, num_tokens)` through a loss function; then the loss is averaged
over the tokens of the whole global batch, so the result does not depend on how the batch is split.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist

from rapidtrain.config.describe import describe_plan
from rapidtrain.core.errors import UserError
from rapidtrain.core.metrics import ThroughputMeter
from rapidtrain.core.stopped_run import RUN
from rapidtrain.data.dynamic_shape import FinetuneCollator
from rapidtrain.data.loaders import (
    ShardedLoader,
    eval_loader,
    gather_across_ranks,
    move_to_device,
    samples_per_epoch,
    shutdown_workers,
    train_batch_sampler,
    train_loader,
)
from rapidtrain.models import moe, mtp
from rapidtrain.models.transformer import canonical_name
from rapidtrain.parallel.runner import as_loss, autocast
from rapidtrain.train.control import Checkpointer, StopConditions
from rapidtrain.train.engine import Engine
from rapidtrain.train.profiling import Profiler
from rapidtrain.train.reporting import IntervalTotals, IterationResult, LossRecords, build_log_line
from rapidtrain.train.step import TrainingStopped, TrainState, train_step
from rapidtrain.train.tracking import Writers

__all__ = ["Trainer", "TrainingStopped", "IterationResult", "default_token_count"]


def default_token_count(batch: Any) -> torch.Tensor | None:
    """Tokens that carry loss in a micro-batch, as a tensor on the host (never read into a Python number: the
    loop only divides by it): the sum of `loss_mask`, or non-ignored `labels`."""
    if isinstance(batch, dict):
        if "loss_mask" in batch:
            return torch.as_tensor(batch["loss_mask"]).sum()
        if "labels" in batch:
            return (torch.as_tensor(batch["labels"]) != -100).sum()
    return None


def _tokens_in(batch: Any) -> int:
    """Tokens a micro-batch feeds the model (for throughput), from its shape."""
    if isinstance(batch, dict):
        for key in ("tokens", "input_ids", "text"):
            if key in batch:
                return torch.as_tensor(batch[key]).numel()
    return 0


def moe_layer_row(name: str, num_layers: int) -> int | None:
    """The row of an MoE layer named by named_modules (wrapper prefixes and all): its layer number, or for
    multi-token prediction's depth k, num_layers + k."""
    canonical = canonical_name(name)
    layer = re.search(r"(?:^|\.)layers\.(\d+)\.", canonical + ".")
    if layer:
        return int(layer.group(1))
    depth = re.search(r"(?:^|\.)mtp\.depths\.(\d+)\.", canonical + ".")
    return num_layers + int(depth.group(1)) if depth else None


class Trainer:
    """The loop, and the general template's epoch-based data. Subclasses provide data and models."""
    loss_name = "loss"  # the training loss's name in the log line (PreTrainer: Megatron's "lm loss")

    def __init__(self, engine: Engine | None = None, **engine_kwargs: Any) -> None:
        self.engine = engine or Engine(**engine_kwargs)
        self.args = self.engine.args  # for Rapidformer user code; rapidtrain's own code reads the plan
        self.plan = self.engine.plan
        self.state = TrainState(last_global_batch=self.plan.batches.global_batch_size)
        self.model: Any = None
        self.tokenizer: Any = None  # a template's tokenizer, when it has one (padding, export)
        self.token_count: Callable[[Any], int | torch.Tensor | None] = default_token_count
        self.checkpointer = Checkpointer(self.plan.checkpoint, self)
        RUN.save = self.plan.checkpoint.save  # for the story told if the run stops (core/stopped_run.py)
        # SIGTERM from here on asks for a save at the end of an iteration, even if it comes during setup.
        self.stop = StopConditions(self.plan.training)
        self.history: list[dict[str, Any]] = []
        self.timers = self.engine.timers
        # The general template's epoch data (setup()): datasets, this rank's share, epoch arithmetic.
        self.train_ds: Any = None
        self.valid_ds: Any = None
        self.test_ds: Any = None
        self.settings: Any = None
        self.lengths: list[int] | None = None
        self.samples_per_epoch = 0
        self.micro_steps_per_epoch = 0
        self.steps_per_epoch: int | None = None
        self.bar: Any = None  # the epoch's progress bar
        self._epoch_ends = False  # the last global batch handed out closes an epoch
        self._eval_loader: ShardedLoader | None = None
        self._eval_loaders: dict[int, ShardedLoader] = {}  # evaluation_loader(): one per evaluation set
        # What one run() opens and closes (_run()): writers, throughput, log totals, loss records, profiler.
        self.writer = Writers()
        self.meter = ThroughputMeter(self.engine.device)
        self.totals = IntervalTotals()
        self.records = LossRecords(None)
        self.profiler: Profiler | None = None

    # The loop's position, kept in `state` (checkpoints save it); Rapidformer's templates expose these names.
    @property
    def iteration(self) -> int:
        return self.state.iteration

    @iteration.setter
    def iteration(self, value: int) -> None:
        self.state.iteration = value

    @property
    def consumed_samples(self) -> int:
        return self.state.consumed_samples

    @consumed_samples.setter
    def consumed_samples(self, value: int) -> None:
        self.state.consumed_samples = value

    @property
    def last_global_batch(self) -> int:
        return self.state.last_global_batch

    # ---- hooks a subclass provides ----
    def train_valid_test_datasets_provider(self) -> tuple[Any, Any, Any, Any]:
        raise NotImplementedError(
            f"{type(self).__name__} implements train_valid_test_datasets_provider() → (train, valid, test, "
            "collate_fn) (see templates/finetuner_template.py for its shape)")

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, Any, Any]:
        raise NotImplementedError(
            f"{type(self).__name__} implements model_optimizer_lr_scheduler_provider() → (model, optimizer or "
            "None, scheduler or None)")

    def run_forward_step(self, data_iterator: Iterator[Any], model: Any) -> Any:
        """Default for Hugging Face style models: `model(**batch).loss`."""
        batch = next(data_iterator)
        output = model(**batch)
        return output.loss if hasattr(output, "loss") else output["loss"]

    def run_compute_metrics(self, model: Any, eval_dataloader: Any) -> dict[str, Any]:
        """Default: the validation loss (per token when the forward step returns loss sums)."""
        totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        for batch in eval_dataloader:
            value, count, _ = as_loss(self.forward_step(iter([batch]), self.model))
            if eval_dataloader.real_rows == 0:  # a padding batch: forward for the collectives, not counted
                continue
            rows = count if count is not None else eval_dataloader.real_rows
            total = value.detach().double() * (1 if count is not None else rows)
            totals += torch.stack([total.to(totals.device).reshape(()),
                                   torch.as_tensor(rows, dtype=torch.float64, device=totals.device).reshape(())])
        self.engine.all_reduce_data_parallel(totals)
        return {"loss": float(totals[0] / totals[1].clamp(min=1))}

    def forward_step(self, batches: Iterator[Any], model: Any) -> Any:
        """One micro-batch's forward (`model`: the wrapped model, or the pipeline's recorder of its inputs);
        the general template hands its hook the iterator, batches on the device."""
        device = self.engine.device
        return self.run_forward_step((move_to_device(b, device) for b in batches), model)

    def checkpoint_extra(self) -> dict[str, Any]:
        """What a template keeps in a checkpoint beyond model, optimizer and position (JSON values)."""
        return {"history": self.history}

    def restore_checkpoint_extra(self, extra: dict[str, Any]) -> None:
        """Take back what `checkpoint_extra` saved."""
        self.history = list(extra.get("history", []))

    def sample_lengths(self, dataset: Any) -> list[int]:
        """Tokens per sample for `--data-iterator dynamic-shape` (length buckets)."""
        try:
            return [len(dataset[i]["input_ids"]) for i in range(len(dataset))]
        except (KeyError, TypeError) as error:
            raise ValueError(
                "--data-iterator dynamic-shape groups samples by length: the training samples need "
                f"an `input_ids` field, or override {type(self).__name__}.sample_lengths(dataset)"
            ) from error

    def pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad) if pad is not None else 0

    # ---- the loop ----
    def train(self) -> dict[str, Any]:
        try:
            self.setup()
        except BaseException:
            # A refusal or failure while setting up (a user's script may catch it and train again in the same
            # process): --save's lock is this run's, and the kernel drops an flock only when the process ends.
            self.checkpointer.close()
            raise
        return self.run()

    def run(self) -> dict[str, Any]:
        """Iterate until the end of training or a stop; save at the end; the template's final results."""
        try:
            if self.finished():
                self.engine.print_rank0(f" nothing to do: the checkpoint is at iteration {self.iteration}, the end")
                return {}
            return self._run()
        finally:
            self.stop.close()  # only now: a SIGTERM during the final save must not cut it

    def _run(self) -> dict[str, Any]:
        plan, started_at, stop = self.plan, self.iteration, self.stop
        self.writer = self.open_writers()
        self.meter, self.totals = ThroughputMeter(self.engine.device), IntervalTotals()
        self.records = LossRecords(plan.logging.loss_log_file if self.is_logging_rank else None)
        self.profiler = Profiler(plan.profile, self.engine.rank, self.engine.device, self.iteration)
        if self.profiler.note:
            print(self.profiler.note, flush=True)
        stopped = completed = False
        try:
            self.meter.start()
            self.engine.runner.train()
            self.profiler.step(self.iteration)
            for micro_batches, data_seconds in self.train_batches():
                result = self.train_step(micro_batches, stop_requested=stop.requested())
                result.data_seconds = data_seconds
                self.after_step(result)
                self.after_iteration()
                self.checkpointer.maybe_save(self.iteration)
                self.profiler.step(self.iteration)
                if result.stop or stop.interval_reached(self.iteration):
                    self.engine.print_rank0(f" exiting at iteration {self.iteration} (signal, --exit-interval or "
                                            "--exit-duration-in-mins)")
                    stopped = True
                    break
            self.profiler.close()
            self.records.flush()
            if self.iteration != started_at:
                self.checkpointer.save(self.iteration)
            self.checkpointer.finish()
            results = self.end_of_training(stopped)
            completed = True
        finally:
            self.records.flush()
            self.profiler.close()
            self.checkpointer.close()
            self.writer.close(failed=not completed)
            self.close_data()
        return results

    def close_data(self) -> None:
        """Stop what the template keeps open for the whole run: its evaluation loaders' persistent workers."""
        for loader in self._eval_loaders.values():
            shutdown_workers(loader.loader)
        self._eval_loaders.clear()

    def open_writers(self) -> Writers:
        """The logging rank's writers (TensorBoard, W&B, MLflow), handed the plan as the run's config. Every rank
        learns whether they opened, so a tracker that cannot start stops the whole run with its reason instead of
        leaving the other ranks waiting."""
        problem, writers = "", Writers()
        if self.is_logging_rank:
            try:
                writers = Writers.open(self.plan.logging, json.loads(self.plan.to_json()))
            except UserError as error:
                problem = str(error)
        if dist.is_initialized() and dist.get_world_size() > 1:
            problems = [""] * dist.get_world_size()
            dist.all_gather_object(problems, problem)
            problem = next((p for p in problems if p), "")
        if problem:
            raise UserError(problem)
        return writers

    def after_step(self, result: IterationResult) -> None:
        """Count the iteration; the log line every --log-interval iterations."""
        self.state.advance(result.samples)
        RUN.iteration = self.iteration
        self.meter.record(result.samples, result.tokens)
        self.totals.add(result)
        self.records.add(self.iteration, result)
        if self.iteration % self.plan.logging.log_interval == 0:
            self.log()

    def log(self) -> None:
        totals, self.totals = self.totals, IntervalTotals()
        interval = self.meter.interval()
        logging = self.plan.logging
        load, per_layer = self.expert_load()
        line, scalars = build_log_line(
            self.plan, totals, interval, iteration=self.iteration,
            train_iters=self.engine.total_iterations(self.steps_per_epoch),
            consumed_samples=self.consumed_samples, learning_rate=self.current_lr(),
            loss_scale=self.engine.runner.loss_scale, loss_name=self.loss_name,
            flops_per_iteration=self.flops_per_iteration(interval), device=self.engine.device,
            extras={**self.log_extras(), **load}, global_batch_size=self.last_global_batch,
            reported=self.reduce_reported(totals.reported),
            params_norm=float(self.engine.runner.params_norm()) if logging.params_norm else None)
        self.records.flush()
        if self.is_logging_rank:
            self.print_log(line)
            self.writer.add_scalars({**scalars, **per_layer}, self.iteration)
            if logging.timers_to_tensorboard:
                self.timers.write(self.writer, self.iteration, interval.iterations)

    expert_load_total: torch.Tensor | None = None  # [layers + MTP depths, experts]: every log line's loads summed

    def expert_load(self) -> tuple[dict[str, str], dict[str, float]]:
        """Routing load since the last log line, per MoE layer (of every pipeline stage, and multi-token prediction's
        depths after the layers): the busiest expert's assignments over the mean, summed over data-parallel ranks.
        The log line names the worst layer; TensorBoard gets every layer (moe/load_max_over_mean/layer_N). Every
        rank joins the two all-reduces; one host read per log line. `expert_load_total` keeps the sum over the run."""
        model = self.plan.model
        if model is None or not any(model.num_experts):
            return {}, {}
        runner = self.engine.runner
        loads: dict[str, torch.Tensor] = {}
        for part in [runner.module, *getattr(runner, "views", [])]:
            loads.update(moe.collect_expert_load(part))
        rows = model.num_layers + model.mtp_num_layers
        table = torch.zeros(rows, max(model.num_experts), dtype=torch.float64, device=self.engine.device)
        for name, counts in loads.items():
            row = moe_layer_row(name, model.num_layers)
            if row is not None:
                table[row, :counts.numel()] = counts.to(table.device, torch.float64)
        self.engine.all_reduce_data_parallel(table)
        self.engine.all_reduce_pipeline(table)
        self.expert_load_total = table if self.expert_load_total is None else self.expert_load_total + table
        ratios: dict[int, float] = {}
        for row, counts in enumerate(table.tolist()):
            experts = model.experts_in_layer(row) if row < model.num_layers else \
                model.experts_in_layer(model.num_layers - 1)
            if experts and sum(counts[:experts]) > 0:
                ratios[row] = max(counts[:experts]) * experts / sum(counts[:experts])
        if not ratios:
            return {}, {}
        worst = max(ratios, key=ratios.__getitem__)
        where = f"layer {worst}" if worst < model.num_layers else f"MTP depth {worst - model.num_layers + 1}"
        return ({"expert load max/mean": f"{ratios[worst]:.3f} ({where})"},
                {f"moe/load_max_over_mean/layer_{row}": value for row, value in ratios.items()})

    def reduce_reported(self, pairs: dict[str, torch.Tensor]) -> dict[str, float]:
        """The interval's means of a Megatron loss function's values over every data-parallel rank (one
        all-reduce at a log line: each value is a [sum, weight] pair)."""
        if not pairs:
            return {}
        names = sorted(pairs)
        stacked = torch.stack([pairs[name].to(self.engine.device) for name in names])
        self.engine.all_reduce_data_parallel(stacked)
        return {name: total / max(weight, 1e-12)
                for name, (total, weight) in zip(names, stacked.tolist(), strict=True)}

    def flops_per_iteration(self, interval: Any = None) -> float | None:
        """Model FLOPs of one iteration (`interval`: the log interval's counts, for templates whose iterations
        vary), for TFLOP/s and MFU in the log line; None when unknown."""
        return None

    @property
    def is_logging_rank(self) -> bool:
        """Megatron prints from the last pipeline stage; among its ranks, the first data- and tensor-parallel."""
        return self.engine.is_logging_rank

    def current_lr(self) -> float:
        return float(self.engine.runner.optimizer.param_groups[0]["lr"])

    # ---- one iteration ----
    def train_step(self, micro_batches: list[Any], stop_requested: bool = False) -> IterationResult:
        """One global batch through train.step (the step's one owner), with the MoE balancing loss's scale set
        before and its value read after."""
        self._set_moe_aux_scale(len(micro_batches))
        result = train_step(self.engine.step_context(), micro_batches, self.forward_step, self.token_count,
                            _tokens_in, stop_requested=stop_requested, where=f"iteration {self.iteration + 1}")
        outcome = result.decision.outcome
        return IterationResult(result.loss, outcome.grad_norm, outcome.skipped, result.decision.nan,
                               result.samples, result.tokens, extras=self._moe_extras(), stop=result.decision.stop,
                               reported=result.reported)

    def _set_moe_aux_scale(self, steps: int) -> None:
        moe.set_aux_loss_scale(self.engine.runner.module, self.engine.runner.backward_scale / steps)

    def _moe_extras(self) -> dict[str, torch.Tensor]:
        """The MoE balancing loss (the mean over all MoE layers of every pipeline stage and data-parallel ranks) and
        multi-token prediction's loss (the mean over its depths, unscaled, over the iteration's micro-batches), in one
        [4] tensor and one all-reduce per group: every stage joins, also one with neither."""
        model = self.plan.model
        with_mtp = model is not None and model.mtp_num_layers > 0
        total, layers = moe.collect_aux_loss_sum(self.engine.runner.module)
        # Under pipelining every stage joins the sum, also one whose layers are all dense.
        staged = self.engine.mesh.group("pp") is not None and model is not None and any(model.num_experts)
        balancing = total is not None or staged
        if not (balancing or with_mtp):
            return {}
        totals = torch.zeros(4, dtype=torch.float64, device=self.engine.device)
        if total is not None:
            totals[0], totals[1] = total.detach(), layers
        recorded = mtp.collect_mtp_loss(self.engine.runner.module) if with_mtp else None
        if recorded is not None:
            totals[2:] = recorded.to(totals.device)
        self.engine.all_reduce_pipeline(totals)
        self.engine.all_reduce_data_parallel(totals)
        extras = {"load balancing loss": (totals[0] / totals[1]).float()} if balancing else {}
        if with_mtp:
            extras["mtp loss"] = (totals[2] / totals[3].clamp(min=1)).float()
        return extras

    # ---- the general template's data: epochs over a map-style dataset ----
    def setup(self) -> None:
        engine, plan = self.engine, self.plan
        if plan.layout.context_parallel_size > 1:  # PreTrainer splits its micro-batches; this template does not
            raise UserError(f"--context-parallel-size {plan.layout.context_parallel_size}: the epoch-based template "
                            f"({type(self).__name__}) hands the model whole sequences; context parallelism is served "
                            "by the iteration-based PreTrainer (the built-in pretraining), which splits each "
                            "micro-batch over the context-parallel ranks. Drop the flag or subclass PreTrainer.")
        self.checkpointer.open()  # --save usable and ours, before minutes go into data and model
        if plan.batches.schedule is not None:
            raise UserError(f"{plan.batches.schedule.describe(plan.batches.global_batch_size)}: a changing global "
                            f"batch applies to iteration-based pretraining (PreTrainer); {type(self).__name__} "
                            "groups each epoch's micro-batches into fixed global batches. Drop --rampup-batch-size "
                            "/ --step-batch-size-schedule.")
        self.train_ds, self.valid_ds, self.test_ds, collate_fn = self.train_valid_test_datasets_provider()
        if collate_fn is None and plan.switches.dynamic_shape:

            collate_fn = FinetuneCollator(self.pad_token_id())
        self.collate_fn = collate_fn
        self.settings = engine.shard_settings()
        self.lengths = self.sample_lengths(self.train_ds) if plan.switches.dynamic_shape else None
        sampler = train_batch_sampler(self.train_ds, self.settings, 0, True, self.lengths)
        self.samples_per_epoch = samples_per_epoch(sampler)
        self.micro_steps_per_epoch = self.samples_per_epoch // (
            plan.data.micro_batch_size * plan.layout.data_parallel_size)
        self.steps_per_epoch = math.ceil(self.micro_steps_per_epoch / plan.batches.accumulation_steps)
        model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        self.prepare_model(model)
        if scheduler is not None:
            scheduler_fn = lambda _optimizer: scheduler  # noqa: E731
        else:  # Megatron's schedule over the whole run, whose length is known now
            scheduler_fn = lambda optimizer: engine.build_scheduler(optimizer, None, self.steps_per_epoch)  # noqa: E731
        self.model, *_ = engine.compose(model, optimizer=optimizer, lr_scheduler_fn=scheduler_fn)
        self.load()
        self.plan = plan = engine.plan  # compose describes the model it was given
        engine.print_rank0(describe_plan(plan))
        engine.print_rank0(
            f" training: {len(self.train_ds)} samples, {self.steps_per_epoch} steps of "
            f"{plan.batches.global_batch_size} samples per epoch, {engine.total_iterations(self.steps_per_epoch)} "
            "steps in all")

    def prepare_model(self, model: Any) -> None:
        """Look at the model before it is wrapped (Finetuner: how to export it)."""
    def load(self) -> None:
        self.checkpointer.open()
        loaded = self.checkpointer.load()
        if loaded is not None:
            self.iteration, self.consumed_samples = loaded.iteration, loaded.consumed_samples
            self.restore_checkpoint_extra(loaded.extra)
            self.rederive_train_iters()

    def rederive_train_iters(self) -> None:
        """A sample-based run (--train-samples) resumed with another --global-batch-size ends when its samples are
        used, not after the iterations the new batch would have taken from the start: the iterations left are
        re-derived from the samples left (Megatron's update_train_iters counts from zero, which would stop early
        or late). The plan's count changes with it, so the log line and `finished` agree."""
        training, batches = self.engine.plan.training, self.engine.plan.batches
        if training.train_samples is None or batches.schedule is not None:
            return
        left = max(training.train_samples - self.consumed_samples, 0) // batches.global_batch_size
        if self.iteration + left == training.train_iters:
            return
        self.engine.print_rank0(f" note: --train-samples {training.train_samples} with a global batch of "
                                f"{batches.global_batch_size} from consumed sample {self.consumed_samples}: the run "
                                f"ends at iteration {self.iteration + left} (not {training.train_iters})")
        self.engine.plan = dataclasses.replace(
            self.engine.plan, training=dataclasses.replace(training, train_iters=self.iteration + left))
        self.plan = self.engine.plan

    def finished(self) -> bool:
        training = self.plan.training
        if training.train_iters is not None:
            return self.iteration >= training.train_iters
        return self.epoch >= (training.epochs or 1)

    @property
    def epoch(self) -> int:
        """Epochs completed (the one under way is `epoch + 1` in the progress bar)."""
        return self.consumed_samples // self.samples_per_epoch

    def train_batches(self) -> Iterator[tuple[list[Any], float]]:
        """(micro-batches of one global batch, seconds spent fetching them) until the end, epoch by epoch;
        an epoch's last group may be shorter and still averages exactly over its own samples."""
        plan = self.plan
        chunk = plan.data.micro_batch_size * plan.layout.data_parallel_size
        while not self.finished():
            done = (self.consumed_samples % self.samples_per_epoch) // chunk
            loader = train_loader(self.train_ds, self.collate_fn, self.settings, None, self.consumed_samples,
                                  self.lengths)
            if hasattr(self.train_ds, "set_epoch"):
                self.train_ds.set_epoch(self.epoch)
            self.bar = self.progress_bar(done)
            iterator = iter(loader)
            while done < self.micro_steps_per_epoch and not self.finished():
                fetch_started = time.perf_counter()
                size = min(plan.batches.accumulation_steps, self.micro_steps_per_epoch - done)
                group = [next(iterator) for _ in range(size)]
                done += size
                self._epoch_ends = done >= self.micro_steps_per_epoch
                yield group, time.perf_counter() - fetch_started
            self.bar.close()

    def progress_bar(self, done_micro_steps: int) -> Any:
        from tqdm.auto import tqdm

        training = self.plan.training
        epochs = f"/{training.epochs or 1}" if training.train_iters is None else ""
        return tqdm(total=self.steps_per_epoch,
                    initial=math.ceil(done_micro_steps / self.plan.batches.accumulation_steps),
                    desc=f"epoch {self.epoch + 1}{epochs}", disable=not self.is_logging_rank, dynamic_ncols=True)

    def print_log(self, line: str) -> None:
        """The log line, written above the epoch's progress bar."""
        (self.bar.write if self.bar is not None else print)(line)

    def after_iteration(self) -> None:
        """The general template's own work after an iteration: progress, step-based evaluation when
        --eval-interval is given, and the epoch's end (validation, a checkpoint)."""
        self.bar.update(1)
        self.bar.set_postfix(lr=f"{self.current_lr():.2e}", refresh=False)
        interval = self.plan.training.eval_interval
        if interval and self.iteration % interval == 0 and not self._epoch_ends:
            self.evaluate_and_report(f"iteration {self.iteration}")
        if self._epoch_ends:
            self._epoch_ends = False
            self.end_of_epoch()

    def end_of_epoch(self) -> None:
        self.evaluate_and_report(f"epoch {self.epoch}")
        self.checkpointer.request()

    def log_extras(self) -> dict[str, Any]:
        """Fields after Megatron's: the epoch the last iteration belongs to."""
        at_boundary = self.consumed_samples % self.samples_per_epoch == 0
        return {"epoch": max(self.epoch if at_boundary else self.epoch + 1, 1)}

    def evaluate_and_report(self, when: str) -> dict[str, Any]:
        """The metrics on the validation set, printed and recorded in the history."""
        metrics = self.evaluate(self.valid_ds) if self.valid_ds is not None and len(self.valid_ds) else {}
        self.history.append({"epoch": self.epoch, "iteration": self.iteration, **metrics})
        shown = " | ".join(f"{k}: {v:.6g}" if isinstance(v, float) else f"{k}: {v}" for k, v in metrics.items())
        self.engine.print_rank0(f" {when} | iteration {self.iteration} | validation {shown or '(no data)'}")
        if self.is_logging_rank:
            self.writer.add_scalars({f"validation/{k}": v for k, v in metrics.items() if isinstance(v, float)},
                                    self.iteration)
        return metrics

    def evaluate(self, dataset: Any) -> dict[str, Any]:
        """`run_compute_metrics` over every sample of `dataset` (each rank its share, autocast as in training)."""
        runner = self.engine.runner
        loader = self._eval_loader = self.persistent_eval_loader(dataset)
        runner.train(False)
        try:
            with torch.no_grad():
                metrics = self.run_compute_metrics(self.metrics_model(), loader)
        finally:
            runner.train(True)
            self._eval_loader = None
        return {name: _plain(value) for name, value in (metrics or {}).items()}

    def persistent_eval_loader(self, dataset: Any) -> ShardedLoader:
        """One loader per evaluation set for the whole run: its workers persist, so an evaluation forks none while
        other threads run (a fork meeting a thread that starts or ends can deadlock the child in CPython 3.11's
        after-fork handling, as it hung the PreTrainer's 2-rank runs; the training loader forks once per epoch)."""
        loader = self._eval_loaders.get(id(dataset))
        if loader is None:
            runner = self.engine.runner
            loader = self._eval_loaders[id(dataset)] = eval_loader(
                dataset, self.collate_fn, self.settings, self.engine.device, persistent=True,
                context=lambda _step: autocast(runner.precision, self.engine.device.type))
        return loader

    def metrics_model(self) -> Any:
        return self.model

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` of every data-parallel rank concatenated along dim 0 (evaluation padding dropped, so the
        gathered rows of an evaluation batch are the dataset's samples in order, each once)."""
        if self._eval_loader is not None:
            return self._eval_loader.gather(tensor)
        return gather_across_ranks(tensor, self.engine.mesh.group("dp"))

    def end_of_training(self, stopped: bool) -> dict[str, Any]:
        """The results `train()` returns: the last evaluation's metrics."""
        return self.history[-1] if self.history else {}


def _plain(value: Any) -> Any:
    """Metric values as plain Python numbers for printing and JSON (tensors and numpy scalars included)."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return float(value.item())
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return value
