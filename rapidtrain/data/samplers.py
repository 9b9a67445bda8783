"""Batch samplers that give each data-parallel rank its micro-batches and resume exactly from a
count of consumed samples: in order (pretraining) or shuffled per epoch (fine-tuning)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from rapidtrain.core.errors import UserError


class SamplerError(UserError, ValueError):
    """Sampler settings that cannot work together; the message names the flags."""


def check_data_parallel_layout(
    micro_batch_size: int, data_parallel_rank: int, data_parallel_size: int
) -> None:
    if micro_batch_size <= 0:
        raise SamplerError(f"--micro-batch-size must be positive, got {micro_batch_size}")
    if data_parallel_size <= 0 or not 0 <= data_parallel_rank < data_parallel_size:
        raise SamplerError(
            f"data-parallel rank {data_parallel_rank} is outside [0, {data_parallel_size}) ranks"
        )


class MegatronPretrainingSampler:
    """Global samples in order; step k hands rank r samples [c + r·m, c + (r+1)·m) of its chunk.

    c = consumed_samples + k·m·dp. Resuming with the consumed-samples count of a checkpoint yields
    exactly the batches the interrupted run had not yet seen.
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        drop_last: bool = True,
    ) -> None:
        check_data_parallel_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        if total_samples <= 0:
            raise SamplerError(f"the dataset has no samples (total_samples={total_samples})")
        if not 0 <= consumed_samples < total_samples:
            raise SamplerError(
                f"consumed samples {consumed_samples} is not below the {total_samples} samples of the "
                "dataset: the run already went through all its data (raise --train-iters or --train-samples)"
            )
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.drop_last = drop_last

    @property
    def global_chunk(self) -> int:
        """Samples consumed by one micro-step across all data-parallel ranks."""
        return self.micro_batch_size * self.data_parallel_size

    def __len__(self) -> int:
        remaining = self.total_samples - self.consumed_samples
        full, partial = divmod(remaining, self.global_chunk)
        return full + (1 if partial and not self.drop_last else 0)

    def _rank_slice(self, chunk_start: int, chunk_end: int) -> list[int]:
        start = chunk_start + self.data_parallel_rank * self.micro_batch_size
        return list(range(start, min(start + self.micro_batch_size, chunk_end)))

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.global_chunk
        start = self.consumed_samples
        while start + chunk <= self.total_samples:
            yield self._rank_slice(start, start + chunk)
            start += chunk
        # Megatron's last partial chunk: ranks past its end get an empty batch.
        if start < self.total_samples and not self.drop_last:
            yield self._rank_slice(start, self.total_samples)


class MegatronRandomSampler:
    """Epoch-shuffled micro-batches for fine-tuning, resumable from a consumed-samples count.

    Each epoch uses the samples of whole global chunks (micro × dp; the rest are left out that
    epoch) permuted by torch.randperm seeded with seed + epoch. Step k gives rank r positions
    [k·m·dp + r·m, k·m·dp + (r+1)·m) of the permutation. Each `iter()` yields the rest of the
    current epoch, so a loop `for epoch ...: for batch in loader` walks successive epochs.

    `keep_last` (Megatron's --keep-last): the rest is not left out; the epoch's order is completed to a whole
    chunk with its first samples (so every micro-batch stays full, as accumulation and exact resume need).
    """

    def __init__(
        self,
        total_samples: int,
        consumed_samples: int,
        micro_batch_size: int,
        data_parallel_rank: int,
        data_parallel_size: int,
        seed: int = 0,
        keep_last: bool = False,
    ) -> None:
        check_data_parallel_layout(micro_batch_size, data_parallel_rank, data_parallel_size)
        if total_samples < micro_batch_size * data_parallel_size and not keep_last:
            raise SamplerError(
                f"{total_samples} samples cannot fill one step of --micro-batch-size {micro_batch_size} "
                f"× {data_parallel_size} data-parallel ranks; use a smaller micro batch or more data"
            )
        if consumed_samples < 0:
            raise SamplerError(f"consumed samples must be >= 0, got {consumed_samples}")
        self.total_samples = total_samples
        self.consumed_samples = consumed_samples
        self.micro_batch_size = micro_batch_size
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.seed = seed
        self.keep_last = keep_last

    @property
    def samples_per_epoch(self) -> int:
        """Samples used per epoch: whole global chunks only (with keep_last, enough of them for every sample)."""
        chunk = self.micro_batch_size * self.data_parallel_size
        if self.keep_last:
            return -(-self.total_samples // chunk) * chunk
        return (self.total_samples // chunk) * chunk

    @property
    def epoch(self) -> int:
        """The epoch the next batch belongs to."""
        return self.consumed_samples // self.samples_per_epoch

    def __len__(self) -> int:
        remaining = self.samples_per_epoch - self.consumed_samples % self.samples_per_epoch
        return remaining // (self.micro_batch_size * self.data_parallel_size)

    def epoch_permutation(self, epoch: int) -> list[int]:
        """The sample order of `epoch` (the same on every rank)."""
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        order = torch.randperm(self.total_samples, generator=generator).tolist()
        while len(order) < self.samples_per_epoch:  # keep_last: the last chunk completed from the start
            order += order[: self.samples_per_epoch - len(order)]
        return order[: self.samples_per_epoch]

    def __iter__(self) -> Iterator[list[int]]:
        chunk = self.micro_batch_size * self.data_parallel_size
        epoch = self.epoch
        order = self.epoch_permutation(epoch)
        start = self.consumed_samples - epoch * self.samples_per_epoch
        for chunk_start in range(start, self.samples_per_epoch - chunk + 1, chunk):
            first = chunk_start + self.data_parallel_rank * self.micro_batch_size
            self.consumed_samples = epoch * self.samples_per_epoch + chunk_start + chunk
            yield order[first : first + self.micro_batch_size]
        # A count that was not a whole number of chunks still ends the epoch here.
        self.consumed_samples = (epoch + 1) * self.samples_per_epoch
