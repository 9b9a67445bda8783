"""PreTrainer: Rapidformer's iteration-based template over Megatron-style sample streams.

Subclass it and provide `train_valid_test_datasets_provider(train_val_test_num_samples)`,
`model_optimizer_lr_scheduler_provider()` (None for the optimizer or schedule: built from the flags) and
`run_forward_step(data_iterator, model)` (a loss, or `(output, loss_fn)`). `train()` runs the shared loop
with Megatron's log line, evaluation over --eval-iters, checkpoints and exact resume from consumed samples.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader

from rapidtrain.config.describe import describe_plan
from rapidtrain.core.errors import UserError
from rapidtrain.core.shutdown import ignore_sigterm_in_worker
from rapidtrain.data.gpt_dataset import train_valid_test_num_samples
from rapidtrain.data.loaders import shutdown_workers
from rapidtrain.data.samplers import MegatronPretrainingSampler
from rapidtrain.data.worker_start import WorkerLoader, worker_context
from rapidtrain.parallel.context_parallel import split_batch
from rapidtrain.parallel.runner import add_pairs
from rapidtrain.train.trainer import Trainer


class PreTrainer(Trainer):
    """Iteration-based training (`--train-iters`) on datasets indexed by global sample number."""

    loss_name = "lm loss"

    def __init__(self, engine: Any = None, **engine_kwargs: Any) -> None:
        super().__init__(engine, **engine_kwargs)
        self._evaluation_loaders: dict[int, DataLoader] = {}  # evaluation_loader(): one per evaluation set
        self.last_validation: tuple[int, dict[str, float]] = (-1, {})  # (iteration, results) of the latest

    # ---- hooks a subclass provides ----
    def train_valid_test_datasets_provider(  # type: ignore[override]
        self, train_val_test_num_samples: list[int]
    ) -> tuple[Any, Any, Any]:
        raise NotImplementedError("PreTrainer subclasses implement train_valid_test_datasets_provider()")

    def model_factory(self) -> Any:
        """A callable that builds the same model again (None: none), so that ZeRO-3 can create it partitioned
        under deepspeed.zero.Init; the weights are then copied from the provider's model."""
        return None

    def collate_fn(self) -> Any:
        return None

    def supports_dynamic_shape(self) -> bool:
        """Whether this template batches its samples by length for --data-iterator dynamic-shape (it then
        provides `train_batch_sampler` and `collate_fn`); the built-in pretraining does."""
        return False

    def train_batch_sampler(self, dataset: Any, consumed_samples: int) -> Any:
        """This rank's micro-batches of the training stream from `consumed_samples` on (Megatron's sampler)."""
        data = self.plan.data
        return MegatronPretrainingSampler(len(dataset), consumed_samples, data.micro_batch_size,
                                          self.engine.mesh.data_parallel_rank, self.plan.layout.data_parallel_size)

    def forward_step(self, batches: Iterator[Any], model: Any) -> Any:
        """Megatron's contract: the hook gets the iterator of host batches and moves what it uses."""
        return self.run_forward_step(batches, model)

    # ---- setup ----
    def setup(self) -> None:
        plan, training = self.plan, self.plan.training
        self.checkpointer.open()  # --save usable and ours, before minutes go into data and model
        if plan.switches.dynamic_shape and not self.supports_dynamic_shape():
            raise UserError(f"--data-iterator dynamic-shape: {type(self).__name__} does not say how to batch its "
                            "samples by length (the built-in pretraining, rapidtrain/pretrain.py, does). Override "
                            "supports_dynamic_shape(), train_batch_sampler() and collate_fn(), or drop the flag.")
        iterations = training.train_iters
        if iterations is None:  # the rules allow --epochs only for data whose length is known once it is read
            iterations = self.iterations_of_epochs()
            training = self.plan.training
        counts = list(train_valid_test_num_samples(iterations, training.eval_interval or iterations,
                                                   training.eval_iters, plan.batches.global_batch_size))
        # Sample-based training or a ramp-up: the samples the iterations really take (Megatron's update_train_iters
        # may end a ramp-up iteration a little past --train-samples).
        counts[0] = max(training.train_samples or 0, plan.batches.samples_for_iterations(training.train_iters or 0))
        self.train_ds, self.valid_ds, self.test_ds = self.train_valid_test_datasets_provider(counts)
        model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        scheduler_fn = (lambda _optimizer: scheduler) if scheduler is not None else None
        self.model, *_ = self.engine.compose(model, optimizer=optimizer, lr_scheduler_fn=scheduler_fn,
                                             model_factory=self.model_factory())
        self.load()
        self.plan = self.engine.plan  # compose describes the model it was given
        self.engine.print_rank0(describe_plan(self.plan))

    def samples_per_epoch_of_data(self) -> int:
        """The training samples one epoch holds (read from the data); a template with epoch-based data says."""
        raise UserError(f"--epochs: {type(self).__name__} trains over a sample stream, counted in iterations; give "
                        "--train-iters N (or --train-samples N)")

    def iterations_of_epochs(self) -> int:
        """--epochs over data read now: whole global batches per epoch (an epoch's last, incomplete one is dropped,
        as Pai's fine-tuning loader drops it), the run's length written into the plan, which says so."""
        plan = self.plan
        samples, batch = self.samples_per_epoch_of_data(), plan.batches.global_batch_size
        if samples < batch:
            raise UserError(f"--epochs {plan.training.epochs}: an epoch holds {samples} samples, fewer than one "
                            f"global batch of {batch}; lower --global-batch-size or add data")
        self.steps_per_epoch = samples // batch
        iterations = self.steps_per_epoch * (plan.training.epochs or 1)
        self.plan = self.engine.plan = dataclasses.replace(
            plan, training=dataclasses.replace(plan.training, train_iters=iterations))
        self.engine.print_rank0(f" --epochs {plan.training.epochs}: {samples:,} samples an epoch, "
                                f"{self.steps_per_epoch} iterations of {batch} each "
                                f"({samples - self.steps_per_epoch * batch} left out), {iterations} iterations in all")
        return iterations

    def data_loader(self, dataset: Any, consumed_samples: int, train: bool = False) -> DataLoader:
        data = self.plan.data
        if train:
            sampler = self.train_batch_sampler(dataset, consumed_samples)
        else:  # evaluation: the same first batches each time, in order
            sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, data.micro_batch_size,
                                                 self.engine.mesh.data_parallel_rank,
                                                 self.plan.layout.data_parallel_size)
        # Its own generator: each iter() of a DataLoader draws a worker seed, which must not move the global
        # RNG (dropout), or a run resumed would draw different masks than the run it continues. Workers leave
        # SIGTERM to this process, which saves before it stops them. They are not forked from this process once
        # its process group's threads run (data/worker_start.py).
        collate_fn = self.collate_fn()
        return WorkerLoader(dataset, batch_sampler=sampler, num_workers=data.num_workers, collate_fn=collate_fn,
                            pin_memory=data.pin_memory, persistent_workers=data.num_workers > 0,
                            generator=torch.Generator().manual_seed(data.seed), worker_init_fn=ignore_sigterm_in_worker,
                            multiprocessing_context=worker_context(dataset, collate_fn, data.num_workers))

    def micro_batches(self, iterator: Iterator[Any]) -> list[Any]:
        """The next global batch's micro-batches: its accumulation steps follow a batch-size ramp-up."""
        steps = self.plan.batches.accumulation_steps_at(self.consumed_samples)
        layout = self.plan.layout
        if layout.context_parallel_size == 1:
            return [next(iterator) for _ in range(steps)]
        # Context parallelism: this rank's part of each sequence (the data ranks' samples, split along the sequence).
        rank = self.engine.mesh.context_parallel_rank
        return [split_batch(next(iterator), layout.context_parallel_size, rank, layout.cp_comm_type)
                for _ in range(steps)]

    # ---- the loop's template parts ----
    def finished(self) -> bool:
        return self.iteration >= (self.plan.training.train_iters or 0)

    def train_batches(self) -> Iterator[tuple[list[Any], float]]:
        iterator = iter(self.data_loader(self.train_ds, self.consumed_samples, train=True))
        while not self.finished():
            fetch_started = time.perf_counter()
            group = self.micro_batches(iterator)
            yield group, time.perf_counter() - fetch_started

    def after_iteration(self) -> None:
        interval = self.plan.training.eval_interval
        if interval and self.iteration % interval == 0 and self.valid_ds is not None:
            self.last_validation = (self.iteration, self.evaluate_each("validation", self.valid_ds))

    def end_of_training(self, stopped: bool) -> dict[str, Any]:
        if not stopped and self.finished() and self.test_ds is not None and self.plan.training.eval_iters:
            return self.evaluate_each("test", self.test_ds)
        return {}

    def evaluate_each(self, name: str, datasets: Any) -> dict[str, float]:
        """One evaluation set, or several by name (a dict, as BigScience's validation groups): each evaluated and
        printed on its own, `name GROUP`."""
        if not isinstance(datasets, dict):
            return self.evaluate_and_print(name, datasets)
        results: dict[str, float] = {}
        for group, dataset in datasets.items():
            results.update(self.evaluate_and_print(f"{name} {group}", dataset))
        return results

    def print_log(self, line: str) -> None:
        print(line, flush=True)

    def log_extras(self) -> dict[str, Any]:
        return {}

    def checkpoint_extra(self) -> dict[str, Any]:
        return {}

    # ---- evaluation ----
    def close_data(self) -> None:
        """The evaluation loaders' persistent workers stop now, while this process runs: they ignore SIGTERM (a
        save request is this process's), so multiprocessing's exit handler, which terminates them with SIGTERM
        and then joins them, would wait on them forever."""
        for loader in self._evaluation_loaders.values():
            shutdown_workers(loader)
        self._evaluation_loaders.clear()
        super().close_data()

    def evaluation_loader(self, dataset: Any) -> DataLoader:
        """One loader per evaluation set for the whole run: its workers persist, so no evaluation forks new ones
        while the training loader's threads run (a fork that meets a thread starting or ending deadlocks the child
        in CPython 3.11's after-fork handling, which hung 2-rank runs at their second evaluation)."""
        loader = self._evaluation_loaders.get(id(dataset))
        if loader is None:
            loader = self._evaluation_loaders[id(dataset)] = self.data_loader(dataset, 0)
        return loader

    @torch.no_grad()
    def evaluate(self, dataset: Any) -> dict[str, float]:
        """Mean losses over --eval-iters global batches from the start of `dataset` (the same batches each time):
        {"lm loss": ...}, or the means of what a Megatron loss function reported."""
        runner = self.engine.runner
        runner.train(False)
        totals = torch.zeros(2, dtype=torch.float64, device=self.engine.device)
        reported: dict[str, torch.Tensor] = {}
        iterator = iter(self.evaluation_loader(dataset))
        try:
            batches = min(self.plan.training.eval_iters, len(dataset) // self.plan.batches.global_batch_size)
            for _ in range(batches):
                loss_sum, weight, values = runner.evaluate(self.micro_batches(iterator), self.forward_step)
                totals += torch.stack([loss_sum.to(totals.device), weight.to(totals.device)])
                add_pairs(reported, values)
        finally:
            runner.train(True)
        self.engine.all_reduce_data_parallel(totals)
        return self.reduce_reported(reported) or {self.loss_name: float(totals[0] / totals[1].clamp(min=1))}

    def evaluate_and_print(self, name: str, dataset: Any) -> dict[str, float]:
        """Megatron's evaluation block: each loss's value and perplexity."""
        losses = self.evaluate(dataset)
        text = f" {name} loss at iteration {self.iteration} | "
        scalars, results = {}, {}
        for key, loss in losses.items():
            ppl = math.exp(min(20.0, loss))
            text += f"{key} value: {loss:.6E} | {key} PPL: {ppl:.6E} | "
            scalars[f"{name}/{key}"] = loss
            if self.plan.logging.validation_ppl_to_tensorboard:
                scalars[f"{name}/{key} PPL"] = ppl
            suffix = "" if key == self.loss_name else f" {key}"
            results.update({f"{name} loss{suffix}": loss, f"{name} ppl{suffix}": ppl})
        if self.is_logging_rank:
            print("-" * (len(text) + 1) + "\n" + text + "\n" + "-" * (len(text) + 1), flush=True)
            self.writer.add_scalars(scalars, self.iteration)
        return results
