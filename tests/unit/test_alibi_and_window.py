"""BLOOM's and Mistral's attention in the built-in GPT: ALiBi's slopes (Press et al. 2022) and causal biases against a
plain computation on every CPU kernel, the LayerNorm on the word embeddings, sliding-window attention (with
Megatron's every-Nth-layer full attention) against an explicit band mask, KV-cache decoding, and tensor parallelism
(each rank takes the slopes of its own heads)."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.models import GPTModel, ModelConfig, build_model
from rapidtrain.models.attention import alibi_slopes, attend, flex_block_mask
from rapidtrain.models.counting import count_parameters
from rapidtrain.models.transformer import KVCache, init_weights
from tests.launch import spawn_ranks

SMALL = dict(num_layers=2, hidden_size=48, num_attention_heads=6, vocab_size=64, seq_length=16,
             hidden_dropout=0.0, attention_dropout=0.0)
BLOOM = dict(position_embedding_type="alibi", embed_layernorm=True, openai_gelu=True)


def tokens(batch: int = 2, length: int = 12, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (batch, length), generator=torch.Generator().manual_seed(seed))


def test_slopes_are_the_papers_geometric_sequence_and_its_interleaved_extension():
    # 8 heads: 2^-1 ... 2^-8. 6 heads: those of 4 heads (2^-2, 2^-4, 2^-6, 2^-8), then 8 heads' 1st and 3rd.
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0 ** -i for i in (2, 4, 6, 8, 1, 3)]))
    # 112 heads (BLOOM-176B): 64 of 2^(-i/8), then 48 of 128 heads' odd exponents 2^(-(2j+1)/16).
    expected = [2.0 ** (-i / 8) for i in range(1, 65)] + [2.0 ** (-(2 * j + 1) / 16) for j in range(48)]
    torch.testing.assert_close(alibi_slopes(112), torch.tensor(expected))


def reference_alibi_attention(q, k, v, slopes):
    """BLOOM's form: softmax(QKᵀ/√d + slope × key position), causal, one head at a time; the bias differs from
    -slope × distance by a constant per row, which softmax ignores."""
    s, d = q.shape[2], q.shape[3]
    out = torch.empty_like(q)
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    for h in range(q.shape[1]):
        g = h // (q.shape[1] // k.shape[1])
        scores = q[:, h] @ k[:, g].transpose(-1, -2) / d ** 0.5 + slopes[h] * torch.arange(s, dtype=q.dtype)
        out[:, h] = scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v[:, g]
    return out


@pytest.mark.parametrize("kernel", ["sdpa", "sdpa_flash", "eager", "flex"])
def test_causal_alibi_matches_the_plain_computation_on_every_kernel(kernel):
    generator = torch.Generator().manual_seed(3)
    q = torch.randn(2, 6, 40, 16, generator=generator)
    k, v = (torch.randn(2, 3, 40, 16, generator=generator) for _ in range(2))
    slopes = alibi_slopes(6)
    mask = flex_block_mask(2, 40, 40, q.device, causal=True) if kernel == "flex" else None
    out = attend(q, k, v, mask, kernel != "flex", 0.0, kernel, alibi=slopes)
    torch.testing.assert_close(out, reference_alibi_attention(q, k, v, slopes), rtol=1e-5, atol=1e-5)


def test_bloom_shaped_gpt_has_no_position_table_and_counts_its_embedding_norm():
    config = ModelConfig(**SMALL, **BLOOM)
    model = build_model(config, seed=1)
    names = {name for name, _ in model.named_parameters()}
    assert "embedding.word_embeddings_norm.weight" in names and "embedding.word_embeddings_norm.bias" in names
    assert model.embedding.position_embeddings is None
    assert count_parameters(config)[0] == sum(p.numel() for p in model.parameters())
    assert count_parameters(config)[0] == count_parameters(ModelConfig(**SMALL, position_embedding_type="alibi"))[0] \
        + 2 * 48
    assert config.architecture == "built-in GPT (BLOOM-style)"


def test_alibi_model_sees_only_relative_positions():
    """One layer, a window of 4: the last position sees only the last 4 tokens, and ALiBi has no absolute
    positions, so those 4 tokens give the same logits at position 11 as alone at position 3."""
    model = build_model(ModelConfig(**{**SMALL, "num_layers": 1}, **BLOOM, sliding_window=4), seed=2).eval()
    ids = tokens(length=12)
    with torch.no_grad():
        whole = model(ids)[:, -1]
        tail = model(ids[:, -4:])[:, -1]
    torch.testing.assert_close(whole, tail, rtol=1e-5, atol=1e-5)


def band_mask(length: int, window: int) -> torch.Tensor:
    query, key = torch.arange(length)[:, None], torch.arange(length)[None, :]
    return (key <= query) & (query - key < window)


@pytest.mark.parametrize("kernel", ["sdpa", "eager", "flex"])
@pytest.mark.parametrize("alibi", [False, True], ids=["learned", "alibi"])
def test_sliding_window_equals_an_explicit_band_mask(kernel, alibi):
    """Every query sees itself and the 3 keys before it (window 4): the same logits as the model without a window
    given that band as its attention mask (the reference path), on each kernel."""
    shape = {**SMALL, "attention_kernel": kernel, **(BLOOM if alibi else {})}
    windowed = build_model(ModelConfig(**shape, sliding_window=4), seed=4).eval()
    plain = build_model(ModelConfig(**shape), seed=4).eval()
    ids = tokens(length=12)
    with torch.no_grad():
        expected = plain(ids, attention_mask=band_mask(12, 4).expand(2, 12, 12))
        torch.testing.assert_close(windowed(ids), expected, rtol=1e-5, atol=1e-5)
        assert not torch.allclose(plain(ids), expected, atol=1e-4)  # the window does change the result


def test_every_nth_layer_attends_to_the_whole_sequence():
    """Megatron's --window-attn-skip-freq 2: layers 2, 4, ... (1-based) are full attention."""
    config = ModelConfig(**{**SMALL, "num_layers": 4}, sliding_window=3, window_skip_freq=2)
    assert [config.window_of_layer(i) for i in range(4)] == [3, None, 3, None]
    torch.manual_seed(0)
    model = build_model(config, seed=5).eval()
    ids = tokens(length=10)
    with torch.no_grad():
        by_layer = ref_layers(model, ids, [band_mask(10, 3), None, band_mask(10, 3), None])
        torch.testing.assert_close(model(ids), by_layer, rtol=1e-5, atol=1e-5)


