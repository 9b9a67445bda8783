"""rapidtrain: a Megatron-style training launcher that speaks PAI-Rapidformer's command line.

The public API loads lazily, so `import rapidtrain` pulls in neither DeepSpeed nor Transformers.
"""

from __future__ import annotations

import importlib
from typing import Any

__version__ = "0.1.0"

_EXPORTS = {
    "Engine": "rapidtrain.engine",
    "RapidformerEngine": "rapidtrain.engine",
    "get_args": "rapidtrain.engine",
    "Trainer": "rapidtrain.trainers.trainer",
    "PreTrainer": "rapidtrain.trainers.pretrainer",
    "Finetuner": "rapidtrain.trainers.finetuner",
}
__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'rapidtrain' has no attribute {name!r}")
