"""PreTrainer: Rapidformer's iteration-based template over Megatron-style sample streams.

Subclass it and provide `train_valid_test_datasets_provider(train_val_test_num_samples)`,
`model_optimizer_lr_scheduler_provider()` (None for the optimizer or schedule: built from the flags) and
`run_forward_step(data_iterator, model)` (a loss, or `(output, loss_fn)`). `train()` runs the loop with
Megatron's log line, evaluation, checkpoints and exact resume from consumed samples.
"""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from rapidtrain.data.gpt_dataset import train_valid_test_num_samples
from rapidtrain.data.samplers import MegatronPretrainingSampler
from rapidtrain.metrics import TensorBoardWriter, ThroughputMeter, format_log_line, mfu, peak_memory_bytes
from rapidtrain.trainers.trainer import IntervalTotals, IterationResult, StopSignal, Trainer

# Fault-tolerance tests only: rank 1 SIGKILLs itself once after this iteration (see kill_for_fault_test).
KILL_AT_ITERATION_VARIABLE = "RAPIDTRAIN_TEST_KILL_AT_ITERATION"


def kill_for_fault_test(iteration: int, rank: int, save: str | None) -> None:
    """Rank 1 dies by SIGKILL after `$RAPIDTRAIN_TEST_KILL_AT_ITERATION`, once: a marker file in --save (or
    `$RAPIDTRAIN_TEST_KILL_MARKER`) keeps the group torchrun restarts from dying again."""
    at = os.environ.get(KILL_AT_ITERATION_VARIABLE)
    if not at or rank != 1 or iteration != int(at):
        return
    marker = Path(os.environ.get("RAPIDTRAIN_TEST_KILL_MARKER") or Path(save or ".") / ".test_killed")
    if marker.exists():
        return
    marker.write_text(f"killed rank {rank} after iteration {iteration}\n")
    os.kill(os.getpid(), signal.SIGKILL)


