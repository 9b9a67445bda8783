"""What resuming checks beyond the tensors: the learning-rate schedule of the saved run against this one's, with
the flags that changed named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidtrain.core.errors import UserError
from rapidtrain.optim.lr_schedule import LRScheduler


class ResumeError(UserError, ValueError):
    """The checkpoint cannot be continued with these flags."""


# The flags the learning-rate schedule is computed from (in samples: the batch and the run's length count too).
SCHEDULE_FLAGS = ("lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_decay_samples", "lr_warmup_iters",
                  "lr_warmup_fraction", "lr_warmup_samples", "lr_warmup_init", "lr_wsd_decay_iters",
                  "lr_wsd_decay_samples", "lr_wsd_decay_style", "train_iters", "train_samples", "global_batch_size",
                  "rampup_batch_size", "step_batch_size_schedule")


def changed_schedule_flags(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The schedule's flags whose values differ between the saved run and this one, as `--flag (checkpoint A,
    now B)`; flags a side did not record are not compared."""
    names: tuple[str, ...] = SCHEDULE_FLAGS
    if any(saved.get(name) and saved.get(name) == current.get(name) for name in ("lr_decay_iters", "lr_decay_samples")):
        names = tuple(n for n in names if n not in ("train_iters", "train_samples"))  # the decay horizon is set
    return [f"--{name.replace('_', '-')} (checkpoint {saved[name]}, now {current[name]})"
            for name in names if name in saved and name in current and saved[name] != current[name]]


def check_optimizer_groups(saved: dict[str, Any], current: dict[str, Any], directory: Path) -> None:
    """--decoupled-lr gives the embedding and output layer optimizer groups of their own: a saved optimizer state
    with the other grouping cannot load (torch names a missing group key, which reads as damage)."""
    before, now = saved.get("decoupled_lr"), current.get("decoupled_lr")
    if (before is None) == (now is None):
        return
    had = f"with --decoupled-lr {before}" if before is not None else "without --decoupled-lr"
    has = f"with --decoupled-lr {now}" if now is not None else "without it"
    raise ResumeError(f"--load {directory}: its optimizer state was saved {had}, and this run is {has}, which changes "
                      "the optimizer's parameter groups (the embedding and output layer have their own with it). Give "
                      "--no-load-optim (or --finetune) to start a fresh optimizer from the saved weights, or "
                      f"{'drop --decoupled-lr' if now is not None else 'give the saved --decoupled-lr'} to continue "
                      "the saved run.")


# The saved state of rapidtrain's LRScheduler: each entry's type (a damaged common.json is refused before use).
_SAVED_SCHEDULE_TYPES: dict[str, type | tuple[type, ...]] = {
    "num_steps": int, "max_lr": (int, float), "min_lr": (int, float), "lr_warmup_steps": (int, float),
    "lr_decay_steps": (int, float, type(None)), "lr_decay_style": str}  # warm-up/decay: fractions of a horizon


def _damaged_schedule(saved: Any) -> list[str]:
    if not isinstance(saved, dict):
        return ["lr_scheduler"]
    return [name for name, kinds in _SAVED_SCHEDULE_TYPES.items() if name in saved and (
        not isinstance(saved[name], kinds) or isinstance(saved[name], bool)
        or (isinstance(saved[name], int | float) and name.endswith("steps") and saved[name] < 0))
        ] + ([] if "num_steps" in saved else ["num_steps"])


def load_schedule(lr_scheduler: Any, saved: dict[str, Any], schedule_from: str, directory: Path,
                   changed: list[str]) -> None:
    if isinstance(lr_scheduler, LRScheduler) and _damaged_schedule(saved):
        raise ResumeError(f"--load {directory}: the learning-rate schedule in its common.json is damaged (missing or "
                          f"wrong: {', '.join(_damaged_schedule(saved))}); resume from another iteration or --load "
                          "folder.")
    try:
        if isinstance(lr_scheduler, LRScheduler):
            lr_scheduler.load_state_dict(saved, schedule_from=schedule_from)
        else:
            lr_scheduler.load_state_dict(saved)
    except ValueError as error:
        keep = ("--override-opt_param-scheduler keeps these flags' schedule, --use-checkpoint-opt_param-scheduler "
                "the saved one")
        if changed:
            raise ResumeError(f"--load {directory}: the learning-rate schedule would change, since "
                              f"{', '.join(changed)}: give the saved run's value to continue it, or {keep}.") from None
        raise ResumeError(f"--load {directory}: {error} (the flags --lr, --min-lr, --lr-decay-style, --lr-decay-iters "
                          f"and the warm-up must be the saved run's to continue it; {keep}).") from None
