"""A fine-grained MoE model trained by rapidtrain against its peers: Hugging Face's Qwen2-MoE and Mixtral of the same
shape (`from_config`, the same initial weights), trained by a plain torch loop and by HF Trainer, and a plain loop over
rapidtrain's own model. Tokens/s, CPU time and peak memory of each.

Shapes (--shapes): `qwen2_moe` is 16 experts top-4 with a small expert hidden size beside a gated shared expert,
softmax over all experts (Qwen's norm_topk_prob=False) and q/k/v biases; `mixtral` the same routed experts without the
shared expert, the top-k weights renormalised. rapidtrain's flags for each shape are exported by
rapidtrain.models.hf_weights (export_family, hf_config_for, hf_state_dict) into the Hugging Face config and weights, so
both sides are one model (checked: equal parameter counts, and the first step's loss printed beside each row). Both
sides train the router with the load-balancing loss (HF: output_router_logits=True, the same coefficient), dropless.

Rows (--systems):
  rapidtrain                    the product: MegatronPreTrainer on the demo corpus, the flags below
  plain loop                    a hand-written loop over rapidtrain's model (the same samples, fused AdamW, clipping)
  HF loop                       the Hugging Face model in a hand-written loop (its default experts: grouped_mm)
  HF loop, eager experts        the same with experts_implementation="eager" (a Python loop over the experts hit)
  HF Trainer                    the Hugging Face model trained by transformers.Trainer (defaults, adamw_torch_fused)
Every row is fused AdamW, clip 1.0, lr 3e-4 constant, no dropout, the same demo-corpus samples, --precision (fp32, or
bf16 autocast). As bench/pretrain_throughput.py and bench/long_sequence.py: each measurement in a process of its own,
the systems interleaved (A B C, B C A, ...) over --rounds, each row the median of its rounds with the spread beside
it, every ratio the median of per-round ratios.

    python bench/moe_throughput.py [--rounds 3 --iters 8 --warmup 2 --layers 2 --hidden 256 --heads 4 --seq 256
        --batch 4 --experts 16 --topk 4 --expert-ffn 128 --shared-ffn 512 --precision fp32|bf16 --threads 1
        --shapes qwen2_moe mixtral --systems rapidtrain "HF loop" ...]
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from pretrain_throughput import demo_samples, measure_in_child, median, spread, steady_seconds  # noqa: E402

SHAPES = ("qwen2_moe", "mixtral")
SYSTEMS = ("rapidtrain", "plain loop", "HF loop", "HF loop, eager experts", "HF Trainer")
PEERS = tuple(system for system in SYSTEMS if system.startswith("HF"))
SEED = 1234


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds: every row is their median")
    parser.add_argument("--iters", type=int, default=8, help="training steps of each measurement")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the timing")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--topk", type=int, default=4)
    parser.add_argument("--expert-ffn", type=int, default=128, help="each routed expert's hidden size")
    parser.add_argument("--shared-ffn", type=int, default=512, help="the shared expert's hidden size (qwen2_moe)")
    parser.add_argument("--aux-loss-coeff", type=float, default=0.01, help="load-balancing loss weight of every row")
    parser.add_argument("--precision", choices=("fp32", "bf16"), default="fp32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads(),
                        help="torch intra-op threads of every row (OMP_NUM_THREADS, which rapidtrain keeps as given); "
                             "on a loaded host 1 is what is fair: each OpenMP barrier of a small kernel costs a "
                             "timeslice there, so rows with many small kernels lose to the load, not to their code")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--systems", nargs="+", choices=SYSTEMS, default=list(SYSTEMS),
                        help="rows to run in every shape (default: all); 'vs fastest peer' needs an HF row")
    parser.add_argument("--system", choices=SYSTEMS, help=argparse.SUPPRESS)  # child process: one measurement
    parser.add_argument("--shape", choices=SHAPES, help=argparse.SUPPRESS)
    return parser.parse_args()


def model_flags(o: argparse.Namespace, shape: str) -> list[str]:
    """rapidtrain's flags of the model: Llama-family attention and norms, every layer MoE, dropless."""
    flags = ["--num-layers", o.layers, "--hidden-size", o.hidden, "--num-attention-heads", o.heads,
             "--seq-length", o.seq, "--max-position-embeddings", o.seq, "--position-embedding-type", "rope",
             "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear", "--untie-embeddings-and-output-weights",
             "--hidden-dropout", "0", "--attention-dropout", "0", "--num-experts", o.experts, "--moe-router-topk",
             o.topk, "--disable-moe-token-dropping", "--moe-aux-loss-coeff", o.aux_loss_coeff]
    if shape == "qwen2_moe":
        flags += ["--add-qkv-bias", "--ffn-hidden-size", 4 * o.hidden, "--moe-ffn-hidden-size", o.expert_ffn,
                  "--moe-shared-expert-intermediate-size", o.shared_ffn, "--moe-shared-expert-gate",
                  "--moe-router-pre-softmax"]
    else:  # Mixtral's experts are its FFN
        flags += ["--ffn-hidden-size", o.expert_ffn]
    return [str(flag) for flag in flags]


