"""Pretraining throughput: rapidtrain against a plain PyTorch loop and Hugging Face Trainer, in one run.

The same GPT shape (default 6 layers, hidden 384, 6 heads, seq 256), the same demo-corpus samples, fused
AdamW and batch size, in fp32 and bf16. Prints tokens/s of each, the ratios, and MFU against a
matrix-multiply peak measured first on this machine.

Each system runs in a process of its own (allocator state, caches and compiled kernels do not leak from
one into the next); the systems run interleaved in `--rounds N` rounds (A B C, B C A, C A B, ...), each row is
the median of its rounds with the spread beside it, and each ratio is the median of the per-round ratios (on a shared
host a single run moves by ±20%; the two sides of a ratio taken in one round saw the same host).
Rows:
  rapidtrain                 the product as shipped (on CPU it tunes glibc malloc: rapidtrain/core/cpu_allocator.py)
  rapidtrain, glibc default  the same with --no-cpu-allocator-tuning: the loop and model alone
  rapidtrain, compiled       the product with --torch-compile (its fastest equivalent of HF's best row)
  plain loop                 a hand-written loop on the same model, glibc default
  HF Trainer                 GPT2LMHeadModel of the same shape, Trainer defaults (adamw_torch_fused)
  HF Trainer, tuned malloc   the same with rapidtrain's allocator setting, to show what that setting is worth
  HF Trainer, best           Trainer's fastest equivalent: torch_compile=True and rapidtrain's allocator setting
Each row also shows the child process's CPU time per step (all its threads: on a shared host load moves it far less
than the wall clock) and its peak resident memory (ru_maxrss: model, optimizer, activations, logits).

    python bench/pretrain_throughput.py [--iters 20] [--warmup 3] [--rounds 3] [--layers 6 --hidden 384 ...]
        [--systems "plain loop" rapidtrain ...] [--precisions fp32]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from matmul_peak import linear_gemm_shapes, measure_gemm_tflops, measure_peak_tflops  # noqa: E402

from rapidtrain.data.demo import prepare_demo_data  # noqa: E402
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets  # noqa: E402
from rapidtrain.data.tokenizer import TokenizerSettings, build_tokenizer, padded_vocab_size  # noqa: E402
from rapidtrain.models import build_model  # noqa: E402
from rapidtrain.models.config import ModelConfig  # noqa: E402
from rapidtrain.models.counting import model_flops_per_iteration  # noqa: E402


def steady_seconds(stamps: list[float], warmup: int) -> float:
    """Mean seconds per step after `warmup` steps (compilation, allocator and cache warm-up excluded)."""
    steady = stamps[warmup:]
    return (steady[-1] - steady[0]) / (len(steady) - 1)


class StepStamps:
    """The wall clock and this process's CPU time at the end of each step: on a shared host load moves the wall
    clock of a step far more than the CPU time its threads spend."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []

    def append(self) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())

    def steady(self, warmup: int) -> tuple[float, float]:
        """(wall, CPU) seconds per steady step."""
        return steady_seconds(self.wall, warmup), steady_seconds(self.cpu, warmup)


def run_rapidtrain(o: argparse.Namespace, precision: list[str]) -> tuple[float, float]:
    from rapidtrain.pretrain import MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    stamps = StepStamps()

    class Timed(MegatronPreTrainer):
        def train_step(self, micro_batches, stop_requested=False):
            result = super().train_step(micro_batches, stop_requested=stop_requested)
            stamps.append()
            return result

    argv = ["--num-layers", str(o.layers), "--hidden-size", str(o.hidden), "--num-attention-heads", str(o.heads),
            "--seq-length", str(o.seq), "--micro-batch-size", str(o.batch), "--train-iters", str(o.iters),
            "--lr", "3e-4", "--lr-decay-style", "constant", "--num-workers", "0", "--log-interval", str(10**6),
            "--eval-interval", str(10**6), "--eval-iters", "0", "--hidden-dropout", str(o.dropout),
            "--attention-dropout", str(o.dropout),
            "--clip-grad", "1.0", *precision]
    Timed(Engine(argv=argv)).train()
    return stamps.steady(o.warmup)


