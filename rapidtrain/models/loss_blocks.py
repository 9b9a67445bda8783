"""How many vocabulary entries one block of the chunked head + loss (chunked_loss.py) computes at once: a module
without torch, so that the plan's memory model (config/activations.py) imports nothing heavy."""

from __future__ import annotations

# Vocabulary entries per block are chosen so one block's fp32 logits stay near this many elements: on a CPU 8 Mi
# (32 MiB), large enough for efficient matmuls, small enough that the loss never dominates peak memory; on CUDA
# 128 Mi (512 MiB), where each block's elementwise passes cost kernel launches and the head's matmuls want long
# blocks. Measured on an H100 (bench/head_loss.py, 8,192 tokens, hidden 2048, vocabulary 50,304, bf16; forward and
# backward): block 1,024 took 26.0 ms, 16,384 18.4 ms, the plain fp32-logits path 13.7 ms; peak memory above the
# inputs 1.3, 2.5 and 4.9 GiB. With the blocks' elementwise work compiled (--torch-compile on CUDA), block 16,384
# took 10.8 ms and 1.7 GiB (same bench, same H100, a later run: plain 13.8 ms, eager block 16,384 18.6 ms).
BLOCK_ELEMENTS = 8 * 2**20
CUDA_BLOCK_ELEMENTS = 128 * 2**20


def block_size(vocab_size: int, tokens: int, device_type: str = "cpu") -> int:
    """Vocabulary entries per block: a multiple of 64 (at least 64) giving about the device's block elements of fp32
    logits (BLOCK_ELEMENTS, CUDA_BLOCK_ELEMENTS)."""
    elements = CUDA_BLOCK_ELEMENTS if device_type == "cuda" else BLOCK_ELEMENTS
    return min(vocab_size, max(64, elements // max(tokens, 1) // 64 * 64))
