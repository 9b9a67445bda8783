"""MoE in the training loop, one process: the balancing loss's gradient through accumulation and loss
scaling, the log line and plan of a per-layer expert list, and the plan's counts under expert parallelism."""

from __future__ import annotations

import pytest
import torch

from rapidtrain import arguments, plan
from rapidtrain.engine import Engine
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.counting import count_parameters, expert_parameter_count, model_flops_per_iteration
from rapidtrain.plan import RunContext
from tests.moe_reference import (
    OneStepTrainer,
    capture_step_gradients,
    global_batches,
    model_flags,
    reference_gradients,
    relative_gradient_difference,
)


def one_step_gradients(micro_batches: int, extra: list[str]) -> tuple[dict, dict, ModelConfig]:
    """Gradients the optimizer applies after one Trainer.train_step of `micro_batches` micro-batches."""
    engine = Engine(argv=model_flags(micro_batches, 1) + extra)
    config = engine.plan.model
    trainer = OneStepTrainer(engine)
    trainer.model, *_ = engine.compose(build_model(config, seed=3))
    seen = capture_step_gradients(engine.runner)
    batches = global_batches(micro_batches)
    trainer.train_step(batches)
    return seen, reference_gradients(build_model(config, seed=3), batches, config.moe_aux_loss_coeff), config


@pytest.mark.parametrize("micro_batches", [1, 4])
def test_balancing_loss_gradient_is_coeff_times_mean_over_micro_batches(micro_batches: int):
    """The trainer sets the router-loss gradient scale to 1 / accumulation steps: with 4 micro-batches the
    router gets coeff × d(mean balancing loss)/dθ, as with 1 (the reference builds the loss by hand)."""
    seen, expected, config = one_step_gradients(micro_batches, [])
    assert relative_gradient_difference(seen, expected) < 1e-6
    # The balancing loss matters here: without it the router's gradient would be far off.
    without = reference_gradients(build_model(config, seed=3), global_batches(micro_batches), 0.0)
    router = "layers.1.mlp.router.weight"
    assert (without[router] - expected[router]).norm() > 0.1 * expected[router].norm()


def test_balancing_loss_gradient_carries_the_fp16_loss_scale():
    """Under --fp16 with a static loss scale 1024 the router loss's gradient is scaled like the main loss and
    unscaled with it: the applied gradient matches the fp32 reference to fp16 rounding, not 1024× off."""
    seen, expected, _ = one_step_gradients(2, ["--fp16", "--loss-scale", "1024"])
    router = "layers.1.mlp.router.weight"
    assert (seen[router] - expected[router]).norm() < 2e-2 * expected[router].norm()


def test_per_layer_expert_list_trains_and_logs_balancing_loss(demo_data, capsys):
    """`--num-experts 0 4` through pretrain.py: dense layer 0, MoE layer 1; the log line has the
    balancing loss as its own field and the plan prints total and active parameters."""
    from rapidtrain.pretrain import main

    main(
        "--num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 32 --micro-batch-size 2 "
        "--global-batch-size 4 --num-workers 0 --train-iters 3 --log-interval 1 --eval-iters 0 "
        "--lr-warmup-iters 0 --num-experts 0 4 --moe-router-topk 2".split()
    )
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "iteration        " in line]
    assert len(lines) == 3 and all("| load balancing loss: " in line for line in lines)
    values = [float(line.split("load balancing loss: ")[1].split(" |")[0]) for line in lines]
    assert all(0.9 < v < 2.0 for v in values)  # ≥ 1 only in expectation; 2 = all tokens on one of 4 experts
    assert "experts [0, 4]" in out
    parameters_line = next(line for line in out.splitlines() if "parameters:" in line and "active" in line)
    total, active = (int(word.replace(",", "")) for word in parameters_line.split()[1:4:2])
    assert total > active and total - active == 2 * (2 * 32 * 128 + 128 + 32)  # two of four experts idle


def test_plan_splits_expert_parameters_over_expert_parallel_ranks():
    argv = (
        "--train-iters 10 --lr 1e-4 --num-layers 4 --hidden-size 64 --num-attention-heads 4 "
        "--num-experts 8 --moe-layer-freq 2"
    ).split()
    one = plan.from_args(arguments.parse_args(argv), RunContext(4, "cpu"))
    four = plan.from_args(arguments.parse_args(argv + ["--expert-model-parallel-size", "4"]), RunContext(4, "cpu"))
    experts = expert_parameter_count(one.model)
    assert experts == 2 * 8 * (2 * 64 * 256 + 256 + 64)  # layers 1 and 3, 8 experts each
    assert one.memory.parameters == one.memory.total_params == count_parameters(one.model)[0]
    assert four.memory.parameters == one.memory.parameters - experts + experts // 4
    assert "expert parallel 4" in four.describe()


def test_model_flops_count_only_the_experts_a_token_visits():
    base = dict(num_layers=2, hidden_size=32, num_attention_heads=2, seq_length=16, vocab_size=64)
    top1 = model_flops_per_iteration(ModelConfig(**base, num_experts=(8, 8), moe_router_topk=1), 4)
    top2 = model_flops_per_iteration(ModelConfig(**base, num_experts=(8, 8), moe_router_topk=2), 4)
    more_experts = model_flops_per_iteration(ModelConfig(**base, num_experts=(16, 16), moe_router_topk=1), 4)
    tokens, h, ffn = 4 * 16, 32, 128
    assert top2 - top1 == 3 * 2 * (4 * tokens * h * ffn)  # one more expert MLP per token, in both layers
    assert more_experts - top1 == 3 * 2 * (2 * tokens * h * 8)  # only the router grows with the expert count


def test_expert_parallel_needs_materialized_weights():
    from rapidtrain.models.moe import Experts
    from rapidtrain.parallel.experts import ExpertParallelExperts

    with torch.device("meta"):
        experts = Experts(4, 8, 16)
    with pytest.raises(ValueError, match="real device"):
        ExpertParallelExperts(experts, group=None, ep_rank=0, ep_size=2)  # type: ignore[arg-type]
