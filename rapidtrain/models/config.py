"""Settings of the built-in transformer models: the model's own part of the plan, nothing else."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal


@dataclass(frozen=True)
class ModelConfig:
    """Shape and regularisation of a built-in GPT or BERT.

    `vocab_size` is already padded (a multiple of make-vocab-size-divisible-by × TP), so every
    layout builds the same embedding table. `num_experts` has one entry per layer: 0 is a dense MLP.
    """

    model_type: Literal["gpt", "bert"] = "gpt"
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    ffn_hidden_size: int | None = None  # None: 4 × hidden_size
    seq_length: int = 128
    max_position_embeddings: int = 128
    vocab_size: int = 128
    hidden_dropout: float = 0.1
    attention_dropout: float = 0.1
    init_method_std: float = 0.02
    layernorm_epsilon: float = 1e-5
    position_embedding_type: Literal["learned_absolute", "rope"] = "learned_absolute"
    rotary_base: int = 10000
    tie_embeddings: bool = True
    bert_binary_head: bool = False
    num_tokentypes: int = 0  # BERT: 2 when the binary head is on
    num_experts: tuple[int, ...] = field(default_factory=tuple)  # per layer; empty: all dense
    moe_router_topk: int = 1
    moe_capacity_factor: float = 1.0
    moe_min_capacity: int = 4
    moe_token_dropping: bool = True
    moe_aux_loss_coeff: float = 0.01
    moe_z_loss_coeff: float = 0.0
    moe_jitter_eps: float = 0.0

    @property
    def ffn_size(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def experts_in_layer(self, layer: int) -> int:
        return self.num_experts[layer] if self.num_experts else 0
