"""gpt-oss's architecture in the built-in GPT: attention sinks (--softmax-type off-by-one / learnable) against a plain
softmax with one more column on every kernel, with causal, padding and sliding-window masks and the KV cache; the
clamped quick-GEGLU (--quick-geglu, --activation-func-clamp-value, --glu-linear-offset) in the dense MLP and the
experts; the router's bias; gpt-oss's routing (softmax over the top-k logits) against rapidtrain's (softmax, top-k,
renormalise); Megatron's flags and their refusals; Hugging Face GptOss folders both ways against transformers (eager
attention, fp32, dropless); tensor and expert parallelism; the memory estimate of the sinks' mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.attention import attend, flex_block_mask
from rapidtrain.models.counting import count_parameters
from rapidtrain.models.hf_weights import WeightsReader, export_family, hf_state_dict, save_hf_folder
from rapidtrain.models.mlp import GatedUnit
from rapidtrain.models.moe import Experts, MoELayer
from rapidtrain.models.transformer import KVCache
from tests.launch import spawn_ranks

SMALL = dict(num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=64, seq_length=16,
             hidden_dropout=0.0, attention_dropout=0.0, position_embedding_type="rope", normalization="RMSNorm")
GPT_OSS_MLP = dict(quick_geglu=True, activation_clamp=7.0, glu_linear_offset=1.0)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def reference_sink_attention(q, k, v, sink, allowed):
    """softmax over [scores of the allowed keys, the head's sink logit], the sink's column dropped: one head at a
    time, allowed a bool [b, sq, sk] (True = may attend)."""
    out = torch.empty_like(q)
    for h in range(q.shape[1]):
        g = h // (q.shape[1] // k.shape[1])
        scores = (q[:, h] @ k[:, g].transpose(-1, -2) / q.shape[-1] ** 0.5).masked_fill(~allowed, float("-inf"))
        column = sink[h].expand(*scores.shape[:-1], 1)
        out[:, h] = torch.cat([scores, column], dim=-1).softmax(-1)[..., :-1] @ v[:, g]
    return out


def qkv(seed: int = 3, sq: int = 20, sk: int = 20):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(2, 6, sq, 16, generator=generator)
    k, v = (torch.randn(2, 3, sk, 16, generator=generator) for _ in range(2))
    return q, k, v


@pytest.mark.parametrize("kernel", ["sdpa", "sdpa_flash", "eager", "flex"])
def test_sinks_match_a_softmax_with_one_more_column_on_every_kernel(kernel):
    q, k, v = qkv()
    sink = torch.linspace(-2.0, 3.0, 6)
    causal = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, 20, 20)
    mask = flex_block_mask(2, 20, 20, q.device, causal=True) if kernel == "flex" else None
    out = attend(q, k, v, mask, kernel != "flex", 0.0, kernel, sink=sink)
    torch.testing.assert_close(out, reference_sink_attention(q, k, v, sink, causal), rtol=1e-5, atol=1e-5)
    plain = attend(q, k, v, mask, kernel != "flex", 0.0, kernel)
    assert not torch.allclose(out, plain, atol=1e-3)  # the sinks take probability away from the keys


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex"])
def test_sinks_under_padding_and_window_masks_and_after_cached_keys(kernel):
    """A padding-and-window boolean mask, and 4 queries after 16 cached keys (the KV cache's case)."""
    q, k, v = qkv(sq=4, sk=20)
    sink = torch.linspace(-1.0, 1.0, 6)
    query = torch.arange(16, 20)[:, None]
    key = torch.arange(20)[None, :]
    padding = torch.ones(2, 20, dtype=torch.bool)
    padding[1, :3] = False
    allowed = ((key <= query) & (query - key < 6))[None] & padding[:, None, :]
    if kernel == "flex":
        mask = flex_block_mask(2, 4, 20, q.device, causal=True, attention_mask=padding.long(), window=6)
    else:
        mask = allowed[:, None]
    out = attend(q, k, v, mask, False, 0.0, kernel, sink=sink)
    torch.testing.assert_close(out, reference_sink_attention(q, k, v, sink, allowed), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kernel", ["sdpa", "eager"])
def test_learnable_sinks_get_the_gradient_of_the_plain_computation(kernel):
    q, k, v = qkv()
    sink = torch.linspace(-2.0, 3.0, 6).requires_grad_()
    expected_sink = sink.detach().clone().requires_grad_()
    causal = torch.ones(20, 20, dtype=torch.bool).tril().expand(2, 20, 20)
    weights = torch.randn(q.shape, generator=torch.Generator().manual_seed(9))
    (attend(q, k, v, None, True, 0.0, kernel, sink=sink) * weights).sum().backward()
    (reference_sink_attention(q, k, v, expected_sink, causal) * weights).sum().backward()
    assert sink.grad is not None and sink.grad.abs().sum() > 0
    torch.testing.assert_close(sink.grad, expected_sink.grad, rtol=1e-4, atol=1e-5)


def test_off_by_one_adds_one_to_the_softmax_denominator():
    """A query that sees only itself: softmax weight exp(s) / (exp(s) + 1) with off-by-one, 1 without."""
    q, k, v = qkv()
    out = attend(q[:, :, :1], k[:, :, :1], v[:, :, :1], None, True, 0.0, "eager", sink=torch.zeros(6))
    score = (q[:, :, :1] * k.repeat_interleave(2, dim=1)[:, :, :1]).sum(-1, keepdim=True) / 4.0
    expected = torch.sigmoid(score) * v.repeat_interleave(2, dim=1)[:, :, :1]
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("softmax_type", ["off-by-one", "learnable"])
@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex"])
def test_kv_cache_decoding_with_sinks_and_alternating_windows_gives_the_full_forward_logits(softmax_type, kernel):
    config = ModelConfig(**SMALL, softmax_type=softmax_type, attention_kernel=kernel, sliding_window=3,
                         window_skip_freq=2)
    model = build_model(config, seed=6).eval()
    if softmax_type == "learnable":
        with torch.no_grad():
            for layer in model.layers.values():
                layer.attention.sink.logits.copy_(torch.linspace(-1.0, 2.0, 6))
    ids = tokens(length=9)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :5], kv_cache=cache), model(ids[:, 5:6], kv_cache=cache),
                 model(ids[:, 6:], kv_cache=cache)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_sdpa_and_eager_models_with_sinks_agree_and_train_the_sinks():
    logits, grads = [], []
    for kernel in ("sdpa", "eager"):
        model = build_model(ModelConfig(**SMALL, softmax_type="learnable", attention_kernel=kernel), seed=2)
        ids = tokens()
        out = model(ids)
        out.float().pow(2).mean().backward()
        logits.append(out.detach())
        grads.append(model.layers["0"].attention.sink.logits.grad)
    torch.testing.assert_close(logits[0], logits[1], rtol=1e-5, atol=1e-5)
    assert grads[0] is not None and grads[0].abs().sum() > 0
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-4, atol=1e-6)


