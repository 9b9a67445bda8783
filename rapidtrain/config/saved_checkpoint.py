"""A checkpoint's saved flags and model settings, resolved as today's flags would be: `rapidtrain generate` and the
export script rebuild the model a checkpoint holds from them (older checkpoints carry only their flags)."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from rapidtrain.checkpoint.checkpointer import read_common
from rapidtrain.config.arguments import build_parser
from rapidtrain.config.resolve import model_config_from_args
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_config import trains_builtin_model


def saved_args(directory: Path) -> argparse.Namespace:
    """The flags the checkpoint was saved with; flags added since then take today's defaults."""
    defaults = vars(build_parser().parse_args([]))
    return argparse.Namespace(**(defaults | read_common(directory)["args"]))


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
        fields = {f.name for f in dataclasses.fields(ModelConfig)}
        values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in model.items() if k in fields}
        return ModelConfig(**{**values, "hf_weights": None})
    # older checkpoints: the model is rebuilt from the saved flags
    args = saved_args(directory)
    if not trains_builtin_model(args) or not getattr(args, "padded_vocab_size", None):
        return None
    args.pretrained_model_name_or_path, args.builtin_from_pretrained = None, False
    return model_config_from_args(args, args.padded_vocab_size)