def train_flags(o: argparse.Namespace, shape: str) -> list[str]:
    return [*model_flags(o, shape), "--micro-batch-size", str(o.batch), "--train-iters", str(o.iters),
            "--lr", "3e-4", "--lr-decay-style", "constant", "--num-workers", "0", "--log-interval", str(10**6),
            "--eval-interval", str(10**6), "--eval-iters", "0", "--clip-grad", "1.0", "--seed", str(SEED),
            *(["--bf16"] if o.precision == "bf16" else [])]


def rapidtrain_model(o: argparse.Namespace, shape: str, vocab: int) -> tuple[Any, torch.nn.Module]:
    """(ModelConfig, model) the flags make, initialised as the product initialises it."""
    from rapidtrain.config import arguments, resolve
    from rapidtrain.models import build_model

    config = resolve.model_config_from_args(arguments.parse_args(train_flags(o, shape)), vocab)
    return config, build_model(config, seed=SEED)


def hf_model(o: argparse.Namespace, shape: str, vocab: int, experts: str | None) -> torch.nn.Module:
    """The Hugging Face model of the same shape, holding rapidtrain's initial weights."""
    import transformers

    from rapidtrain.models.hf_weights import save_hf_folder

    config, ours = rapidtrain_model(o, shape, vocab)
    with tempfile.TemporaryDirectory() as folder:  # transformers' own loader converts the per-expert checkpoint
        kind = save_hf_folder(ours.state_dict(), config, folder)
        assert kind == shape, f"the {shape} flags export as {kind}"
        # Train the router with the balancing loss, as ours does (HF leaves it out unless output_router_logits).
        model = transformers.AutoModelForCausalLM.from_pretrained(
            folder, attn_implementation="sdpa", experts_implementation=experts, dtype=torch.float32,
            output_router_logits=o.aux_loss_coeff > 0, use_cache=False)
    return model


class Clock:
    """Wall and process-CPU time stamps at each step's end (the rows' time and the host-load-proof CPU time)."""

    def __init__(self) -> None:
        self.wall: list[float] = []
        self.cpu: list[float] = []
        self.losses: list[float] = []

    def stamp(self, loss: torch.Tensor | float) -> None:
        self.wall.append(time.perf_counter())
        self.cpu.append(time.process_time())
        self.losses.append(float(loss))  # after the stamp: a device's loss is read outside the step


def run_rapidtrain(o: argparse.Namespace, clock: Clock) -> torch.nn.Module:
    from rapidtrain.pretrain import MegatronPreTrainer
    from rapidtrain.train.engine import Engine

    class Timed(MegatronPreTrainer):
        def train_step(self, micro_batches, stop_requested=False):  # noqa: ANN001, ANN202
            result = super().train_step(micro_batches, stop_requested=stop_requested)
            clock.stamp(result.loss)
            return result

    trainer = Timed(Engine(argv=train_flags(o, o.shape)))
    trainer.train()
    return trainer.engine.runner.module


