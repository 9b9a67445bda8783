"""The MoE layer: capacity arithmetic, which tokens drop, balancing/z losses by hand, equality with a
naive per-token reference, gradients (including the injected router-loss gradient), the tracker; no host reads in
routing, dispatch and combine."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.checkpoint import checkpoint

from rapidtrain.models import ModelConfig, build_model, moe
from rapidtrain.models.moe import (
    MoELayer,
    bucketed_counts,
    collect_aux_losses,
    collect_expert_load,
    expert_capacity,
    load_balancing_loss,
    padded_rows,
    router_z_loss,
    set_aux_loss_scale,
)


def moe_layer(experts: int = 4, hidden: int = 4, **overrides: object) -> MoELayer:
    settings = dict(hidden_size=hidden, num_attention_heads=1, ffn_hidden_size=8, moe_min_capacity=1)
    torch.manual_seed(0)
    return MoELayer(ModelConfig(**{**settings, **overrides}), experts)


def test_expert_capacity_arithmetic():
    assert expert_capacity(16, 4, 1, 1.0, 1) == 4
    assert expert_capacity(16, 4, 2, 1.0, 1) == 8
    assert expert_capacity(10, 4, 1, 1.1, 1) == 3  # ceil(2.75)
    assert expert_capacity(16, 4, 1, 1.25, 1) == 5
    assert expert_capacity(100, 10, 1, 1.1, 1) == 11  # float math would give ceil(11.000000000000002) = 12
    assert expert_capacity(16, 8, 1, 1.0, 4) == 4  # raised to min capacity
    assert expert_capacity(2, 8, 1, 1.0, 4) == 2  # never more slots than tokens
    assert expert_capacity(16, 4, 1, 1.0, 1, token_dropping=False) == 16


def test_tokens_over_capacity_drop_in_token_order():
    layer = moe_layer(experts=2).eval()
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[5.0, 0, 0, 0], [0, 5.0, 0, 0]]))
    x = torch.tensor([[1.0, 0, 0, 0]] * 5 + [[0, 1.0, 0, 0]])  # 5 tokens want expert 0, 1 wants expert 1
    probs = layer.router_logits(x).softmax(-1)
    routing, _ = layer.route(probs)
    assert routing.capacity == 3  # ceil(6 / 2)
    kept = (routing.weight > 0).tolist()
    assert kept == [True, True, True, False, False, True]
    out = layer(x)
    assert torch.equal(out[3:5], torch.zeros(2, 4))
    assert (out[:3].abs().sum(-1) > 0).all() and out[5].abs().sum() > 0


def test_first_choices_outrank_second_choices():
    layer = moe_layer(experts=3, moe_router_topk=2, moe_capacity_factor=0.5).eval()
    # Token 0 picks (1, 0); tokens 1 and 2 pick (0, 2): expert 0 has capacity 1 (ceil(2·3/3·0.5)).
    probs = torch.tensor([[0.3, 0.6, 0.1], [0.6, 0.1, 0.3], [0.5, 0.2, 0.3]])
    routing, expert_index = layer.route(probs)
    assert expert_index.tolist() == [[1, 0], [0, 2], [0, 2]]
    assert routing.capacity == 1
    weights = routing.weight.view(2, 3).t()  # [token, choice]
    # Expert 0 keeps token 1's first choice (not token 0's earlier, second choice); expert 2 keeps token 1.
    assert (weights > 0).tolist() == [[True, False], [True, True], [False, False]]
    assert weights[1].tolist() == pytest.approx([0.6 / 0.9, 0.3 / 0.9])


def test_no_token_dropping_keeps_every_token():
    layer = moe_layer(experts=2, moe_token_dropping=False)
    with torch.no_grad():
        layer.router.weight.copy_(torch.tensor([[5.0, 0, 0, 0], [0, 0, 0, 0]]))
    routing, _ = layer.route(layer.router_logits(torch.rand(10, 4) + 0.5).softmax(-1))
    assert routing.capacity == 10 and bool((routing.weight > 0).all())


def even_routing_layer(topk: int) -> tuple[MoELayer, torch.Tensor]:
    """4 experts, 8 tokens; token t prefers expert t mod 4, then expert t+1 mod 4: a cyclic symmetry."""
    layer = moe_layer(experts=4, moe_router_topk=topk)
    with torch.no_grad():
        layer.router.weight.copy_(4.0 * torch.eye(4))
    x = torch.zeros(8, 4)
    for t in range(8):
        x[t, t % 4], x[t, (t + 1) % 4] = 1.0, 0.5
    return layer, x


@pytest.mark.parametrize("topk", [1, 2])
def test_balancing_loss_is_one_under_even_routing(topk: int):
    layer, x = even_routing_layer(topk)
    layer.train()
    layer(x)
    load = collect_expert_load(torch.nn.Sequential(layer))
    assert load["0"].tolist() == [2 * topk] * 4
    assert collect_aux_losses(layer).item() == pytest.approx(1.0, abs=1e-6)


def test_balancing_and_z_loss_hand_computed():
    probs = torch.tensor([[0.7, 0.3], [0.6, 0.4]])
    # Both tokens choose expert 0: fraction (1, 0), mean prob (0.65, 0.35): 2 · 0.65 = 1.3.
    assert load_balancing_loss(probs, torch.tensor([2, 0])).item() == pytest.approx(1.3)
    # Top-2 of 3 experts, 2 tokens: assignments (2, 1, 1) of 4, mean prob (0.5, 0.3, 0.2).
    probs3 = torch.tensor([[0.6, 0.3, 0.1], [0.4, 0.3, 0.3]])
    expected = 3 * (0.5 * 0.5 + 0.3 * 0.25 + 0.2 * 0.25)
    assert load_balancing_loss(probs3, torch.tensor([2, 1, 1])).item() == pytest.approx(expected)
    assert router_z_loss(torch.tensor([[0.0, 0.0], [1.0, 1.0]])).item() == pytest.approx(
        (math.log(2) ** 2 + (1 + math.log(2)) ** 2) / 2
    )


def naive_moe(layer: MoELayer, x: torch.Tensor) -> torch.Tensor:
    """Token by token: choices, capacity counted in priority order, weighted expert MLPs."""
    probs = F.softmax(x @ layer.router.weight.t(), dim=-1)
    k, experts = layer.topk, layer.experts
    capacity = expert_capacity(len(x), layer.num_experts, k, layer.capacity_factor, layer.min_capacity)
    choices = [torch.topk(p, k) for p in probs]
    used = [0] * layer.num_experts
    out = torch.zeros_like(x)
    for rank in range(k):
        for t, (weights, index) in enumerate(choices):
            e = int(index[rank])
            used[e] += 1
            if used[e] > capacity:
                continue
            weight = weights[rank] / weights.sum() if k > 1 else weights[rank]
            hidden = F.gelu(x[t] @ experts.w1[e] + experts.b1[e])
            out[t] += weight * (hidden @ experts.w2[e] + experts.b2[e])
    return out


@pytest.mark.parametrize("topk,factor", [(1, 1.0), (1, 0.5), (2, 1.0), (2, 0.6)])
def test_moe_output_equals_naive_reference(topk: int, factor: float):
    layer = moe_layer(experts=4, hidden=8, moe_router_topk=topk, moe_capacity_factor=factor).eval()
    with torch.no_grad():
        layer.experts.b1.normal_(0, 0.1)
        layer.experts.b2.normal_(0, 0.1)
    x = torch.randn(24, 8, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(layer(x), naive_moe(layer, x), rtol=1e-5, atol=1e-6)
    assert layer(x.view(3, 8, 8)).shape == (3, 8, 8)


def test_gradients_reach_router_and_every_used_expert():
    layer = moe_layer(experts=4, hidden=8, moe_aux_loss_coeff=0.0).train()
    layer(torch.randn(32, 8)).square().sum().backward()
    assert layer.router.weight.grad.abs().sum() > 0
    used = collect_expert_load(torch.nn.Sequential(layer))["0"] > 0
    for grad in (layer.experts.w1.grad, layer.experts.w2.grad, layer.experts.b1.grad, layer.experts.b2.grad):
        assert (grad.flatten(1).abs().sum(-1) > 0).tolist() == used.tolist()


def test_router_loss_gradient_is_injected_and_scaled():
    layer = moe_layer(experts=4, hidden=8, moe_aux_loss_coeff=0.1, moe_z_loss_coeff=0.01).train()
    x = torch.randn(32, 8, generator=torch.Generator().manual_seed(2))
    logits = x @ layer.router.weight.t()
    counts = F.one_hot(logits.topk(1).indices, 4).sum((0, 1))
    reference = 0.1 * load_balancing_loss(logits.softmax(-1), counts) + 0.01 * router_z_loss(logits)
    (expected,) = torch.autograd.grad(reference, layer.router.weight)
    # Zero gradient from the output: the router's gradient is the injected loss's alone.
    (layer(x) * 0).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, expected)
    layer.zero_grad()
    set_aux_loss_scale(layer, 0.25)
    (layer(x) * 0).sum().backward()
    torch.testing.assert_close(layer.router.weight.grad, 0.25 * expected)
    assert layer.experts.w1.grad.abs().sum() == 0


def test_jitter_only_in_training():
    layer = moe_layer(moe_jitter_eps=0.5)
    x = torch.randn(6, 4)
    plain = F.linear(x, layer.router.weight)
    torch.testing.assert_close(layer.eval().router_logits(x), plain)
    torch.manual_seed(3)
    assert not torch.allclose(layer.train().router_logits(x), plain)


def test_tracker_counts_each_forward_once_under_activation_checkpointing():
    config = ModelConfig(
        num_layers=2,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=32,
        num_experts=(4, 4),
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    model = build_model(config, seed=1).train()
    ids = torch.randint(0, 32, (2, 8))

    def step(use_checkpoint: bool) -> None:
        hidden = model.embedding(ids)
        for layer in model.layers.values():
            hidden = checkpoint(layer, hidden, use_reentrant=False) if use_checkpoint else layer(hidden)
        hidden.sum().backward()

    torch.manual_seed(0)
    step(use_checkpoint=False)
    plain_loss, plain_load = collect_aux_losses(model), collect_expert_load(model)
    torch.manual_seed(0)
    step(use_checkpoint=True)
    step(use_checkpoint=True)
    ckpt_loss, ckpt_load = collect_aux_losses(model), collect_expert_load(model)
    torch.testing.assert_close(ckpt_loss, plain_loss)
    assert sorted(ckpt_load) == ["layers.0.mlp", "layers.1.mlp"]
    for name, load in plain_load.items():
        assert int(load.sum()) == 16 and int(ckpt_load[name].sum()) == 32
    assert collect_aux_losses(model) is None and collect_expert_load(model) == {}
    model.eval()
    model(ids)
    assert collect_aux_losses(model) is None


class HostReads(TorchDispatchMode):
    """Records the aten ops that bring a value to the host (on a GPU: a synchronisation) or whose output size
    depends on values (likewise a read): what routing and dispatch must not do in the hot path."""

    READS = ("_local_scalar_dense", "item", "nonzero", "masked_select", "unique", "_unique", "_unique2",
             "unique_consecutive", "bincount", "histc", "equal", "is_nonzero")

    def __init__(self) -> None:
        super().__init__()
        self.reads: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        name = func.overloadpacket.__name__
        # repeat_interleave with a tensor of repeats sums them on the host unless given output_size
        if name in self.READS or (name == "repeat_interleave" and isinstance(args[0], torch.Tensor)
                                  and args[0].dtype in (torch.int32, torch.int64)
                                  and (kwargs or {}).get("output_size") is None and len(args) < 3):
            self.reads.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("overrides", [
    dict(moe_token_dropping=False, moe_router_topk=2, swiglu=True, add_bias_linear=False,
         moe_shared_expert_intermediate_size=8, moe_shared_expert_gate=True, moe_router_pre_softmax=True),
    dict(moe_token_dropping=False, moe_router_topk=2),  # the grouped path with biases (each row's expert found)
    dict(moe_router_topk=2, moe_capacity_factor=0.5),  # capacity buffers, dropping
    dict(moe_token_dropping=False, moe_router_topk=2, moe_router_score_function="sigmoid",
         moe_router_enable_expert_bias=True, moe_router_num_groups=2, moe_router_group_topk=1,
         moe_router_topk_scaling_factor=2.0, moe_aux_loss_type="seq_aux_loss", moe_z_loss_coeff=0.01),
])
def test_routing_dispatch_and_combine_read_nothing_to_the_host(overrides):
    """Forward and backward of a training MoE layer issue no op that reads a tensor's value on the host (no .item(),
    no nonzero, no bincount, no value-sized output): on a GPU each would stall the step on the device. The CPU
    grouped_mm kernel reads its offsets inside the kernel (on CPU, no device to wait for; CUDA's bf16 kernel does
    not read them), which this mode does not see: it sees what rapidtrain's Python asks for."""
    layer = moe_layer(experts=4, hidden=8, **overrides).train()
    x = torch.randn(2, 6, 8, requires_grad=True)
    with HostReads() as mode:
        layer(x).square().sum().backward()
    assert x.grad is not None and layer.router.weight.grad is not None
    assert mode.reads == []


