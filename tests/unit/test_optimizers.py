"""Optimizers by name: Megatron's weight-decay groups, LAMB's arithmetic by hand, what serves each name."""

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from rapidtrain.optim.lamb import LAMB
from rapidtrain.optim.optimizers import (
    ADAFACTOR_LR_MEANING,
    OPTIMIZER_NAMES,
    OptimizerSettings,
    apex_optimizer_class,
    build_optimizer,
    describe_optimizer,
    param_groups,
)


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embedding = nn.Embedding(10, 4)
        self.norm = nn.LayerNorm(4)
        self.proj = nn.Linear(4, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.head = nn.Linear(4, 10, bias=False)
        self.head.weight = self.embedding.weight  # tied: must appear once

    def forward(self, tokens):
        return self.head(self.proj(self.norm(self.embedding(tokens))))


def test_biases_and_norms_get_no_weight_decay():
    model = TinyModel()
    groups = param_groups(model, weight_decay=0.1)
    assert [group["weight_decay"] for group in groups] == [0.1, 0.0]
    assert [id(p) for p in groups[0]["params"]] == [id(model.embedding.weight), id(model.proj.weight)]
    assert [id(p) for p in groups[1]["params"]] == [
        id(model.norm.weight),
        id(model.norm.bias),
        id(model.proj.bias),
    ]


def test_a_model_without_trainable_parameters_is_refused():
    model = nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, OptimizerSettings(name="adamw"), "cpu")


def lamb_step(weights, grads, weight_decay, **options):
    """One LAMB step on 1-D float32 parameters, one parameter per group."""
    params = [nn.Parameter(torch.tensor(w, dtype=torch.float32)) for w in weights]
    for param, grad in zip(params, grads, strict=True):
        param.grad = torch.tensor(grad, dtype=torch.float32)
    groups = [{"params": [p], "weight_decay": weight_decay} for p in params]
    LAMB(groups, **options).step()
    return [p.detach().tolist() for p in params]


def test_lamb_first_step_matches_hand_computation():
    # w = (3, 4), ‖w‖ = 5; g = (0.3, -0.4), ‖g‖ = 0.5 < 1, so no clipping.
    # Step 1 with bias correction: m̂ = g, v̂ = g², so the Adam direction is g / (|g| + eps).
    # u = (0.3/0.300001 + 0.1·3, -0.4/0.400001 + 0.1·4) = (1.2999967, -0.5999975)
    # ‖u‖ = 1.4317780; trust ratio 5 / 1.4317780 = 3.4921614; w ← w − 0.01 · 3.4921614 · u
    [new] = lamb_step([[3.0, 4.0]], [[0.3, -0.4]], weight_decay=0.1, lr=0.01, eps=1e-6)
    u = (0.3 / 0.300001 + 0.3, -0.4 / 0.400001 + 0.4)
    ratio = 5.0 / math.hypot(*u)
    assert ratio == pytest.approx(3.4921614, rel=1e-7)
    assert new == pytest.approx([3.0 - 0.01 * ratio * u[0], 4.0 - 0.01 * ratio * u[1]], abs=1e-6)
    assert new == pytest.approx([2.9546020, 4.0209529], abs=1e-6)


def test_lamb_clips_by_the_global_norm_over_all_groups():
    # Gradients 3 and -4 in two groups: global norm 5 > 1, so each is divided by 5 → 0.6, -0.8.
    # eps = 1 makes the step size depend on that: 0.6 / 1.6 = 0.375 and -0.8 / 1.8 = -0.4444.
    # Without weight decay the trust ratio is 1 (apex without nvlamb): w ← w − 0.1 · u.
    new = lamb_step([[3.0], [4.0]], [[3.0], [-4.0]], weight_decay=0.0, lr=0.1, eps=1.0)
    assert [w for [w] in new] == pytest.approx([3.0 - 0.0375, 4.0 + 0.1 * 0.8 / 1.8], abs=1e-6)
    unclipped = lamb_step([[3.0]], [[3.0]], weight_decay=0.0, lr=0.1, eps=1.0, max_grad_norm=None)
    assert unclipped[0] == pytest.approx([3.0 - 0.1 * 3.0 / 4.0], abs=1e-7)


