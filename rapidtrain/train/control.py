"""When the loop saves and when it stops: the checkpointer owns the save interval and the final save; the
stop signal turns SIGTERM (sent by schedulers and torchrun on shutdown) into a request the loop agrees on."""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from typing import Any

from rapidtrain.checkpoint.checkpointer import (
    LoadedState,
    async_save_done,
    background_save_group,
    load_checkpoint,
    prepare_save_folder,
    publish_async_save,
    save_checkpoint,
    start_async_save,
)
from rapidtrain.checkpoint.foreign_formats import detect_foreign
from rapidtrain.checkpoint.save_folder import check_resume_safety, check_save_shared
from rapidtrain.config.job_identity import data_files
from rapidtrain.config.settings import CheckpointSettings, TrainingSettings
from rapidtrain.core.stopped_run import EXIT_INTERRUPTED, RUN, first_to_report

ABORT_AFTER_S = 1.0  # a second Ctrl-C this long after the first aborts; an echo of the same press comes sooner


class StopSignal:
    """SIGTERM or Ctrl-C (SIGINT) asks the loop to save and exit cleanly; a second Ctrl-C aborts at once, without
    saving (one line, status 130). The handler stays until `restore()` (after the final
    save), so a second SIGTERM during that save does not kill it; after a stop by signal it stays until the
    process exits (then ignored through the interpreter's finalization), as a repeat must not kill the exit. A
    process forked from this one (a multiprocessing pool, whose terminate() sends SIGTERM) still ends on
    SIGTERM as usual."""
    def __init__(self, exit_signal: str = "SIGTERM") -> None:
        self.received = False
        self._owner = os.getpid()
        self._interrupted_at: float | None = None
        # --exit-signal (Megatron's): one more signal that stops the run as SIGTERM does (SIGUSR1 from Slurm's
        # --signal, ...). An inherited "ignore" is kept for it: a run started under nohup stays deaf to SIGHUP.
        extra = getattr(signal, exit_signal)
        handled = [signal.SIGTERM, signal.SIGINT]
        if extra not in handled and signal.getsignal(extra) is not signal.SIG_IGN:
            handled.append(extra)
        self._previous = {signum: signal.signal(signum, self._handle) for signum in handled}

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._owner:  # inherited by a fork: not the trainer, so the default action
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if signum == signal.SIGINT:
            now = time.monotonic()
            if self._interrupted_at is not None and now - self._interrupted_at > ABORT_AFTER_S:
                if first_to_report("abort"):
                    print("rapidtrain: second Ctrl-C: stopped at once, without saving", file=sys.stderr, flush=True)
                os._exit(EXIT_INTERRUPTED)
            self._interrupted_at = self._interrupted_at or now
        self.received = True
        if RUN.stop_signal is None or signum == signal.SIGINT:
            RUN.stop_signal = signum

    def restore(self) -> None:
        if not self.received:
            for signum, previous in self._previous.items():
                signal.signal(signum, previous)
            return
        # The process is on its way out. The interpreter puts back the default action for Python handlers when
        # it finalizes, which a late repeat would turn into death by SIGTERM after a good save: from the
        # atexit hooks on, repeats are ignored by the kernel instead.
        for signum in self._previous:
            if signum != signal.SIGINT:
                atexit.register(signal.signal, signum, signal.SIG_IGN)
        signal.signal(signal.SIGINT, self._previous[signal.SIGINT])  # the save is done: Ctrl-C may end the exit


class StopConditions:
    """--exit-interval (the same on every rank), and the requests a rank makes alone (SIGTERM,
    --exit-duration-in-mins, counted from when the trainer is built), which the loop agrees on with the
    iteration's other decisions. SIGTERM is handled with --save or --exit-signal-handler (plan.training.on_sigterm);
    otherwise it ends the process at once, as in Megatron without --exit-signal-handler."""
    def __init__(self, settings: TrainingSettings) -> None:
        self.settings = settings
        self.started = time.time()
        self.signal = StopSignal(settings.exit_signal) if settings.on_sigterm != "default" else None

    def requested(self) -> bool:
        minutes = self.settings.exit_duration_in_mins
        received = self.signal is not None and self.signal.received
        return received or bool(minutes and time.time() - self.started > minutes * 60)

    def interval_reached(self, iteration: int) -> bool:
        interval = self.settings.exit_interval
        return bool(interval and iteration % interval == 0)

    def close(self) -> None:
        if self.signal is not None:
            self.signal.restore()


