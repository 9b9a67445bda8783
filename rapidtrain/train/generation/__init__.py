"""Text from a trained model: the built-in GPT (GPT-2-style or Llama-family) from any saved layout, or a Hugging Face
causal LM folder; greedy decoding or sampling (temperature, top-k, top-p), batched with left padding, one new token
per row per step through a KV cache.

`rapidtrain generate --load DIR --prompt "..."` (or --input-file prompts.jsonl) is `command.py`; the loop is
`decoding.py`; what is loaded and how it runs (device, dtype, attention kernel, k-bit weights) is
`loading.py` and `runtime.py`. `generate_sample` is the short sample a training script prints at its end.
"""

from rapidtrain.train.generation.command import generate_command, generation_parser
from rapidtrain.train.generation.decoding import (
    Decoding,
    SamplingSettings,
    continuation,
    decode,
    generate,
    generate_sample,
    left_padded,
    next_token,
)
from rapidtrain.train.generation.loading import load_for_generation

__all__ = ["Decoding", "SamplingSettings", "continuation", "decode", "generate", "generate_command",
           "generate_sample", "generation_parser", "left_padded", "load_for_generation", "next_token"]