def run_loop(o: argparse.Namespace, clock: Clock, vocab: int, dataset: Any) -> torch.nn.Module:
    """A hand-written loop over rapidtrain's model or a Hugging Face one (the row's), the same steps as the product."""
    if o.system == "plain loop":
        model = rapidtrain_model(o, o.shape, vocab)[1]
    else:
        model = hf_model(o, o.shape, vocab, "eager" if o.system == "HF loop, eager experts" else None)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.01, fused=True)
    loader = torch.utils.data.DataLoader(dataset, batch_size=o.batch, shuffle=False)
    dtype = torch.bfloat16 if o.precision == "bf16" else None
    for batch in itertools.islice(loader, o.iters):
        with torch.autocast("cpu", dtype=dtype, enabled=dtype is not None):
            if o.system == "plain loop":
                per_token = model(batch["tokens"], position_ids=batch["position_ids"], labels=batch["labels"])
                mask = batch["loss_mask"]
                loss = lm_loss = (per_token.float() * mask).sum() / mask.sum()
            else:  # Hugging Face shifts the labels itself; its loss includes the weighted balancing loss
                out = model(input_ids=batch["tokens"], labels=batch["tokens"])
                loss = out.loss
                lm_loss = loss - o.aux_loss_coeff * out.aux_loss if out.aux_loss is not None else loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        clock.stamp(lm_loss.detach())
    return model