def demo_samples(o: argparse.Namespace):
    demo = prepare_demo_data(progress=False)
    tokenizer = build_tokenizer(TokenizerSettings("SentencePieceTokenizer", tokenizer_model=demo.tokenizer_model))
    config = GPTDatasetConfig([demo.data_prefix], "969, 30, 1", o.seq, 1234, tokenizer.eod)
    train, _, _ = build_gpt_datasets(config, [o.iters * o.batch, 0, 0])
    return train, padded_vocab_size(tokenizer.vocab_size)


def run_plain_loop(o: argparse.Namespace, dtype: torch.dtype | None, vocab: int, dataset) -> tuple[float, float]:
    """A hand-written loop: the same built-in model, DataLoader, fused AdamW, clipping and masked mean loss."""
    config = ModelConfig(num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, seq_length=o.seq,
                         max_position_embeddings=o.seq, vocab_size=vocab, hidden_dropout=o.dropout,
                         attention_dropout=o.dropout)
    model = build_model(config, seed=1234)
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    no_decay = [p for n, p in model.named_parameters() if p.ndim <= 1]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=3e-4, fused=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=o.batch, shuffle=False)
    stamps = StepStamps()
    # --iters steps, as the other rows run: the dataset holds at least a whole epoch of the corpus.
    for batch in itertools.islice(loader, o.iters):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            per_token = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"])
        mask = batch["loss_mask"]
        loss = (per_token.float() * mask).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        stamps.append()
    return stamps.steady(o.warmup)


def run_hf_trainer(o: argparse.Namespace, bf16: bool, vocab: int, dataset, workdir: str,
                   compile_: bool) -> tuple[float, float]:
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments

    config = GPT2Config(vocab_size=vocab, n_positions=o.seq, n_embd=o.hidden, n_layer=o.layers, n_head=o.heads,
                        activation_function="gelu", resid_pdrop=o.dropout, embd_pdrop=o.dropout,
                        attn_pdrop=o.dropout)
    model = GPT2LMHeadModel(config)
    stamps = StepStamps()

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            stamps.append()

    class Samples(torch.utils.data.Dataset):
        def __len__(self):
            return len(dataset)

        def __getitem__(self, i):
            sample = dataset[i]
            return {"input_ids": torch.as_tensor(sample["tokens"]), "labels": torch.as_tensor(sample["tokens"])}

    arguments = TrainingArguments(output_dir=workdir, per_device_train_batch_size=o.batch, max_steps=o.iters,
                                  learning_rate=3e-4, weight_decay=0.01, max_grad_norm=1.0, bf16=bf16, use_cpu=True,
                                  report_to=[], logging_steps=10**6, save_strategy="no", dataloader_num_workers=0,
                                  lr_scheduler_type="constant", disable_tqdm=True, torch_compile=compile_)
    Trainer(model=model, args=arguments, train_dataset=Samples(), callbacks=[Stamp()]).train()
    return stamps.steady(o.warmup)


SYSTEMS = ("rapidtrain", "rapidtrain, glibc default", "rapidtrain, compiled", "plain loop", "HF Trainer",
           "HF Trainer, tuned malloc", "HF Trainer, best")
HF_ROWS = tuple(system for system in SYSTEMS if system.startswith("HF"))


def run_one(o: argparse.Namespace) -> tuple[float, float]:
    """(Wall, CPU) seconds per steady step of one system at one precision (the child process's whole job)."""
    import tempfile

    from rapidtrain.core.cpu_allocator import keep_freed_memory

    bf16 = o.precision == "bf16"
    if o.system == "rapidtrain":
        return run_rapidtrain(o, ["--bf16"] if bf16 else [])
    if o.system == "rapidtrain, glibc default":
        return run_rapidtrain(o, ["--no-cpu-allocator-tuning", *(["--bf16"] if bf16 else [])])
    if o.system == "rapidtrain, compiled":
        return run_rapidtrain(o, ["--torch-compile", *(["--bf16"] if bf16 else [])])
    dataset, vocab = demo_samples(o)
    if o.system == "plain loop":
        return run_plain_loop(o, torch.bfloat16 if bf16 else None, vocab, dataset)
    if o.system in ("HF Trainer, tuned malloc", "HF Trainer, best"):
        assert keep_freed_memory()
    with tempfile.TemporaryDirectory() as workdir:
        return run_hf_trainer(o, bf16, vocab, dataset, workdir, compile_=o.system == "HF Trainer, best")