class PreTrainer(Trainer):
    """Iteration-based training (`--train-iters`) on datasets indexed by global sample number."""

    # ---- hooks a subclass provides ----
    def train_valid_test_datasets_provider(self, train_val_test_num_samples: list[int]) -> tuple[Any, Any, Any]:
        raise NotImplementedError("PreTrainer subclasses implement train_valid_test_datasets_provider()")

    def model_optimizer_lr_scheduler_provider(self) -> tuple[Any, Any, Any]:
        raise NotImplementedError("PreTrainer subclasses implement model_optimizer_lr_scheduler_provider()")

    def model_factory(self) -> Any:
        """A callable that builds the same model again (None: none), so that ZeRO-3 can create it partitioned
        under deepspeed.zero.Init; the weights are then copied from the provider's model."""
        return None

    def flops_per_iteration(self) -> float | None:
        """Model FLOPs of one iteration, for TFLOP/s and MFU in the log line; None when unknown."""
        return None

    def collate_fn(self) -> Any:
        return None

    # ---- setup ----
    def setup(self) -> None:
        a = self.args
        batches = self.engine.plan.batches
        counts = train_valid_test_num_samples(a.train_iters, a.eval_interval, a.eval_iters, batches.global_batch_size)
        self.train_ds, self.valid_ds, self.test_ds = self.train_valid_test_datasets_provider(counts)
        model, optimizer, scheduler = self.model_optimizer_lr_scheduler_provider()
        scheduler_fn = (lambda _optimizer: scheduler) if scheduler is not None else None
        self.model, *_ = self.engine.compose(model, optimizer=optimizer, lr_scheduler_fn=scheduler_fn,
                                             model_factory=self.model_factory())
        self.load()
        self.engine.print_rank0(self.engine.plan.describe())

    def data_loader(self, dataset: Any, consumed_samples: int) -> DataLoader:
        mesh, a = self.engine.mesh, self.args
        sampler = MegatronPretrainingSampler(len(dataset), consumed_samples, a.micro_batch_size,
                                             mesh.data_parallel_rank, self.engine.plan.layout.data_parallel_size)
        workers = a.num_workers
        return DataLoader(dataset, batch_sampler=sampler, num_workers=workers, collate_fn=self.collate_fn(),
                          pin_memory=self.engine.device.type == "cuda", persistent_workers=workers > 0)

    def micro_batches(self, iterator: Iterator[Any]) -> list[Any]:
        return [next(iterator) for _ in range(self.engine.plan.batches.accumulation_steps)]

    # ---- the loop ----
    def train(self) -> dict[str, float]:
        self.setup()
        a, plan = self.args, self.engine.plan
        if self.iteration >= a.train_iters:
            self.engine.print_rank0(f" nothing to do: the checkpoint is at iteration {self.iteration} of "
                                    f"{a.train_iters}")
            return {}
        train_iterator = iter(self.data_loader(self.train_ds, self.consumed_samples))
        self.writer = TensorBoardWriter(a.tensorboard_dir if self.is_logging_rank else None)
        stop_signal, started = StopSignal(), time.time()
        meter, totals = ThroughputMeter(self.engine.device), IntervalTotals()
        meter.start()
        self.engine.runner.train()
        saved_at = None
        try:
            while self.iteration < a.train_iters:
                fetch_started = time.perf_counter()
                micro_batches = self.micro_batches(train_iterator)
                data_seconds = time.perf_counter() - fetch_started
                result = self.train_step(micro_batches)
                result.data_seconds = data_seconds
                self.iteration += 1
                self.consumed_samples += plan.batches.global_batch_size
                meter.record(plan.batches.global_batch_size, result.tokens)
                totals.add(result)
                self.record_loss(result)
                if self.iteration % a.log_interval == 0:
                    self.log(meter, totals, result)
                    totals = IntervalTotals()
                if a.eval_interval and self.iteration % a.eval_interval == 0 and self.valid_ds is not None:
                    self.evaluate_and_print("validation", self.valid_ds)
                if a.save and a.save_interval and self.iteration % a.save_interval == 0:
                    self.save()
                    saved_at = self.iteration
                kill_for_fault_test(self.iteration, self.engine.rank, a.save)
                if self.should_stop(stop_signal, started):
                    self.engine.print_rank0(f" exiting at iteration {self.iteration} (signal, --exit-interval or "
                                            "--exit-duration-in-mins)")
                    break
        finally:
            stop_signal.restore()
        if a.save and saved_at != self.iteration:
            self.save()
        results = {}
        if self.iteration >= a.train_iters and self.test_ds is not None and a.eval_iters:
            results = self.evaluate_and_print("test", self.test_ds)
        self.writer.close()
        return results

    @property
    def is_logging_rank(self) -> bool:
        """Megatron prints from the last pipeline stage; among its ranks, the first."""
        mesh = self.engine.mesh
        return mesh.is_last_stage and mesh.data_parallel_rank == 0 and mesh.tensor_parallel_rank == 0

    def log(self, meter: ThroughputMeter, totals: IntervalTotals, last: IterationResult) -> None:
        interval = meter.interval()
        a, plan = self.args, self.engine.plan
        seconds = interval.seconds_per_iteration
        flops = self.flops_per_iteration()
        losses = {"lm loss": totals.loss_sum / max(totals.loss_count, 1)}
        losses.update({name: value / max(totals.iterations, 1) for name, value in totals.extras.items()})
        extras: dict[str, Any] = {
            "tokens per second": round(interval.tokens_per_second, 1),
            "data time (ms)": round(1000 * totals.data_seconds / max(totals.iterations, 1), 2),
            "peak memory (MB)": round(peak_memory_bytes(self.engine.device) / 2**20, 1),
        }
        if flops is not None and a.peak_tflops:
            extras["MFU"] = f"{100 * mfu(flops, seconds, plan.layout.world_size, a.peak_tflops):.2f}%"
        scaler = getattr(self.engine.runner, "scaler", None)
        line = format_log_line(
            iteration=self.iteration, train_iters=a.train_iters, consumed_samples=self.consumed_samples,
            seconds_per_iteration=seconds, learning_rate=self.current_lr(),
            global_batch_size=plan.batches.global_batch_size, losses=losses,
            loss_scale=self.engine.runner.loss_scale if hasattr(self.engine.runner, "loss_scale")
            else (scaler.loss_scale if scaler is not None else 1.0),
            grad_norm=last.grad_norm, skipped_iterations=totals.skipped, nan_iterations=totals.nan,
            flops_per_iteration=flops, world_size=plan.layout.world_size, extras=extras)
        if self.is_logging_rank:
            print(line, flush=True)
            self.writer.add_scalars({f"train/{k}": v for k, v in losses.items()} | {
                "train/learning rate": self.current_lr(), "train/tokens per second": interval.tokens_per_second,
                **({"train/grad norm": last.grad_norm} if last.grad_norm is not None else {})}, self.iteration)

    def record_loss(self, result: IterationResult) -> None:
        if self.args.loss_log_file and self.is_logging_rank:
            with open(self.args.loss_log_file, "a") as log:
                grad_norm = "-" if result.grad_norm is None else float(result.grad_norm).hex()
                log.write(f"{self.iteration} {float(result.loss).hex()} {int(result.skipped)} {grad_norm}\n")

    def current_lr(self) -> float:
        return float(self.engine.runner.optimizer.param_groups[0]["lr"])

    # ---- evaluation ----
    @torch.no_grad()
    def evaluate(self, dataset: Any) -> float:
        """Mean loss over --eval-iters global batches from the start of `dataset` (the same batches each time)."""
        runner = self.engine.runner
        runner.train(False)
        loss_sum = torch.zeros((), dtype=torch.float64)
        weight = torch.zeros((), dtype=torch.float64)
        iterator = iter(self.data_loader(dataset, 0))
        try:
            for _ in range(min(self.args.eval_iters, len(dataset) // self.engine.plan.batches.global_batch_size)):
                micro_batches = self.micro_batches(iterator)
                if hasattr(runner, "evaluate_iteration"):  # pipeline parallel: forward through every stage
                    value, count = runner.evaluate_iteration(micro_batches, self.run_forward_step)
                    loss_sum += value
                    weight += count
                    continue
                for batch in micro_batches:
                    with runner.micro_batch(is_last=True):
                        value, count = self._as_loss(self.run_forward_step(iter([batch]), self.model))
                    loss_sum += value.detach().double().cpu()
                    weight += count if count is not None else 1
        finally:
            runner.train(True)
        totals = torch.stack([loss_sum, weight]).float()
        self.engine.all_reduce_data_parallel(totals)
        return float(totals[0] / totals[1].clamp(min=1))

    def evaluate_and_print(self, name: str, dataset: Any) -> dict[str, float]:
        loss = self.evaluate(dataset)
        ppl = math.exp(min(20.0, loss))
        text = f" {name} loss at iteration {self.iteration} | lm loss value: {loss:.6E} | lm loss PPL: {ppl:.6E} | "
        if self.is_logging_rank:
            print("-" * (len(text) + 1) + "\n" + text + "\n" + "-" * (len(text) + 1), flush=True)
            self.writer.add_scalars({f"{name}/lm loss": loss, f"{name}/lm loss PPL": ppl}, self.iteration)
        return {f"{name} loss": loss, f"{name} ppl": ppl}
