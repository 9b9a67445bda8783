"""The black-box command's Hugging Face tasks: records → features, the Auto class, loss and metrics.

One class per task (`Task` in base.py); `build_task` picks it by `--task` (`causal_lm` is `casual_lm`).
"""

from __future__ import annotations

from typing import Any

import torch

from rapidtrain.config.arguments import TASK_ALIASES
from rapidtrain.core.errors import UserError
from rapidtrain.models.lora import LoraSettings, add_lora, prepare_quantised, quantization_config
from rapidtrain.tasks.base import Task, load_model
from rapidtrain.tasks.classification import SequenceClassification, TokenClassification
from rapidtrain.tasks.language_modeling import CausalLM, MaskedLM, Seq2SeqLM
from rapidtrain.tasks.question_answering import QuestionAnswering

# Each task is named once, by its class (`Task.name`, the --task value); the flags list the same names in
# arguments.TASKS, and its aliases (Rapidformer's `casual_lm` spelled correctly) are accepted here too.
_TASKS = (SequenceClassification, TokenClassification, QuestionAnswering, MaskedLM, CausalLM, Seq2SeqLM)
TASK_CLASSES: dict[str, type[Task]] = {task.name: task for task in _TASKS}
TASK_CLASSES |= {alias: TASK_CLASSES[name] for alias, name in TASK_ALIASES.items()}
NEEDS_FAST_TOKENIZER = ("token_classification", "question_answering")


def build_task(
    name: str, tokenizer: Any, seq_length: int, dynamic_shape: bool = False, seed: int = 0,
    padding_free: bool = False,
) -> Task:
    if name not in TASK_CLASSES:
        raise ValueError(
            f"--task {name}: not a fine-tuning task; choose one of {', '.join(TASK_CLASSES)} "
            "(--task pretraining runs the built-in PreTrainer)"
        )
    if padding_free:
        if TASK_CLASSES[name] is not CausalLM:
            raise UserError(f"--padding-free packs the casual_lm task's sequences; --task {name} does not use it")
        return CausalLM(tokenizer, seq_length, dynamic_shape, seed, padding_free=True)
    return TASK_CLASSES[name](tokenizer, seq_length, dynamic_shape, seed)


def load_task_model(task: Task, path: str, lora: LoraSettings | int = 0, device: Any = None,
                    compute_dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> Any:
    """The task's Auto class from the local folder (new heads initialised from the seed), with LoRA adapters
    (and a 4/8-bit base) as `lora` says; an int is a rank with the other settings at their defaults.
    `attn_implementation` (--attention-backend): transformers' attention kernel; None keeps its default."""
    settings = lora if isinstance(lora, LoraSettings) else LoraSettings(rank=lora)
    bits = settings.load_in_bits
    quantization = quantization_config(bits, compute_dtype) if bits else None
    kwargs = task.model_kwargs()
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    try:
        model = load_model(task.auto_class, path, quantization=quantization, device=device, **kwargs)
    except (ValueError, ImportError) as error:
        if attn_implementation is None or "attn" not in str(error).lower():
            raise
        raise UserError(f"--attention-backend: the model in {path} cannot load with attn_implementation="
                        f"{attn_implementation!r} ({error}); choose sdpa or eager") from error
    if bits:
        model = prepare_quantised(model)
    return add_lora(model, settings, task.peft_task_type) if settings.rank > 0 else model


__all__ = ["TASK_CLASSES", "Task", "build_task", "load_task_model"]