def test_lamb_trust_ratio_zero_convention_and_nvlamb():
    # A zero parameter has ‖w‖ = 0: the ratio is taken as 1, the step is lr · u with u ≈ sign(g).
    [new] = lamb_step([[0.0, 0.0]], [[0.5, -0.5]], weight_decay=0.1, lr=0.01, eps=1e-6)
    assert new == pytest.approx([-0.01 * 0.5 / 0.500001, 0.01 * 0.5 / 0.500001], abs=1e-7)
    # nvlamb applies the ratio without weight decay too: ‖w‖ = 5, u = (1, 1)·(0.5/0.500001).
    [new] = lamb_step([[3.0, 4.0]], [[0.5, 0.5]], weight_decay=0.0, lr=0.01, eps=1e-6, use_nvlamb=True)
    ratio = 5.0 / math.hypot(0.5 / 0.500001, 0.5 / 0.500001)
    assert new == pytest.approx([3.0 - 0.01 * ratio * 0.5 / 0.500001, 4.0 - 0.01 * ratio * 0.5 / 0.500001])


def test_lamb_second_step_uses_bias_correction_and_l2_mode():
    param = nn.Parameter(torch.tensor([2.0]))
    optimizer = LAMB([param], lr=0.1, eps=0.0, weight_decay=0.0, max_grad_norm=None)
    for grad in (0.5, -0.25):
        param.grad = torch.tensor([grad])
        optimizer.step()
    # Step 2: m = 0.9·0.05 + 0.1·(−0.25) = 0.02, v = 0.999·0.00025 + 0.001·0.0625 = 0.00031225;
    # m̂ = 0.02 / 0.19, v̂ = 0.00031225 / 0.001999; without decay the ratio is 1.
    m_hat, v_hat = 0.02 / 0.19, 0.00031225 / (1 - 0.999**2)
    assert param.item() == pytest.approx(2.0 - 0.1 - 0.1 * m_hat / math.sqrt(v_hat), abs=1e-6)

    # L2 mode folds the decay into the gradient: g' = 0.3 + 0.1·3 = 0.6 → u = 0.6/0.600001 ≈ 1,
    # and the ratio ‖w‖/‖u‖ = 3 / 0.9999983 since the group decays.
    [new] = lamb_step([[3.0]], [[0.3]], weight_decay=0.1, lr=0.01, eps=1e-6, adam_w_mode=False)
    u = 0.6 / 0.600001
    assert new == pytest.approx([3.0 - 0.01 * (3.0 / u) * u], abs=1e-6)


def test_lamb_resumes_from_a_saved_state_dict(tmp_path):
    torch.manual_seed(0)
    model, resumed_model = nn.Linear(3, 2), nn.Linear(3, 2)
    resumed_model.load_state_dict(model.state_dict())
    optimizer = LAMB(param_groups(model, 0.01), lr=0.1)
    inputs = torch.randn(4, 3)
    model(inputs).square().sum().backward()
    optimizer.step()
    resumed_model.load_state_dict(model.state_dict())
    resumed = LAMB(param_groups(resumed_model, 0.01), lr=0.1)
    torch.save(optimizer.state_dict(), tmp_path / "optimizer.pt")
    resumed.load_state_dict(torch.load(tmp_path / "optimizer.pt"))
    for net, opt in ((model, optimizer), (resumed_model, resumed)):
        net.zero_grad()
        net(inputs).square().sum().backward()
        opt.step()
    assert torch.equal(model.weight, resumed_model.weight)
    assert torch.equal(model.bias, resumed_model.bias)


def expected_resolution(name, device_type):
    apex_adam = apex_optimizer_class("FusedAdam") is not None
    apex_lamb = apex_optimizer_class("FusedLAMB") is not None
    speed = "fused=True" if device_type in ("cuda", "cpu") else "foreach=True"
    why = "apex not installed"
    bitsandbytes = "(block-wise 8-bit moments; tensors under 4096 elements keep fp32 state)"
    return {
        "apex_adam": "apex FusedAdam"
        if apex_adam and device_type == "cuda"
        else f"torch.optim.AdamW({speed}) ({why if not apex_adam else 'apex FusedAdam needs CUDA'})",
        "apex_lamb": "apex FusedLAMB"
        if apex_lamb and device_type == "cuda"
        else "rapidtrain LAMB with apex FusedLAMB's update rule "
        f"({why if not apex_lamb else 'apex FusedLAMB needs CUDA'})",
        "adamw": f"torch.optim.AdamW({speed})",
        "adam": f"torch.optim.Adam({speed}) (L2 weight decay; adamw decouples it)",
        "adafactor": f"torch.optim.Adafactor(foreach=True){ADAFACTOR_LR_MEANING}",
        "sgd": "torch.optim.SGD(momentum=0.9, foreach=True)",
        "adamw_8bit": f"bitsandbytes AdamW8bit {bitsandbytes}",
        "paged_adamw_8bit": f"bitsandbytes PagedAdamW8bit {bitsandbytes}",
        "adamw_4bit": "torchao AdamW4bit (4-bit moments as tensor subclasses, each parameter's step compiled by "
        "torch.compile)",
        "muon": "torch.optim.Muon(momentum=0.9, nesterov=False, ns_steps=5, quintic Newton–Schulz in bfloat16; "
        "update × spectral scale × 1) for the transformer layers' 2-D weights and each MoE expert's matrix; "
        f"torch.optim.AdamW({speed}) for the embeddings, output head, norms and biases",
    }[name]