def run_hf_trainer(o: argparse.Namespace, clock: Clock, vocab: int, dataset: Any) -> torch.nn.Module:
    from transformers import Trainer, TrainerCallback, TrainingArguments

    model = hf_model(o, o.shape, vocab, None)

    class Stamp(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN003, ANN202
            clock.stamp(float("nan"))  # Trainer reads its losses at its logging steps only

    class Samples(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return len(dataset)

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            tokens = torch.as_tensor(dataset[i]["tokens"])
            return {"input_ids": tokens, "labels": tokens}

    with tempfile.TemporaryDirectory() as workdir:
        arguments = TrainingArguments(output_dir=workdir, per_device_train_batch_size=o.batch, max_steps=o.iters,
                                      learning_rate=3e-4, weight_decay=0.01, max_grad_norm=1.0,
                                      bf16=o.precision == "bf16", use_cpu=True, report_to=[], logging_steps=10**6,
                                      save_strategy="no", dataloader_num_workers=0, lr_scheduler_type="constant",
                                      disable_tqdm=True)
        Trainer(model=model, args=arguments, train_dataset=Samples(), callbacks=[Stamp()]).train()
    return model


def measure(o: argparse.Namespace) -> dict[str, float]:
    """One system's steady seconds and CPU seconds per step, peak memory and first loss (the child's whole job)."""
    dataset, vocab = demo_samples(o)
    # The high-water mark before any model exists (interpreter, torch, transformers, the data): what the row's own
    # training adds above it is its model, optimizer state and activations.
    baseline = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    clock = Clock()
    if o.system == "rapidtrain":
        model = run_rapidtrain(o, clock)
    elif o.system == "HF Trainer":
        model = run_hf_trainer(o, clock, vocab, dataset)
    else:
        model = run_loop(o, clock, vocab, dataset)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": steady_seconds(clock.wall, o.warmup), "cpu_seconds": steady_seconds(clock.cpu, o.warmup),
            "peak_mib": peak, "training_mib": peak - baseline, "first_loss": clock.losses[0],
            "parameters": sum(p.numel() for p in model.parameters())}


def child(o: argparse.Namespace, shape: str, system: str) -> dict[str, float]:
    flags = []
    for name, value in vars(o).items():
        if name in ("system", "shape", "shapes", "systems"):
            continue
        flags.append(f"--{name.replace('_', '-')}={value}")
    env = {**os.environ, "OMP_NUM_THREADS": str(o.threads)}
    return measure_in_child(__file__, [*flags, "--shape", shape, "--system", system], f"{system} ({shape})", env)


def main() -> None:
    o = parse_args()
    if o.system:
        torch.set_num_threads(o.threads)
        print(json.dumps(measure(o)))
        return
    if o.warmup + 2 > o.iters:
        raise SystemExit(f"--iters {o.iters} must exceed --warmup {o.warmup} by 2 (the steady rate needs two stamps)")
    tokens = o.batch * o.seq
    print(f"MoE {o.layers} layers, hidden {o.hidden}, {o.heads} heads, {o.experts} experts top-{o.topk}, expert ffn "
          f"{o.expert_ffn} (qwen2_moe: + shared {o.shared_ffn}); batch {o.batch} × seq {o.seq}, {o.precision}; "
          f"{o.threads} threads, AVX512-BF16 {torch.cpu._is_avx512_bf16_supported()}; {o.iters} steps, "
          f"first {o.warmup} excluded; {o.rounds} interleaved rounds, medians", flush=True)
    rows = []
    for shape in o.shapes:
        runs: dict[str, list[dict[str, float]]] = {system: [] for system in o.systems}
        for round_ in range(o.rounds):
            for system in o.systems[round_ % len(o.systems):] + o.systems[:round_ % len(o.systems)]:
                runs[system].append(child(o, shape, system))
                run = runs[system][-1]
                print(f"    round {round_ + 1} {shape} {system}: {run['seconds'] * 1000:.1f} ms/step, CPU "
                      f"{run['cpu_seconds'] * 1000:.1f} ms/step, peak {run['peak_mib']:.0f} MiB", flush=True)
        counts = {system: int(results[0]["parameters"]) for system, results in runs.items()}
        if len(set(counts.values())) != 1:
            raise SystemExit(f"{shape}: the rows' models differ in shape: {counts}")
        peers = [system for system in PEERS if system in runs]
        for system, results in runs.items():
            seconds = [run["seconds"] for run in results]
            # Per round, the fastest peer's time over this row's: both saw the same host in that round.
            vs_peer = (median([min(runs[p][r]["seconds"] for p in peers) / seconds[r] for r in range(o.rounds)])
                       if peers else float("nan"))
            vs_peer_cpu = (median([min(runs[p][r]["cpu_seconds"] for p in peers) / results[r]["cpu_seconds"]
                                   for r in range(o.rounds)]) if peers else float("nan"))
            rows.append((shape, system, tokens / median(seconds), spread(seconds) * 100,
                         median([run["cpu_seconds"] for run in results]) * 1000, vs_peer, vs_peer_cpu,
                         max(run["peak_mib"] for run in results), max(run["training_mib"] for run in results),
                         results[0]["first_loss"], counts[system]))
    print(f"\n{'shape':<10} {'system':<23} {'tokens/s':>9} {'± %':>5} {'CPU ms/step':>11} {'vs fastest peer':>15} "
          f"{'(CPU time)':>10} {'peak MiB':>9} {'training MiB':>12} {'first loss':>10} {'params M':>8}")
    for shape, system, rate, moved, cpu_ms, vs_peer, vs_cpu, peak, training, first, params in rows:
        print(f"{shape:<10} {system:<23} {rate:9.0f} {moved:5.1f} {cpu_ms:11.1f} {vs_peer:15.3f} {vs_cpu:10.3f} "
              f"{peak:9.0f} {training:12.0f} {first:10.4f} {params / 1e6:8.2f}")
    print("\ntokens/s: at the median steady step time of the rounds; ± %: half the range of the rounds over the median;"
          "\nCPU ms/step: the process's CPU time per steady step (user + system, all threads), median of the rounds;"
          "\nvs fastest peer: the fastest Hugging Face row's time per step over this row's, per round, median (> 1 is "
          "faster); (CPU time): the same of CPU time;\npeak MiB: the child process's peak resident set (ru_maxrss, "
          "not torch's allocator: the CPU allocator keeps no peak); training MiB: that peak minus the high-water "
          "mark\nbefore the model was built (model, gradients, AdamW state, activations); first loss: the first "
          "step's language-model loss (the same initial weights and tokens in every row but HF Trainer, which "
          "reports nan).")


if __name__ == "__main__":
    main()
