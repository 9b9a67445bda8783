"""Megatron's `megatron.training` names: `from rapidtrain.training import pretrain, get_args, get_timers,
get_tokenizer, print_rank_0` replaces `from megatron.training import ...` in a Megatron-written script."""

from rapidtrain.compat.megatron import get_timers, get_tokenizer, pretrain, print_rank_0
from rapidtrain.train.engine import get_args

__all__ = ["get_args", "get_timers", "get_tokenizer", "pretrain", "print_rank_0"]
