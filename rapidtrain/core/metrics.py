"""What a run reports: Megatron's log line, throughput and MFU, timers, peak memory, TensorBoard.

The log line's layout lives only here (`format_log_line`); FLOPs per iteration come from the model
(`rapidtrain.models.counting`), this module only divides them by time.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import torch

Clock = Callable[[], float]


def tflops_per_device(flops_per_iteration: float, seconds_per_iteration: float, world_size: int) -> float:
    """Achieved TFLOP/s per device, as Megatron computes it: flops / (seconds × 10¹² × world size)."""
    return flops_per_iteration / (seconds_per_iteration * 1e12 * world_size)


def mfu(flops_per_iter: float, seconds: float, world_size: int, peak_tflops: float) -> float:
    """Model FLOPs utilisation as a fraction (0.41 = 41%) of each device's peak TFLOP/s."""
    return tflops_per_device(flops_per_iter, seconds, world_size) / peak_tflops


def format_log_line(
    *,
    iteration: int,
    train_iters: int,
    consumed_samples: int,
    seconds_per_iteration: float,
    learning_rate: float,
    global_batch_size: int,
    losses: Mapping[str, float],
    loss_scale: float,
    grad_norm: float | None = None,
    skipped_iterations: int = 0,
    nan_iterations: int = 0,
    flops_per_iteration: float | None = None,
    world_size: int = 1,
    extras: Mapping[str, Any] | None = None,
    timestamp: datetime | None = None,
    params_norm: float | None = None,
) -> str:
    """Megatron's training log line, field widths included.

    `losses` are the interval's averages by name (`{"lm loss": 1.82}`; an MoE run adds
    `"load balancing loss"`), printed as `%.6E`. The throughput field appears only when
    `flops_per_iteration` is known. `extras` are appended as `name: value |` after Megatron's
    fields; a string value is printed as given, an int as is, a float with 6 significant digits.
    """
    when = (timestamp or datetime.now()).strftime("%Y-%m-%d %H:%M:%S")
    fields = [
        f" [{when}] iteration {iteration:8d}/{train_iters:8d}",
        f"consumed samples: {consumed_samples:12d}",
        f"elapsed time per iteration (ms): {seconds_per_iteration * 1000.0:.1f}",
    ]
    if flops_per_iteration is not None:
        throughput = tflops_per_device(flops_per_iteration, seconds_per_iteration, world_size)
        fields.append(f"throughput per GPU (TFLOP/s/GPU): {throughput:.1f}")
    fields.append(f"learning rate: {learning_rate:.6E}")
    fields.append(f"global batch size: {global_batch_size:5d}")
    fields.extend(f"{name}: {value:.6E}" for name, value in losses.items())
    fields.append(f"loss scale: {loss_scale:.1f}")
    if grad_norm is not None:
        fields.append(f"grad norm: {grad_norm:.3f}")
    if params_norm is not None:  # --log-params-norm, where Megatron shows it
        fields.append(f"params norm: {params_norm:.3f}")
    fields.append(f"number of skipped iterations: {skipped_iterations:3d}")
    fields.append(f"number of nan iterations: {nan_iterations:3d}")
    fields.extend(f"{name}: {_format_extra(value)}" for name, value in (extras or {}).items())
    return " | ".join(fields) + " |"


def _format_extra(value: Any) -> str:
    if isinstance(value, bool | int | str):
        return str(value)
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def synchronize(device: torch.device | str | None) -> None:
    """Wait for queued device work, so a timer reads the real end of a step (no-op on CPU)."""
    if device is None:
        return
    device = torch.device(device)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type != "cpu":
        module = getattr(torch, device.type, None)
        if module is not None and hasattr(module, "synchronize"):
            module.synchronize()


class Timer:
    """Accumulates seconds over start/stop pairs (or `with timer:` blocks), e.g. data loading time.

    `clock` is injectable so tests can drive it; `device` makes each reading wait for that device.
    """

    def __init__(self, device: torch.device | str | None = None, clock: Clock = time.perf_counter) -> None:
        self.device = device
        self.clock = clock
        self._total = 0.0
        self._started_at: float | None = None

    def start(self) -> None:
        if self._started_at is not None:
            raise RuntimeError("Timer.start() called twice without stop()")
        synchronize(self.device)
        self._started_at = self.clock()

    def stop(self) -> None:
        if self._started_at is None:
            raise RuntimeError("Timer.stop() called without start()")
        synchronize(self.device)
        self._total += self.clock() - self._started_at
        self._started_at = None

    def reset(self) -> None:
        self._total = 0.0
        self._started_at = None

    def elapsed(self, reset: bool = True) -> float:
        """Seconds accumulated so far (a running interval counts up to now)."""
        total = self._total
        if self._started_at is not None:
            synchronize(self.device)
            total += self.clock() - self._started_at
        if reset:
            self._total = 0.0
            if self._started_at is not None:
                self._started_at = self.clock()
        return total

    def __enter__(self) -> Timer:
        self.start()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.stop()


class ScalarSink(Protocol):
    """Where timers write their means: a TensorBoard writer, or the run's writers together."""

    def add_scalar(self, tag: str, value: float, step: int) -> None: ...