# Paging is CUDA unified memory: refused on CPU (test_low_bit_optimizers.py). Muon takes transformer layers'
# matrices, which TinyModel lacks (test_muon.py steps it on the built-in GPT).
RUNS_ON_CPU = [name for name in OPTIMIZER_NAMES if name not in ("paged_adamw_8bit", "muon")]


@pytest.mark.parametrize("name", RUNS_ON_CPU)
def test_each_optimizer_builds_and_steps_on_cpu(name):
    torch.manual_seed(0)
    model = TinyModel()
    settings = OptimizerSettings(name=name, lr=0.01, weight_decay=0.1)
    optimizer, resolution = build_optimizer(model, settings, "cpu")
    assert resolution == describe_optimizer(settings, "cpu") == expected_resolution(name, "cpu")
    assert [group["weight_decay"] for group in optimizer.param_groups] == [0.1, 0.0]
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    model(torch.tensor([[1, 2, 3]])).square().mean().backward()
    bias_grad = model.proj.bias.grad.clone()
    optimizer.step()
    for param_name, param in model.named_parameters():
        changed = not torch.equal(before[param_name], param.detach())
        assert changed == (not param_name.startswith("frozen")), param_name
    if name == "sgd":  # first SGD step, no decay on a bias: b ← b − lr · g
        assert torch.allclose(model.proj.bias, before["proj.bias"] - 0.01 * bias_grad)


def test_cuda_resolution_is_described_without_building():
    for name in OPTIMIZER_NAMES:
        assert describe_optimizer(OptimizerSettings(name=name), "cuda") == expected_resolution(name, "cuda")


def test_plain_parameter_lists_and_groups_are_accepted():
    weight = nn.Parameter(torch.ones(2, 2))
    optimizer, _ = build_optimizer([weight], OptimizerSettings(name="adamw", weight_decay=0.05), "cpu")
    assert optimizer.param_groups[0]["weight_decay"] == 0.05
    optimizer, _ = build_optimizer(
        [{"params": [weight], "lr_mult": 0.5}], OptimizerSettings(name="sgd"), "cpu"
    )
    assert optimizer.param_groups[0]["lr_mult"] == 0.5
    assert optimizer.param_groups[0]["weight_decay"] == 0.01


@pytest.mark.parametrize("broken_module", ["", "raise RuntimeError('not NVIDIA apex')\n"])
def test_an_unrelated_apex_package_falls_back_to_torch(tmp_path, monkeypatch, broken_module):
    # PyPI's `apex` is another project: it has no `apex.optimizers.FusedAdam`, or breaks on import.
    (tmp_path / "apex").mkdir()
    (tmp_path / "apex" / "__init__.py").write_text("")
    (tmp_path / "apex" / "optimizers.py").write_text(broken_module)
    (tmp_path / "amp_C.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    apex_optimizer_class.cache_clear()
    try:
        assert apex_optimizer_class("FusedAdam") is None
        resolution = describe_optimizer(OptimizerSettings(name="apex_adam"), "cuda")
        assert resolution == "torch.optim.AdamW(fused=True) (apex not installed)"
    finally:
        for module in ("apex", "apex.optimizers", "amp_C"):
            sys.modules.pop(module, None)
        apex_optimizer_class.cache_clear()


def test_importing_the_optimizers_does_not_import_apex():
    code = "import sys, rapidtrain.optim.optimizers; print('apex' in sys.modules, 'amp_C' in sys.modules)"
    repo_root = Path(__file__).resolve().parents[2]
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=repo_root
    )
    assert result.stdout.split() == ["False", "False"]


def test_stacked_expert_biases_get_no_weight_decay():
    from rapidtrain.models import build_model
    from rapidtrain.models.config import ModelConfig
    from rapidtrain.optim.optimizers import param_groups

    model = build_model(ModelConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64,
                                    num_experts=(4,)), seed=1)
    names = {id(p): n for n, p in model.named_parameters()}
    no_decay = {names[id(p)] for g in param_groups(model, 0.1) if g["weight_decay"] == 0.0 for p in g["params"]}
    assert {"layers.0.mlp.experts.b1", "layers.0.mlp.experts.b2"} <= no_decay
    assert "layers.0.mlp.experts.w1" not in no_decay
