"""Fine-grained MoE (DeepSeek-V2/V3, Qwen-MoE): the router's score functions, expert bias, groups and scaling, the
sequence-wise balancing loss, shared experts and the bias update (and Megatron-Core's Sinkhorn routing, by its
balance), against transformers' own MoE blocks as the oracle
(DeepseekV3MoE, Qwen2MoeSparseMoeBlock, Qwen3MoeSparseMoeBlock built from tiny configs here) over drawn settings."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.moe import (
    MoELayer,
    load_balancing_loss,
    sequence_load_balancing_loss,
    sinkhorn,
    update_expert_biases,
)

H = 16


def moe_config(**overrides) -> ModelConfig:
    base = dict(num_layers=1, hidden_size=H, num_attention_heads=2, vocab_size=32, swiglu=True,
                add_bias_linear=False, normalization="RMSNorm", moe_token_dropping=False, ffn_hidden_size=24)
    return ModelConfig(**{**base, **overrides})


def copy_experts(layer: MoELayer, gate_up: torch.Tensor, down: torch.Tensor) -> None:
    """transformers' fused experts (gate_up [E, 2f, h]: gate rows first, then up; down [E, h, f]) into ours."""
    f = down.shape[-1]
    with torch.no_grad():
        layer.experts.w_gate.copy_(gate_up[:, :f].transpose(1, 2))
        layer.experts.w1.copy_(gate_up[:, f:].transpose(1, 2))
        layer.experts.w2.copy_(down.transpose(1, 2))


def copy_mlp(ours: torch.nn.Module, theirs: torch.nn.Module) -> None:
    with torch.no_grad():
        ours.gate.weight.copy_(theirs.gate_proj.weight)
        ours.fc1.weight.copy_(theirs.up_proj.weight)
        ours.fc2.weight.copy_(theirs.down_proj.weight)


def randomize(module: torch.nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in module.parameters():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)


