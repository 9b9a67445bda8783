"""The built-in models (GPT, BERT, MoE layers), their settings, initialization and size/FLOP counts."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

    from rapidtrain.models.config import ModelConfig

# Loaded on first use: `rapidtrain plan` reads the torch-free modules here (config, attention_backends, hf_config),
# and importing the package must not pull in torch for them (torch alone takes seconds to import).
_EXPORTS = {
    "BertModel": "rapidtrain.models.bert",
    "GPTModel": "rapidtrain.models.gpt",
    "ModelConfig": "rapidtrain.models.config",
    "init_weights": "rapidtrain.models.transformer",
    "tie_weights": "rapidtrain.models.transformer",
}
__all__ = [*_EXPORTS, "build_model"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidtrain.models' has no attribute {name!r}")


def build_model(config: ModelConfig, seed: int | None = 1234) -> nn.Module:
    """GPT or BERT by `config.model_type`, initialized from `seed` (Megatron's default seed 1234).

    Built under `torch.device("meta")` nothing is initialized: call `model.to_empty(device=...)`
    then `init_weights(model, seed)` after parallelizing. `seed=None` skips initialization.
    With `config.hf_weights` (a Hugging Face folder) the weights are then read from it
    (`load_hf_weights`, which also takes a sharded model).
    """
    from rapidtrain.models.bert import BertModel
    from rapidtrain.models.gpt import GPTModel
    from rapidtrain.models.transformer import init_weights

    models = {"gpt": GPTModel, "bert": BertModel}
    if config.model_type not in models:
        raise ValueError(f"unknown model_type {config.model_type!r}: choose one of {sorted(models)}")
    with _skip_meta_init(seed is None):
        model = models[config.model_type](config)
    if seed is not None:
        init_weights(model, seed)
        if config.hf_weights:
            from rapidtrain.models.hf_weights import load_hf_weights

            load_hf_weights(model, config.hf_weights)
    return model


def _skip_meta_init(uninitialized: bool) -> Any:
    """While building an uninitialized model on the meta device, skip torch.nn.init's calls in the layers'
    reset_parameters: on meta they set nothing, and the first one imports torch._dynamo (~1.5 s of `rapidtrain
    plan`, which builds one-layer models on meta to count parameter shapes)."""
    import contextlib

    import torch
    from torch.overrides import TorchFunctionMode

    class SkipInit(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            if getattr(func, "__module__", None) == "torch.nn.init":
                return args[0] if args else kwargs["tensor"]
            return func(*args, **(kwargs or {}))

    meta = torch.get_default_device().type == "meta"
    return SkipInit() if uninitialized and meta else contextlib.nullcontext()
