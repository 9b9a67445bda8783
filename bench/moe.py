"""Dense GPT against MoE GPTs with the same active parameters: tokens/s, validation loss after a fixed
number of steps, and each MoE layer's expert load histogram.

Every model trains through the real loop (`rapidtrain/pretrain.py`'s MegatronPreTrainer) on the demo
corpus, same samples, seed and schedule. The MoE rows keep a token's active parameters equal to the
dense model's: top-1 of E experts of the dense FFN size, or top-2 of E experts of half that size (the
routers add h·E per MoE layer). Rows differ only in the MLPs.

    python bench/moe.py [--iters 300 --layers 4 --hidden 128 --heads 4 --seq 128 --micro-batch 8 --experts 8]
    torchrun --nproc-per-node 2 bench/moe.py --expert-parallel 2    # experts sharded over 2 ranks
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from rapidtrain.models.counting import count_parameters  # noqa: E402
from rapidtrain.pretrain import MegatronPreTrainer  # noqa: E402
from rapidtrain.train.engine import Engine  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--iters", type=int, default=300, help="training steps of every model")
    parser.add_argument("--warmup", type=int, default=10, help="steps left out of the timing")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--experts", type=int, default=8, help="experts of every MoE layer")
    parser.add_argument("--capacity-factor", type=float, default=1.25)
    parser.add_argument(
        "--expert-parallel", type=int, default=1, help="--expert-model-parallel-size of MoE rows"
    )
    parser.add_argument("--eval-iters", type=int, default=20, help="validation batches for the final loss")
    parser.add_argument("--lr", type=float, default=1e-3)
    return parser.parse_args()


@dataclass
class Row:
    name: str
    total_params: int
    active_params: int
    tokens_per_second: float
    final_train_loss: float
    validation_loss: float
    balancing_loss: float | None
    load: dict[str, torch.Tensor]


def train_one(o: argparse.Namespace, name: str, model_flags: list[str]) -> Row:
    step_seconds: list[float] = []
    losses: list[float] = []
    balancing: list[float] = []

    class Timed(MegatronPreTrainer):
        def train_step(self, micro_batches, stop_requested=False):  # noqa: ANN001, ANN202
            started = time.perf_counter()
            result = super().train_step(micro_batches, stop_requested=stop_requested)
            step_seconds.append(time.perf_counter() - started)
            losses.append(float(result.loss))  # device tensors: read here, outside the timed step
            if "load balancing loss" in result.extras:
                balancing.append(float(result.extras["load balancing loss"]))
            return result

    argv = (
        f"--num-layers {o.layers} --hidden-size {o.hidden} --num-attention-heads {o.heads} --seq-length {o.seq} "
        f"--micro-batch-size {o.micro_batch} --train-iters {o.iters} --lr {o.lr} --min-lr {o.lr / 10} "
        f"--lr-decay-style cosine --lr-warmup-iters 10 --log-interval {o.iters} --eval-interval {10 * o.iters} "
        f"--eval-iters {o.eval_iters} --num-workers 0 --hidden-dropout 0 --attention-dropout 0"
    ).split() + model_flags
    engine = Engine(argv=argv)
    trainer = Timed(engine)
    trainer.train()
    # The same --eval-iters batches for every model; evaluate returns each reported loss by name.
    validation = trainer.evaluate(trainer.valid_ds)[trainer.loss_name]
    trainer.expert_load()  # the forwards since the last log line join the run's total
    total_load = trainer.expert_load_total
    load = {} if total_load is None else {  # every training forward since the start, per MoE layer
        f"layers.{row}.mlp": counts[:experts].round().long() for row, counts in enumerate(total_load)
        if row < engine.plan.model.num_layers and (experts := engine.plan.model.experts_in_layer(row))
        and counts.sum() > 0}
    steady = step_seconds[o.warmup :] or step_seconds
    tokens_per_step = engine.plan.batches.global_batch_size * o.seq
    total, active = count_parameters(engine.plan.model)
    return Row(
        name,
        total,
        active,
        tokens_per_step / statistics.median(steady),
        statistics.mean(losses[-10:]),
        validation,
        statistics.mean(balancing[-10:]) if balancing else None,
        load,
    )


def histogram(load: torch.Tensor, width: int = 40) -> list[str]:
    share = load.double() / load.sum()
    return [
        f"      expert {e:2d} {100 * s:5.1f}% " + "#" * round(width * s * len(share) / 2)
        for e, s in enumerate(share.tolist())
    ]


def main() -> None:
    o = parse_args()
    e, half = o.experts, 2 * o.hidden
    moe = [
        "--moe-capacity-factor",
        str(o.capacity_factor),
        "--expert-model-parallel-size",
        str(o.expert_parallel),
    ]
    runs = [
        ("dense", []),
        (f"MoE top-1 of {e}", ["--num-experts", str(e), "--moe-router-topk", "1", *moe]),
        (
            f"MoE top-2 of {e}, ffn {half}",
            ["--num-experts", str(e), "--moe-router-topk", "2", "--ffn-hidden-size", str(half), *moe],
        ),
    ]
    rows = [train_one(o, name, flags) for name, flags in runs]
    if torch.distributed.is_initialized() and torch.distributed.get_rank() != 0:
        return
    device = "cuda" if torch.cuda.is_available() else "cpu"
    print(
        f"\n{o.layers} layers, hidden {o.hidden}, seq {o.seq}, micro-batch {o.micro_batch}, {o.iters} steps, "
        f"capacity factor {o.capacity_factor:g}, {device}\n"
    )
    print(
        "| model | total params | active params | tokens/s | train loss (last 10) | validation loss "
        "| balancing loss |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        balancing = f"{r.balancing_loss:.3f}" if r.balancing_loss is not None else "–"
        print(
            f"| {r.name} | {r.total_params:,} | {r.active_params:,} | {r.tokens_per_second:,.0f} | "
            f"{r.final_train_loss:.3f} | {r.validation_loss:.3f} | {balancing} |"
        )
    for r in rows:
        for layer, load in r.load.items():
            print(f"\n  {r.name}, {layer}: expert load over training (assignments before dropping)")
            print("\n".join(histogram(load)))


if __name__ == "__main__":
    main()
