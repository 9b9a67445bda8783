"""The built-in BERT: a bidirectional pre-LN encoder (Megatron BERT's default; post-LN as the original
BERT with `post_layernorm`) with a masked-LM head tied to the word embeddings and an optional binary
(next-sentence) head on the pooled [CLS].

Like GPT, parts may be None for a pipeline stage: no `embedding` → input is hidden states; no
`lm_head` → output is hidden states.
"""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from rapidtrain.models.config import ModelConfig
from rapidtrain.models.mlp import gelu
from rapidtrain.models.transformer import (
    Embedding,
    OutputLayer,
    TokenCrossEntropy,
    TransformerLayer,
    check_model_config,
    init_weights,
    make_norm,
    run_layers,
    tie_weights,
)


class BertLMHead(nn.Module):
    """dense (h → h) + GELU + norm, then the decoder `output` (tied weight, own bias)."""

    def __init__(self, config: ModelConfig, tied_weight: nn.Parameter | None) -> None:
        super().__init__()
        h = config.hidden_size
        self.openai_gelu = config.openai_gelu
        self.dense = nn.Linear(h, h)
        self.norm = make_norm(config)
        self.output = OutputLayer(h, config.vocab_size, tied_weight, bias=True)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.output(self.norm(gelu(self.dense(hidden), self.openai_gelu)))


class Pooler(nn.Module):
    """tanh(dense(hidden of the first token)), the sentence summary the binary head reads."""

    def __init__(self, hidden_size: int) -> None:
        super().__init__()
        self.dense = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.dense(hidden[:, 0]))


class BertModel(nn.Module):
    """embedding → layers → final_norm → lm_head (+ pooler → binary_head when enabled) → loss."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_model_config(config)
        self.config = config
        self.embedding: Embedding | None = Embedding(config)
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, i, causal=False) for i in range(config.num_layers)}
        )
        self.final_norm: nn.Module | None = None if config.post_layernorm else make_norm(config)
        tied = cast(nn.Parameter, self.embedding.word_embeddings.weight) if config.tie_embeddings else None
        self.lm_head: BertLMHead | None = BertLMHead(config, tied)
        self.pooler = Pooler(config.hidden_size) if config.bert_binary_head else None
        self.binary_head = nn.Linear(config.hidden_size, 2) if config.bert_binary_head else None
        self.loss = TokenCrossEntropy()

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
        lm_labels: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Token ids [b, s] and padding mask [b, s] (1 = keep) → MLM loss [b, s] fp32 with
        `lm_labels` (labels < 0 give 0), else MLM logits [b, s, V]; with the binary head on, a
        tuple (that, binary logits [b, 2]). Hidden states when this stage has no `lm_head`.
        """
        if self.embedding is not None:
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)
        else:
            hidden = input_ids
        hidden = run_layers(self.layers, hidden, self.config, position_ids, attention_mask, causal=False)
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        if self.lm_head is None:
            return hidden
        lm_logits = self.lm_head(hidden)
        lm_output = lm_logits if lm_labels is None else self.loss(lm_logits, lm_labels)
        if self.binary_head is None:
            return lm_output
        assert self.pooler is not None  # built together with the binary head
        return lm_output, self.binary_head(self.pooler(hidden))

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> BertModel:
        """Materialize from meta, then restore the embedding/decoder tie that new Parameters break."""
        super().to_empty(device=device, recurse=recurse)
        tie_weights(self)
        return self

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)
