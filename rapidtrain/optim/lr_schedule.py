"""Learning-rate schedule with Megatron's semantics, counted in samples.

Warm-up, then constant / linear / cosine / inverse-square-root / WSD decay, as Megatron-Core's
`OptimizerParamScheduler` computes it; `LRScheduler` writes the value into an optimizer's groups.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch

DecayStyle = Literal["constant", "linear", "cosine", "inverse-square-root", "WSD"]
WSDDecayStyle = Literal["linear", "cosine", "exponential", "minus_sqrt"]


@dataclass(frozen=True, kw_only=True)
class LRScheduleSettings:
    """The schedule in samples (one iteration advances it by the global batch size).

    `init_lr` is where warm-up starts (Megatron's `--lr-warmup-init`, 0 by default). With the `WSD`
    style the rate stays at `lr` until the last `wsd_decay_samples` of the decay horizon, then anneals
    to `min_lr` by `wsd_decay_style`.
    """

    lr: float
    decay_samples: int
    min_lr: float = 0.0
    decay_style: DecayStyle = "linear"
    warmup_samples: float = 0
    init_lr: float = 0.0
    wsd_decay_samples: int | None = None
    wsd_decay_style: WSDDecayStyle = "linear"

    def __post_init__(self) -> None:
        problems = []
        if self.decay_samples <= 0:
            problems.append(
                f"the decay horizon is {self.decay_samples} samples; set --train-iters or "
                "--lr-decay-iters (or --lr-decay-samples) to a positive number"
            )
        if not 0.0 <= self.min_lr <= self.lr:
            problems.append(f"--min-lr {self.min_lr} must lie between 0 and --lr {self.lr}")
        if not 0.0 <= self.init_lr <= self.lr:
            problems.append(f"--lr-warmup-init {self.init_lr} must lie between 0 and --lr {self.lr}")
        if self.warmup_samples < 0 or (self.decay_samples > 0 and self.warmup_samples >= self.decay_samples):
            problems.append(
                f"warm-up ({self.warmup_samples} samples) must be shorter than the decay horizon "
                f"({self.decay_samples} samples); lower --lr-warmup-iters / --lr-warmup-fraction "
                "or raise --lr-decay-iters"
            )
        if self.decay_style == "WSD" and not (self.wsd_decay_samples and self.wsd_decay_samples > 0):
            problems.append("--lr-decay-style WSD needs --lr-wsd-decay-iters (or -samples) > 0")
        if problems:
            raise ValueError("learning-rate schedule: " + "; ".join(problems))


def lr_schedule_from_iters(
    lr: float,
    min_lr: float,
    style: DecayStyle,
    train_iters: int | None,
    lr_decay_iters: int | None,
    lr_warmup_iters: int,
    lr_warmup_fraction: float | None,
    global_batch_size: int,
    lr_warmup_init: float = 0.0,
    lr_wsd_decay_iters: int | None = None,
    lr_wsd_decay_style: WSDDecayStyle = "linear",
) -> LRScheduleSettings:
    """Translate Megatron's iteration flags into samples.

    decay horizon = (`--lr-decay-iters` or `--train-iters`) × global batch; warm-up =
    `--lr-warmup-fraction` × decay horizon, or `--lr-warmup-iters` × global batch.
    """
    if lr_warmup_fraction is not None and lr_warmup_iters:
        raise ValueError("--lr-warmup-fraction and --lr-warmup-iters are both set; keep only one of them")
    if lr_warmup_fraction is not None and not 0.0 <= lr_warmup_fraction < 1.0:
        raise ValueError(f"--lr-warmup-fraction {lr_warmup_fraction} must be in [0, 1)")
    decay_samples = (lr_decay_iters or train_iters or 0) * global_batch_size
    if lr_warmup_fraction is not None:
        # Megatron keeps this product as a float; rounding it would move the warm-up's end.
        warmup_samples: float = lr_warmup_fraction * decay_samples
    else:
        warmup_samples = lr_warmup_iters * global_batch_size
    wsd_samples = lr_wsd_decay_iters * global_batch_size if lr_wsd_decay_iters is not None else None
    return LRScheduleSettings(
        lr=lr,
        min_lr=min_lr,
        decay_style=style,
        decay_samples=decay_samples,
        warmup_samples=warmup_samples,
        init_lr=lr_warmup_init,
        wsd_decay_samples=wsd_samples,
        wsd_decay_style=lr_wsd_decay_style,
    )


def lr_schedule_for(schedule: Any, global_batch_size: int, train_iters: int | None) -> LRScheduleSettings:
    """The plan's schedule settings (`plan.ScheduleSettings`, in iterations, or in samples for sample-based
    training) in samples, for a run of `train_iters` iterations of `global_batch_size` samples."""
    if schedule.decay_samples is not None:  # --train-samples: Megatron reads the -samples flags as they are
        if schedule.warmup_fraction is not None:
            warmup: float = schedule.warmup_fraction * schedule.decay_samples
        else:
            warmup = schedule.warmup_samples
        return LRScheduleSettings(lr=schedule.lr, min_lr=schedule.min_lr, decay_style=schedule.decay_style,
                                  decay_samples=schedule.decay_samples, warmup_samples=warmup,
                                  wsd_decay_samples=schedule.wsd_decay_samples,
                                  init_lr=getattr(schedule, "warmup_init", 0.0),
                                  wsd_decay_style=getattr(schedule, "wsd_decay_style", "linear"))
    return lr_schedule_from_iters(
        lr=schedule.lr, min_lr=schedule.min_lr, style=schedule.decay_style, train_iters=train_iters,
        lr_decay_iters=schedule.decay_iters, lr_warmup_iters=schedule.warmup_iters,
        lr_warmup_fraction=schedule.warmup_fraction, global_batch_size=global_batch_size,
        lr_wsd_decay_iters=schedule.wsd_decay_iters, lr_warmup_init=getattr(schedule, "warmup_init", 0.0),
        lr_wsd_decay_style=getattr(schedule, "wsd_decay_style", "linear"))


def learning_rate_at(settings: LRScheduleSettings, samples: float) -> float:
    """The learning rate after `samples` consumed samples (Megatron's `get_lr`)."""
    s = settings
    if s.warmup_samples > 0 and samples <= s.warmup_samples:
        return s.init_lr + (s.lr - s.init_lr) * float(samples) / float(s.warmup_samples)
    # Megatron checks `constant` before the horizon: a constant rate never drops to min_lr.
    if s.decay_style == "constant":
        return s.lr
    if samples > s.decay_samples:
        return s.min_lr
    if s.decay_style == "inverse-square-root":
        warmup = max(s.warmup_samples, 1)
        return max(s.min_lr, s.lr * math.sqrt(warmup) / math.sqrt(max(samples, 1)))
    decay_ratio = float(samples - s.warmup_samples) / float(s.decay_samples - s.warmup_samples)
    return s.min_lr + _decay_coefficient(s, samples, decay_ratio) * (s.lr - s.min_lr)


def _decay_coefficient(s: LRScheduleSettings, samples: float, decay_ratio: float) -> float:
    if s.decay_style == "linear":
        return 1.0 - decay_ratio
    if s.decay_style == "cosine":
        return 0.5 * (math.cos(math.pi * decay_ratio) + 1.0)
    if s.decay_style == "WSD":
        assert s.wsd_decay_samples is not None  # checked in LRScheduleSettings
        anneal_start = s.decay_samples - s.wsd_decay_samples
        if samples <= anneal_start:
            return 1.0
        ratio = float(samples - anneal_start) / float(s.wsd_decay_samples)
        if s.wsd_decay_style == "linear":
            return 1.0 - ratio
        if s.wsd_decay_style == "cosine":
            return 0.5 * (math.cos(math.pi * ratio) + 1.0)
        if s.wsd_decay_style == "exponential":
            return 2.0 * math.pow(0.5, ratio) - 1.0
        if s.wsd_decay_style == "minus_sqrt":
            return 1.0 - math.sqrt(ratio)
        raise ValueError(f"--lr-wsd-decay-style {s.wsd_decay_style!r} is not one of {WSDDecayStyle}")
    raise ValueError(f"--lr-decay-style {s.decay_style!r} is not one of {DecayStyle}")


def set_group_lr(group: dict[str, Any], value: float) -> None:
    """Set an optimizer group's learning rate. torchao's low-bit AdamW keeps it as a tensor (so its compiled
    step never recompiles) and refuses a float in its place: the value is written into that tensor."""
    if isinstance(group["lr"], torch.Tensor):
        group["lr"].fill_(value)
    else:
        group["lr"] = value


class LRScheduler:
    """Sets `group["lr"]` of every optimizer group from the schedule.

    The caller advances it with `step(increment)` in samples (global batch size per iteration),
    only after an optimizer step that was taken: iterations skipped for an fp16 overflow do not
    advance the schedule, as in Megatron. A group's optional `lr_mult` scales its rate; a group with
    `max_lr` / `min_lr` (Megatron-Core's keys, set for --decoupled-lr) follows the same warm-up and
    decay between its own peak and floor.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, settings: LRScheduleSettings) -> None:
        self.optimizer = optimizer
        self.settings = settings
        self.num_steps = 0  # samples consumed by steps taken so far
        self.step(0)

    def get_lr(self) -> float:
        """The base learning rate now (before any group's `lr_mult`)."""
        return learning_rate_at(self.settings, self.num_steps)

    def get_last_lr(self) -> list[float]:
        """The rate of each group, as torch's schedulers report it."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def step(self, increment: int) -> None:
        """Advance by `increment` samples and write the new rate into the optimizer."""
        self.num_steps += increment
        lr = self.get_lr()
        for group in self.optimizer.param_groups:
            rate = lr if "max_lr" not in group else self.group_lr(group["max_lr"], group["min_lr"])
            set_group_lr(group, rate * group.get("lr_mult", 1.0))

    def group_lr(self, peak: float, floor: float) -> float:
        """The rate now of a group with its own peak and floor: the schedule's shape, those values replaced."""
        return learning_rate_at(replace(self.settings, lr=peak, min_lr=floor), self.num_steps)

    def state_dict(self) -> dict[str, Any]:
        """Megatron's scheduler keys (steps in samples), plus the WSD settings."""
        s = self.settings
        return {
            "max_lr": s.lr,
            "min_lr": s.min_lr,
            "lr_warmup_steps": s.warmup_samples,
            "lr_decay_steps": s.decay_samples,
            "lr_decay_style": s.decay_style,
            "lr_warmup_init": s.init_lr,
            "wsd_decay_steps": s.wsd_decay_samples,
            "lr_wsd_decay_style": s.wsd_decay_style,
            "num_steps": self.num_steps,
        }

    def load_state_dict(self, state_dict: dict[str, Any], schedule_from: str = "same") -> None:
        """Resume at the saved sample count.

        `schedule_from="same"`: the saved schedule must equal the current one, else a ValueError lists the
        differences; "flags" keeps the current flags' schedule (Megatron's `--override-opt_param-scheduler`);
        "checkpoint" takes the saved one (`--use-checkpoint-opt_param-scheduler`).
        """
        if schedule_from == "checkpoint":
            self.settings = replace(self.settings, **{
                name: state_dict[saved] for name, saved in _SAVED_NAMES.items() if saved in state_dict})
        elif schedule_from != "flags":
            differences = _schedule_differences(asdict(self.settings), state_dict)
            if differences:
                raise ValueError(
                    "the checkpoint's learning-rate schedule differs from the flags: "
                    + ", ".join(differences)
                    + "; pass the saved run's values, or override the saved schedule"
                )
        self.num_steps = 0
        self.step(int(state_dict["num_steps"]))


_SAVED_NAMES = {
    "lr": "max_lr",
    "min_lr": "min_lr",
    "warmup_samples": "lr_warmup_steps",
    "decay_samples": "lr_decay_steps",
    "decay_style": "lr_decay_style",
}


def _schedule_differences(current: dict[str, Any], saved: dict[str, Any]) -> list[str]:
    differences = []
    for field_name, saved_name in _SAVED_NAMES.items():
        if saved_name in saved and saved[saved_name] != current[field_name]:
            differences.append(f"{field_name} saved {saved[saved_name]!r}, now {current[field_name]!r}")
    return differences
