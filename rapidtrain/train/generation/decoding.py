"""The decoding loop: greedy or sampled (temperature, top-k, top-p) next tokens for a left-padded batch of prompts,
one new token per row per step through a KV cache, for any causal model behind a `Forward` callable (the built-in
GPT or a Hugging Face model)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from rapidtrain.models.transformer import KVCache

# (token ids [b, s], position ids [b, s], padding mask [b, cached + s] or None, cache or None) → logits [b, s', V]
Forward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None, Any], torch.Tensor]


@dataclass(frozen=True)
class SamplingSettings:
    """How each next token is chosen. temperature 0 is greedy (the most likely token); above 0 tokens are
    sampled from softmax(logits / temperature), restricted to the top_k most likely (0: all) and to the
    smallest set whose probability reaches top_p (1.0: all)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0  # end of document is not chosen before this many new tokens (HF's min_new_tokens)

    def problems(self) -> list[str]:
        found = []
        if self.max_new_tokens < 1:
            found.append(f"--max-new-tokens {self.max_new_tokens} must be at least 1")
        if self.temperature < 0:
            found.append(f"--temperature {self.temperature} must be 0 (greedy) or positive")
        if self.top_k < 0:
            found.append(f"--top-k {self.top_k} must be 0 (off) or positive")
        if not 0 < self.top_p <= 1:
            found.append(f"--top-p {self.top_p} must lie in (0, 1]")
        if self.temperature == 0 and (self.top_k or self.top_p < 1):
            found.append("--top-k / --top-p filter sampling; greedy decoding (--temperature 0) has nothing to "
                         "filter: give --temperature > 0 (e.g. 0.8)")
        return found