def test_padded_bf16_grouped_path_reads_nothing_to_the_host():
    """The bf16 CPU path pads each expert's rows to a bucketed size without reading the counts: static buffer."""
    layer = moe_layer(experts=4, hidden=16, moe_token_dropping=False, moe_router_topk=2, swiglu=True).train()
    x = torch.randn(2, 6, 16, requires_grad=True)
    with HostReads() as mode, torch.autocast("cpu", dtype=torch.bfloat16):
        out = layer(x)
    with HostReads() as backward_mode:
        out.float().square().sum().backward()
    assert x.grad is not None and layer.experts.w1.grad is not None
    assert mode.reads == [] and backward_mode.reads == []


def test_bucketed_counts_bound_the_shapes_and_the_padding():
    """Few distinct group sizes whatever the counts (oneDNN compiles a kernel per shape), each at least the count,
    and the padded total within the static buffer `padded_rows` sizes."""
    counts = torch.arange(0, 20_000)
    padded = bucketed_counts(counts)
    assert (padded >= counts).all() and padded[0] == 0 and padded[1] == 32 and padded[32] == 32
    assert (padded - counts <= torch.clamp(counts // 8, min=32)).all()
    assert len(padded.unique()) <= 110  # 625 multiples of 32 up to 20,000
    generator = torch.Generator().manual_seed(0)
    for experts, assignments in ((4, 48), (16, 4096), (64, 32768)):
        draw = torch.multinomial(torch.rand(experts, generator=generator) ** 4, assignments, replacement=True,
                                 generator=generator)
        routed = torch.zeros(experts, dtype=torch.int64).scatter_add_(0, draw, torch.ones_like(draw))
        assert bucketed_counts(routed).sum() <= padded_rows(assignments, experts)


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("swiglu", [False, True])
def test_padded_groups_compute_the_unpadded_numbers_bitwise(monkeypatch, bias, swiglu):
    """Under bf16 autocast on a CPU the grouped path pads each expert's rows (zero rows, weight 0, never read
    back; the static buffer's tail is not computed): the output and every gradient are bitwise those of the
    unpadded rows."""
    results = []
    for pads in (True, False):
        monkeypatch.setattr(moe, "pads_expert_groups", lambda device, dtype, pads=pads: pads)
        layer = moe_layer(experts=4, hidden=32, moe_token_dropping=False, moe_router_topk=2, swiglu=swiglu,
                          add_bias_linear=bias).train()
        with torch.no_grad():
            for name, param in layer.named_parameters():
                if name.startswith("experts.b"):
                    param.normal_(0, 0.3)
        x = torch.randn(2, 24, 32, generator=torch.Generator().manual_seed(4), requires_grad=True)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = layer(x)
        out.float().square().sum().backward()
        results.append((out, x.grad, {name: p.grad for name, p in layer.named_parameters()}))
    (padded, padded_x, padded_grads), (plain, plain_x, plain_grads) = results
    assert padded.dtype == torch.bfloat16 and torch.equal(padded, plain)
    assert torch.equal(padded_x, plain_x)
    assert padded_grads.keys() == plain_grads.keys()
    for name, grad in padded_grads.items():
        assert torch.isfinite(grad).all() and torch.equal(grad, plain_grads[name]), name


def test_host_read_detector_sees_item_and_nonzero():
    with HostReads() as mode:
        t = torch.arange(4.0)
        t.sum().item()
        t.nonzero()
        torch.repeat_interleave(torch.tensor([1, 2]))
    assert len(mode.reads) == 3, mode.reads


@pytest.mark.parametrize("swiglu", [False, True])
def test_grouped_dropless_path_equals_capacity_buffers_with_biases(swiglu):
    """The grouped path (assignments sorted by expert, combine weights applied to the down projection's input, its
    bias weighted apart) computes what the [E, C = T, h] buffers compute, forward and every gradient."""
    grouped = moe_layer(experts=4, hidden=8, moe_token_dropping=False, moe_router_topk=2, swiglu=swiglu).train()
    buffers = moe_layer(experts=4, hidden=8, moe_token_dropping=False, moe_router_topk=2, swiglu=swiglu).train()
    with torch.no_grad():
        for name, param in grouped.named_parameters():
            if name.startswith("experts.b"):
                param.normal_(0, 0.3)
    buffers.load_state_dict(grouped.state_dict())
    buffers.experts.takes_grouped_rows = False  # this instance only
    x = torch.randn(2, 6, 8, generator=torch.Generator().manual_seed(4))
    outputs = []
    for layer in (grouped, buffers):
        out = layer(x)
        out.square().sum().backward()
        outputs.append(out.detach())
    torch.testing.assert_close(outputs[0], outputs[1])
    for (name, ours), theirs in zip(grouped.named_parameters(), buffers.parameters(), strict=True):
        torch.testing.assert_close(ours.grad, theirs.grad, msg=name)