@st.composite
def deepseek_settings(draw):
    groups = draw(st.sampled_from([1, 2, 4]))
    per_group = draw(st.sampled_from([2, 3]))
    experts = groups * per_group
    group_topk = draw(st.integers(1, groups))
    # k >= 2: Megatron-Core normalises sigmoid scores only then (a top-1 weight stays the score), as ours does;
    # DeepSeek's norm_topk_prob would make a single weight 1.
    topk = draw(st.integers(2, max(2, group_topk * per_group)))
    return dict(experts=experts, groups=groups, group_topk=max(group_topk, -(-topk // per_group)), topk=topk,
                shared=draw(st.integers(0, 2)), scaling=draw(st.sampled_from([1.0, 2.5])),
                bias_seed=draw(st.integers(0, 10**6)))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(deepseek_settings())
def test_deepseek_v3_moe_block_equals_transformers(s):
    """Sigmoid scores, expert bias for the choice only, group-limited routing, top-k normalisation, routed scaling
    and shared experts: the same output as DeepseekV3MoE with the same weights."""
    import transformers

    f = 8
    hf_config = transformers.DeepseekV3Config(
        hidden_size=H, moe_intermediate_size=f, n_routed_experts=s["experts"], num_experts_per_tok=s["topk"],
        n_group=s["groups"], topk_group=s["group_topk"], n_shared_experts=max(s["shared"], 1),
        routed_scaling_factor=s["scaling"], norm_topk_prob=True, hidden_act="silu")
    theirs = transformers.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE(hf_config)
    randomize(theirs, 1)
    bias = torch.randn(s["experts"], generator=torch.Generator().manual_seed(s["bias_seed"])) * 0.2
    theirs.gate.e_score_correction_bias.copy_(bias)
    if not s["shared"]:  # DeepSeek always has a shared expert: ours may have none, so compare without it
        theirs.shared_experts = None
    config = moe_config(
        num_experts=(s["experts"],), moe_router_topk=s["topk"], moe_router_score_function="sigmoid",
        moe_router_enable_expert_bias=True, moe_router_num_groups=s["groups"], moe_router_group_topk=s["group_topk"],
        moe_router_topk_scaling_factor=s["scaling"], moe_ffn_hidden_size=f,
        moe_shared_expert_intermediate_size=f * s["shared"] or None)
    ours = MoELayer(config, s["experts"]).eval()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        ours.expert_bias.copy_(bias)
    copy_experts(ours, theirs.experts.gate_up_proj, theirs.experts.down_proj)
    if s["shared"]:
        copy_mlp(ours.shared_experts, theirs.shared_experts)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        expected = theirs.experts(x.view(-1, H), *reversed(theirs.gate(x)[1:])).view_as(x)
        if theirs.shared_experts is not None:
            expected = expected + theirs.shared_experts(x)
        got = ours(x)
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@pytest.mark.parametrize("kind, normalize", [("qwen2_moe", False), ("qwen2_moe", True), ("qwen3_moe", True),
                                             ("qwen3_moe", False)])
def test_qwen_moe_blocks_equal_transformers(kind, normalize):
    """Softmax over all experts with (norm_topk_prob) or without (--moe-router-pre-softmax) renormalising the k
    chosen; Qwen2-MoE's shared expert behind its sigmoid gate."""
    import transformers

    module = getattr(transformers.models, kind)
    modeling = getattr(module, f"modeling_{kind}")
    config_class = transformers.Qwen2MoeConfig if kind == "qwen2_moe" else transformers.Qwen3MoeConfig
    extra = {"shared_expert_intermediate_size": 12} if kind == "qwen2_moe" else {}
    hf_config = config_class(hidden_size=H, moe_intermediate_size=8, num_experts=6, num_experts_per_tok=3,
                             norm_topk_prob=normalize, **extra)
    block_class = modeling.Qwen2MoeSparseMoeBlock if kind == "qwen2_moe" else modeling.Qwen3MoeSparseMoeBlock
    theirs = block_class(hf_config)
    randomize(theirs, 2)
    shared = kind == "qwen2_moe"
    config = moe_config(num_experts=(6,), moe_router_topk=3, moe_router_pre_softmax=not normalize,
                        moe_ffn_hidden_size=8, moe_shared_expert_intermediate_size=12 if shared else None,
                        moe_shared_expert_gate=shared)
    ours = MoELayer(config, 6).eval()
    with torch.no_grad():
        ours.router.weight.copy_(theirs.gate.weight)
        if shared:
            copy_mlp(ours.shared_experts, theirs.shared_expert)
            ours.shared_expert_gate.weight.copy_(theirs.shared_expert_gate.weight)
    copy_experts(ours, theirs.experts.gate_up_proj, theirs.experts.down_proj)
    x = torch.randn(2, 5, H, generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        expected, got = theirs(x), ours(x)
    expected = expected[0] if isinstance(expected, tuple) else expected
    assert torch.allclose(got, expected, atol=1e-5), (got - expected).abs().max()


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4), st.integers(2, 12), st.sampled_from([2, 4, 8]), st.integers(1, 3), st.integers(0, 10**6))
def test_sequence_loss_is_the_batch_loss_of_each_sequence_averaged(sequences, length, experts, topk, seed):
    generator = torch.Generator().manual_seed(seed)
    topk = min(topk, experts)
    probs = torch.rand(sequences * length, experts, generator=generator).softmax(dim=-1)
    index = torch.rand(sequences * length, experts, generator=generator).topk(topk, dim=-1).indices
    per_sequence = [
        load_balancing_loss(p, torch.nn.functional.one_hot(i, experts).sum(dim=(0, 1)))
        for p, i in zip(probs.view(sequences, length, experts), index.view(sequences, length, topk), strict=True)]
    assert torch.allclose(sequence_load_balancing_loss(probs, index, sequences), torch.stack(per_sequence).mean())
    if sequences == 1:  # one sequence: the two losses are one
        counts = torch.nn.functional.one_hot(index, experts).sum(dim=(0, 1))
        assert torch.allclose(sequence_load_balancing_loss(probs, index, 1), load_balancing_loss(probs, counts))


def test_expert_bias_moves_towards_the_mean_load_once_per_step_and_never_in_evaluation():
    config = moe_config(num_experts=(4,), moe_router_topk=1, moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True, moe_router_bias_update_rate=0.01)
    layer = MoELayer(config, 4)
    with torch.no_grad():  # every token prefers expert 2: its bias must fall, the others' rise
        layer.router.weight.zero_()
        layer.router.weight[2].fill_(1.0)
    x = torch.ones(1, 6, H)
    layer.eval()
    layer(x)
    update_expert_biases([layer], None)
    assert torch.equal(layer.expert_bias, torch.zeros(4)), "an evaluation forward moved the bias"
    layer.train()
    layer(x)
    layer(x)  # two micro-batches: one update from their summed load
    update_expert_biases([layer], None)
    assert torch.allclose(layer.expert_bias, torch.tensor([0.01, 0.01, -0.01, 0.01]))
    assert layer.pending_load is None
    assert "expert_bias" in layer.state_dict(), "the bias is part of the checkpoint"
    # The bias only chooses: the combine weight stays the sigmoid score (top-1 has no normalisation).
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([5.0, 0.0, 0.0, 0.0]))
        weights, index = layer.choose(torch.sigmoid(layer.router_logits(x.view(-1, H))))
    assert index.flatten().tolist() == [0] * 6
    assert torch.allclose(weights, torch.full((6, 1), 0.5))