def next_token(logits: torch.Tensor, settings: SamplingSettings, generator: torch.Generator | None) -> torch.Tensor:
    """The next token [b] from the last position's logits [b, V] (fp32)."""
    if settings.temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / settings.temperature
    if settings.top_k:
        kth = logits.topk(min(settings.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if settings.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(dim=-1)
        # Drop a token when the tokens more likely than it already reach top_p (the first always stays).
        drop = probs.cumsum(dim=-1) - probs >= settings.top_p
        logits = logits.scatter(-1, order, ordered.masked_fill(drop, float("-inf")))
    probs = logits.softmax(dim=-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.cpu(), 1, generator=generator).squeeze(-1).to(probs.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


@dataclass(frozen=True)
class Decoding:
    """What the loop needs beside the model: the settings, ids never to choose (≥ vocab_size: padded embedding
    rows), end of document (a row that produced it keeps producing it), whether to cache keys and values, and the
    sampling generator."""

    settings: SamplingSettings
    vocab_size: int | None = None
    eos_id: int | None = None
    use_cache: bool = True
    generator: torch.Generator | None = None


def left_padded(prompts: Sequence[Sequence[int]], pad_id: int, device: torch.device | str) -> tuple[torch.Tensor,
                                                                                                      torch.Tensor]:
    """Prompts of different lengths as one batch: token ids [b, s] padded on the left, and the mask (1 = real)."""
    longest = max(len(p) for p in prompts)
    tokens = torch.full((len(prompts), longest), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), longest), dtype=torch.long)
    for row, prompt in enumerate(prompts):
        if prompt:
            tokens[row, longest - len(prompt):] = torch.tensor(prompt)
            mask[row, longest - len(prompt):] = 1
    return tokens.to(device), mask.to(device)


def choose(logits: torch.Tensor, step: int, finished: torch.Tensor, how: Decoding) -> torch.Tensor:
    """Each row's next token from its last logits [b, V]; a finished row keeps ending the document."""
    logits = logits.float()
    if how.vocab_size is not None and how.vocab_size < logits.shape[-1]:
        logits[:, how.vocab_size:] = float("-inf")
    if how.eos_id is not None and step < how.settings.min_new_tokens:
        logits[:, how.eos_id] = float("-inf")
    chosen = next_token(logits, how.settings, how.generator)
    if how.eos_id is not None:
        chosen = torch.where(finished, torch.full_like(chosen, how.eos_id), chosen)
        finished |= chosen == how.eos_id
    return chosen


# no_grad, not inference_mode: the training-time sample runs the trained (maybe DeepSpeed ZeRO-3) model, whose
# autograd functions cannot touch inference tensors ("Cannot set version_counter for inference tensor").
@torch.no_grad()
def decode(forward: Forward, tokens: torch.Tensor, mask: torch.Tensor, how: Decoding,
           new_cache: Callable[[], Any]) -> torch.Tensor:
    """The new tokens [b, n ≤ max_new_tokens] after a left-padded batch (tokens and mask [b, s]). Each row's
    positions count its real tokens only and its padding is masked out, so a row decodes exactly as it would
    alone. Stops early when every row has produced end of document."""
    padded = not bool(mask.all())
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    cache = new_cache() if how.use_cache else None
    step_tokens, step_positions = tokens, positions
    finished = torch.zeros(tokens.shape[0], dtype=torch.bool, device=tokens.device)
    chosen_so_far: list[torch.Tensor] = []
    for step in range(how.settings.max_new_tokens):
        logits = forward(step_tokens, step_positions, mask if padded else None, cache)
        chosen = choose(logits[:, -1], step, finished, how)[:, None]
        chosen_so_far.append(chosen)
        next_position = positions[:, -1:] + 1
        if cache is None:
            tokens, positions = torch.cat([tokens, chosen], dim=1), torch.cat([positions, next_position], dim=1)
            step_tokens, step_positions = tokens, positions
        else:
            step_tokens, step_positions, positions = chosen, next_position, next_position
        if padded:
            mask = torch.cat([mask, torch.ones_like(chosen)], dim=1)
        if how.eos_id is not None and bool(finished.all()):
            break
    return torch.cat(chosen_so_far, dim=1)


def builtin_forward(model: nn.Module) -> Forward:
    """The built-in GPT as the loop calls it: the last position's logits only (the head over a whole prompt is
    wasted work), except that a tensor-parallel model computes and gathers its vocabulary-split logits whole
    (under sequence parallelism each rank holds part of the positions, so "the last" is not local)."""
    from torch.distributed.tensor import DTensor

    output = getattr(model, "output", None)
    keep = 0 if output is None or isinstance(output.weight, DTensor) else 1

    def forward(tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                cache: Any) -> torch.Tensor:
        logits = model(tokens, position_ids=positions, attention_mask=mask, kv_cache=cache, logits_to_keep=keep)
        return logits.full_tensor() if hasattr(logits, "full_tensor") else logits

    return forward


def _check_decoder(model: nn.Module) -> None:
    if getattr(model, "embedding", None) is None or getattr(model, "output", None) is None:
        raise ValueError(
            "generation needs the whole built-in GPT (embedding and output head): a pipeline stage holds only "
            "part of it. Save a checkpoint and run `rapidtrain generate --load DIR`, which loads it whole."
        )


def check_length(model: nn.Module, prompt_length: int, max_new_tokens: int) -> None:
    """Refuse a prompt + new tokens that pass the built-in model's learned positions."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "position_embedding_type", None) != "learned_absolute":
        return
    if prompt_length + max_new_tokens > config.max_position_embeddings:
        raise ValueError(f"prompt ({prompt_length} tokens) + --max-new-tokens {max_new_tokens} exceeds "
                         f"the model's {config.max_position_embeddings} learned positions: shorten one of them")


def generate(
    model: nn.Module,
    prompt: torch.Tensor,
    settings: SamplingSettings,
    *,
    vocab_size: int | None = None,
    eos_id: int | None = None,
    use_cache: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """The built-in GPT: prompt [b, s] (no padding) → [b, s + new] token ids. `use_cache=False` recomputes the
    whole sequence each step (the reference the cache must match)."""
    _check_decoder(model)
    check_length(model, prompt.shape[1], settings.max_new_tokens)
    was_training = model.training
    model.eval()
    try:
        how = Decoding(settings, vocab_size, eos_id, use_cache, generator)
        new = decode(builtin_forward(model), prompt, torch.ones_like(prompt), how, KVCache)
    finally:
        model.train(was_training)
    return torch.cat([prompt, new], dim=1)


def generate_sample(model: nn.Module, tokenizer: Any, prompt: str, max_new_tokens: int = 32,
                    settings: SamplingSettings | None = None, generator: torch.Generator | None = None) -> str:
    """The prompt and the model's continuation, as text: what a training script prints at its end. Greedy unless
    `settings` sample (drawn with `generator`, for a sample that is the same on every run).

    `model` may be wrapped (DDP, torch.compile); a tensor-parallel model must be called on every rank of its
    group (each runs its heads); a pipeline stage cannot generate alone.
    """
    from rapidtrain.parallel.data_parallel import unwrap

    model = unwrap(model)
    device = next(model.parameters()).device
    ids = torch.tensor([tokenizer.tokenize(prompt)], device=device)
    config = getattr(model, "config", None)
    if config is not None and getattr(config, "position_embedding_type", None) == "learned_absolute":
        # Nobody asked for this length: a model of few learned positions (--seq-length 16) shows a shorter sample
        # rather than failing at the end of its training.
        max_new_tokens = min(max_new_tokens, config.max_position_embeddings - ids.shape[1])
        if max_new_tokens < 1:
            return prompt
    # The whole length: a briefly trained model often ends the document at once, which would print the prompt alone.
    settings = replace(settings or SamplingSettings(), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens)
    # Layers compiled for training (--torch-compile) run eagerly here: decoding with a growing KV cache gives
    # the compiled frames new shapes and strides each token, and every one was a compilation (on an H100, eight
    # of them until dynamo's recompile limit, for a 24-token sample).
    with torch.compiler.set_stance("force_eager"):
        tokens = generate(model, ids, settings, vocab_size=tokenizer.vocab_size, eos_id=tokenizer.eod,
                          generator=generator)
    return prompt + continuation(tokenizer, tokens[0].tolist(), ids.shape[1])


def continuation(tokenizer: Any, tokens: list[int], prompt_length: int) -> str:
    """The text the new tokens add, up to end-of-document; decoded with the prompt so that word boundaries
    (SentencePiece's leading spaces) come out right."""
    new = tokens[prompt_length:]
    if tokenizer.eod is not None and tokenizer.eod in new:
        new = new[: new.index(tokenizer.eod)]
    before = tokenizer.detokenize(tokens[:prompt_length])
    return tokenizer.detokenize(tokens[:prompt_length] + new)[len(before):]