class Timers:
    """Megatron's named timers: `timers("forward-backward").start()` ... `.stop()`; `timers.write(writer,
    step)` puts each one's seconds per iteration since the last write into TensorBoard as `timers/NAME`.

    The loop times its phases only with --log-timers-to-tensorboard (a reading waits for the device); user
    code gets the same object from `rapidtrain.get_timers()`.
    """

    def __init__(self, device: torch.device | str | None = None, clock: Clock = time.perf_counter) -> None:
        self.device = device
        self.clock = clock
        self._timers: dict[str, Timer] = {}

    def __call__(self, name: str, log_level: int = 0) -> Timer:
        if name not in self._timers:
            self._timers[name] = Timer(self.device, self.clock)
        return self._timers[name]

    def write(self, writer: ScalarSink, step: int, iterations: int) -> None:
        for name, timer in self._timers.items():
            writer.add_scalar(f"timers/{name}", timer.elapsed(reset=True) / max(iterations, 1), step)

    def log(self, names: list[str] | None = None, normalizer: float = 1.0) -> str:
        """Megatron's `timers.log(names)`: "time (ms) | name: ms | ..." (the readings are reset)."""
        chosen = names if names is not None else list(self._timers)
        parts = [f"{name}: {1000 * self._timers[name].elapsed(reset=True) / normalizer:.2f}"
                 for name in chosen if name in self._timers]
        return "time (ms) | " + " | ".join(parts)


@dataclass(frozen=True)
class IntervalStats:
    """What happened between two log lines."""

    iterations: int
    seconds: float
    samples: int
    tokens: int

    @property
    def seconds_per_iteration(self) -> float:
        return self.seconds / max(self.iterations, 1)

    @property
    def samples_per_second(self) -> float:
        return self.samples / self.seconds if self.seconds > 0 else 0.0

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class ThroughputMeter:
    """Counts iterations, samples and tokens per log interval and times it (Megatron's interval timer).

    `start()` once before the loop, `record(samples, tokens)` after each iteration (skipped ones
    included, as Megatron divides by all iterations), `interval()` at each log line: it returns the
    interval's numbers and starts the next one.
    """

    def __init__(self, device: torch.device | str | None = None, clock: Clock = time.perf_counter) -> None:
        self._timer = Timer(device, clock)
        self._iterations = 0
        self._samples = 0
        self._tokens = 0

    def start(self) -> None:
        self._timer.start()

    def record(self, samples: int, tokens: int = 0) -> None:
        self._iterations += 1
        self._samples += samples
        self._tokens += tokens

    def interval(self) -> IntervalStats:
        stats = IntervalStats(self._iterations, self._timer.elapsed(reset=True), self._samples, self._tokens)
        self._iterations = self._samples = self._tokens = 0
        return stats


class _Tee:
    """A stream that also appends what it writes to a file (line-buffered)."""

    def __init__(self, stream: Any, file: Any) -> None:
        self.stream, self.file = stream, file

    def write(self, text: str) -> int:
        self.file.write(text)
        return self.stream.write(text)

    def flush(self) -> None:
        self.file.flush()
        self.stream.flush()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.stream, name)


def tee_output(path: str | Path) -> Path:
    """Rapidformer's --logging-path: from now on this process's stdout also goes to `path` (appended; a
    folder gets rapidtrain.log inside). Returns the file."""
    target = Path(path)
    if target.is_dir():
        target = target / "rapidtrain.log"
    target.parent.mkdir(parents=True, exist_ok=True)
    file = open(target, "a", buffering=1, encoding="utf-8")  # noqa: SIM115 - kept open for the process's life
    sys.stdout = _Tee(sys.stdout, file)
    return target


def peak_memory_bytes(device: torch.device | str) -> int:
    """Peak memory so far: CUDA's max allocated bytes, or on CPU the process's max resident set."""
    device = torch.device(device)
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    import resource  # POSIX only; imported here so the module still imports elsewhere

    max_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports kilobytes, macOS bytes.
    return int(max_rss if sys.platform == "darwin" else max_rss * 1024)


class TensorBoardWriter:
    """Thin wrapper over `torch.utils.tensorboard.SummaryWriter`; does nothing when `log_dir` is None.

    Give the directory (`--tensorboard-dir`) on the rank that logs and None on the others.
    """

    def __init__(self, log_dir: str | Path | None, max_queue: int = 10) -> None:
        self.log_dir = None if log_dir is None else Path(log_dir)
        self._writer = None
        if self.log_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as error:
                raise ImportError(
                    f"--tensorboard-dir {self.log_dir} needs the `tensorboard` package: "
                    "`pip install tensorboard`, or drop the flag"
                ) from error
            self._writer = SummaryWriter(log_dir=str(self.log_dir), max_queue=max_queue)

    @property
    def enabled(self) -> bool:
        return self._writer is not None

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        if self._writer is not None:
            self._writer.add_scalar(tag, value, step)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        """Each value under its own tag (not SummaryWriter's grouped `add_scalars`)."""
        for tag, value in values.items():
            self.add_scalar(tag, value, step)

    def add_text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None

    def __enter__(self) -> TensorBoardWriter:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.close()
