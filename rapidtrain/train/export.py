"""The fine-tuned model as a folder `from_pretrained` loads: full weights gathered from any wrapping (DDP,
FSDP2, ZeroRedundancyOptimizer, DeepSpeed ZeRO 1-3), LoRA adapters merged in, written by rank 0 under a
temporary name and published by a rename, so a reader never sees half a model."""

from __future__ import annotations

import copy
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn

from rapidtrain.checkpoint.checkpointer import publish_folder
from rapidtrain.parallel.data_parallel import unwrap


@dataclass
class ExportRecipe:
    """How to rebuild the model's skeleton on rank 0: its class and config, and the LoRA settings if any."""

    model_class: type
    config: Any
    peft_config: Any = None


def recipe_of(model: nn.Module) -> ExportRecipe | None:
    """Taken before the model is wrapped; None for models that are not Hugging Face `PreTrainedModel`s."""
    peft_config = None
    base = model
    if hasattr(model, "peft_config") and hasattr(model, "get_base_model"):
        peft: Any = model  # a peft model, whose attributes nn.Module's typing does not know
        peft_config = copy.deepcopy(next(iter(peft.peft_config.values())))
        base = peft.get_base_model()
    if not (hasattr(base, "save_pretrained") and hasattr(base, "config")):
        return None
    config = copy.deepcopy(base.config)
    if hasattr(config, "quantization_config"):  # a 4/8-bit base is exported dequantised (full_model_state)
        del config.quantization_config
    return ExportRecipe(type(base), config, peft_config)


def full_model_state(runner: Any) -> dict[str, torch.Tensor]:
    """Every rank takes part (gathers are collective); the full fp32 values come back on rank 0."""
    if hasattr(runner, "checkpoint_state"):  # DeepSpeed: fp32 master weights by parameter name
        return runner.checkpoint_state.model_state(sharded=False)
    from rapidtrain.models.lora import dequantised_state, is_quantised

    module = unwrap(runner.module)
    if is_quantised(module):  # a k-bit base runs unsharded (one process, DDP or OSS): every rank holds it all
        return dequantised_state(module)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    # A model's state dict holds tensors (the declared type covers optimizer state too).
    state = cast(dict[str, torch.Tensor], get_model_state_dict(runner.module, options=options))
    return {
        name: value.detach().float() if value.is_floating_point() else value for name, value in state.items()
    }


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _skeleton(recipe: ExportRecipe, state: dict[str, torch.Tensor]) -> nn.Module:
    """The model class built without memory (meta device), then given the gathered values."""
    with torch.device("meta"):
        model = recipe.model_class(copy.deepcopy(recipe.config))
    if recipe.peft_config is not None:
        from peft import get_peft_model

        model = get_peft_model(model, copy.deepcopy(recipe.peft_config))
    persistent = set(model.state_dict())
    missing = sorted(persistent - set(state))
    if missing:
        raise KeyError(
            f"the gathered weights lack {missing[:5]} ...: the model changed after it was composed"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in persistent}, assign=True)
    return model


def write_model(
    directory: str | Path,
    state: dict[str, torch.Tensor],
    recipe: ExportRecipe | None,
    tokenizer: Any = None,
    files: dict[str, Any] | None = None,
) -> Path | None:
    """Rank 0 writes `directory` (save_pretrained, or model.pt for other models) plus `files` as JSON."""
    final = Path(directory)
    if _rank() != 0:
        return None
    tmp = final.with_name(final.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    if recipe is None:
        torch.save(state, tmp / "model.pt")
    else:
        model: Any = _skeleton(recipe, state)  # a transformers (or peft) model: save_pretrained and the rest
        if recipe.peft_config is not None:
            model.save_pretrained(tmp / "adapter")  # the LoRA adapter alone, for peft users
            model = model.merge_and_unload()
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        model.save_pretrained(tmp)
    # A Hugging Face tokenizer goes beside the model; Megatron's (tasks_main.py) are the user's own --vocab-file.
    if hasattr(tokenizer, "save_pretrained"):
        tokenizer.save_pretrained(tmp)
    for name, content in (files or {}).items():
        with open(tmp / name, "w", encoding="utf-8") as f:
            if name.endswith(".jsonl"):
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in content)
            else:
                json.dump(content, f, indent=2, ensure_ascii=False)
    publish_folder(tmp, final)
    return final
