"""What the demo prints when it ends: the validation loss against a model that knows only token frequencies, a greedy
and a fixed-seed sampled continuation, the loss curve as a picture, and where the run's files are. A newcomer sees
whether training learned something and where to look next."""

from __future__ import annotations

import math
import os
from typing import Any

import torch

from rapidtrain.train.generation import generate_sample
from rapidtrain.train.generation.decoding import SamplingSettings

DEMO_PROMPT = "Return a new"  # the demo corpus is the standard library's docstrings
DEMO_SAMPLE_TOKENS = 32
# The demo's promise: validation loss this far under the unigram entropy, i.e. well past word frequencies (about
# what held-out bigram statistics of the corpus reach).
DEMO_TARGET_NATS = 1.5
SAMPLING = SamplingSettings(max_new_tokens=DEMO_SAMPLE_TOKENS, temperature=0.8, top_k=40,
                            min_new_tokens=DEMO_SAMPLE_TOKENS)
SAMPLING_SEED = 1234
LOSS_CURVE_FILE = "loss_curve.png"


def baseline_line(validation_loss: float, entropy: float, iteration: int) -> str:
    """The loss against the corpus's unigram entropy, and whether the demo's target was reached."""
    under = entropy - validation_loss
    # Rounded toward the baseline, so that a loss just short of the target never shows as reaching it (1.495: 1.49).
    shown = math.floor(abs(under) * 100) / 100
    where = f"{shown:.2f} nats under" if under >= 0 else f"{shown:.2f} nats above"
    verdict = (f"the demo's target of {DEMO_TARGET_NATS} under reached" if under >= DEMO_TARGET_NATS else
               f"short of the demo's target of {DEMO_TARGET_NATS} under: train longer (--train-iters)")
    return (f" validation loss {validation_loss:.2f} nats at iteration {iteration}: {where} the corpus's unigram "
            f"entropy of {entropy:.2f} (a model that knows only how often each token occurs); {verdict}")


def reference_losses(entropy: float) -> list[tuple[float, str]]:
    """The loss curve's horizontal lines: the baseline and the demo's target."""
    return [(entropy, f"unigram entropy {entropy:.2f} (token frequencies only)"),
            (entropy - DEMO_TARGET_NATS, f"the demo's target: {DEMO_TARGET_NATS} nats under it")]


def sample_lines(model: Any, tokenizer: Any) -> list[str]:
    """A greedy and a sampled continuation of the demo's prompt. Every rank of a tensor-parallel group must call it
    (each runs its heads); the sampling generator is seeded alike on each, so they draw the same tokens."""
    greedy = generate_sample(model, tokenizer, DEMO_PROMPT, DEMO_SAMPLE_TOKENS)
    generator = torch.Generator().manual_seed(SAMPLING_SEED)
    sampled = generate_sample(model, tokenizer, DEMO_PROMPT, DEMO_SAMPLE_TOKENS, settings=SAMPLING,
                              generator=generator)
    indent = "\n   "
    return [f" sample from the trained model (greedy, up to {DEMO_SAMPLE_TOKENS} tokens after the prompt):"
            f"{indent}{greedy.replace(chr(10), indent)}",
            f" sampled (temperature {SAMPLING.temperature}, top-k {SAMPLING.top_k}, seed {SAMPLING_SEED}):"
            f"{indent}{sampled.replace(chr(10), indent)}"]


def loss_curve_path(save: str | None, tensorboard_dir: str | None) -> str | None:
    """The PNG beside the run's logs: in --tensorboard-dir, else in --save; None when the run writes neither."""
    folder = tensorboard_dir or save
    return os.path.join(folder, LOSS_CURVE_FILE) if folder else None


def files_lines(save: str | None, tensorboard_dir: str | None, curve: str | None, curve_problem: str) -> list[str]:
    """Where the run's files are, each with the command that opens it."""
    lines = [" the run's files:"]
    if curve and not curve_problem:
        lines.append(f"   loss curve (training and validation): {os.path.abspath(curve)}")
    elif curve:
        lines.append(f"   loss curve: not drawn ({curve_problem})")
    else:
        lines.append("   loss curve: not drawn (give --tensorboard-dir or --save for a folder to write it in)")
    if tensorboard_dir:
        lines.append(f"   TensorBoard logs: {os.path.abspath(tensorboard_dir)} "
                     f"(tensorboard --logdir {tensorboard_dir})")
    if save:
        lines.append(f"   checkpoint: {os.path.abspath(save)} (rapidtrain generate --load {save} --prompt "
                     f"'{DEMO_PROMPT}'; scripts/convert_checkpoint.py --hf exports it)")
    else:
        lines.append("   checkpoint: none (give --save DIR to keep the model)")
    return lines
