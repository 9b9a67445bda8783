"""Optimizers by `--optimizers`, Megatron's learning-rate schedule (in samples), fp16 loss scaling."""

from rapidtrain.optim.grad_scaler import LossScaler, LossScaleSettings
from rapidtrain.optim.lamb import LAMB
from rapidtrain.optim.lr_schedule import (
    LRScheduler,
    LRScheduleSettings,
    learning_rate_at,
    lr_schedule_from_iters,
)
from rapidtrain.optim.optimizers import (
    OPTIMIZER_NAMES,
    OptimizerSettings,
    apex_optimizer_class,
    build_optimizer,
    describe_optimizer,
    param_groups,
)

__all__ = [
    "LAMB",
    "OPTIMIZER_NAMES",
    "LRScheduleSettings",
    "LRScheduler",
    "LossScaleSettings",
    "LossScaler",
    "OptimizerSettings",
    "apex_optimizer_class",
    "build_optimizer",
    "describe_optimizer",
    "learning_rate_at",
    "lr_schedule_from_iters",
    "param_groups",
]
