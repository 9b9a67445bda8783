"""Decoding through a static KV cache (preallocated for prompt + max_new_tokens), so that every step after the
prompt has the same shapes and `torch.compile` compiles the one-token step once (--torch-compile); the prompt runs
uncompiled, its length changing from batch to batch."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from rapidtrain.models.transformer import StaticKVCache
from rapidtrain.train.generation.decoding import Decoding, Forward, builtin_forward, choose


def compile_mode(device_type: str) -> str:
    """CUDA graphs ("reduce-overhead") replay a step's kernels with one launch on CUDA; a CPU has no graphs to
    replay, so it takes Inductor's default (fused C++ kernels)."""
    return "reduce-overhead" if device_type == "cuda" else "default"


def compiled_step(model: nn.Module, device_type: str) -> Forward:
    """The built-in GPT's forward for one-token steps, compiled with static shapes (dynamic=False: a prompt-length
    shape never reaches it, so nothing is recompiled once the first step compiled)."""
    step: Callable = torch.compile(builtin_forward(model), mode=compile_mode(device_type), dynamic=False)
    return step


def cache_length(tokens: int, bucket: int = 64) -> int:
    """The static cache's slots for prompt + new tokens, rounded up to a multiple of `bucket`: the step's shapes
    (and so its compilation) change only when a batch's prompt crosses a bucket, not with every prompt length."""
    return -(-tokens // bucket) * bucket


@torch.no_grad()
def decode_static(prompt_forward: Forward, step_forward: Forward, tokens: torch.Tensor, mask: torch.Tensor,
                  how: Decoding) -> torch.Tensor:
    """What `decode` returns (the new tokens [b, n] after a left-padded batch), through a StaticKVCache:
    `prompt_forward` fills it from the prompt, then `step_forward` (compiled or not) adds one token per row per
    step at slot s + step, attending over every slot under a mask of the written real ones."""
    batch, length = tokens.shape
    cache = StaticKVCache(cache_length(length + how.settings.max_new_tokens))
    written = torch.zeros(batch, cache.max_length, dtype=mask.dtype, device=mask.device)
    written[:, :length] = mask
    positions = (mask.cumsum(dim=-1) - 1).clamp(min=0)
    padded = not bool(mask.all())
    logits = prompt_forward(tokens, positions, mask if padded else None, cache)
    for buffer in (*cache.keys.values(), *cache.values.values()):
        # The steps write the buffers in place: CUDA graphs ("reduce-overhead") replay such writes only into
        # tensors whose address stays fixed.
        torch._dynamo.mark_static_address(buffer)
    position = positions[:, -1:]
    slots = torch.full((1,), length - 1, device=tokens.device)
    finished = torch.zeros(batch, dtype=torch.bool, device=tokens.device)
    chosen_so_far: list[torch.Tensor] = []
    for step in range(how.settings.max_new_tokens):
        chosen = choose(logits[:, -1], step, finished, how)[:, None]
        chosen_so_far.append(chosen)
        if step + 1 == how.settings.max_new_tokens or (how.eos_id is not None and bool(finished.all())):
            break
        written[:, length + step] = 1
        slots += 1  # on the device, in place: no host-to-device copy per step
        cache.slots = slots
        position = position + 1
        logits = step_forward(chosen, position, written, cache)
    return torch.cat(chosen_so_far, dim=1)