def test_sink_logits_are_counted_and_named_as_gpt_oss_has_them():
    config = ModelConfig(**SMALL, softmax_type="learnable")
    model = build_model(config, seed=1)
    names = [name for name, _ in model.named_parameters() if "sink" in name]
    assert names == ["layers.0.attention.sink.logits", "layers.1.attention.sink.logits"]
    assert count_parameters(config)[0] == sum(p.numel() for p in model.parameters())
    off_by_one = ModelConfig(**SMALL, softmax_type="off-by-one")
    assert count_parameters(off_by_one) == count_parameters(ModelConfig(**SMALL))


# ---- the clamped quick-GEGLU ----


def gpt_oss_glu(gate: torch.Tensor, up: torch.Tensor, limit: float = 7.0, alpha: float = 1.702) -> torch.Tensor:
    """gpt-oss's expert activation as its model card states it."""
    gate, up = gate.clamp(max=limit), up.clamp(-limit, limit)
    return gate * torch.sigmoid(alpha * gate) * (up + 1)


def test_gated_unit_is_gpt_oss_clamped_glu_and_swiglu_by_default():
    generator = torch.Generator().manual_seed(0)
    gate, up = (torch.randn(5, 40, generator=generator) * 6 for _ in range(2))
    torch.testing.assert_close(GatedUnit(True, 7.0, 1.0)(gate, up), gpt_oss_glu(gate, up))
    torch.testing.assert_close(GatedUnit()(gate, up), F.silu(gate) * up)
    assert (gate > 7).any() and (up.abs() > 7).any()  # the clamps are exercised


