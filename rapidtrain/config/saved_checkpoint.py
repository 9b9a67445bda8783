"""A checkpoint's saved flags and model settings, resolved as today's flags would be: `rapidtrain generate` and the
export script rebuild the model a checkpoint holds from them (older checkpoints carry only their flags)."""

from __future__ import annotations

import argparse
import math
import types
import typing
from pathlib import Path
from typing import Any

from rapidtrain.checkpoint.checkpointer import COMMON_FILE, CheckpointError, read_common
from rapidtrain.config.arguments import build_parser
from rapidtrain.config.resolve import model_config_from_args
from rapidtrain.models.config import ModelConfig, shape_past_bounds
from rapidtrain.models.hf_config import trains_builtin_model


def saved_args(directory: Path) -> argparse.Namespace:
    """The flags the checkpoint was saved with; flags added since then take today's defaults."""
    defaults = vars(build_parser().parse_args([]))
    return argparse.Namespace(**(defaults | (read_common(directory).get("args") or {})))


_COUNTS = ("num_layers", "hidden_size", "num_attention_heads", "seq_length", "max_position_embeddings", "vocab_size")


def _of_type(value: Any, hint: Any) -> bool:
    """`value` (read from JSON) is of the type `hint` names: a ModelConfig field's annotation."""
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return value in args
    if origin in (typing.Union, types.UnionType):
        return any(_of_type(value, arg) for arg in args)
    if origin is tuple:
        return isinstance(value, (list, tuple)) and all(type(v) is int and v >= 0 for v in value)
    if hint is bool:
        return isinstance(value, bool)
    if hint is int:
        return type(value) is int and value >= 0
    if hint is float:
        return type(value) in (int, float) and math.isfinite(value) and value >= 0
    if hint is type(None):
        return value is None
    return isinstance(value, hint) if isinstance(hint, type) else True


def saved_model_config(directory: Path) -> ModelConfig | None:
    """The built-in model's settings saved with the checkpoint's plan; None for a Hugging Face model's
    checkpoint. The Hugging Face folder that initialised it (if any) is not needed again: the weights are in
    the checkpoint."""
    common = read_common(directory)
    saved_plan = common.get("plan") or {}
    if saved_plan.get("script_model"):  # a user script's own model: no built-in model to rebuild
        return None
    model = saved_plan.get("model")
    if model:
        hints = typing.get_type_hints(ModelConfig)
        if not isinstance(model, dict) or any(not _of_type(v, hints[k]) or (k in _COUNTS and not v)
                                              for k, v in model.items() if k in hints):
            raise CheckpointError(f"{directory / COMMON_FILE}: damaged: its plan's model settings are not a built-in "
                                  "model's (a value of the wrong type); use another iteration or --load folder.")
        if shape_past_bounds(model):
            raise CheckpointError(f"{directory / COMMON_FILE}: damaged: its plan's model settings give "
                                  f"{', '.join(shape_past_bounds(model))}, past any real model's size; use another "
                                  "iteration or --load folder.")
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items() if k in hints}
        return ModelConfig(**{**values, "hf_weights": None})
    # older checkpoints: the model is rebuilt from the saved flags
    args = saved_args(directory)
    try:
        if not trains_builtin_model(args) or not getattr(args, "padded_vocab_size", None):
            return None
        args.pretrained_model_name_or_path, args.builtin_from_pretrained = None, False
        if shape_past_bounds(vars(args)):
            raise CheckpointError(f"{directory / COMMON_FILE}: damaged: its saved flags give "
                                  f"{', '.join(shape_past_bounds(vars(args)))}, past any real model's size; use "
                                  "another iteration or --load folder.")
        return model_config_from_args(args, args.padded_vocab_size)
    except (TypeError, ValueError, AttributeError) as error:  # saved flags of the wrong type
        raise CheckpointError(f"{directory / COMMON_FILE}: damaged: its saved flags do not describe a model "
                              f"({type(error).__name__}: {error}); use another iteration or --load folder.") from None
