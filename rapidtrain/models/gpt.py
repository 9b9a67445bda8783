"""The built-in GPT: a decoder-only, pre-norm, Megatron-shaped transformer in plain PyTorch; GPT-2's
architecture by default, Llama's with RMSNorm, SwiGLU, rope, grouped-query attention and no biases.

Pipeline stages are this same class with parts set to None (torchtitan style): without
`embedding` the input is hidden states; without `output` the result is hidden states. `layers` is
a ModuleDict keyed "0", "1", ... so a stage that deletes layers keeps the names of the rest.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from rapidtrain.models.config import ModelConfig
from rapidtrain.models.dropout import dropout
from rapidtrain.models.mtp import MultiTokenPrediction
from rapidtrain.models.transformer import (
    Embedding,
    KVCache,
    OutputLayer,
    StaticKVCache,
    TokenCrossEntropy,
    TransformerLayer,
    cached_positions,
    check_model_config,
    init_weights,
    make_norm,
    run_layers,
    tie_weights,
)


class GPTModel(nn.Module):
    """embedding → layers → final_norm → output (tied to the word embeddings by default) → loss."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        check_model_config(config)
        self.config = config
        self.embedding: Embedding | None = Embedding(config)
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, i, causal=True) for i in range(config.num_layers)}
        )
        self.final_norm: nn.Module | None = None if config.post_layernorm else make_norm(config)
        tied = cast(nn.Parameter, self.embedding.word_embeddings.weight) if config.tie_embeddings else None
        self.output: OutputLayer | None = OutputLayer(config.hidden_size, config.vocab_size, tied, bias=False)
        self.loss = TokenCrossEntropy()
        # Multi-token prediction's depths (mtp.py), after the head so that parameter order keeps the main model's.
        self.mtp: MultiTokenPrediction | None
        self.register_module("mtp", MultiTokenPrediction(config) if config.mtp_num_layers else None)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        attention_mask: torch.Tensor | None = None,
        labels: torch.Tensor | None = None,
        tokentype_ids: torch.Tensor | None = None,
        kv_cache: KVCache | StaticKVCache | None = None,
        document_ids: torch.Tensor | None = None,
        logits_to_keep: int = 0,
    ) -> torch.Tensor:
        """Token ids [b, s] (hidden states [b, s, h] on a stage without embedding) → per-token loss
        [b, s] fp32 when `labels` are given, else logits [b, s, V] (hidden states without a head).

        `attention_mask` (optional): [b, s] padding (1 = keep) or [b, (1,) s, s] with True = may
        attend, e.g. Megatron's reset-attention-mask inverted; it is combined with the causal mask.
        `kv_cache` (decoding): the tokens continue the cached ones, whose keys and values are reused.
        `document_ids` [b, s] (with the flex kernel): tokens attend only within their own packed document.
        `logits_to_keep` n > 0: logits of the last n positions only (decoding needs the last; the head of a
        whole prompt would cost s times that of one token).
        """
        if kv_cache is not None and position_ids is None:
            position_ids = cached_positions(input_ids, kv_cache)
        if self.embedding is not None:
            hidden = self.embedding(input_ids, position_ids, tokentype_ids)
        else:
            hidden = input_ids
        hidden = run_layers(
            self.layers, hidden, self.config, position_ids, attention_mask, causal=True, cache=kv_cache,
            document_ids=document_ids,
        )
        if self.final_norm is not None:
            hidden = self.final_norm(hidden)
        mtp_loss = None  # MTP's depths start from the normed hidden states, as Megatron-Core's (and vLLM's) do
        if self.mtp is not None and labels is not None and self.training and torch.is_grad_enabled():
            mtp_loss = self.mtp(hidden, labels, self._embed_ahead, self._head_loss, position_ids, attention_mask)
        if self.output is None:
            return hidden
        if labels is not None:
            loss = self._head_loss(hidden, labels)
            return loss if mtp_loss is None or self.mtp is None else self.mtp.inject(loss, mtp_loss)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.output(hidden)

    def _head_loss(self, hidden: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        """Per-token loss [b, s] of the head over normed hidden states (chunked with the head where it may)."""
        assert self.output is not None  # called where the model has its head
        if self.loss.can_fuse_head(self.output):
            return self.loss.from_hidden(hidden, self.output, labels)
        return self.loss(self.output(hidden), labels)

    def _embed_ahead(self, tokens: torch.Tensor) -> torch.Tensor:
        """Multi-token prediction's embeddings of the tokens ahead: the model's own embedding module, or on a last
        pipeline stage without it the tied head's copy of the word embeddings (kept equal to them by the pipeline;
        its gradient joins theirs), with the embedding's dropout."""
        if self.embedding is not None:
            return self.embedding(tokens)
        config = self.config
        if self.output is None or self.output.tied_to is None or config.position_embedding_type == "learned_absolute" \
                or config.embed_layernorm:
            raise ValueError("multi-token prediction on a pipeline stage without the embedding takes the word "
                             "embeddings from the tied head: it needs tied embeddings, no learned positions and no "
                             "--embed-layernorm")
        return dropout(F.embedding(tokens, self.output.weight), config.hidden_dropout, self.training)

    def to_empty(self, *, device: torch.device | str | int | None, recurse: bool = True) -> GPTModel:
        """Materialize from meta, then restore the embedding/output tie that new Parameters break."""
        super().to_empty(device=device, recurse=recurse)
        tie_weights(self)
        return self

    def init_weights(self, seed: int) -> None:
        init_weights(self, seed)