def test_expert_bias_starts_at_zero_on_models_built_on_meta():
    config = moe_config(num_layers=2, num_experts=(4, 4), moe_router_score_function="sigmoid",
                        moe_router_enable_expert_bias=True)
    with torch.device("meta"):
        model = build_model(config, seed=None)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for layer in model.modules():
            if isinstance(layer, MoELayer):
                layer.expert_bias.fill_(float("nan"))
    model.init_weights(3)
    biases = [m.expert_bias for m in model.modules() if isinstance(m, MoELayer)]
    assert len(biases) == 2 and all(torch.equal(b, torch.zeros(4)) for b in biases)


def test_shared_experts_and_gate_take_gradients_and_count_as_parameters():
    from rapidtrain.models.counting import count_parameters

    config = moe_config(num_layers=2, num_experts=(0, 4), moe_router_topk=2, moe_ffn_hidden_size=8,
                        moe_shared_expert_intermediate_size=12, moe_shared_expert_gate=True)
    model = build_model(config, seed=1)
    total, active = count_parameters(config)
    assert total == sum(p.numel() for p in model.parameters())
    one_expert = 3 * H * 8
    assert total - active == 2 * one_expert  # 4 experts, 2 active
    ids = torch.randint(0, 32, (2, 8))
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    layer = model.layers["1"].mlp
    for param in (*layer.shared_experts.parameters(), layer.shared_expert_gate.weight):
        assert param.grad is not None and param.grad.abs().sum() > 0


def test_forced_load_balancing_routes_by_random_logits_and_the_router_learns_nothing():
    """Megatron-Core's benchmarking switch: the choice ignores the router (a router that prefers one expert still
    spreads tokens), which gets a zero gradient, and the plan says so."""
    config = moe_config(num_experts=(4,), moe_router_topk=1, moe_router_force_load_balancing=True)
    layer = MoELayer(config, 4).train()
    with torch.no_grad():
        layer.router.weight.zero_()
        layer.router.weight[2].fill_(10.0)
    torch.manual_seed(0)
    layer(torch.ones(1, 64, H)).sum().backward()
    load = layer.routing_stats[2:]
    assert (load > 0).all() and load.max() < 40  # not all 64 on expert 2
    assert torch.equal(layer.router.weight.grad, torch.zeros_like(layer.router.weight))
    assert any("random router logits" in words for words in config.moe_router_features)


def test_wsd_decay_style_shapes_the_final_phase():
    from rapidtrain.config import arguments, plan, settings
    from rapidtrain.optim.lr_schedule import learning_rate_at, lr_schedule_for

    def halfway(style: str) -> float:
        args = arguments.parse_args(["--train-iters", "100", "--lr", "1e-3", "--min-lr", "0", "--lr-decay-style",
                                     "WSD", "--lr-wsd-decay-iters", "20", "--lr-wsd-decay-style", style,
                                     "--global-batch-size", "1", "--micro-batch-size", "1"])
        schedule = lr_schedule_for(plan.from_args(args, settings.RunContext(1, "cpu")).schedule, 1, 100)
        return learning_rate_at(schedule, 90)

    assert halfway("linear") == pytest.approx(5e-4)
    assert halfway("cosine") == pytest.approx(5e-4)  # cos at the middle is the mean too
    assert halfway("minus_sqrt") == pytest.approx(1e-3 * (1 - 0.5**0.5))


