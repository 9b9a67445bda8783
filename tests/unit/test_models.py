"""The built-in GPT and BERT: outputs, masks, rope, layout-independent init, pipeline stages,
tensor-parallel head split, activation checkpointing and torch.compile."""

from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rapidtrain.models import BertModel, GPTModel, ModelConfig, build_model, init_weights
from rapidtrain.models.rope import plain_inverse_frequency, rotary_cos_sin
from rapidtrain.models.transformer import apply_rotary
from tests.launch import spawn_ranks

SMALL = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
NO_DROPOUT = dict(hidden_dropout=0.0, attention_dropout=0.0)


def gpt(**overrides: object) -> GPTModel:
    return build_model(ModelConfig(**{**SMALL, **NO_DROPOUT, **overrides}), seed=7)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_gpt_returns_logits_or_fp32_per_token_loss():
    model = gpt().eval()
    ids = tokens()
    logits = model(ids)
    assert logits.shape == (2, 12, 64)
    labels = torch.roll(ids, -1, dims=1)
    loss = model(ids, labels=labels)
    assert loss.shape == (2, 12) and loss.dtype == torch.float32
    expected = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="none").view(2, 12)
    torch.testing.assert_close(loss, expected)


def test_negative_labels_give_zero_loss():
    model = gpt().eval()
    ids = tokens()
    labels = ids.clone()
    labels[0, :3] = -1
    labels[1, 5] = -100
    loss = model(ids, labels=labels)
    assert loss[0, :3].tolist() == [0.0, 0.0, 0.0] and loss[1, 5].item() == 0.0
    assert (loss[0, 3:] > 0).all()


def test_gpt_is_causal():
    model = gpt().eval()
    ids = tokens()
    changed = ids.clone()
    changed[:, 8:] = (changed[:, 8:] + 1) % 64
    torch.testing.assert_close(model(ids)[:, :8], model(changed)[:, :8])
    assert not torch.allclose(model(ids)[:, 8:], model(changed)[:, 8:])


def test_meta_build_then_init_equals_direct_init_and_keeps_tie():
    config = ModelConfig(**SMALL, num_experts=(0, 4, 0, 4), moe_router_topk=2)
    direct = build_model(config, seed=11)
    with torch.device("meta"):
        lazy = build_model(config)
    lazy.to_empty(device="cpu")
    assert lazy.output.weight is lazy.embedding.word_embeddings.weight
    init_weights(lazy, 11)
    assert direct.state_dict().keys() == lazy.state_dict().keys()
    for name, value in direct.state_dict().items():
        assert torch.equal(value, lazy.state_dict()[name]), name


def test_pipeline_stage_with_layers_2_3_gets_identical_parameters():
    config = ModelConfig(**SMALL)
    whole = build_model(config, seed=5)
    with torch.device("meta"):
        stage = GPTModel(config)
    stage.embedding = None
    del stage.layers["0"], stage.layers["1"]
    stage.to_empty(device="cpu")
    init_weights(stage, 5)
    names = dict(stage.named_parameters())
    assert sorted(names) == sorted(
        ["final_norm.bias", "final_norm.weight", "output.weight"]
        + [n for n, _ in whole.named_parameters() if n.startswith(("layers.2.", "layers.3."))]
    )
    for name, param in names.items():
        source = "embedding.word_embeddings.weight" if name == "output.weight" else name
        assert torch.equal(param, whole.get_parameter(source)), name


def test_pipeline_stages_compose_to_the_whole_model():
    whole = gpt().eval()
    first, last = copy.deepcopy(whole), copy.deepcopy(whole)
    first.final_norm = first.output = None
    del first.layers["2"], first.layers["3"]
    last.embedding = None
    del last.layers["0"], last.layers["1"]
    ids = tokens()
    hidden = first(ids)
    assert hidden.shape == (2, 12, 32)
    torch.testing.assert_close(last(hidden), whole(ids))
    torch.testing.assert_close(last(hidden, labels=ids), whole(ids, labels=ids))


def test_init_values_follow_megatron_rules():
    config = ModelConfig(num_layers=8, hidden_size=256, num_attention_heads=4, vocab_size=512)
    model = build_model(config, seed=1)
    layer = model.layers["3"]
    assert torch.equal(layer.ln1.weight, torch.ones(256)) and torch.equal(layer.ln1.bias, torch.zeros(256))
    assert torch.equal(layer.attention.q_proj.bias, torch.zeros(256))
    assert layer.attention.q_proj.weight.std().item() == pytest.approx(0.02, rel=0.02)
    scaled = 0.02 / math.sqrt(2 * 8)
    assert layer.attention.o_proj.weight.std().item() == pytest.approx(scaled, rel=0.02)
    assert layer.mlp.fc2.weight.std().item() == pytest.approx(scaled, rel=0.02)
    assert model.embedding.word_embeddings.weight.std().item() == pytest.approx(0.02, rel=0.02)
    assert not torch.equal(layer.attention.q_proj.weight, layer.attention.k_proj.weight)
    other_seed = build_model(config, seed=2)
    assert not torch.equal(other_seed.layers["3"].attention.q_proj.weight, layer.attention.q_proj.weight)


