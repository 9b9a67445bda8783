"""--profile: the PyTorch profiler over a window of training steps, stepped by the loop after each iteration.

Steps are counted as Megatron counts them (iterations completed before the step, from 0): steps
[--profile-step-start, --profile-step-end) are traced, the step before them warms the profiler up. Each traced
rank writes one Chrome trace (`rank{R}.steps{S}-{E}.{time}.pt.trace.json`, for Perfetto, chrome://tracing or
TensorBoard's profiler plugin); on CUDA also the allocator's memory snapshot over the same steps
(`memory_snapshot_rank{R}.pickle`, for pytorch.org/memory_viz).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from rapidtrain.config.settings import ProfileSettings

MEMORY_HISTORY_ENTRIES = 100_000  # allocation events kept for the snapshot (Megatron's choice)


class Profiler:
    """Starts torch.profiler one step before the window (or at the first step a resumed run reaches inside it)
    and exports the trace when the window ends; does nothing on ranks not in --profile-ranks."""

    def __init__(self, settings: ProfileSettings, rank: int, device: torch.device, first_step: int) -> None:
        self.settings = settings
        self.rank = rank
        self.device = device
        self.trace_path: Path | None = None
        self.snapshot_path: Path | None = None
        self._profiler: Any = None
        traced = settings.enabled and rank in settings.ranks and settings.step_end > first_step
        self._first_traced = max(settings.step_start, first_step)
        self._begin_at = max(settings.step_start - 1, first_step) if traced else None
        self.note = ""
        if settings.enabled and rank in settings.ranks and not traced:
            self.note = (f" profiler: nothing traced: this run starts at step {first_step}, past --profile-step-end "
                         f"{settings.step_end}")

    @property
    def active(self) -> bool:
        return self._profiler is not None

    def step(self, completed: int) -> None:
        """Call before the first iteration and after each, with the iterations completed so far."""
        if self._profiler is not None:
            self._profiler.step()
            if completed >= self.settings.step_end:
                self.close()
        elif completed == self._begin_at:
            self._start(completed)

    def _start(self, completed: int) -> None:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.memory._record_memory_history(max_entries=MEMORY_HISTORY_ENTRIES)
        self._profiler = profile(activities=activities, record_shapes=True, schedule=self._schedule(completed),
                                 on_trace_ready=self._export)
        self._profiler.step_num = completed  # the trace's ProfilerStep#N are then the training steps
        self._profiler.start()

    def _schedule(self, begin: int) -> Any:
        """Profiler actions by training step: warm up before the window, record inside, save at its last step."""
        from torch.profiler import ProfilerAction

        first, end = self._first_traced, self.settings.step_end

        def action(step: int) -> ProfilerAction:
            step = max(step, begin)  # the profiler asks for step 0 before its step_num is moved to `begin`
            if step < first:
                return ProfilerAction.WARMUP
            if step < end - 1:
                return ProfilerAction.RECORD
            return ProfilerAction.RECORD_AND_SAVE if step == end - 1 else ProfilerAction.NONE

        return action

    def _export(self, profiler: Any) -> None:
        folder = Path(self.settings.trace_dir)
        folder.mkdir(parents=True, exist_ok=True)
        name = f"rank{self.rank}.steps{self._first_traced}-{self.settings.step_end}.{int(time.time() * 1000)}"
        self.trace_path = folder / f"{name}.pt.trace.json"
        profiler.export_chrome_trace(str(self.trace_path))

    def close(self) -> None:
        """Stop tracing (the window's end, or the run's if it stops first) and write what was recorded."""
        if self._profiler is None:
            return
        profiler, self._profiler = self._profiler, None
        profiler.stop()
        if self.device.type == "cuda":
            self.snapshot_path = Path(self.settings.trace_dir) / f"memory_snapshot_rank{self.rank}.pickle"
            self.snapshot_path.parent.mkdir(parents=True, exist_ok=True)
            torch.cuda.memory._dump_snapshot(str(self.snapshot_path))
            torch.cuda.memory._record_memory_history(enabled=None)
        if self.trace_path is not None:
            print(f" profiler: rank {self.rank} traced steps {self._first_traced}-{self.settings.step_end - 1} "
                  f"→ {self.trace_path}" + (f"; memory snapshot → {self.snapshot_path}" if self.snapshot_path
                                            else ""), flush=True)
