"""rapidtrain: a Megatron-style training launcher that speaks PAI-Rapidformer's command line.

The public API loads lazily, so `import rapidtrain` pulls in neither DeepSpeed nor Transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "rapidtrain.train.engine",
    "RapidformerEngine": "rapidtrain.train.engine",
    "get_args": "rapidtrain.train.engine",
    "Trainer": "rapidtrain.train.trainer",
    "PreTrainer": "rapidtrain.train.pretrainer",
    "Finetuner": "rapidtrain.train.finetuner",
    # Megatron-LM's user-code API (rapidtrain/compat/megatron.py), for scripts written against Megatron.
    "get_tokenizer": "rapidtrain.compat.megatron",
    "print_rank_0": "rapidtrain.compat.megatron",
    "print_rank_last": "rapidtrain.compat.megatron",
    "get_timers": "rapidtrain.compat.megatron",
    "average_losses_across_data_parallel_group": "rapidtrain.compat.megatron",
    "get_ltor_masks_and_position_ids": "rapidtrain.compat.megatron",
    "build_train_valid_test_datasets": "rapidtrain.compat.megatron",
    "ModelType": "rapidtrain.compat.megatron",
    "GPTModel": "rapidtrain.compat.megatron",
    "BertModel": "rapidtrain.compat.megatron",
    "megatron_pretrain": "rapidtrain.compat.megatron",
    # Rapidformer's names beyond the three templates above (rapidtrain/compat/rapidformer.py): `from rapidformer
    # import X` becomes `from rapidtrain import X`. Its GPTModel (which returns the MoE balancing losses) is
    # rapidtrain.rapidformer.GPTModel; rapidtrain.GPTModel is Megatron's.
    "GPTFinetuner": "rapidtrain.compat.rapidformer",
    "GPTDataset": "rapidtrain.compat.rapidformer",
    "PETDataset": "rapidtrain.compat.rapidformer",
    "build_pretrain_huggingface_bert_datasets": "rapidtrain.compat.rapidformer",
}
_MODULES = {"mpu": "rapidtrain.compat.mpu"}  # `from rapidtrain import mpu`, as `from megatron import mpu`
__all__ = [*_EXPORTS, *_MODULES, "__version__"]


def __getattr__(name: str) -> Any:
    if name == "megatron_pretrain":  # Megatron's pretrain(); rapidtrain.pretrain is the built-in entry module
        return importlib.import_module(_EXPORTS[name]).pretrain
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    if name in _MODULES:
        return importlib.import_module(_MODULES[name])
    raise AttributeError(f"module 'rapidtrain' has no attribute {name!r}")
