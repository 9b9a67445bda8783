"""Models built on the meta device for sharded layouts: no rank ever holds the whole model.

The plan decides (`plan.switches.build_on_meta`): the built-in model is created under `torch.device("meta")`
(shapes only), split and wrapped as the layout says (pipeline stages, tensor-parallel DTensors, FSDP2 shards),
then each rank allocates only what it holds (`to_empty`) and initialises it. The built-in models seed every
parameter by (seed, name) and draw it on the CPU, so a shard gets exactly the values the whole model would have
had, whatever the layout: at most one whole parameter exists at a time while its shard is cut from it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from rapidtrain.config.settings import Plan


def build_model_for(plan: Plan) -> nn.Module:
    """The plan's built-in model: on meta (nothing allocated) when the plan builds on meta, else whole and
    initialised (from the Hugging Face folder too, when the plan names one)."""
    from rapidtrain.models import build_model

    assert plan.model is not None, "the plan trains no built-in model"
    if plan.switches.build_on_meta:
        with torch.device("meta"):
            return with_adapters(build_model(plan.model, seed=None), plan)
    return with_adapters(build_model(plan.model, seed=plan.training.seed), plan)


def with_adapters(model: nn.Module, plan: Plan) -> nn.Module:
    """The built-in model with the plan's LoRA adapters, the rest frozen; adapters on a model that holds values get
    them now, from their names (as materialize gives them to one built on meta), so every layout starts alike."""
    lora = plan.lora
    if lora is None or not lora.builtin or lora.rank <= 0:
        return model
    from rapidtrain.models.lora import add_builtin_lora, is_adapter_weight
    from rapidtrain.models.transformer import init_weights

    add_builtin_lora(model, lora)
    if not is_on_meta(model):
        init_weights(model, plan.training.seed, only=is_adapter_weight)
    return model


def is_on_meta(model: nn.Module) -> bool:
    return any(p.is_meta for p in model.parameters())


def materialize(model: nn.Module, device: torch.device, plan: Plan, parts: Sequence[nn.Module] = ()) -> None:
    """Allocate this rank's parameters on `device` and initialise them as the whole model's would be.

    Call after splitting and wrapping, before the optimizer exists. `parts`: the wrapped modules when the model
    is wrapped in several (a pipeline rank's virtual stages), so each FSDP unit resets its own shards.
    """
    from rapidtrain.models import init_weights, tie_weights

    for part in parts or [model]:
        part.to_empty(device=device)
    tie_weights(model)  # plain parameters come back as new objects (DTensors keep theirs)
    init_weights(model, plan.training.seed)
    if plan.model is not None and plan.model.hf_weights:
        from rapidtrain.models.hf_weights import load_hf_weights

        load_hf_weights(model, plan.model.hf_weights)
