"""rapidtrain's short-sequence attention (models/attention.py's short_attention, auto's kernel in bf16 on a CPU at
≤ SHORT_KERNEL_MAX_KEYS keys): its gradients are its forward's (fp64 gradcheck over every branch: causal, no mask,
a per-sample mask, a shared mask with an emptied row, grouped-query stacking, MLA's value size, dropout); in bf16 it
is as accurate as Megatron's unfused bf16 attention against an fp64 reference, over a grid of shapes and masks; auto
dispatches to it exactly where the plan says; the plan counts what it keeps; a tiny GPT trains in bf16 with it to
the losses of SDPA's kernel within bf16 rounding."""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from rapidtrain.config import arguments
from rapidtrain.config.activations import layer_bytes
from rapidtrain.config.memory import activation_context, short_attention_planned
from rapidtrain.config.resolve import switches_of
from rapidtrain.config.settings import Layout, Precision, RunContext
from rapidtrain.models import build_model
from rapidtrain.models.attention import _short_bias, _ShortAttention, attend, eager_attention, short_attention
from rapidtrain.models.attention_backends import SHORT_KERNEL_MAX_KEYS, short_kernel_runs
from rapidtrain.models.config import ModelConfig


def qkv(b: int, heads: int, groups: int, s: int, d: int, dv: int, dtype: torch.dtype, seed: int):
    generator = torch.Generator().manual_seed(seed)
    q = torch.randn(b, heads, s, d, generator=generator, dtype=torch.float64)
    k = torch.randn(b, groups, s, d, generator=generator, dtype=torch.float64)
    v = torch.randn(b, groups, s, dv, generator=generator, dtype=torch.float64)
    return [t.to(dtype).requires_grad_() for t in (q, k, v)]