def test_dense_mlp_and_experts_apply_the_clamped_glu():
    config = ModelConfig(**SMALL, **GPT_OSS_MLP, ffn_hidden_size=32)
    model = build_model(config, seed=3)
    mlp = model.layers["0"].mlp
    x = torch.randn(2, 5, 48, generator=torch.Generator().manual_seed(1)) * 4
    expected = mlp.fc2(gpt_oss_glu(mlp.gate(x), mlp.fc1(x)))
    torch.testing.assert_close(mlp(x), expected)
    experts = Experts(3, 48, 32, swiglu=True, bias=True, gated_unit=GatedUnit(True, 7.0, 1.0))
    with torch.no_grad():
        for param in experts.parameters():
            param.normal_(0, 0.5)
    buffers = torch.randn(3, 4, 48, generator=torch.Generator().manual_seed(2))
    for e in range(3):
        gate = buffers[e] @ experts.w_gate[e] + experts.b_gate[e]
        up = buffers[e] @ experts.w1[e] + experts.b1[e]
        expected = gpt_oss_glu(gate, up) @ experts.w2[e] + experts.b2[e]
        torch.testing.assert_close(experts(buffers)[e], expected, rtol=1e-5, atol=1e-5)


def test_router_bias_enters_the_logits_and_the_parameter_count():
    config = ModelConfig(**SMALL, **GPT_OSS_MLP, ffn_hidden_size=32, num_experts=(4, 4), moe_router_topk=2,
                         moe_router_bias=True, moe_token_dropping=False)
    model = build_model(config, seed=3)
    layer = model.layers["0"].mlp
    assert isinstance(layer, MoELayer) and layer.router.bias is not None
    with torch.no_grad():
        layer.router.bias.copy_(torch.tensor([0.5, -1.0, 2.0, 0.0]))
    tokens_ = torch.randn(7, 48)
    torch.testing.assert_close(layer.router_logits(tokens_), tokens_ @ layer.router.weight.t() + layer.router.bias)
    assert count_parameters(config)[0] == sum(p.numel() for p in model.parameters())


def test_gpt_oss_routing_equals_softmax_topk_renormalised():
    """gpt-oss: softmax over the k largest logits. rapidtrain: softmax over all, top k, divided by their sum. The
    experts chosen and their weights are the same."""
    logits = torch.randn(50, 8, generator=torch.Generator().manual_seed(4)) * 3
    top_logits, gpt_oss_experts = logits.topk(2, dim=-1)
    gpt_oss_weights = top_logits.softmax(dim=-1)
    config = ModelConfig(**SMALL, num_experts=(8, 8), moe_router_topk=2, moe_token_dropping=False)
    layer = MoELayer(config, 8)
    routing, experts = layer.route(logits.softmax(dim=-1))
    assert torch.equal(experts, gpt_oss_experts)
    weights = routing.weight.view(2, 50).t()  # choice-major → [tokens, k]
    torch.testing.assert_close(weights, gpt_oss_weights, rtol=1e-6, atol=1e-7)


# ---- the flags ----