def test_untied_output_has_its_own_weight():
    model = gpt(tie_embeddings=False)
    assert model.output.weight is not model.embedding.word_embeddings.weight
    assert not torch.equal(model.output.weight, model.embedding.word_embeddings.weight)
    assert model.output.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_padding_mask_matches_the_unpadded_sequences():
    ids = tokens(length=10)
    padded = torch.cat([ids, torch.zeros(2, 6, dtype=torch.long)], dim=1)
    keep = torch.cat([torch.ones(2, 10), torch.zeros(2, 6)], dim=1)
    model = gpt().eval()
    torch.testing.assert_close(model(padded, attention_mask=keep)[:, :10], model(ids))
    bert = build_model(ModelConfig(**SMALL, **NO_DROPOUT, model_type="bert"), seed=3).eval()
    torch.testing.assert_close(bert(padded, attention_mask=keep)[:, :10], bert(ids), rtol=1e-5, atol=1e-5)
    assert not torch.allclose(bert(padded)[:, :10], bert(ids), atol=1e-3)  # unmasked padding is seen


def test_document_mask_and_reset_positions_match_separate_documents():
    model = gpt(position_embedding_type="rope").eval()
    ids = tokens(batch=1, length=12)
    block = torch.zeros(1, 12, 12, dtype=torch.bool)
    block[:, :5, :5] = True
    block[:, 5:, 5:] = True
    positions = torch.cat([torch.arange(5), torch.arange(7)]).unsqueeze(0)
    joined = model(ids, position_ids=positions, attention_mask=block)
    torch.testing.assert_close(joined[:, :5], model(ids[:, :5]), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(joined[:, 5:], model(ids[:, 5:]), rtol=1e-5, atol=1e-5)


def test_rope_scores_depend_only_on_relative_position():
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(query_position: int, key_position: int) -> float:
        cos_q, sin_q = rotary_cos_sin(torch.tensor([[query_position]]), plain_inverse_frequency(8, 10000))
        cos_k, sin_k = rotary_cos_sin(torch.tensor([[key_position]]), plain_inverse_frequency(8, 10000))
        return (apply_rotary(q, cos_q, sin_q) * apply_rotary(k, cos_k, sin_k)).sum().item()

    assert score(7, 3) == pytest.approx(score(104, 100), rel=1e-4)
    assert score(7, 3) != pytest.approx(score(7, 5), rel=1e-3)
    model = gpt(position_embedding_type="rope")
    assert model.embedding.position_embeddings is None


def test_heads_split_by_columns_sum_to_full_attention():
    """What tensor parallelism does to one attention: each half of the heads runs alone."""
    attention = gpt().layers["0"].attention.eval()
    x = torch.randn(2, 12, 32)
    halves = []
    for rows in (slice(0, 16), slice(16, 32)):
        part = copy.deepcopy(attention)
        for proj in (part.q_proj, part.k_proj, part.v_proj):
            proj.weight = torch.nn.Parameter(proj.weight[rows].clone())
            proj.bias = torch.nn.Parameter(proj.bias[rows].clone())
        part.o_proj.weight = torch.nn.Parameter(part.o_proj.weight[:, rows].clone())
        part.o_proj.bias = torch.nn.Parameter(part.o_proj.bias / 2)
        halves.append(part(x))
    torch.testing.assert_close(halves[0] + halves[1], attention(x))


def test_bert_heads_losses_and_tie():
    config = ModelConfig(**SMALL, **NO_DROPOUT, model_type="bert", bert_binary_head=True, num_tokentypes=2)
    model = build_model(config, seed=3).eval()
    assert model.lm_head.output.weight is model.embedding.word_embeddings.weight
    ids, types = tokens(), torch.zeros(2, 12, dtype=torch.long)
    types[:, 6:] = 1
    labels = torch.full_like(ids, -1)
    labels[:, 2] = ids[:, 2]
    logits, binary = model(ids, torch.ones_like(ids), types)
    assert logits.shape == (2, 12, 64) and binary.shape == (2, 2)
    loss, binary_again = model(ids, torch.ones_like(ids), types, lm_labels=labels)
    torch.testing.assert_close(binary_again, binary)
    assert loss[:, 2].tolist() == pytest.approx(
        F.cross_entropy(logits[:, 2], ids[:, 2], reduction="none").tolist()
    )
    assert (loss[:, 3:] == 0).all()
    assert not torch.allclose(model(ids, torch.ones_like(ids))[0], logits)  # token types matter
    plain = BertModel(ModelConfig(**SMALL, model_type="bert"))
    assert plain.pooler is None and plain.binary_head is None


def _loss_and_grads(model: GPTModel, use_checkpoint: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    ids = tokens()
    torch.manual_seed(0)
    hidden = model.embedding(ids)
    for layer in model.layers.values():
        hidden = checkpoint(layer, hidden, use_reentrant=False) if use_checkpoint else layer(hidden)
    loss = model.loss(model.output(model.final_norm(hidden)), ids).mean()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad()
    return loss.detach(), grads


def test_activation_checkpointing_gives_identical_loss_and_grads_with_dropout():
    model = build_model(ModelConfig(**SMALL, hidden_dropout=0.2, attention_dropout=0.2), seed=1).train()
    plain_loss, plain_grads = _loss_and_grads(model, use_checkpoint=False)
    ckpt_loss, ckpt_grads = _loss_and_grads(model, use_checkpoint=True)
    assert torch.equal(plain_loss, ckpt_loss)
    for name, grad in plain_grads.items():
        assert torch.equal(grad, ckpt_grads[name]), name


def test_compiles_without_graph_breaks_or_recompiles_per_step():
    from rapidtrain.models.moe import collect_aux_losses

    model = gpt(num_layers=2, position_embedding_type="rope", num_experts=(0, 4), moe_router_topk=2).train()
    ids = tokens()
    eager = model(ids, labels=ids)
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(ids, labels=ids), eager)
    compiled(ids, labels=ids).mean().backward()  # second variant: the MoE tracker now holds a tensor
    with torch._dynamo.config.patch(error_on_recompile=True):
        for _ in range(3):
            compiled(ids, labels=ids).mean().backward()
            assert collect_aux_losses(model) is not None
    torch._dynamo.reset()


@pytest.mark.slow
def test_compiles_with_inductor():
    # One dense layer and one MoE layer: every kind of kernel inductor generates for this model; four layers were
    # the same two twice over, and inductor's C++ build is most of this test's time.
    model = gpt(num_layers=2, num_experts=(0, 4)).train()
    ids = tokens()
    eager = model(ids, labels=ids)
    compiled = torch.compile(model)(ids, labels=ids)
    torch.testing.assert_close(compiled, eager, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


def test_rejects_heads_that_do_not_divide_hidden():
    with pytest.raises(ValueError, match="--num-attention-heads"):
        build_model(ModelConfig(hidden_size=30, num_attention_heads=4))
    with pytest.raises(ValueError, match="--num-experts"):
        build_model(ModelConfig(num_layers=2, num_experts=(4,)))


def _tensor_parallel_worker(rank: int, store_path: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    dist.init_process_group("gloo", init_method=f"file://{store_path}", rank=rank, world_size=2)
    try:
        config = ModelConfig(**{**SMALL, **NO_DROPOUT, "num_layers": 2})
        whole = build_model(config, seed=9).eval()
        with torch.device("meta"):
            model = GPTModel(config).eval()
        plan = {}
        for i in range(config.num_layers):
            plan |= {f"layers.{i}.attention.{p}": ColwiseParallel() for p in ("q_proj", "k_proj", "v_proj")}
            plan |= {
                f"layers.{i}.attention.o_proj": RowwiseParallel(),
                f"layers.{i}.mlp.fc1": ColwiseParallel(),
            }
            plan |= {f"layers.{i}.mlp.fc2": RowwiseParallel()}
        parallelize_module(model, init_device_mesh("cpu", (2,)), plan)
        model.to_empty(device="cpu")
        init_weights(model, 9)
        q = model.layers["1"].attention.q_proj.weight
        assert q.to_local().shape == (16, 32)
        for name, param in model.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            assert torch.equal(full, whole.get_parameter(name)), name
        ids = tokens()
        torch.testing.assert_close(model(ids), whole(ids), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_init_and_forward_match_the_whole_model(tmp_path):
    spawn_ranks(_tensor_parallel_worker, str(tmp_path / "store"))


# ---- Llama-family shape: RMSNorm, SwiGLU, grouped-query attention, rope, no biases, untied ----

LLAMA = dict(normalization="RMSNorm", swiglu=True, num_query_groups=2, add_bias_linear=False,
             position_embedding_type="rope", tie_embeddings=False, ffn_hidden_size=48)


def test_llama_shape_has_its_parts_and_no_biases():
    model = gpt(**LLAMA)
    layer = model.layers["0"]
    assert isinstance(layer.ln1, torch.nn.RMSNorm) and isinstance(model.final_norm, torch.nn.RMSNorm)
    assert torch.equal(layer.ln1.weight, torch.ones(32))
    assert layer.attention.k_proj.weight.shape == (16, 32)  # 2 key/value heads of size 8
    assert layer.mlp.gate.weight.shape == (48, 32) and layer.mlp.fc1.weight.shape == (48, 32)
    assert not [name for name, _ in model.named_parameters() if name.endswith("bias")]
    qwen = gpt(**LLAMA, add_qkv_bias=True)
    biased = sorted({name.split(".", 2)[2] for name, _ in qwen.named_parameters() if name.endswith("bias")})
    assert biased == ["attention.k_proj.bias", "attention.q_proj.bias", "attention.v_proj.bias"]


def test_grouped_query_attention_equals_heads_sharing_repeated_keys_and_values():
    """Query heads 2g and 2g+1 read key/value group g: the same as multi-head attention whose k/v
    projections repeat each group's rows for its heads."""
    grouped = gpt(**LLAMA).layers["0"].attention.eval()
    full = gpt(**{**LLAMA, "num_query_groups": None}).layers["0"].attention.eval()
    full.load_state_dict(grouped.state_dict() | {
        f"{p}_proj.weight": getattr(grouped, f"{p}_proj").weight.view(2, 8, 32).repeat_interleave(2, dim=0)
        .reshape(32, 32) for p in "kv"
    })
    x = torch.randn(2, 12, 32)
    rope = rotary_cos_sin(torch.arange(12).unsqueeze(0), plain_inverse_frequency(8, 10000))
    torch.testing.assert_close(grouped(x, rope=rope), full(x, rope=rope))


def test_rotary_percent_leaves_the_other_dimensions_alone():
    x = torch.randn(1, 2, 5, 8)
    cos, sin = rotary_cos_sin(torch.arange(5).unsqueeze(0), plain_inverse_frequency(4, 10000))  # half of 8 dims
    rotated = apply_rotary(x, cos, sin)
    assert torch.equal(rotated[..., 4:], x[..., 4:])
    assert not torch.allclose(rotated[..., 1:, :4], x[..., 1:, :4])
    assert gpt(**LLAMA, rotary_percent=0.5).config.rotary_dim == 4


def test_llama_meta_build_then_init_equals_direct_init():
    config = ModelConfig(**SMALL, **LLAMA, num_experts=(0, 4, 0, 4), moe_router_topk=2)
    direct = build_model(config, seed=11)
    with torch.device("meta"):
        lazy = build_model(config)
    lazy.to_empty(device="cpu")
    init_weights(lazy, 11)
    assert "layers.1.mlp.experts.w_gate" in direct.state_dict()
    assert "layers.1.mlp.experts.b1" not in direct.state_dict()
    for name, value in direct.state_dict().items():
        assert torch.equal(value, lazy.state_dict()[name]), name


def test_post_layernorm_bert_normalises_each_residual_sum():
    config = ModelConfig(**SMALL, **NO_DROPOUT, model_type="bert", post_layernorm=True)
    model = build_model(config, seed=3).eval()
    assert model.final_norm is None and isinstance(model.embedding.norm, torch.nn.LayerNorm)
    outputs = []
    model.layers["1"].register_forward_hook(lambda _m, _a, out: outputs.append(out))
    model(tokens(), torch.ones(2, 12))
    normalised = outputs[0]
    torch.testing.assert_close(normalised.mean(-1), torch.zeros(2, 12), atol=1e-5, rtol=0)  # ln2 weight 1, bias 0


MIXTRAL = {**LLAMA, "num_experts": (0, 4, 0, 4), "moe_router_topk": 2, "moe_token_dropping": False}


@pytest.mark.parametrize("shape", [{}, LLAMA, MIXTRAL], ids=["gpt2", "llama", "llama-moe"])
def test_kv_cache_decoding_gives_the_full_forward_logits(shape):
    """A prompt of 5, then 1 token, then 3 at once through the cache: the logits of a full forward.
    (MoE without token dropping: with capacity, which tokens drop depends on how many run at once.)"""
    from rapidtrain.models.transformer import KVCache

    model = gpt(**shape).eval()
    ids = tokens(length=9)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :5], kv_cache=cache), model(ids[:, 5:6], kv_cache=cache),
                 model(ids[:, 6:], kv_cache=cache)]
    assert cache.length == 9 and cache.keys["0"].shape[2] == 9
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


def test_rejects_query_groups_that_do_not_divide_heads():
    with pytest.raises(ValueError, match="--num-query-groups 3"):
        build_model(ModelConfig(**{**SMALL, **LLAMA, "num_query_groups": 3}))