class Checkpointer:
    """Saves every --save-interval iterations, when asked (end of an epoch), and once at the end; never twice
    at one iteration. Loads at start (--load)."""
    def __init__(self, settings: CheckpointSettings, trainer: Any) -> None:
        self.settings = settings
        self.trainer = trainer
        self.saved_at: int | None = None
        self._requested = False
        self._lock: Any = None
        self._shared = False  # every rank checked it sees --save (once: open() is called again before loading)
        self._pending: Any = None  # a background save (--async-save) not yet published
        self._group: Any = None  # the gloo group background saves run their collectives on
        # Set by fine-tuning templates: a pretrained model named by --pretrained-model-name-or-path is loaded
        # model only (as --finetune), the run starting at iteration 0 on its own data.
        self.pretrained_model_only = False

    def open(self) -> None:
        """Before the data and the model are built (the templates' setup starts with it), and again harmlessly
        before loading: rank 0 takes --save for this run (one writer per folder), refuses to overwrite
        checkpoints it did not load, and cleans what killed saves left."""
        if not self.enabled or self._lock is not None or self._shared:
            return
        if self.trainer.engine.rank == 0:
            self._lock, cleaned = prepare_save_folder(self.save_dir, self.settings.load, self.settings.finetune)
            for line in cleaned:
                print(f" {line}", flush=True)
        check_save_shared(self.save_dir)  # every node sees the folder rank 0 prepared
        self._shared = True

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def enabled(self) -> bool:
        return bool(self.settings.save)

    @property
    def save_dir(self) -> str:
        """--save, where saving is enabled (every caller checks `enabled` first)."""
        assert self.settings.save is not None
        return self.settings.save

    def request(self) -> None:
        """Save at the end of this iteration, whatever the interval (the template's state changed)."""
        self._requested = True

    def maybe_save(self, iteration: int) -> None:
        self.poll()
        interval = self.settings.save_interval
        due = self._requested or bool(interval and iteration % interval == 0)
        self._requested = False
        if due:
            self.save(iteration, force=True)

    def save(self, iteration: int, force: bool = False) -> None:
        """Save the trainer's state at `iteration` (unless it was already saved there and nothing changed); with
        --async-save in the background, after the previous background save is published."""
        if not self.enabled or (self.saved_at == iteration and not force):
            return

        trainer, engine = self.trainer, self.trainer.engine
        # The data files' sizes and times beside the plan: a resume says what changed under it (checkpoint/resume.py).
        config = {"args": self.settings.flags, "plan": json.loads(engine.plan.to_json()),
                  "data_files": data_files(engine.plan, with_mtime=True)}
        state = (self.save_dir, iteration, engine.runner, engine.lr_scheduler, trainer.consumed_samples, config,
                 trainer.checkpoint_extra())
        self.saved_at = iteration
        if not self.settings.async_save:
            path = save_checkpoint(*state)
            engine.print_rank0(f" saved checkpoint at iteration {iteration:7d} to {path}")
            return
        self.finish()  # one background save at a time: its host copy of the state is freed before the next
        if self._group is None:
            self._group = background_save_group()
        self._pending = start_async_save(*state, process_group=self._group)
        engine.print_rank0(f" saving checkpoint at iteration {iteration:7d} to {self._pending.final} in the "
                           "background")

    def poll(self) -> None:
        """Publish a background save once every rank has written it (a host all-reduce each iteration while one
        is under way; nothing otherwise)."""

        if self._pending is not None and async_save_done(self._pending):
            self._publish()

    def finish(self) -> None:
        """Wait for a background save and publish it: before the next save and at the end of the run."""
        if self._pending is not None:
            self._publish()

    def _publish(self) -> None:
        pending, self._pending = self._pending, None
        path = publish_async_save(pending)
        self.trainer.engine.print_rank0(f" saved checkpoint at iteration {pending.iteration:7d} to {path} (written "
                                        f"in the background, published at iteration {self.trainer.iteration})")

    def load(self) -> Any:
        """Fill the runner (and schedule, RNG) from --load; the loaded state, or None when there is none."""
        if not self.settings.load:
            return None
        # A mistyped --load is refused with or without --save (a torchrun started by hand has no launcher check).
        check_resume_safety(self.settings.save, self.settings.load, self.settings.finetune)
        engine, s = self.trainer.engine, self.settings
        model = json.loads(json.dumps(engine.plan.model.__dict__)) if engine.plan.model is not None else None
        finetune = s.finetune or (self.pretrained_model_only and s.load_is_pretrained_model)
        assert s.load is not None  # returned above without --load
        foreign = detect_foreign(s.load, s.universal_checkpoint)  # Megatron-LM's or DeepSpeed's folder
        loaded: LoadedState | None
        if foreign is not None:
            from rapidtrain.checkpoint.foreign import load_foreign_checkpoint

            loaded = load_foreign_checkpoint(foreign, engine.runner, engine.lr_scheduler, model, finetune=finetune,
                                             load_optimizer=s.load_optimizer, schedule_from=s.schedule_from,
                                             flags=s.flags)
        else:
            data = (json.loads(engine.plan.to_json()), data_files(engine.plan, with_mtime=True))
            loaded = load_checkpoint(s.load, engine.runner, engine.lr_scheduler, model, finetune=finetune,
                                     load_optimizer=s.load_optimizer, load_rng=s.load_rng,
                                     schedule_from=s.schedule_from, flags=s.flags, data=data)
        if loaded is None:
            engine.print_rank0(f" no checkpoint in {s.load}; starting from scratch")
        else:
            engine.print_rank0(f" loaded checkpoint from {s.load} at iteration {loaded.iteration}")
        return loaded