def test_router_and_mtp_values_nothing_reads_are_said_to_do_nothing():
    from rapidtrain.config import arguments, plan, settings
    from rapidtrain.config.describe import describe_plan

    def notes(*flags: str) -> str:
        args = arguments.parse_args(["--train-iters", "2", "--lr", "1e-3", *flags])
        return describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))

    assert "--moe-router-score-function: no effect without --num-experts" in notes(
        "--moe-router-score-function", "sigmoid")
    assert "--moe-router-bias-update-rate: no effect without --moe-router-enable-expert-bias" in notes(
        "--num-experts", "4", "--moe-router-bias-update-rate", "0.01")
    assert "--mtp-loss-scaling-factor: no effect without --mtp-num-layers" in notes("--mtp-loss-scaling-factor", "0.3")
    assert "no effect without" not in notes("--num-experts", "4", "--moe-router-enable-expert-bias",
                                            "--moe-router-bias-update-rate", "0.01", "--mtp-num-layers", "1",
                                            "--mtp-loss-scaling-factor", "0.3")


def test_sinkhorn_balances_every_token_and_every_expert():
    """Sinkhorn-Knopp over exp(logits): each token's row sums to 1/T and each expert's column to 1/E (to the
    convergence tolerance), and it is exp(logits) scaled by one factor per row and one per column."""
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(0)) * 3 + torch.arange(8.0)
    balanced = sinkhorn(logits)
    assert torch.allclose(balanced.sum(dim=1), torch.full((64,), 1 / 64), rtol=1e-3)
    assert torch.allclose(balanced.sum(dim=0), torch.full((8,), 1 / 8), rtol=1e-3)
    ratio = balanced / logits.exp()  # rank one: row factor × column factor
    assert torch.allclose(ratio, ratio[:, :1] * ratio[:1, :] / ratio[0, 0], rtol=1e-5)


@pytest.mark.parametrize("topk", [1, 2])
def test_sinkhorn_routing_chooses_balanced_experts_in_training_and_by_score_in_evaluation(topk):
    """Megatron-Core's sinkhorn balancing: a router that prefers one expert for every token still spreads the
    micro-batch evenly in training (the choice of the balanced logits), combining with sigmoid(logit) for top-1 and the
    softmax probabilities for top-2, unnormalised; in evaluation each token takes its own best experts. The router
    learns through the combine weights; no balancing loss reaches it."""
    torch.manual_seed(0)
    experts, tokens = 4, 32
    layer = MoELayer(moe_config(num_experts=experts, moe_router_topk=topk, moe_aux_loss_type="sinkhorn",
                                moe_aux_loss_coeff=0.0), experts)
    with torch.no_grad():
        layer.router.weight.mul_(0.01)
        layer.router.weight[0] += 0.2  # expert 0 first for nearly every token
    x = torch.randn(tokens, H).abs()
    logits = layer.router_logits(x)
    scores, _ = layer.scores(logits)
    expected_scores = torch.sigmoid(logits) if topk == 1 else logits.softmax(dim=-1)
    assert torch.equal(scores, expected_scores)
    weights, index = layer.choose(scores, layer.balanced_choice(logits))
    by_score = torch.bincount(scores.topk(topk, dim=-1).indices.flatten(), minlength=experts)
    balanced = torch.bincount(index.flatten(), minlength=experts)
    assert by_score[0] == tokens and by_score.min() <= 1  # measured: [32, 0, 0, 0] (top-1), [32, 21, 1, 10] (top-2)
    mean = tokens * topk / experts  # measured: [11, 8, 6, 7] and [11, 18, 20, 15]
    assert balanced.max() <= 1.5 * mean and balanced.min() >= 0.5 * mean
    assert torch.equal(weights, expected_scores.gather(-1, index))
    layer.eval()
    assert layer.balanced_choice(logits) is None
    _, eval_index = layer.choose(scores)
    assert torch.equal(eval_index, expected_scores.topk(topk, dim=-1).indices) and (eval_index[:, 0] == 0).all()
    layer.train()
    layer(x.unsqueeze(0)).sum().backward()
    assert layer.router.weight.grad is not None and layer.router.weight.grad.abs().sum() > 0


def test_sinkhorn_settles_under_bf16_autocast_and_with_large_logits():
    """The balancing runs in fp32 whatever the autocast (a bf16 matmul kept the factors from settling: a pipeline
    run of Megatron's sinkhorn functional test hung there), and logits past exp's fp32 range (exp(90) is inf)
    balance as well."""
    logits = torch.randn(64, 4, generator=torch.Generator().manual_seed(1)) * 3 + 90.0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        balanced = sinkhorn(logits)
    assert balanced.dtype == torch.float32 and torch.isfinite(balanced).all()
    assert torch.allclose(balanced.sum(dim=0), torch.full((4,), 1 / 4), rtol=1e-3)