GPT_OSS_FLAGS = ("--normalization", "RMSNorm", "--position-embedding-type", "rope", "--quick-geglu",
                 "--glu-linear-offset", "1", "--activation-func-clamp-value", "7", "--softmax-type", "learnable",
                 "--window-size", "7,0", "--window-attn-skip-freq", "2", "--num-experts", "4", "--moe-router-topk",
                 "2", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32")


def plan_of(*flags: str, device: str = "cpu"):
    from rapidtrain.config import arguments, rules
    from rapidtrain.config.plan import from_args
    from rapidtrain.config.settings import RunContext

    args = arguments.parse_args(["--train-iters", "2", "--lr", "1e-3", *flags])
    ctx = RunContext(device_type=device)
    rules.validate(args, ctx)
    return from_args(args, ctx)


def refusal(*flags: str, device: str = "cpu") -> str:
    from rapidtrain.config import rules

    with pytest.raises(rules.FlagConflict) as conflict:
        plan_of(*flags, device=device)
    return str(conflict.value)


def test_megatron_gpt_oss_flags_build_gpt_oss_and_the_plan_says_so():
    """Megatron's examples/gptoss flags: sinks, clamped quick-GEGLU with offset 1, window 8 in every other layer
    (layer 0 sliding, as gpt-oss), a router with a bias."""
    plan = plan_of(*GPT_OSS_FLAGS)
    model = plan.model
    assert (model.softmax_type, model.quick_geglu, model.activation_clamp, model.glu_linear_offset) == \
        ("learnable", True, 7.0, 1.0)
    assert model.moe_router_bias and model.gated_linear_unit and not model.swiglu
    assert [model.window_of_layer(i) for i in range(2)] == [8, None]
    from rapidtrain.config.describe import describe_plan

    text = describe_plan(plan)
    assert "attention sinks" in text and "quick_gelu(gate) × linear" in text and "router with a bias" in text
    built = build_model(model, seed=0)
    assert built.layers["0"].mlp.router.bias is not None and built.layers["0"].attention.sink is not None


@pytest.mark.parametrize(("flags", "says"), [
    (("--swiglu", "--quick-geglu"), "--swiglu and --quick-geglu"),
    (("--glu-linear-offset", "1"), "--glu-linear-offset without a gated MLP"),
    (("--activation-func-clamp-value", "7"), "--activation-func-clamp-value without a gated MLP"),
    (("--quick-geglu", "--activation-func-clamp-value", "0"), "give a finite value above 0"),
    (("--quick-geglu", "--openai-gelu"), "--openai-gelu with --quick-geglu"),
])
def test_gpt_oss_flags_that_cannot_mean_anything_are_refused(flags, says):
    assert says in refusal(*flags)


def test_sinks_with_cuda_flash_attention_are_refused_as_it_takes_no_mask():
    assert "--softmax-type learnable" in refusal("--softmax-type", "learnable", "--attention-backend", "flash",
                                                 "--bf16", device="cuda")


def test_enable_gpt_oss_sets_megatrons_yarn_and_the_plan_says_so():
    """Megatron's --enable-gpt-oss sets gpt-oss's YaRN and nothing else; with the architecture's flags (Megatron's
    gpt-oss example) the model is gpt-oss with YaRN, and the plan names both."""
    from rapidtrain.config import arguments, plan, resolve, settings
    from rapidtrain.config.describe import describe_plan

    args = arguments.parse_args(["--train-iters", "2", "--lr", "1e-3", "--enable-gpt-oss", "--position-embedding-type",
                                 "rope", "--softmax-type", "learnable", "--quick-geglu", "--glu-linear-offset", "1",
                                 "--activation-func-clamp-value", "7"])
    assert (args.rope_type, args.rotary_scaling_factor, args.yarn_original_max_position_embeddings) == \
        ("yarn", 32.0, 131072)
    config = resolve.model_config_from_args(args, 256)
    assert config.rope_scaling == "yarn" and config.softmax_type == "learnable" and config.quick_geglu
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert "--enable-gpt-oss: gpt-oss's YaRN rope" in described


# ---- Hugging Face GptOss folders, both ways ----

HF_SEQ = 32


def tiny_gpt_oss(**overrides):
    """hidden 64, 2 layers (sliding, full), 4 heads of 16 over 2 key/value heads, 4 experts top-2, window 8 < the 32
    tokens, plain rope (YaRN: its own test), and a clamp of 0.3 so that the clamps bite."""
    import transformers

    settings = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    head_dim=16, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2, sliding_window=8,
                    max_position_embeddings=64, swiglu_limit=0.3, attention_dropout=0.0,
                    rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return transformers.GptOssConfig(**settings | overrides)


def save_gpt_oss(folder, **overrides):
    import transformers

    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(tiny_gpt_oss(**overrides))
    with torch.no_grad():  # every parameter matters: biases and norms off their starting values, sinks spread
        for name, param in model.named_parameters():
            param.add_(torch.randn_like(param) * (1.0 if name.endswith("sinks") else 0.05))
    model.save_pretrained(folder)
    return folder


def builtin_from(folder, *extra: str):
    from rapidtrain.config import arguments, resolve, rules, settings

    args = arguments.parse_args(["--pretrained-model-name-or-path", str(folder), "--data-path", "unused",
                                 "--train-iters", "1", "--lr", "0.1", "--seq-length", str(HF_SEQ),
                                 "--hidden-dropout", "0", "--attention-dropout", "0", *extra])
    rules.validate(args, settings.RunContext(1, "cpu"))
    config = resolve.model_config_from_args(args, resolve.builtin_vocab_size(args, None))
    return build_model(config, seed=1), args


def load_hf(folder):
    import transformers

    return transformers.GptOssForCausalLM.from_pretrained(folder, attn_implementation="eager")


def hf_tokens() -> torch.Tensor:
    return torch.randint(0, 256, (2, HF_SEQ), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("kernel", ["auto", "eager"])
def test_gpt_oss_folder_gives_the_builtin_model_transformers_logits(kernel, tmp_path):
    from rapidtrain.config import plan, settings
    from rapidtrain.config.describe import describe_plan

    folder = save_gpt_oss(tmp_path / "hf")
    ours, args = builtin_from(folder, "--attention-backend", kernel)
    config = ours.config
    assert (config.softmax_type, config.quick_geglu, config.activation_clamp, config.glu_linear_offset) == \
        ("learnable", True, 0.3, 1.0)
    assert [config.window_of_layer(i) for i in range(2)] == [8, None] and not config.moe_token_dropping
    assert config.moe_router_bias and config.num_experts == (4, 4) and config.head_dim == 16
    ids = hf_tokens()
    with torch.no_grad():
        difference = (ours.eval()(ids) - load_hf(folder).eval()(ids).logits).abs().max()
    assert difference < 1e-5
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert f"initialised from Hugging Face weights in {folder}" in described and "attention sinks" in described


def test_one_training_step_equals_transformers_gpt_oss(tmp_path):
    """Same loss, and after one SGD step the same weights in transformers' names: the gradients of the sinks, the
    router's bias and the interleaved gate/up columns agree (no balancing loss: transformers adds none here)."""
    folder = save_gpt_oss(tmp_path / "hf")
    ours, _ = builtin_from(folder, "--moe-aux-loss-coeff", "0")
    theirs = load_hf(folder)
    ours.train(), theirs.train()
    ids = hf_tokens()
    our_loss = ours(ids[:, :-1], labels=ids[:, 1:]).mean()
    their_loss = theirs(ids, labels=ids).loss
    assert abs(our_loss.item() - their_loss.item()) < 1e-5
    for model, loss in ((ours, our_loss), (theirs, their_loss)):
        loss.backward()
        with torch.no_grad():
            for param in model.parameters():
                if param.grad is not None:
                    param.sub_(0.1 * param.grad)
    updated = hf_state_dict(ours.state_dict(), ours.config, "gpt_oss")
    expected = theirs.state_dict()
    assert set(updated) == set(expected)
    worst = max(float((updated[name] - expected[name]).abs().max()) for name in updated)
    assert worst < 1e-5
    assert float((expected["model.layers.0.self_attn.sinks"] - load_hf(folder).state_dict()[
        "model.layers.0.self_attn.sinks"]).abs().max()) > 1e-4  # the step did move the sinks


def test_gpt_oss_round_trip_keeps_every_tensor_and_exports_a_folder_transformers_loads(tmp_path):
    folder = save_gpt_oss(tmp_path / "in")
    ours, _ = builtin_from(folder)
    assert export_family(ours.config) == "gpt_oss"
    assert save_hf_folder(ours.state_dict(), ours.config, tmp_path / "out") == "gpt_oss"
    source, again = WeightsReader(folder), WeightsReader(tmp_path / "out")
    assert set(source.location) == set(again.location)
    for name in source.location:
        assert torch.equal(source.get(name), again.get(name)), name
    exported = load_hf(tmp_path / "out").eval()
    assert exported.config.layer_types == ["sliding_attention", "full_attention"]
    assert exported.config.sliding_window == 8 and exported.config.swiglu_limit == 0.3
    ids = hf_tokens()
    with torch.no_grad():
        assert (ours.eval()(ids) - exported(ids).logits).abs().max() < 1e-5


def test_builtin_gpt_oss_exports_with_its_window_pattern(tmp_path):
    """A model built from flags alone (every 3rd layer full, tied embeddings) exports with matching layer_types."""
    config = ModelConfig(**{**SMALL, "num_layers": 3, "hidden_size": 64, "num_attention_heads": 4}, **GPT_OSS_MLP,
                         ffn_hidden_size=32, softmax_type="learnable", num_experts=(4, 4, 4), moe_router_topk=2,
                         moe_router_bias=True, moe_token_dropping=False, sliding_window=5, window_skip_freq=3,
                         num_query_groups=2, max_position_embeddings=64)
    ours = build_model(config, seed=5).eval()
    save_hf_folder(ours.state_dict(), config, tmp_path / "out")
    theirs = load_hf(tmp_path / "out").eval()
    assert theirs.config.layer_types == ["sliding_attention", "sliding_attention", "full_attention"]
    ids = tokens(length=14)
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-5


@pytest.mark.parametrize(("overrides", "says"), [
    ({"swiglu_alpha": 1.5}, "swiglu_alpha 1.5"),
    ({"quantization_config": {"quant_method": "mxfp4"}}, "mxfp4 weights"),
    ({"num_experts_per_tok": 1}, "num_experts_per_tok 1"),
    ({"attention_bias": False}, "attention_bias false"),
    ({"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
])
def test_gpt_oss_configs_the_builtin_model_cannot_hold_are_refused(overrides, says):
    """(YaRN, gpt-oss's own rope, is not among them: test_gpt_oss_with_yarn_gives_transformers_logits.)"""
    from rapidtrain.models.hf_config import UnsupportedModel, builtin_flags

    config = tiny_gpt_oss(**overrides).to_dict()
    with pytest.raises(UnsupportedModel, match=says):
        builtin_flags(config)


def test_models_with_sinks_or_the_clamped_glu_do_not_export_as_other_families():
    from rapidtrain.models.hf_config import UnsupportedModel

    llama = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope")
    with pytest.raises(UnsupportedModel, match="--softmax-type learnable"):
        export_family(ModelConfig(**SMALL | llama, softmax_type="off-by-one"))
    with pytest.raises(UnsupportedModel, match="no --activation-func-clamp-value"):
        export_family(ModelConfig(**SMALL | llama, activation_clamp=7.0))


def test_trained_gpt_oss_checkpoint_converts_to_a_folder_transformers_loads(tmp_path, demo_data):
    """Megatron's gpt-oss flags train two steps and save; scripts/convert_checkpoint.py --hf writes a GptOss folder
    whose logits are the checkpoint's. Dropless, as Megatron-Core's default and gpt-oss (with a capacity the built-in
    MoE drops tokens that transformers' never does)."""
    import importlib.util
    import json

    from safetensors.torch import load_file

    from rapidtrain.pretrain import main as pretrain
    from tests.launch import REPO

    flags = [*GPT_OSS_FLAGS[:-1], "64"]  # --seq-length 64, as the other tiny demo runs
    pretrain([*flags, "--ffn-hidden-size", "32", "--group-query-attention", "--num-query-groups", "2",
              "--untie-embeddings-and-output-weights", "--disable-moe-token-dropping", "--micro-batch-size", "2",
              "--global-batch-size", "2", "--train-iters", "2", "--lr", "1e-2", "--num-workers", "0", "--eval-iters",
              "0", "--log-interval", "1", "--hidden-dropout", "0", "--attention-dropout", "0",
              "--save", str(tmp_path / "ck")])
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--load", str(tmp_path / "ck"), "--output", str(tmp_path / "out"), "--hf"]) == 0
    saved = json.loads((tmp_path / "out" / "rapidtrain_config.json").read_text())
    config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    ours = build_model(config, seed=None).eval()
    ours.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    theirs = load_hf(tmp_path / "out" / "hf").eval()
    assert theirs.config.layer_types == ["sliding_attention", "full_attention"] and theirs.config.sliding_window == 8
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (ours(ids) - theirs(ids).logits).abs().max() < 1e-4


# ---- tensor and expert parallelism (two gloo processes) ----


def _parallel_worker(rank: int, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rapidtrain.models import GPTModel
    from rapidtrain.models.transformer import init_weights
    from rapidtrain.parallel.experts import ExpertParallelExperts
    from rapidtrain.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        # Tensor parallelism: each rank runs 3 of the 6 heads with their own sink logits; the logits' gradients are
        # summed over the ranks, so they equal the whole model's.
        config = ModelConfig(**SMALL, softmax_type="learnable", sliding_window=5, window_skip_freq=2)
        whole = build_model(config, seed=8)
        with torch.no_grad():
            for layer in whole.layers.values():
                layer.attention.sink.logits.copy_(torch.linspace(-1.0, 2.0, 6))
        with torch.device("meta"):
            model = GPTModel(config)
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)))
        model.to_empty(device="cpu")
        init_weights(model, 8)
        with torch.no_grad():
            for layer in model.layers.values():  # a replicated DTensor: each rank sets its whole local copy
                layer.attention.sink.logits.to_local().copy_(torch.linspace(-1.0, 2.0, 6))
        ids = tokens(length=12)
        logits = model(ids)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        logits.pow(2).mean().backward()
        whole(ids).pow(2).mean().backward()
        torch.testing.assert_close(logits, whole(ids), rtol=1e-5, atol=1e-5)
        for name in ("0", "1"):
            grad = model.layers[name].attention.sink.logits.grad
            grad = grad.to_local() if hasattr(grad, "to_local") else grad
            torch.testing.assert_close(grad, whole.layers[name].attention.sink.logits.grad, rtol=1e-4, atol=1e-6)
        # Expert parallelism: each rank holds 2 of 4 gpt-oss experts (with the gate's bias); every rank's tokens
        # get the whole layer's outputs.
        experts = Experts(4, 48, 32, swiglu=True, bias=True, gated_unit=GatedUnit(True, 0.5, 1.0))
        with torch.no_grad():
            for param in experts.parameters():
                param.copy_(torch.randn(param.shape, generator=torch.Generator().manual_seed(param.numel())))
        sharded = ExpertParallelExperts(experts, dist.group.WORLD, rank, 2)
        assert sharded.b_gate is not None and sharded.b_gate.shape == (2, 32)
        buffers = torch.randn(4, 3, 48, generator=torch.Generator().manual_seed(10 + rank))
        torch.testing.assert_close(sharded(buffers), experts(buffers), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_sinks_and_expert_parallel_gpt_oss_experts_match_one_process(tmp_path):
    spawn_ranks(_parallel_worker, str(tmp_path / "store"))


def test_activation_estimate_counts_the_sink_mask_sdpa_keeps():
    """Bytes one layer keeps for backward, measured by saved-tensor hooks: off-by-one sinks under SDPA add the float
    mask [heads, s, s + 1] (one, shared by the batch), as the estimate says."""
    from rapidtrain.config.activations import ActivationContext, layer_bytes
    from rapidtrain.config.settings import Layout

    def kept(config: ModelConfig) -> int:
        layer = build_model(config, seed=0).layers["0"]
        storages: dict[int, int] = {}

        def pack(tensor: torch.Tensor) -> torch.Tensor:
            storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            layer(torch.randn(2, config.seq_length, config.hidden_size, requires_grad=True))
        return sum(storages.values())

    shape = {**SMALL, "hidden_size": 64, "num_attention_heads": 4, "seq_length": 64}
    plain, sinks = ModelConfig(**shape), ModelConfig(**shape, softmax_type="off-by-one")
    measured = kept(sinks) - kept(plain)
    act = ActivationContext.of(sinks, "fp32", "cpu")
    estimated = layer_bytes(sinks, 2, Layout(1, 1), act) - layer_bytes(plain, 2, Layout(1, 1), act)
    assert estimated == 4 * 64 * 65 * 4
    assert abs(measured - estimated) <= 0.02 * estimated


def test_gpt_oss_with_yarn_gives_transformers_logits(tmp_path):
    """gpt-oss's YaRN (factor 32, beta 32/1, as the published config) over an original context of 16, so that the
    32 tokens reach the stretched pairs: --rope-type yarn from config.json, the same logits as transformers'."""
    yarn = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
            "original_max_position_embeddings": 16, "rope_theta": 150000.0}
    folder = save_gpt_oss(tmp_path / "hf", rope_parameters=yarn)
    ours, args = builtin_from(folder)
    assert args.rope_type == "yarn" and ours.config.rope_scaling == "yarn"
    ids = hf_tokens()
    with torch.no_grad():
        difference = (ours.eval()(ids) - load_hf(folder).eval()(ids).logits).abs().max()
        plain = (ours(ids) - load_hf(save_gpt_oss(tmp_path / "plain")).eval()(ids).logits).abs().max()
    assert difference < 1e-5 and plain > 1e-3  # YaRN changes the logits, and ours follow
