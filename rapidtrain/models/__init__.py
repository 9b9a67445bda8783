"""The built-in models (GPT, BERT, MoE layers), their settings, initialization and size/FLOP counts."""

from __future__ import annotations

from torch import nn

from rapidtrain.models.bert import BertModel
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.gpt import GPTModel
from rapidtrain.models.transformer import init_weights, tie_weights

__all__ = ["BertModel", "GPTModel", "ModelConfig", "build_model", "init_weights", "tie_weights"]


def build_model(config: ModelConfig, seed: int | None = 1234) -> nn.Module:
    """GPT or BERT by `config.model_type`, initialized from `seed` (Megatron's default seed 1234).

    Built under `torch.device("meta")` nothing is initialized: call `model.to_empty(device=...)`
    then `init_weights(model, seed)` after parallelizing. `seed=None` skips initialization.
    With `config.hf_weights` (a Hugging Face folder) the weights are then read from it
    (`load_hf_weights`, which also takes a sharded model).
    """
    models = {"gpt": GPTModel, "bert": BertModel}
    if config.model_type not in models:
        raise ValueError(f"unknown model_type {config.model_type!r}: choose one of {sorted(models)}")
    model = models[config.model_type](config)
    if seed is not None:
        init_weights(model, seed)
        if config.hf_weights:
            from rapidtrain.models.hf_weights import load_hf_weights

            load_hf_weights(model, config.hf_weights)
    return model
