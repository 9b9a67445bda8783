"""MoE in the training loop, one process: the balancing loss's gradient through accumulation and loss
scaling, the log line and plan of a per-layer expert list, and the plan's counts under expert parallelism."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.config import arguments, memory, plan, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.settings import RunContext
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.counting import count_parameters, expert_parameter_count, model_flops_per_iteration
from rapidtrain.train.engine import Engine
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
    assert experts == 2 * 8 * (2 * 64 * 256 + 256 + 64)  # layers 0 and 2 (Megatron-Core's), 8 experts each
    assert one.memory.parameters == one.memory.total_params == count_parameters(one.model)[0]
    assert four.memory.parameters == one.memory.parameters - experts + experts // 4
    assert "expert parallel 4" in describe_plan(four)


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


MOE_8 = "--train-iters 10 --lr 1e-4 --num-layers 4 --hidden-size 64 --num-attention-heads 4 --num-experts 8".split()


def resolve(extra: list[str], world: int = 8) -> settings.Plan:
    args = arguments.parse_args(MOE_8 + extra)
    from rapidtrain.config import rules

    assert rules.violations(args, RunContext(world, "cpu")) == []
    return plan.from_args(args, RunContext(world, "cpu"))


@pytest.mark.parametrize("switch", ["--zero-1-memory-optimization", "--zero-2-memory-optimization",
                                    "--oss-memory-optimization", "--oss-sdp-memory-optimization",
                                    "--fsdp-memory-optimization"])
def test_expert_parallelism_combines_with_partitioning_and_the_plan_says_how_experts_are_treated(switch):
    """EP 2 on 8 ranks: two ranks hold each slice. FSDP2 (also serving ZeRO-1/2 here) shards the slices over
    those two; OSS keeps them out of its partitioning; the memory estimate follows."""
    ep2 = resolve(["--expert-model-parallel-size", "2", switch])
    choice = next(e for e in ep2.engines if e.switch == switch)
    if switch == "--oss-memory-optimization":
        assert ep2.switches.partitioning_engine == "zero-redundancy"
        assert "expert slices stay out of ZeroRedundancyOptimizer's partitioning" in choice.reason
    else:
        assert ep2.switches.partitioning_engine == "fsdp2"  # never DeepSpeed: it cannot reduce expert slices
        assert "fully_shard-ed on their second dimension over the 4 ranks holding the same experts" in choice.reason
    if switch.startswith("--zero"):
        assert choice.engine.startswith("FSDP2") and "reduce expert slices over their own group" in choice.reason
    # Optimizer state per rank: the shared part over 8 ranks; the experts' (1/2 each) over 4 ranks under FSDP2,
    # whole under OSS.
    experts = expert_parameter_count(ep2.model)
    shared = count_parameters(ep2.model)[0] - experts
    expert_ranks = 1 if switch == "--oss-memory-optimization" else 4
    state = memory.optimizer_state_bytes_per_parameter(ep2.model, ep2.optimizer, "cpu")  # AdamW: 8 B + the step scalars
    assert 8 < state < 8.001
    assert ep2.memory.optimizer_bytes == pytest.approx(state * (shared / 8 + experts / 2 / expert_ranks))


def test_experts_stay_out_of_fsdp2_where_nothing_to_shard_under_tensor_parallelism_or_uneven():
    whole = resolve(["--expert-model-parallel-size", "8", "--fsdp-memory-optimization"])
    assert "no other rank holds the same experts (data parallel 8 = expert parallel 8)" in next(
        e.reason for e in whole.engines if e.switch == "--fsdp-memory-optimization")
    tp = resolve(["--expert-model-parallel-size", "2", "--tensor-model-parallel-size", "2",
                  "--zero-2-memory-optimization"])
    reason = next(e.reason for e in tp.engines if e.switch == "--zero-2-memory-optimization")
    assert "DeepSpeed cannot wrap the tensor-parallel model or reduce expert slices" in reason
    assert "stay out of FSDP2: under tensor parallelism" in reason
    # 6 ranks, EP 2: three ranks hold each slice, and hidden 64 / FFN 256 do not split in three.
    uneven = resolve(["--expert-model-parallel-size", "2", "--oss-sdp-memory-optimization"], world=6)
    assert "second dimensions (64, 256) (hidden, FFN) do not split evenly over the 3 ranks" in next(
        e.reason for e in uneven.engines if e.switch == "--oss-sdp-memory-optimization")


def test_expert_parallelism_with_pipeline_is_accepted_and_zero3_cpu_offload_fairscale_are_refused():
    staged = resolve(["--expert-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"])
    assert staged.layout.expert_parallel_size == 2 and staged.layout.data_parallel_size == 4
    from rapidtrain.config import rules

    def refused(extra: list[str]) -> set[str]:
        args = arguments.parse_args(MOE_8 + ["--expert-model-parallel-size", "2", *extra])
        return {rule.name for rule in rules.RULES if rule.violated(args, RunContext(8, "cpu"))}

    assert "ep-with-zero3-or-fairscale" in refused(["--zero-3-memory-optimization"])
    assert "ep-with-zero3-or-fairscale" in refused(["--oss-memory-optimization", "--sharding-backend", "fairscale"])
    # ZeRO-2 with EP is FSDP2, where --cpu-offload (DeepSpeedCPUAdam) would silently do nothing.
    assert "cpu-offload-needs-zero" in refused(["--zero-2-memory-optimization", "--cpu-offload"])


@pytest.mark.parametrize(("flags", "layers"), [
    (["--moe-layer-freq", "2"], (0, 2, 4)),  # Megatron-Core: every 2nd layer from layer 0
    (["--moe-layer-freq", "3"], (0, 3)),
    (["--expert-interval", "2"], (1, 3, 5)),  # Megatron-DeepSpeed: layers 2, 4, 6 counted from 1
    (["--expert-interval", "3"], (2, 5)),
    ([], (0, 1, 2, 3, 4, 5)),
])
def test_moe_layers_are_where_the_flags_origin_puts_them(flags, layers):
    """--moe-layer-freq N is Megatron-Core's (layers 0, N, 2N, ...; its checkpoints' MoE layers are there) and
    --expert-interval N Megatron-DeepSpeed's (layer numbers from 1 divisible by N): one spelling must not take the
    other's meaning."""
    argv = "--train-iters 10 --lr 1e-4 --num-layers 6 --hidden-size 64 --num-attention-heads 4 --num-experts 4"
    resolved = plan.from_args(arguments.parse_args(argv.split() + flags), RunContext(1, "cpu"))
    assert tuple(i for i, count in enumerate(resolved.model.num_experts) if count) == layers


def test_the_plan_says_whose_balancing_weight_runs_when_none_is_given():
    """The origins' defaults differ (Megatron-Core 0, Megatron-DeepSpeed 0.1, Pai 0.01): rapidtrain keeps 0.01 and its
    plan says so with the flag to type; a weight given is taken as it is, without the note."""
    argv = "--train-iters 10 --lr 1e-4 --num-layers 2 --hidden-size 64 --num-attention-heads 4 --num-experts 4".split()
    default = plan.from_args(arguments.parse_args(argv), RunContext(1, "cpu"))
    assert default.model.moe_aux_loss_coeff == 0.01
    assert any("Megatron-Core's is 0" in note and "--moe-aux-loss-coeff" in note for note in default.notes)
    given = plan.from_args(arguments.parse_args(argv + ["--moe-aux-loss-coeff", "0"]), RunContext(1, "cpu"))
    assert given.model.moe_aux_loss_coeff == 0 and not any("balancing loss weight" in n for n in given.notes)
