"""Parameter counts against built models and by hand; FLOPs against Megatron's closed form."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.counting import (
    count_parameters,
    expert_parameter_count,
    gpt_flops_per_iteration,
    megatron_gpt_flops,
    model_flops_per_iteration,
    parameter_order,
    parameter_shapes,
)
from rapidtrain.optim.optimizers import param_groups

SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, max_position_embeddings=16)
# RMSNorm, SwiGLU, grouped-query attention (2 key/value heads), rope, no biases, untied output.
LLAMA = dict(normalization="RMSNorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
             position_embedding_type="rope", tie_embeddings=False, ffn_hidden_size=48)
# Multi-head latent attention (DeepSeek): a query bottleneck, latent norms, head parts apart from hidden / heads.
MLA = dict(num_query_groups=None, multi_latent_attention=True, q_lora_rank=12, kv_lora_rank=8, qk_head_dim=6,
           qk_pos_emb_head_dim=4, v_head_dim=5, qk_layernorm=True)


@pytest.mark.parametrize(
    "overrides",
    [
        {},
        {"tie_embeddings": False},
        {"position_embedding_type": "rope", "ffn_hidden_size": 48},
        {"num_experts": (0, 4, 0, 8), "moe_router_topk": 2},
        {"model_type": "bert"},
        {"model_type": "bert", "bert_binary_head": True, "num_tokentypes": 2, "tie_embeddings": False},
        {"model_type": "bert", "num_experts": (2, 2, 2, 2)},
        LLAMA,
        {**LLAMA, "add_qkv_bias": True, "num_experts": (0, 4, 0, 4), "moe_router_topk": 2},
        {**LLAMA, "swiglu": False, "tie_embeddings": True},
        {"model_type": "bert", "post_layernorm": True, "bert_binary_head": True, "num_tokentypes": 2},
        {"position_embedding_type": "alibi", "embed_layernorm": True},
        {**LLAMA, "embed_layernorm": True, "sliding_window": 8},
        # fine-grained MoE: experts of their own size, gated shared experts, multi-token prediction's depths
        {**LLAMA, "num_experts": (0, 4, 4, 8), "moe_router_topk": 2, "moe_ffn_hidden_size": 16,
         "moe_shared_expert_intermediate_size": 24, "moe_shared_expert_gate": True, "mtp_num_layers": 2},
        {"mtp_num_layers": 1},
        {**LLAMA, **MLA},
        {**MLA, "position_embedding_type": "rope", "q_lora_rank": None, "qk_layernorm": False},
    ],
)
def test_total_parameters_match_the_built_model(overrides: dict):
    config = ModelConfig(**{**SMALL, **overrides})
    model = build_model(config, seed=None)
    total, active = count_parameters(config)
    assert total == sum(p.numel() for p in model.parameters())
    if not config.num_experts:
        assert active == total


@st.composite
def model_configs(draw) -> ModelConfig:
    """Any valid built-in model: every switch that adds, removes or reshapes a parameter, drawn together."""
    model_type = draw(st.sampled_from(["gpt", "bert"]))
    heads = draw(st.integers(1, 4))
    groups = draw(st.sampled_from([g for g in (1, 2, 4) if heads % g == 0] + [None]))
    kv_channels = draw(st.sampled_from([None, 2, 6]))
    hidden = heads * draw(st.integers(1, 3)) * 2
    layers = draw(st.integers(1, 3))
    swiglu = draw(st.booleans())
    experts = draw(st.one_of(st.just(()), st.lists(st.sampled_from([0, 1, 2, 3]), min_size=layers,
                                                   max_size=layers).map(tuple)))
    smallest = min([e for e in experts if e] or [1])
    positions = ["learned_absolute", "rope"] + (["alibi"] if model_type == "gpt" else [])
    binary_head = model_type == "bert" and draw(st.booleans())
    latent: dict = {}
    if draw(st.booleans()):  # multi-head latent attention: rope, no key/value groups
        positions, groups = ["rope"], None
        latent = dict(multi_latent_attention=True, q_lora_rank=draw(st.sampled_from([None, 3])),
                      kv_lora_rank=draw(st.integers(1, 5)), qk_head_dim=draw(st.integers(1, 4)),
                      qk_pos_emb_head_dim=draw(st.sampled_from([2, 4])), v_head_dim=draw(st.integers(1, 4)))
    return ModelConfig(**latent,
        model_type=model_type, num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
        num_query_groups=groups, kv_channels=kv_channels, vocab_size=draw(st.integers(3, 40)),
        max_position_embeddings=draw(st.integers(1, 9)), seq_length=8,
        ffn_hidden_size=draw(st.sampled_from([None, 5])) if not swiglu else 7, swiglu=swiglu,
        normalization=draw(st.sampled_from(["LayerNorm", "RMSNorm"])),
        position_embedding_type=draw(st.sampled_from(positions)),
        add_bias_linear=draw(st.booleans()), add_qkv_bias=draw(st.booleans()),
        qk_layernorm=draw(st.booleans()), embed_layernorm=draw(st.booleans()),
        post_layernorm=draw(st.booleans()), tie_embeddings=draw(st.booleans()),
        num_tokentypes=draw(st.integers(0, 2)), bert_binary_head=binary_head,
        num_experts=experts, moe_router_topk=draw(st.integers(1, smallest)), moe_residual=draw(st.booleans()),
        moe_ffn_hidden_size=draw(st.sampled_from([None, 3])),
        moe_shared_expert_intermediate_size=draw(st.sampled_from([None, 4])) if any(experts) else None,
        moe_shared_expert_gate=draw(st.booleans()),
        mtp_num_layers=draw(st.integers(0, 2)) if model_type == "gpt" else 0,
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(model_configs())
def test_parameter_shapes_and_counts_equal_the_built_model(config: ModelConfig):
    """The plan sizes memory and optimizer state from settings alone: each shape, count, expert share and
    active count must be what the model really builds."""
    with torch.device("meta"):
        model = build_model(config, seed=None)
    built = Counter(tuple(p.shape) for p in model.parameters())
    assert parameter_shapes(config) == dict(built)
    # In order, each with the role the optimizer's groups give it (what OSS's partition follows)
    order = list(parameter_order(config))
    assert [shape for shape, _ in order] == [tuple(p.shape) for p in model.parameters()]
    no_decay = {id(p) for group in param_groups(model, 0.01) if group["weight_decay"] == 0.0 for p in group["params"]}
    assert [role in ("vector", "expert_bias") for _, role in order] == [id(p) in no_decay for p in model.parameters()]
    total, active = count_parameters(config)
    assert total == sum(p.numel() for p in model.parameters())
    experts = sum(p.numel() for name, p in model.named_parameters() if ".experts." in name)
    assert expert_parameter_count(config) == experts
    # Active: everything but the experts a token does not reach (top-k of each layer's experts).
    unused = sum(p.numel() * (1 - config.moe_router_topk / p.shape[0])
                 for name, p in model.named_parameters() if ".experts." in name)
    assert active == pytest.approx(total - unused)


def test_parameters_by_hand():
    # V=10, h=4, 2 heads, ffn 8, 1 layer, 6 positions, tied:
    # embeddings 40 + 24; layer: norms 16, attention 4·(16+4) = 80, MLP 32+8+32+4 = 76; final norm 8.
    config = ModelConfig(
        num_layers=1,
        hidden_size=4,
        num_attention_heads=2,
        ffn_hidden_size=8,
        vocab_size=10,
        max_position_embeddings=6,
    )
    assert count_parameters(config) == (244, 244)
    untied = ModelConfig(**{**config.__dict__, "tie_embeddings": False})
    assert count_parameters(untied) == (284, 284)
    # Same with 4 experts top-1: router 16, experts 4·76; active has one expert.
    moe = ModelConfig(**{**config.__dict__, "num_experts": (4,)})
    assert count_parameters(moe) == (244 + 16 + 3 * 76, 244 + 16)


def test_active_parameters_count_topk_experts():
    config = ModelConfig(**SMALL, num_experts=(0, 8, 0, 8), moe_router_topk=2)
    total, active = count_parameters(config)
    expert = 2 * 32 * 128 + 128 + 32
    assert total - active == 2 * (8 - 2) * expert


@pytest.mark.parametrize(
    "layers,hidden,heads,seq,vocab,batch",
    [(24, 1024, 16, 2048, 51200, 512), (2, 64, 4, 128, 128, 8), (96, 12288, 96, 2048, 51200, 1536)],
)
def test_dense_gpt_flops_equal_megatron_formula(layers, hidden, heads, seq, vocab, batch):
    config = ModelConfig(
        num_layers=layers, hidden_size=hidden, num_attention_heads=heads, seq_length=seq, vocab_size=vocab
    )
    flops = gpt_flops_per_iteration(config, batch)
    assert flops == pytest.approx(megatron_gpt_flops(batch, seq, layers, hidden, vocab), rel=1e-12)


def test_flops_for_other_ffn_sizes_moe_and_bert():
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=128, vocab_size=256)
    dense = model_flops_per_iteration(ModelConfig(**base), 8)
    tokens = 8 * 128
    # ffn 3h instead of 4h: MLP forward 4·N·h·f per layer drops by 4·N·h·h; ×3 for backward, ×2 layers.
    narrow = model_flops_per_iteration(ModelConfig(**base, ffn_hidden_size=192), 8)
    assert dense - narrow == 3 * 2 * 4 * tokens * 64 * 64
    # One MoE layer, 8 experts, top-2: one extra expert MLP + router 2·N·h·E, times 3.
    moe = model_flops_per_iteration(ModelConfig(**base, num_experts=(0, 8), moe_router_topk=2), 8)
    assert moe - dense == 3 * (4 * tokens * 64 * 256 + 2 * tokens * 64 * 8)
    # BERT: full (not causal) attention scores, plus the MLM head's dense layer.
    bert = model_flops_per_iteration(ModelConfig(**base, model_type="bert"), 8)
    assert bert - dense == 3 * (2 * 2 * tokens * 128 * 64 + 2 * tokens * 64 * 64)
    assert model_flops_per_iteration(ModelConfig(**base), 8, seq_length=64) < dense


def test_latent_attention_flops_by_hand():
    """MLA's projections q_down (h → 12), q_up (12 → 4·10), kv_down (h → 8 + 4), kv_up (8 → 4·11), o_proj (4·5 → h)
    replace q/k/v/o's 4·2·N·h²; causal scores over 4·10 query/key and 4·5 value dimensions, s/2 keys on average."""
    llama = ModelConfig(**{**SMALL, **LLAMA, "num_query_groups": None})
    mla = ModelConfig(**{**SMALL, **LLAMA, **MLA})
    tokens, s, h, layers = 8 * 16, 16, 32, 4
    projections = 2 * tokens * (h * 12 + 12 * 40 + h * 12 + 8 * 44 + 20 * h)
    scores = 2 * tokens * (s // 2) * (40 + 20)
    llama_attention = 8 * tokens * h * h + 4 * tokens * (s // 2) * h
    expected = model_flops_per_iteration(llama, 8, s) + 3 * layers * (projections + scores - llama_attention)
    assert model_flops_per_iteration(mla, 8, s) == expected


def test_llama_flops_count_the_gate_and_the_smaller_key_value_projections():
    """SwiGLU's third matrix adds 2·N·h·f per layer; 2 key/value heads of 4 halve k and v (4·N·h·h/2 saved)."""
    dense = ModelConfig(**SMALL, ffn_hidden_size=48)
    llama = ModelConfig(**{**SMALL, **LLAMA})
    tokens, h, f, layers = 8 * 16, 32, 48, 4
    extra = layers * (2 * tokens * h * f - 2 * 2 * tokens * h * h // 2)
    assert model_flops_per_iteration(llama, 8, 16) == model_flops_per_iteration(dense, 8, 16) + 3 * extra