def ref_layers(model: GPTModel, ids: torch.Tensor, masks: list) -> torch.Tensor:
    """The model's forward written out, each layer with its own mask (None: causal)."""
    hidden = model.embedding(ids)
    for layer, mask in zip(model.layers.values(), masks, strict=True):
        full = torch.ones(10, 10, dtype=torch.bool).tril() if mask is None else mask
        hidden = layer(hidden, full.expand(ids.shape[0], 1, 10, 10))
    return model.output(model.final_norm(hidden))


@pytest.mark.parametrize("shape", [BLOOM, {"sliding_window": 3}, {**BLOOM, "sliding_window": 4},
                                   {**BLOOM, "sliding_window": 4, "attention_kernel": "flex"}],
                         ids=["alibi", "window", "alibi-window", "alibi-window-flex"])
def test_kv_cache_decoding_gives_the_full_forward_logits(shape):
    model = build_model(ModelConfig(**SMALL, **shape), seed=6).eval()
    ids = tokens(length=9)
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :5], kv_cache=cache), model(ids[:, 5:6], kv_cache=cache),
                 model(ids[:, 6:], kv_cache=cache)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("bad, says", [
    ({"model_type": "bert", "position_embedding_type": "alibi"}, "causal"),
    ({"sliding_window": 0}, "--sliding-window 0"),
])
def test_model_refuses_what_it_cannot_build(bad, says):
    with pytest.raises(ValueError, match=says):
        build_model(ModelConfig(**{**SMALL, **bad}), seed=None)


def _tensor_parallel_worker(rank: int, store: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from rapidtrain.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        config = ModelConfig(**SMALL, **BLOOM, sliding_window=5)
        whole = build_model(config, seed=8).eval()
        with torch.device("meta"):
            model = GPTModel(config).eval()
        apply_tensor_parallel(model, init_device_mesh("cpu", (2,)))
        model.to_empty(device="cpu")
        init_weights(model, 8)
        assert model.layers["0"].attention.first_head == 3 * rank  # 6 heads, 3 per rank
        ids = tokens(length=12)
        with torch.no_grad():
            logits = model(ids)
            logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            torch.testing.assert_close(logits, whole(ids), rtol=1e-5, atol=1e-5)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_ranks_take_the_slopes_of_their_own_heads(tmp_path):
    """TP 2 over 6 heads: rank 1 computes heads 3-5 with their slopes; the logits equal the whole model's."""
    spawn_ranks(_tensor_parallel_worker, str(tmp_path / "store"))


def test_flops_count_the_keys_a_window_leaves():
    """Causal scores cost 2·2·N·a·s/2 per layer; with a window w the queries see w - w²/2s keys on average: for
    s = 16, w = 4 that is 3.5 instead of 8, in the windowed layers only (here 1 of 2: --window-attn-skip-freq 2)."""
    from rapidtrain.models.counting import model_flops_per_iteration

    plain = ModelConfig(**SMALL)
    windowed = ModelConfig(**SMALL, sliding_window=4, window_skip_freq=2)
    tokens_per_batch, heads_dim = 3 * 16, 48
    saved = 3 * 4 * tokens_per_batch * heads_dim * (8 - 3.5)  # forward + backward, one windowed layer
    assert model_flops_per_iteration(plain, 3) - model_flops_per_iteration(windowed, 3) == saved
