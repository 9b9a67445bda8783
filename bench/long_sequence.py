"""A long sequence (default 4,096 tokens) through a Llama-shaped model: rapidtrain's built-in Llama against Hugging
Face's LlamaForCausalLM with SDPA attention, both a whole training step (forward, loss, backward, fused AdamW), in
the same precision, on the same tokens.

The two models have the same shape (checked: equal parameter counts). Each measurement runs in a process of its own
(its peak resident memory is that system's alone); systems run interleaved (A B, B A, A B, ...) over `--rounds`,
each row is the median of its rounds with the spread beside it, and the ratio is the median of per-round ratios.

    python bench/long_sequence.py [--seq 4096 --layers 4 --hidden 256 --heads 4 --kv-heads 2 --ffn 704
        --vocab 8000 --batch 1 --steps 3 --rounds 3 --precision fp32|bf16 --threads N]

Besides the wall time of a step, each row reports its CPU time (the process's user + system seconds per step, which
the load of a shared host moves far less) and its peak resident memory.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_throughput import measure_in_child  # noqa: E402

SYSTEMS = ("rapidtrain Llama (SDPA)", "HF LlamaForCausalLM (sdpa)")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--ffn", type=int, default=704)
    parser.add_argument("--vocab", type=int, default=8000)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3, help="training steps timed in each round (after one warm-up)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads of both systems (each child's OMP_NUM_THREADS)")
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)  # child process: one measurement
    return parser.parse_args()


def build(args: argparse.Namespace, system: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if system == SYSTEMS[0]:
        from rapidtrain.models import ModelConfig, build_model

        config = ModelConfig(num_layers=args.layers, hidden_size=args.hidden, num_attention_heads=args.heads,
                             num_query_groups=args.kv_heads, ffn_hidden_size=args.ffn, seq_length=args.seq,
                             max_position_embeddings=args.seq, vocab_size=args.vocab, hidden_dropout=0.0,
                             attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm",
                             swiglu=True, add_bias_linear=False, tie_embeddings=False, layernorm_epsilon=1e-6)
        return build_model(config, seed=0)
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.ffn,
                     num_hidden_layers=args.layers, num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                     max_position_embeddings=args.seq, rms_norm_eps=1e-6, tie_word_embeddings=False,
                     attn_implementation="sdpa")
    return LlamaForCausalLM(hf)


def loss_of(system: str, model: torch.nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if system == SYSTEMS[0]:
        return model(tokens, labels=labels).float().mean()
    return model(input_ids=tokens, labels=labels).loss


def measure(args: argparse.Namespace) -> dict[str, float]:
    """One system's median seconds and CPU seconds per training step over --steps (after one warm-up step), its peak
    memory, in this process."""
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # interpreter, torch, transformers
    model = build(args, args.system)
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    # Both see next-token targets; HF shifts its labels itself, rapidtrain's built-in model takes them shifted.
    labels = tokens if args.system == SYSTEMS[1] else torch.roll(tokens, -1, dims=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    dtype = torch.bfloat16 if args.precision == "bf16" else None
    times, cpu_times = [], []
    for step in range(args.steps + 1):
        start, cpu_start = time.perf_counter(), time.process_time()
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            loss = loss_of(args.system, model, tokens, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if step:
            times.append(time.perf_counter() - start)
            cpu_times.append(time.process_time() - cpu_start)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": statistics.median(times), "cpu_seconds": statistics.median(cpu_times),
            "parameters": sum(p.numel() for p in model.parameters()), "peak_mib": peak,
            "training_mib": peak - baseline, "loss": float(loss)}


def child(args: argparse.Namespace, system: str) -> dict[str, float]:
    flags = [f"--{name.replace('_', '-')}={value}" for name, value in vars(args).items() if name != "system"]
    return measure_in_child(__file__, [*flags, "--system", system], system,
                            {**os.environ, "OMP_NUM_THREADS": str(args.threads)})


def main() -> None:
    args = parse_args()
    if args.system:
        torch.set_num_threads(args.threads)
        print(json.dumps(measure(args)))
        return
    print(f"Llama {args.layers} layers, hidden {args.hidden}, {args.heads} heads ({args.kv_heads} key/value), ffn "
          f"{args.ffn}, vocab {args.vocab}; batch {args.batch} × seq {args.seq}, {args.precision}; "
          f"{args.threads} threads; {args.steps} steps per round after a warm-up, {args.rounds} interleaved "
          f"rounds, medians", flush=True)
    results: dict[str, list[dict[str, float]]] = {system: [] for system in SYSTEMS}
    for round_ in range(args.rounds):
        for system in SYSTEMS[round_ % 2:] + SYSTEMS[:round_ % 2]:
            results[system].append(child(args, system))
            run = results[system][-1]
            print(f"    round {round_ + 1} {system}: {run['seconds'] * 1000:.1f} ms/step, CPU "
                  f"{run['cpu_seconds'] * 1000:.1f} ms/step, peak {run['peak_mib']:.0f} MiB", flush=True)
    counts = {system: int(runs[0]["parameters"]) for system, runs in results.items()}
    if len(set(counts.values())) != 1:
        raise SystemExit(f"the two models differ in shape: {counts}")
    tokens = args.batch * args.seq
    print(f"\n{'system':<30} {'ms/step':>9} {'± %':>5} {'tokens/s':>9} {'vs HF':>6} {'CPU ms/step':>11} "
          f"{'(CPU time)':>10} {'peak MiB':>9} {'training MiB':>12}")
    for system, runs in results.items():
        seconds = [run["seconds"] for run in runs]
        step = statistics.median(seconds)
        moved = (max(seconds) - min(seconds)) / 2 / step * 100
        vs_hf = statistics.median([hf["seconds"] / run["seconds"] for run, hf in zip(runs, results[SYSTEMS[1]],
                                                                                     strict=True)])
        cpu_vs_hf = statistics.median([hf["cpu_seconds"] / run["cpu_seconds"]
                                       for run, hf in zip(runs, results[SYSTEMS[1]], strict=True)])
        cpu_ms = statistics.median([run["cpu_seconds"] for run in runs]) * 1000
        peak = max(run["peak_mib"] for run in runs)
        training = max(run["training_mib"] for run in runs)
        print(f"{system:<30} {step * 1000:9.1f} {moved:5.1f} {tokens / step:9.0f} {vs_hf:6.3f} {cpu_ms:11.1f} "
              f"{cpu_vs_hf:10.3f} {peak:9.0f} {training:12.0f}")
    print(f"\n{counts[SYSTEMS[0]] / 1e6:.2f}M parameters each; vs HF: Hugging Face's seconds per step over this row's, "
          "per round, median (> 1 is faster); ± %: half the range of the rounds over the median; CPU ms/step: the "
          "process's CPU time per step (all threads), median of the rounds; (CPU time): vs HF of CPU time;\npeak MiB: "
          "the process's peak resident memory (ru_maxrss: weights, optimizer state, activations of the whole "
          "sequence); training MiB: that peak minus the high-water mark before the model was built.")


if __name__ == "__main__":
    main()
