"""Data loaders over this rank's share of the data: training loaders give each data-parallel rank its
micro-batches (shuffled per epoch, resumable from a consumed-samples count, length-bucketed for dynamic
shape); evaluation loaders cover every sample exactly once, in dataset order when the ranks' batches are
gathered (`gather_across_ranks`)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from rapidtrain.core.shutdown import ignore_sigterm_in_worker
from rapidtrain.data.dynamic_shape import LengthBucketBatchSampler
from rapidtrain.data.samplers import (
    MegatronPretrainingSampler,
    MegatronRandomSampler,
    check_data_parallel_layout,
)
from rapidtrain.data.worker_start import WorkerLoader, worker_context


def move_to_device(batch: Any, device: torch.device) -> Any:
    """Tensors anywhere in a batch (dicts, BatchEncoding, lists, tuples) moved to `device`."""
    if torch.is_tensor(batch):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, Mapping):
        return {key: move_to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(move_to_device(value, device) for value in batch)
    return batch


class EvalBatchSampler:
    """Every sample once; step k gives rank r its slice of chunk k (micro × dp samples), so the ranks'
    batches, gathered in rank order, come out in dataset order. The last chunk is split evenly; a rank
    left without samples gets one repeated sample, which `real_rows` reports as padding (0 real rows).
    """

    def __init__(
        self, total_samples: int, micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int
    ) -> None:
        check_data_parallel_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        self.total = total_samples
        self.micro = micro_batch_size
        self.rank = data_parallel_rank
        self.size = data_parallel_size

    def __len__(self) -> int:
        return math.ceil(self.total / (self.micro * self.size))

    def _slice(self, step: int) -> tuple[int, int]:
        chunk = self.micro * self.size
        start = step * chunk
        remaining = min(chunk, self.total - start)
        if remaining == chunk:
            return start + self.rank * self.micro, start + (self.rank + 1) * self.micro
        share, extra = divmod(remaining, self.size)  # the first `extra` ranks take one more
        first = start + self.rank * share + min(self.rank, extra)
        return first, first + share + (1 if self.rank < extra else 0)

    def real_rows(self, step: int) -> int:
        begin, end = self._slice(step)
        return end - begin

    def __iter__(self) -> Iterator[list[int]]:
        for step in range(len(self)):
            begin, end = self._slice(step)
            yield list(range(begin, end)) if end > begin else [max(self.total - 1, 0)]


class ShardedLoader:
    """A DataLoader over this rank's share; batches come out on `device` (None: where the loader made them,
    so a template can count tokens on the host and move each micro-batch just before its forward).

    `real_rows` is the number of real (not padding) rows of the batch last yielded; `gather(t)` collects a
    tensor of that batch from every data-parallel rank without them. `context(step)` may wrap each yielded
    batch (the own-loop micro-batch context).
    """

    def __init__(
        self,
        loader: DataLoader,
        device: torch.device | None,
        context: Callable[[int], contextlib.AbstractContextManager] | None = None,
        group: dist.ProcessGroup | None = None,
    ) -> None:
        self.loader = loader
        self.device = device
        self.context = context
        self.group = group
        self.real_rows: int | None = None
        self.batch_sampler = loader.batch_sampler
        self.dataset = loader.dataset

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator[Any]:
        eval_sampler = self.batch_sampler if isinstance(self.batch_sampler, EvalBatchSampler) else None
        for step, batch in enumerate(self.loader):
            self.real_rows = eval_sampler.real_rows(step) if eval_sampler else None
            if self.device is not None:
                batch = move_to_device(batch, self.device)
            with self.context(step) if self.context else contextlib.nullcontext():
                yield batch
        self.real_rows = None

    def gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """`tensor` (rows of the current batch) from every data-parallel rank, in dataset order for evaluation."""
        return gather_across_ranks(tensor, self.group, self.real_rows)


@dataclass(frozen=True)
class ShardSettings:
    """How data is shared out: micro batch, this rank's place among the data-parallel ranks, seed."""

    micro_batch_size: int
    data_parallel_rank: int
    data_parallel_size: int
    seed: int
    num_workers: int = 0
    pin_memory: bool = False
    group: dist.ProcessGroup | None = None  # the data-parallel group, for gathering
    keep_last: bool = False  # --keep-last: an epoch's rest is completed to a whole step instead of dropped


def _data_loader(
    dataset: Any, batch_sampler: Any, collate_fn: Callable | None, s: ShardSettings, persistent: bool = False
) -> DataLoader:
    # Its own generator: each iter() of a DataLoader draws a worker seed, which must not move the global RNG
    # (dropout), or a run resumed mid-epoch would draw different masks than the run it continues.
    generator = torch.Generator().manual_seed(s.seed)
    return WorkerLoader(
        dataset,
        batch_sampler=batch_sampler,
        collate_fn=collate_fn,
        num_workers=s.num_workers,
        pin_memory=s.pin_memory,
        persistent_workers=persistent and s.num_workers > 0,
        generator=generator,
        worker_init_fn=ignore_sigterm_in_worker,  # a SIGTERM to the group is the rank's to answer (it saves)
        multiprocessing_context=worker_context(dataset, collate_fn, s.num_workers),  # never a fork of a rank
    )