def masks(b: int, s: int, kind: str) -> tuple[torch.Tensor | None, bool]:
    """(mask, is_causal) of each kind of call the models make."""
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    if kind == "causal":
        return None, True
    if kind == "none":
        return None, False
    if kind == "documents":  # packed documents, per sample: causal AND the same document
        ids = torch.stack([torch.arange(s) // max(1, s // 3), torch.arange(s) // max(1, s // 2)])[:b]
        return (causal & (ids[:, :, None] == ids[:, None, :]))[:, None], False
    if kind == "shared_with_empty_row":  # one mask for the batch whose last query may see nothing
        shared = causal.clone()
        shared[-1] = False
        return shared, False
    raise ValueError(kind)


def reference(q, k, v, mask, is_causal):
    """fp64 SDPA math with grouped-query heads; a row the mask empties gives zeros (SDPA's safe softmax)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    with sdpa_kernel(SDPBackend.MATH):
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, enable_gqa=True)
    return out, (q, k, v)


@pytest.mark.parametrize(("kind", "heads", "groups", "dv", "dropout"), [
    ("causal", 4, 2, 8, 0.0), ("none", 2, 2, 8, 0.0), ("documents", 4, 1, 8, 0.0),
    ("shared_with_empty_row", 4, 2, 8, 0.0), ("causal", 2, 2, 12, 0.0), ("causal", 4, 2, 8, 0.3),
    ("documents", 2, 1, 8, 0.5)])
def test_backward_is_the_forward_s_gradient(kind, heads, groups, dv, dropout):
    """fp64 gradcheck of the autograd function on stacked rows; dropout's mask is drawn again from the same seed
    at every call, so the checked function is fixed."""
    b, s, d = 2, 6, 8
    q, k, v = qkv(b, heads, groups, s, d, dv, torch.float64, seed=1)
    mask, is_causal = masks(b, s, kind)
    bias = _short_bias(mask, is_causal, b, heads, groups, s, torch.float64, q.device)
    rows = heads // groups * s

    def attention(q, k, v):
        torch.manual_seed(5)
        out = _ShortAttention.apply(q.reshape(b * groups, rows, d), k.reshape(b * groups, s, d),
                                    v.reshape(b * groups, s, dv), bias, dropout, d ** -0.5, mask is not None)
        return out.view(b, heads, s, dv)

    assert torch.autograd.gradcheck(attention, (q, k, v))
    if dropout == 0:  # and it is attention: fp64 SDPA's output and gradients
        expected, inputs = reference(q, k, v, mask, is_causal)
        torch.testing.assert_close(attention(q, k, v), expected)
        grad = torch.randn_like(expected)
        torch.testing.assert_close(torch.autograd.grad(attention(q, k, v), (q, k, v), grad),
                                   torch.autograd.grad(expected, inputs, grad))


def test_dropout_keeps_the_expected_share_and_scales_the_rest():
    """With dropout p the probabilities that survive are scaled by 1/(1-p): the output's mean over many draws is
    the undropped output (within 3 standard errors), and different seeds draw different masks."""
    q, k, v = qkv(1, 2, 2, 16, 8, 8, torch.float64, seed=2)
    undropped = short_attention(q, k, v, None, True, 0.0)
    draws = torch.stack([short_attention(q, k, v, None, True, 0.5) for _ in range(400)])
    error = (draws.mean(0) - undropped).abs()
    assert (error <= 3 * draws.std(0) / 400 ** 0.5 + 1e-9).float().mean() > 0.97
    assert not torch.equal(draws[0], draws[1])


SHAPES = [  # (b, heads, groups, s, d, dv)
    (2, 4, 4, 64, 32, 32), (1, 8, 2, 128, 64, 64), (2, 4, 1, 33, 16, 16), (1, 2, 2, SHORT_KERNEL_MAX_KEYS, 64, 64),
    (2, 4, 4, 40, 24, 16),  # MLA: values narrower than queries and keys
]


@pytest.mark.parametrize(("shape", "kind"), list(itertools.product(SHAPES, ("causal", "none", "documents"))))
def test_bf16_is_as_accurate_as_megatron_s_unfused_attention(shape, kind):
    """Against fp64, the output's and each gradient's largest error: at most 1.5× that of the written-out bf16
    attention of Megatron's unfused path and Hugging Face's eager one (rapidtrain's eager kernel: each product
    rounded to bf16, the softmax in fp32) + 1e-3, and within 4 bf16 ulps of the largest exact value. (PyTorch's
    CPU flash kernel, which rounds the unnormalized exponentials and divides after its value product, measured on
    this grid: this kernel's error is 1.1–4.2× the flash kernel's on the output, 1.0–3.0× on dQ, 0.4–2.4× on dK,
    0.2–1.5× on dV.)"""
    b, heads, groups, s, d, dv = shape
    q, k, v = qkv(b, heads, groups, s, d, dv, torch.bfloat16, seed=s)
    mask, is_causal = masks(b, s, kind)
    expected, inputs = reference(q, k, v, mask, is_causal)
    grad = torch.randn(expected.shape, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    expected_grads = torch.autograd.grad(expected, inputs, grad)
    exact = (expected, *expected_grads)

    def errors(out):
        grads = torch.autograd.grad(out, (q, k, v), grad.to(out.dtype))
        return [(a.double() - e).abs().max().item() for a, e in zip((out, *grads), exact, strict=True)]

    ours = errors(short_attention(q, k, v, mask, is_causal, 0.0))
    unfused = errors(eager_attention(q, k, v, mask, is_causal, 0.0))
    for name, mine, theirs, value in zip(("out", "dq", "dk", "dv"), ours, unfused, exact, strict=True):
        assert mine <= 1.5 * theirs + 1e-3, (name, mine, theirs)
        assert mine <= 4 * 2 ** -8 * value.abs().max().item(), (name, mine)


def test_auto_runs_it_exactly_where_the_plan_says():
    """auto's call in bf16 on a CPU over ≤ SHORT_KERNEL_MAX_KEYS keys is short_attention's (bitwise), one key more
    or fp32 or decoding after cached keys or ALiBi is SDPA's; sdpa and eager never run it."""
    q, k, v = qkv(1, 2, 2, 48, 16, 16, torch.bfloat16, seed=4)
    ours = short_attention(q, k, v, None, True, 0.0)
    assert torch.equal(attend(q, k, v, None, True, 0.0, "auto"), ours)
    assert not torch.equal(attend(q, k, v, None, True, 0.0, "sdpa"), ours)
    assert short_kernel_runs("auto", "cpu", "bf16", SHORT_KERNEL_MAX_KEYS, SHORT_KERNEL_MAX_KEYS)
    for refused in (("auto", "cpu", "bf16", SHORT_KERNEL_MAX_KEYS + 1, SHORT_KERNEL_MAX_KEYS + 1),
                    ("auto", "cpu", "fp32", 48, 48), ("auto", "cpu", "fp16", 48, 48), ("auto", "cpu", "bf16", 1, 48),
                    ("auto", "cuda", "bf16", 48, 48), ("sdpa", "cpu", "bf16", 48, 48),
                    ("eager", "cpu", "bf16", 48, 48)):
        assert not short_kernel_runs(*refused), refused
    # With attention dropout PyTorch's CPU flash kernel cannot run: it runs instead of SDPA's math path, fp32 and any
    # length included (not fp16, not decoding, not with ALiBi or sinks).
    for dtype, keys in (("fp32", 48), ("fp32", 4096), ("bf16", 4096)):
        assert short_kernel_runs("auto", "cpu", dtype, keys, keys, dropout=True), (dtype, keys)
    assert not short_kernel_runs("auto", "cpu", "fp16", 48, 48, dropout=True)
    assert not short_kernel_runs("auto", "cpu", "fp32", 1, 48, dropout=True)
    assert not short_kernel_runs("auto", "cpu", "bf16", 48, 48, alibi=True)
    assert not short_kernel_runs("auto", "cpu", "bf16", 48, 48, dropout=True, sink=True)
    decoding = attend(q[:, :, -1:], k, v, None, False, 0.0, "auto")
    torch.testing.assert_close(decoding, ours[:, :, -1:], atol=2e-2, rtol=2e-2)


def plan_bytes(model: ModelConfig, dtype: str, layout: Layout, device: str = "cpu", granularity: str = "none"):
    """(whether the plan runs the short kernel, one layer's kept bytes for one sample)."""
    precision = Precision(dtype, "none", "")
    switches = switches_of(arguments.parse_args(["--train-iters", "1", "--lr", "1e-3"]), layout,
                           RunContext(device_type=device))
    act = activation_context(model, precision, layout, switches, device)
    return short_attention_planned(model, precision, layout, device), layer_bytes(model, 1, layout, act, granularity)


def test_the_plan_counts_the_kept_probabilities():
    """In bf16 on a CPU at ≤ 512 keys a layer keeps heads · s² bf16 probabilities per sample (+ one byte of
    keep-mask each with attention dropout) beyond flash's; under op-level recompute the scores' matmul output;
    fp32, CUDA, longer sequences, the ring and all-gathered CP keep none of them."""
    one = Layout(world_size=1, data_parallel_size=1)
    base = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=256, vocab_size=128,
                       max_position_embeddings=512, hidden_dropout=0.0, attention_dropout=0.0)
    square = 4 * 256 * 256
    short, kept = plan_bytes(base, "bf16", one)
    assert short
    _, flash_kept = plan_bytes(ModelConfig(**{**base.__dict__, "attention_kernel": "sdpa"}), "bf16", one)
    assert kept - flash_kept == pytest.approx(2 * square)
    _, dropped = plan_bytes(ModelConfig(**{**base.__dict__, "attention_dropout": 0.1}), "bf16", one)
    assert dropped - kept == pytest.approx(square)
    assert plan_bytes(base, "bf16", one, granularity="op")[1] - plan_bytes(
        ModelConfig(**{**base.__dict__, "attention_kernel": "sdpa"}), "bf16", one, granularity="op")[1] \
        == pytest.approx(2 * square)
    assert not plan_bytes(base, "fp32", one)[0] and not plan_bytes(base, "bf16", one, "cuda")[0]
    # fp32 with attention dropout: fp32 probabilities and the byte of mask, not the math path's three fp32 squares
    fp32_dropped = ModelConfig(**{**base.__dict__, "attention_dropout": 0.1})
    short, kept = plan_bytes(fp32_dropped, "fp32", one)
    _, sdpa_kept = plan_bytes(ModelConfig(**{**fp32_dropped.__dict__, "attention_kernel": "sdpa"}), "fp32", one)
    assert short and sdpa_kept - kept == pytest.approx((3 * 4 - (4 + 1)) * square)
    long = ModelConfig(**{**base.__dict__, "seq_length": SHORT_KERNEL_MAX_KEYS + 8,
                          "max_position_embeddings": 1024})
    assert not plan_bytes(long, "bf16", one)[0]
    for comm, runs in (("p2p", False), ("allgather", False), ("a2a", True)):
        layout = Layout(world_size=2, data_parallel_size=1, context_parallel_size=2, cp_comm_type=comm)
        assert short_attention_planned(base, Precision("bf16", "none", ""), layout, "cpu") == runs, comm


def test_tiny_gpt_trains_in_bf16_to_sdpa_s_losses():
    """A GPT (grouped-query, RoPE, documents masked) trained 4 steps in bf16 with auto (the short kernel) and with
    sdpa (PyTorch's flash kernel) from the same weights: the losses agree within bf16 rounding (1%) and fall."""
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 128, (4, 65), generator=generator)
    s = 64
    ids = torch.arange(s) // 20
    documents = (torch.ones(s, s, dtype=torch.bool).tril() & (ids[:, None] == ids[None, :]))[None, None]
    losses = {}
    for kernel in ("auto", "sdpa"):
        config = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2,
                             seq_length=s, vocab_size=128, max_position_embeddings=s, position_embedding_type="rope",
                             hidden_dropout=0.0, attention_dropout=0.0, attention_kernel=kernel)
        model = build_model(config, seed=7).to(torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        values = []
        for _ in range(4):
            loss = model(tokens[:, :-1], None, documents, tokens[:, 1:]).float().mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            values.append(loss.item())
        losses[kernel] = values
    assert losses["auto"] == pytest.approx(losses["sdpa"], rel=1e-2)
    assert losses["auto"][-1] < losses["auto"][0]



def test_selective_recompute_recomputes_it_as_it_recomputes_sdpa():
    """--recompute-activations (selective: the attention core under checkpoint) sees the short kernel's call as it
    sees SDPA's: the layer keeps no [s, s] probabilities for backward, and its gradients (attention dropout on, the
    masks drawn again in the recomputation) equal the unwrapped layer's bitwise."""
    from rapidtrain.parallel.recompute import SelectiveRecompute

    s = 48
    config = ModelConfig(num_layers=1, hidden_size=64, num_attention_heads=4, num_query_groups=2, seq_length=s,
                         vocab_size=128, max_position_embeddings=s, hidden_dropout=0.0, attention_dropout=0.2)
    x = torch.randn(2, s, 64, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(1))

    def run(wrap: bool) -> tuple[list[torch.Size], list[torch.Tensor]]:
        layer = build_model(config, seed=3).to(torch.bfloat16).layers["0"].train()
        module = SelectiveRecompute(layer) if wrap else layer
        shapes: list[torch.Size] = []
        torch.manual_seed(9)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: shapes.append(t.shape) or t, lambda t: t):
            out = module(x)
        out.float().square().mean().backward()
        return shapes, [p.grad for p in layer.parameters()]

    plain_shapes, plain_grads = run(False)
    wrapped_shapes, wrapped_grads = run(True)
    probabilities = (2 * 2, 2 * s, s)  # [b · groups, heads/groups · s, s]: 4 heads over 2 groups stacked
    assert probabilities in plain_shapes and probabilities not in wrapped_shapes
    for plain, wrapped in zip(plain_grads, wrapped_grads, strict=True):
        assert torch.equal(plain, wrapped)
