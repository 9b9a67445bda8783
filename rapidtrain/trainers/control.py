"""When the loop saves and when it stops: the checkpointer owns the save interval and the final save; the
stop signal turns SIGTERM (sent by schedulers and torchrun on shutdown) into a request the loop agrees on."""

from __future__ import annotations

import json
import signal
import time
from typing import Any

from rapidtrain.arguments import flag_values
from rapidtrain.plan import CheckpointSettings, TrainingSettings


class StopSignal:
    """SIGTERM asks the loop to save and exit cleanly; the handler stays until `restore()` (after the final
    save), so a second SIGTERM during that save does not kill it."""

    def __init__(self) -> None:
        self.received = False
        self._previous = signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum: int, frame: Any) -> None:
        self.received = True

    def restore(self) -> None:
        signal.signal(signal.SIGTERM, self._previous)


class StopConditions:
    """--exit-interval (the same on every rank), and the requests a rank makes alone (SIGTERM,
    --exit-duration-in-mins), which the loop agrees on with the iteration's other decisions."""

    def __init__(self, settings: TrainingSettings) -> None:
        self.settings = settings
        self.started = time.time()
        self.signal = StopSignal()

    def requested(self) -> bool:
        minutes = self.settings.exit_duration_in_mins
        return self.signal.received or bool(minutes and time.time() - self.started > minutes * 60)

    def interval_reached(self, iteration: int) -> bool:
        interval = self.settings.exit_interval
        return bool(interval and iteration % interval == 0)

    def close(self) -> None:
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
        # Set by fine-tuning templates: a pretrained model named by --pretrained-model-name-or-path is loaded
        # model only (as --finetune), the run starting at iteration 0 on its own data.
        self.pretrained_model_only = False

    def open(self) -> None:
        """Before anything is loaded or saved: rank 0 takes --save for this run (one writer per folder), refuses
        to overwrite checkpoints it did not load, and cleans what killed saves left."""
        if not self.enabled or self.trainer.engine.rank != 0:
            return
        from rapidtrain.save_folder import prepare_save_folder

        self._lock, cleaned = prepare_save_folder(self.settings.save, self.settings.load)
        for line in cleaned:
            print(f" {line}", flush=True)

    def close(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    @property
    def enabled(self) -> bool:
        return bool(self.settings.save)

    def request(self) -> None:
        """Save at the end of this iteration, whatever the interval (the template's state changed)."""
        self._requested = True

    def maybe_save(self, iteration: int) -> None:
        interval = self.settings.save_interval
        due = self._requested or bool(interval and iteration % interval == 0)
        self._requested = False
        if due:
            self.save(iteration, force=True)

    def save(self, iteration: int, force: bool = False) -> None:
        """Save the trainer's state at `iteration` (unless it was already saved there and nothing changed)."""
        if not self.enabled or (self.saved_at == iteration and not force):
            return
        from rapidtrain.checkpoint import save_checkpoint

        trainer, engine = self.trainer, self.trainer.engine
        config = {"args": json.loads(json.dumps(flag_values(engine.args), default=str)),
                  "plan": json.loads(engine.plan.to_json())}
        path = save_checkpoint(self.settings.save, iteration, engine.runner, engine.lr_scheduler,
                               trainer.consumed_samples, config, extra=trainer.checkpoint_extra())
        self.saved_at = iteration
        engine.print_rank0(f" saved checkpoint at iteration {iteration:7d} to {path}")

    def load(self) -> Any:
        """Fill the runner (and schedule, RNG) from --load; the loaded state, or None when there is none."""
        if not self.settings.load:
            return None
        from rapidtrain.checkpoint import load_checkpoint

        engine, s = self.trainer.engine, self.settings
        model = json.loads(json.dumps(engine.plan.model.__dict__)) if engine.plan.model is not None else None
        finetune = s.finetune or (self.pretrained_model_only and s.load_is_pretrained_model)
        loaded = load_checkpoint(s.load, engine.runner, engine.lr_scheduler, model, finetune=finetune,
                                 load_optimizer=s.load_optimizer, load_rng=s.load_rng, schedule_from=s.schedule_from)
        if loaded is None:
            engine.print_rank0(f" no checkpoint in {s.load}; starting from scratch")
        else:
            engine.print_rank0(f" loaded checkpoint from {s.load} at iteration {loaded.iteration}")
        return loaded