def train_batch_sampler(
    dataset: Any,
    s: ShardSettings,
    consumed_samples: int = 0,
    shuffle: bool = True,
    lengths: Sequence[int] | None = None,
) -> Any:
    """Dynamic shape (lengths given): length buckets; shuffle: Megatron's epoch permutation; else in order."""
    if lengths is not None:
        return LengthBucketBatchSampler(
            lengths,
            s.micro_batch_size,
            s.data_parallel_rank,
            s.data_parallel_size,
            seed=s.seed,
            consumed_samples=consumed_samples,
        )
    if shuffle:
        return MegatronRandomSampler(
            len(dataset),
            consumed_samples,
            s.micro_batch_size,
            s.data_parallel_rank,
            s.data_parallel_size,
            seed=s.seed,
            keep_last=s.keep_last,
        )
    return MegatronPretrainingSampler(
        len(dataset), consumed_samples, s.micro_batch_size, s.data_parallel_rank, s.data_parallel_size
    )


def samples_per_epoch(batch_sampler: Any) -> int:
    """Samples one epoch of a training batch sampler walks, over all data-parallel ranks."""
    if isinstance(batch_sampler, LengthBucketBatchSampler):
        return batch_sampler.steps_per_epoch * batch_sampler.step_size
    if isinstance(batch_sampler, MegatronRandomSampler):
        return batch_sampler.samples_per_epoch
    chunk = batch_sampler.micro_batch_size * batch_sampler.data_parallel_size
    return (batch_sampler.total_samples // chunk) * chunk


def train_loader(
    dataset: Any,
    collate_fn: Callable | None,
    s: ShardSettings,
    device: torch.device | None,
    consumed_samples: int = 0,
    lengths: Sequence[int] | None = None,
    shuffle: bool = True,
    context: Callable[[int], contextlib.AbstractContextManager] | None = None,
) -> ShardedLoader:
    sampler = train_batch_sampler(dataset, s, consumed_samples, shuffle, lengths)
    return ShardedLoader(_data_loader(dataset, sampler, collate_fn, s), device, context, s.group)


def eval_loader(
    dataset: Any,
    collate_fn: Callable | None,
    s: ShardSettings,
    device: torch.device | None,
    context: Callable[[int], contextlib.AbstractContextManager] | None = None,
    persistent: bool = False,
) -> ShardedLoader:
    """Every sample of `dataset` once, this rank's share in order; `persistent` keeps the workers between passes (a
    template that evaluates many times forks them once: see Trainer.evaluation_loader)."""
    sampler = EvalBatchSampler(len(dataset), s.micro_batch_size, s.data_parallel_rank, s.data_parallel_size)
    return ShardedLoader(_data_loader(dataset, sampler, collate_fn, s, persistent), device, context, s.group)


def shutdown_workers(loader: DataLoader) -> None:
    """Stop a loader's persistent workers now: they ignore SIGTERM (a save request is the rank's), so
    multiprocessing's exit handler, which terminates them with SIGTERM and then joins them, would wait forever."""
    iterator = getattr(loader, "_iterator", None)  # the persistent workers' iterator, once iterated
    if iterator is not None:
        iterator._shutdown_workers()


# ---- gathering across data-parallel ranks ----


def gather_across_ranks(
    tensor: torch.Tensor,
    group: dist.ProcessGroup | None,
    real_rows: int | None = None,
    pad_value: float = -100,
) -> torch.Tensor:
    """Concatenate every rank's `tensor` along dim 0, in rank order.

    Ranks may hold different shapes (the last evaluation batch, per-batch padding): trailing dimensions
    are padded with `pad_value` to the largest, and rows past `real_rows` (evaluation padding) dropped.
    """
    tensor = tensor.detach()
    if tensor.ndim == 0:
        tensor = tensor.reshape(1)
    if real_rows is not None and tensor.shape[0] >= real_rows:
        tensor = tensor[:real_rows]
    if group is None:
        return tensor
    size = dist.get_world_size(group)
    shape = torch.tensor(tensor.shape, dtype=torch.int64)
    shapes = [torch.zeros_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    largest = torch.stack(shapes).max(dim=0).values.tolist()
    padded = tensor.new_full(largest, pad_value)
    padded[tuple(slice(0, n) for n in tensor.shape)] = tensor
    pieces = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(pieces, padded.contiguous(), group=group)
    rows = [piece[: int(s[0])] for piece, s in zip(pieces, shapes, strict=True)]
    return torch.cat(rows, dim=0)


