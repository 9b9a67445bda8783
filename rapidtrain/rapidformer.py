"""Rapidformer's names for its Megatron-model API: `from rapidtrain.rapidformer import GPTModel, GPTDataset`
replaces `from rapidformer.model.transformer.gpt_model import GPTModel` (and `rapidformer.model_adapter.
parallel_transformer`) and `from rapidformer.dataset.gpt_dataset import GPTDataset`."""

from rapidtrain.compat.rapidformer import (
    GPTDataset,
    GPTFinetuner,
    GPTModel,
    PETDataset,
    build_pretrain_huggingface_bert_datasets,
)
from rapidtrain.train.engine import Engine as RapidformerEngine
from rapidtrain.train.engine import get_args
from rapidtrain.train.finetuner import Finetuner
from rapidtrain.train.pretrainer import PreTrainer

__all__ = ["Finetuner", "GPTDataset", "GPTFinetuner", "GPTModel", "PETDataset", "PreTrainer", "RapidformerEngine",
           "build_pretrain_huggingface_bert_datasets", "get_args"]
