"""Fixed --seq-length padding vs `--data-iterator dynamic-shape` on a skewed (log-normal) length mix.

Prints the padded-token fraction and the forward+backward step time of a small causal
TransformerEncoder LM under both, side by side with their ratio. Same samples, one epoch each, steps of the two
interleaved.

    python bench/dynamic_shape.py --seq-length 512 --num-samples 256 --micro-batch-size 16
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from rapidtrain.data.dynamic_shape import LengthBucketBatchSampler, PretrainingCollator

PAD = 0


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seq-length", type=int, default=512, help="fixed padding length and length cap")
    parser.add_argument("--num-samples", type=int, default=256)
    parser.add_argument("--micro-batch-size", type=int, default=16)
    parser.add_argument(
        "--log-mean", type=float, default=4.5, help="mean of log(length): median ≈ e^4.5 = 90"
    )
    parser.add_argument("--log-sigma", type=float, default=0.8, help="spread of log(length)")
    parser.add_argument("--hidden-size", type=int, default=128)
    parser.add_argument("--num-layers", type=int, default=2)
    parser.add_argument("--num-heads", type=int, default=4)
    parser.add_argument("--vocab-size", type=int, default=2048)
    parser.add_argument("--window-steps", type=int, default=100, help="bucketing window, in micro-batches")
    parser.add_argument("--warmup-steps", type=int, default=3)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seed", type=int, default=1234)
    return parser.parse_args()


class TinyLM(torch.nn.Module):
    """Embedding → causal TransformerEncoder → LM head: a stand-in for the built-in GPT."""

    def __init__(self, args: argparse.Namespace) -> None:
        super().__init__()
        self.embedding = torch.nn.Embedding(args.vocab_size, args.hidden_size)
        self.positions = torch.nn.Embedding(args.seq_length, args.hidden_size)
        layer = torch.nn.TransformerEncoderLayer(
            args.hidden_size,
            args.num_heads,
            4 * args.hidden_size,
            dropout=0.0,
            batch_first=True,
            norm_first=True,
        )
        self.encoder = torch.nn.TransformerEncoder(layer, args.num_layers, enable_nested_tensor=False)
        self.head = torch.nn.Linear(args.hidden_size, args.vocab_size)

    def forward(self, tokens: torch.Tensor, padding_mask: torch.Tensor) -> torch.Tensor:
        length = tokens.shape[1]
        hidden = self.embedding(tokens) + self.positions(torch.arange(length, device=tokens.device))
        causal = torch.nn.Transformer.generate_square_subsequent_mask(length, device=tokens.device)
        # Float key-padding mask, like the causal one: -inf on padding keys.
        key_padding = torch.zeros(padding_mask.shape, device=tokens.device).masked_fill(
            padding_mask, float("-inf")
        )
        hidden = self.encoder(hidden, mask=causal, src_key_padding_mask=key_padding, is_causal=True)
        return self.head(hidden)


def make_samples(args: argparse.Namespace) -> list[dict[str, np.ndarray]]:
    rng = np.random.RandomState(args.seed)
    lengths = np.clip(
        rng.lognormal(args.log_mean, args.log_sigma, args.num_samples).astype(int), 2, args.seq_length
    )
    samples = []
    for length in lengths:
        sequence = rng.randint(1, args.vocab_size, size=length + 1)
        samples.append({"tokens": sequence[:-1], "labels": sequence[1:]})
    return samples


def fixed_batches(samples, args) -> list[dict[str, torch.Tensor]]:
    collate = PretrainingCollator(PAD, multiple=args.seq_length)  # every batch padded to --seq-length
    order = np.random.RandomState(args.seed).permutation(len(samples))
    steps = len(samples) // args.micro_batch_size
    return [
        collate([samples[i] for i in order[k * args.micro_batch_size : (k + 1) * args.micro_batch_size]])
        for k in range(steps)
    ]


def dynamic_batches(samples, args) -> list[dict[str, torch.Tensor]]:
    lengths = [len(s["tokens"]) for s in samples]
    sampler = LengthBucketBatchSampler(
        lengths, args.micro_batch_size, seed=args.seed, window_steps=args.window_steps
    )
    collate = PretrainingCollator(PAD)
    return [collate([samples[i] for i in batch]) for batch in sampler]


def padded_fraction(batches) -> float:
    total = sum(b["tokens"].numel() for b in batches)
    real = sum(int((~b["padding_mask"]).sum()) for b in batches)
    return 1.0 - real / total


def train_step(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: torch.device) -> float:
    """Seconds for one forward + backward of `batch`."""
    if device.type == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    tokens, labels = batch["tokens"].to(device), batch["labels"].to(device)
    logits = model(tokens, batch["padding_mask"].to(device))
    losses = torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none")
    loss_mask = batch["loss_mask"].to(device).flatten()
    (losses * loss_mask).sum().div(loss_mask.sum()).backward()
    model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - start


def time_steps(model, fixed, dynamic, args) -> tuple[list[float], list[float]]:
    """Per-step seconds of both, after warm-up; the two alternate step by step so that load from
    other processes on the machine weighs on both alike."""
    device = torch.device(args.device)
    for batch in fixed[: args.warmup_steps] + dynamic[: args.warmup_steps]:
        train_step(model, batch, device)
    fixed_times, dynamic_times = [], []
    for fixed_batch, dynamic_batch in zip(fixed, dynamic, strict=True):
        fixed_times.append(train_step(model, fixed_batch, device))
        dynamic_times.append(train_step(model, dynamic_batch, device))
    return fixed_times, dynamic_times


def main() -> None:
    args = parse_args()
    torch.manual_seed(args.seed)
    samples = make_samples(args)
    lengths = np.array([len(s["tokens"]) for s in samples])
    model = TinyLM(args).to(args.device)
    batches = {"fixed": fixed_batches(samples, args), "dynamic": dynamic_batches(samples, args)}
    times = dict(zip(batches, time_steps(model, batches["fixed"], batches["dynamic"], args), strict=True))
    results = {
        name: (
            padded_fraction(batches[name]),
            float(np.mean(times[name])),
            float(np.sum(times[name])),
            len(batches[name]),
            float(np.mean([b["tokens"].shape[1] for b in batches[name]])),
        )
        for name in batches
    }
    print(
        f"device {args.device}, {args.num_samples} samples, lengths log-normal(mu={args.log_mean}, "
        f"sigma={args.log_sigma}) capped at {args.seq_length}: median {int(np.median(lengths))}, "
        f"mean {lengths.mean():.0f}, max {lengths.max()}; micro batch {args.micro_batch_size}; "
        f"model {args.num_layers} layers × {args.hidden_size} hidden"
    )
    print(f"{'':24}{'fixed':>12}{'dynamic':>12}{'fixed/dynamic':>16}")
    rows = [
        ("padded-token fraction", 0, "{:.1%}"),
        ("step time (ms)", 1, "{:.1f}"),
        ("epoch time (s)", 2, "{:.2f}"),
    ]
    rows += [("steps", 3, "{:d}"), ("mean batch width", 4, "{:.0f}")]
    for label, i, fmt in rows:
        fixed, dynamic = results["fixed"][i], results["dynamic"][i]
        ratio = f"{fixed / dynamic:.2f}x" if i in (1, 2, 4) else ""
        scale = 1000 if i == 1 else 1
        print(f"{label:24}{fmt.format(fixed * scale):>12}{fmt.format(dynamic * scale):>12}{ratio:>16}")


if __name__ == "__main__":
    main()