# Set by the benches' smoke tests (tests/e2e/test_benches.py): every "child" runs in the bench's own process, one
# after another, so that a smoke run pays for one interpreter and one torch import instead of one per system. Its
# numbers are then not measurements (allocator state, caches and threads carry over); the table is what is tested.
SMOKE_IN_PROCESS = "RAPIDTRAIN_BENCH_SMOKE_IN_PROCESS"


def measure_in_child(script: str, flags: list[str], label: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run `script flags` in a process of its own (one measurement of one system, as every bench here interleaves
    them) and return the JSON report its last line prints; a failed child raises with the end of its output."""
    if os.environ.get(SMOKE_IN_PROCESS) == "1":
        return measure_here(script, flags, label, env)
    result = subprocess.run([sys.executable, script, *flags], capture_output=True, text=True, env=env)
    if result.returncode != 0:
        raise RuntimeError(f"{label} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def measure_here(script: str, flags: list[str], label: str, env: dict[str, str] | None) -> dict[str, Any]:
    """measure_in_child's work in this process (SMOKE_IN_PROCESS): `script` run as `python script flags` would run
    it (runpy, as __main__, with that argv and environment), its printed last line read back."""
    import contextlib
    import io
    import runpy

    printed, argv, environ = io.StringIO(), sys.argv, dict(os.environ)
    sys.argv = [script, *flags]
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stdout(printed):
            runpy.run_path(script, run_name="__main__")
    except Exception as error:
        raise RuntimeError(f"{label} failed:\n{printed.getvalue()[-3000:]}") from error
    finally:
        sys.argv = argv
        os.environ.clear()
        os.environ.update(environ)
    return json.loads(printed.getvalue().strip().splitlines()[-1])


def child_seconds(o: argparse.Namespace, system: str, precision: str) -> tuple[float, float, float]:
    """(seconds per steady step, CPU seconds per steady step, peak resident MiB) of one system in a process of its
    own."""
    shape = ["--iters", str(o.iters), "--warmup", str(o.warmup), "--layers", str(o.layers), "--hidden", str(o.hidden),
             "--heads", str(o.heads), "--seq", str(o.seq), "--batch", str(o.batch), "--dropout", str(o.dropout)]
    report = measure_in_child(__file__, [*shape, "--system", system, "--precision", precision],
                              f"{system} ({precision})")
    return report["seconds"], report["cpu_seconds"], report["peak_mib"]


def round_order(systems: list[str], round_: int) -> list[str]:
    """The systems of round `round_` (from 0), rotated by one a round (A B C, B C A, C A B): each system runs first
    in some round, so that no row always pays for a host that warms up (or is loaded) at the start of a round."""
    return systems[round_ % len(systems):] + systems[:round_ % len(systems)]


def median(values: list[float]) -> float:
    return statistics.median(values)


def spread(values: list[float]) -> float:
    """Half the range over the median (± this fraction covers every round): how much the host moved the system."""
    return (max(values) - min(values)) / 2 / statistics.median(values) if len(values) > 1 else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--rounds", "--repeats", type=int, default=3, dest="rounds",
                        help="interleaved rounds (A B C, B C A, ...): every row is the median of its rounds")
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--hidden", type=int, default=384)
    parser.add_argument("--heads", type=int, default=6)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dropout", type=float, default=0.0,
                        help="hidden, embedding and attention dropout of every row (Megatron's and GPT-2's "
                             "default: 0.1)")
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="rows to run (default: all); 'time vs plain' needs plain loop, 'vs fastest HF' an HF row")
    parser.add_argument("--precisions", nargs="+", choices=("fp32", "bf16"), default=["fp32", "bf16"])
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)  # child process: one measurement
    parser.add_argument("--precision", choices=("fp32", "bf16"), help=argparse.SUPPRESS)
    o = parser.parse_args()
    if o.system:
        import resource

        seconds, cpu_seconds = run_one(o)
        print(json.dumps({"seconds": seconds, "cpu_seconds": cpu_seconds,
                          "peak_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
        return

    _, vocab = demo_samples(o)
    config = ModelConfig(num_layers=o.layers, hidden_size=o.hidden, num_attention_heads=o.heads, seq_length=o.seq,
                         max_position_embeddings=o.seq, vocab_size=vocab)
    flops = model_flops_per_iteration(config, o.batch)
    tokens = o.batch * o.seq
    print(f"GPT {o.layers} layers, hidden {o.hidden}, {o.heads} heads, seq {o.seq}, vocab {vocab}, batch {o.batch}, "
          f"dropout {o.dropout:g}; "
          f"{torch.get_num_threads()} threads; {o.iters} steps, first {o.warmup} excluded; {o.rounds} interleaved "
          f"rounds, medians", flush=True)
    rows = []
    for precision in o.precisions:
        dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
        peak = measure_peak_tflops(dtype, torch.device("cpu"))
        gemm_shapes = linear_gemm_shapes(o.hidden, 4 * o.hidden, vocab, o.layers, tokens)
        seconds: dict[str, list[float]] = {system: [] for system in o.systems}
        peaks: dict[str, list[float]] = {system: [] for system in o.systems}
        cpu: dict[str, list[float]] = {system: [] for system in o.systems}
        ceilings: list[float] = []
        for round_ in range(o.rounds):
            # The ceiling is this model's own linear-layer GEMMs run back to back, timed inside the same round as
            # the systems, so that a host that slows down slows both: no implementation of this step runs its GEMMs
            # faster, so "of GEMM ceiling" is how much of the step is matrix work.
            ceilings.append(measure_gemm_tflops(gemm_shapes, dtype, torch.device("cpu")))
            for system in round_order(o.systems, round_):
                step, cpu_step, mib = child_seconds(o, system, precision)
                seconds[system].append(step)
                cpu[system].append(cpu_step)
                peaks[system].append(mib)
                print(f"    round {round_ + 1} {precision} {system}: {step * 1000:.1f} ms/step, CPU "
                      f"{cpu_step * 1000:.1f} ms/step, peak {mib:.0f} MiB", flush=True)
        ceiling = median(ceilings)
        print(f"  {precision}: matmul peak {peak * 1000:.0f} GFLOP/s (2048² products); this model's linear-layer "
              f"GEMMs alone run at {ceiling * 1000:.0f} GFLOP/s ({ceiling / peak:.0%} of the peak)", flush=True)
        hf_rows = [system for system in HF_ROWS if system in seconds]
        for system in o.systems:
            runs = seconds[system]
            # Ratios are medians of per-round ratios: both sides of each ratio saw the same host in that round.
            vs_plain = (median([a / b for a, b in zip(runs, seconds["plain loop"], strict=True)])
                        if "plain loop" in seconds else float("nan"))
            vs_hf = (median([min(seconds[h][r] for h in hf_rows) / runs[r] for r in range(o.rounds)])
                     if hf_rows else float("nan"))
            of_ceiling = median([flops / s / 1e12 / c * 100 for s, c in zip(runs, ceilings, strict=True)])
            step = median(runs)
            rows.append((precision, system, tokens / step, spread(runs) * 100, flops / step / 1e12 / peak * 100,
                         of_ceiling, vs_plain, vs_hf, median(cpu[system]) * 1000, max(peaks[system])))
    print(f"\n{'precision':<9} {'system':<25} {'tokens/s':>9} {'± %':>5} {'MFU %':>6} {'of GEMM ceiling %':>17} "
          f"{'time vs plain':>14} {'vs fastest HF':>13} {'CPU ms/step':>11} {'peak MiB':>9}")
    for precision, system, tokens_per_s, moved, mfu, of_ceiling, vs_plain, vs_hf, cpu_ms, mib in rows:
        print(f"{precision:<9} {system:<25} {tokens_per_s:9.0f} {moved:5.1f} {mfu:6.1f} {of_ceiling:17.1f} "
              f"{vs_plain:14.3f} {vs_hf:13.3f} {cpu_ms:11.1f} {mib:9.0f}")
    print("\ntokens/s: at the median step time of the rounds; ± %: half the range of the rounds over the median;"
          "\nMFU: model FLOPs per second over the 2048² matmul peak; of GEMM ceiling: over the rate of this model's "
          "own linear-layer GEMMs run back to back in the same round (what a step with no other work would reach);"
          "\ntime vs plain: seconds per step relative to the plain loop, the median of the rounds' ratios;"
          "\nvs fastest HF: the fastest Hugging Face row's seconds per step divided by this system's, per round, "
          "median (> 1 is faster);\nCPU ms/step: the process's CPU time per steady step (all its threads), median "
          "of the rounds: load moves it far less than the wall clock;\npeak MiB: the process's largest peak resident "
          "memory (ru_maxrss) over the rounds.")


if __name__ == "__main__":
    main()
