"""--optimizer muon: which parameters Muon and AdamW take, a step equal to torch.optim.Muon + torch.optim.AdamW applied
by hand, Megatron's update scales, the state a checkpoint holds, and what is refused."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from rapidtrain.config import arguments
from rapidtrain.config.flag_surface import FlagRefused
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.optim.muon import muon_parameter_counts, muon_scale
from rapidtrain.optim.optimizers import STACKED_BIAS_SUFFIXES, OptimizerSettings, build_optimizer

# Dense layer 0, MoE layer 1 (4 experts): matrices of every kind, stacked expert weights, biases, norms, a tied head.
TINY = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64,
                   seq_length=16, max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0,
                   num_experts=(0, 4), swiglu=True)


EXPERT_WEIGHTS = {"layers.1.mlp.experts.w1", "layers.1.mlp.experts.w_gate", "layers.1.mlp.experts.w2"}


def tiny_model() -> torch.nn.Module:
    return build_model(TINY, seed=1)


def backward(model: torch.nn.Module, seed: int) -> None:
    tokens = torch.randint(0, TINY.vocab_size, (2, TINY.seq_length), generator=torch.Generator().manual_seed(seed))
    model(tokens).float().square().mean().backward()


def names_by_optimizer(model, optimizer) -> tuple[set[str], set[str]]:
    name_of = {id(p): name for name, p in model.named_parameters()}
    muon = {name_of[id(p)] for g in optimizer.param_groups if g["use_muon"] for p in g["params"]}
    adamw = {name_of[id(p)] for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]}
    return muon, adamw


def test_muon_takes_the_layers_matrices_and_adamw_the_rest():
    model = tiny_model()
    optimizer, description = build_optimizer(model, OptimizerSettings(name="muon", lr=0.01), "cpu")
    muon, adamw = names_by_optimizer(model, optimizer)
    projections = {f"layers.{i}.attention.{p}_proj.weight" for i in (0, 1) for p in "qkvo"}
    assert muon == projections | {"layers.0.mlp.fc1.weight", "layers.0.mlp.gate.weight", "layers.0.mlp.fc2.weight",
                                  "layers.1.mlp.router.weight"} | EXPERT_WEIGHTS
    assert {"embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "final_norm.weight",
            "layers.0.ln1.weight", "layers.0.attention.q_proj.bias", "layers.1.mlp.experts.b1"} <= adamw
    assert muon | adamw == {name for name, _ in model.named_parameters()} and not muon & adamw
    assert type(optimizer.muon).__name__ == "Muon" and type(optimizer.adamw).__name__ == "AdamW"
    assert "torch.optim.Muon" in description and "torch.optim.AdamW(fused=True)" in description
    # The plan's counts, from the settings alone, are the built model's.
    params = dict(model.named_parameters())
    assert muon_parameter_counts(TINY) == ((len(muon), sum(params[n].numel() for n in muon)),
                                           (len(adamw), sum(params[n].numel() for n in adamw)))


class ByHand:
    """torch.optim.Muon over the layers' matrices and over each expert's matrix as an [out, in] parameter of its own
    (Megatron-Core's one weight per expert), fused torch.optim.AdamW over the rest (no decay for 1-D parameters,
    biases and the experts' stacked biases), built directly."""

    def __init__(self, model, lr, weight_decay, momentum, nesterov, adjust_lr_fn="original"):
        names = {"layers.0.mlp.fc1.weight", "layers.0.mlp.gate.weight", "layers.0.mlp.fc2.weight",
                 "layers.1.mlp.router.weight"} | {f"layers.{i}.attention.{p}_proj.weight" for i in (0, 1)
                                                  for p in "qkvo"}
        params = dict(model.named_parameters())
        self.stacked = [params[name] for name in sorted(EXPERT_WEIGHTS)]
        self.experts = [[torch.nn.Parameter(w.detach()[e].T.clone()) for e in range(w.shape[0])] for w in self.stacked]
        muon = [params[n] for n in names] + [p for expert in self.experts for p in expert]
        rest = {n: p for n, p in params.items() if n not in names | EXPERT_WEIGHTS}
        no_decay = [p for n, p in rest.items() if p.ndim == 1 or n.endswith(("bias", *STACKED_BIAS_SUFFIXES))]
        decay = [p for p in rest.values() if not any(p is q for q in no_decay)]
        self.optimizers = (
            torch.optim.Muon(muon, lr=lr, weight_decay=weight_decay, momentum=momentum, nesterov=nesterov,
                             adjust_lr_fn=adjust_lr_fn),
            torch.optim.AdamW([{"params": decay, "weight_decay": weight_decay},
                               {"params": no_decay, "weight_decay": 0.0}], lr=lr, betas=(0.9, 0.95), eps=1e-8,
                              fused=True))

    def step(self):
        for weight, experts in zip(self.stacked, self.experts, strict=True):
            for e, expert in enumerate(experts):
                expert.grad = weight.grad[e].T.clone()
        for optimizer in self.optimizers:
            optimizer.step()
        with torch.no_grad():
            for weight, experts in zip(self.stacked, self.experts, strict=True):
                weight.copy_(torch.stack([expert.T for expert in experts]))


def set_rates(optimizer, lr):
    for group in optimizer.param_groups:  # what the schedule does
        group["lr"] = lr * group.get("lr_mult", 1.0)


@pytest.mark.parametrize("nesterov", [False, True])
def test_steps_equal_torch_muon_and_adamw_by_hand(nesterov):
    """Keller Jordan's scale (shape_scaling) is torch's `original` on [out, in] weights: three steps equal the
    hand-built optimizers' bitwise; each expert's matrix, stored [in, out], too up to the rounding of its rescaled
    rate and decay."""
    ours_model, hand_model = tiny_model(), tiny_model()
    settings = OptimizerSettings(name="muon", lr=0.02, weight_decay=0.1, adam_beta2=0.95, muon_momentum=0.9,
                                 muon_nesterov=nesterov, muon_scale_mode="shape_scaling")
    ours, _ = build_optimizer(ours_model, settings, "cpu")
    hand = ByHand(hand_model, 0.02, 0.1, 0.9, nesterov)
    initial = {name: p.detach().clone() for name, p in ours_model.named_parameters()}
    for step in range(3):
        for model in (ours_model, hand_model):
            model.zero_grad()
            backward(model, seed=step)
        set_rates(ours, 0.02)
        ours.step()
        hand.step()
    for (name, a), b in zip(ours_model.named_parameters(), hand_model.parameters(), strict=True):
        if name in EXPERT_WEIGHTS:
            assert (a - initial[name]).abs().amin(dim=(1, 2)).gt(0).all(), name  # every expert stepped
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)
        else:
            assert torch.equal(a, b), name


def test_spectral_scale_times_0_2_is_torchs_match_rms_adamw():
    """Megatron's spectral scale sqrt(max(rows, cols)) with --muon-extra-scale-factor 0.2 is Moonshot's adjustment
    (torch's match_rms_adamw); the decay stays lr × weight decay (equal within rounding of the rescaled decay)."""
    ours_model, hand_model = tiny_model(), tiny_model()
    settings = OptimizerSettings(name="muon", lr=0.01, weight_decay=0.1, adam_beta2=0.95, muon_momentum=0.95,
                                 muon_scale_mode="spectral", muon_extra_scale_factor=0.2)
    ours, _ = build_optimizer(ours_model, settings, "cpu")
    hand = ByHand(hand_model, 0.01, 0.1, 0.95, False, adjust_lr_fn="match_rms_adamw")
    for step in range(2):
        for model in (ours_model, hand_model):
            model.zero_grad()
            backward(model, seed=step)
        set_rates(ours, 0.01)
        ours.step()
        hand.step()
    for (name, a), b in zip(ours_model.named_parameters(), hand_model.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7, msg=name)


def test_megatron_scale_modes():
    assert muon_scale(128, 64, "spectral") == math.sqrt(128) == muon_scale(64, 128, "spectral")
    assert muon_scale(128, 64, "shape_scaling") == math.sqrt(2) and muon_scale(64, 128, "shape_scaling") == 1.0
    assert muon_scale(128, 64, "unit_rms_norm") == math.sqrt(2) and muon_scale(64, 128, "unit_rms_norm") == \
        math.sqrt(0.5)


def test_state_dict_holds_both_optimizers_state_and_resumes_exactly():
    model = tiny_model()
    settings = OptimizerSettings(name="muon", lr=0.02, weight_decay=0.1)
    optimizer, _ = build_optimizer(model, settings, "cpu")
    for step in range(2):
        model.zero_grad()
        backward(model, seed=step)
        set_rates(optimizer, 0.02)
        optimizer.step()
    saved = copy.deepcopy(optimizer.state_dict())
    kinds = {frozenset(state) for state in saved["state"].values()}
    assert kinds == {frozenset({"momentum_buffer"}), frozenset({"step", "exp_avg", "exp_avg_sq"})}
    resumed_model = copy.deepcopy(model)
    resumed, _ = build_optimizer(resumed_model, settings, "cpu")
    resumed.load_state_dict(saved)
    assert resumed.muon.state is resumed.state and resumed.adamw.state is resumed.state
    inner_groups = resumed.muon.param_groups + resumed.adamw.param_groups
    assert all(any(g is h for h in resumed.param_groups) for g in inner_groups)  # the loaded groups, not stale ones
    assert "lr_mult" not in resumed.param_groups[0]  # the log line's rate (groups[0]) is the schedule's
    for net, opt in ((model, optimizer), (resumed_model, resumed)):
        net.zero_grad()
        backward(net, seed=7)
        set_rates(opt, 0.02)
        opt.step()
    for a, b in zip(model.parameters(), resumed_model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_model_without_layer_matrices_and_untagged_groups_are_refused():
    with pytest.raises(ValueError, match="no parameter is a 2-D weight of a transformer layer"):
        build_optimizer(torch.nn.Linear(4, 4), OptimizerSettings(name="muon"), "cpu")
    with pytest.raises(ValueError, match="do not say which parameters Muon steps"):
        build_optimizer([torch.nn.Parameter(torch.ones(2, 2))], OptimizerSettings(name="muon"), "cpu")


def test_megatron_muon_flags_work_or_are_refused_by_name():
    args = arguments.parse_args(["--optimizer", "dist_muon", "--muon-momentum", "0.95", "--muon-nesterov",
                                 "--muon-num-ns-steps", "4", "--muon-scale-mode", "unit_rms_norm",
                                 "--muon-extra-scale-factor", "0.5", "--muon-fp32-matmul-prec", "medium",
                                 "--muon-tp-mode", "duplicated", "--muon-scalar-optimizer", "adam"])
    from rapidtrain.config.resolve import optimizer_settings

    settings = optimizer_settings(args)
    assert (settings.name, settings.muon_momentum, settings.muon_nesterov, settings.muon_ns_steps,
            settings.muon_scale_mode, settings.muon_extra_scale_factor) == ("muon", 0.95, True, 4, "unit_rms_norm", 0.5)
    for refused, reason in ((["--muon-use-syrk"], "SYRK"), (["--muon-fp32-matmul-prec", "high"], "bfloat16"),
                            (["--muon-no-split-qkv"], "separate matrices"),
                            (["--muon-coefficient-type", "polar_express"], "quintic"),
                            (["--muon-scalar-optimizer", "lion"], "Lion"), (["--muon-tp-mode", "blockwise"],
                                                                            "duplicated"),
                            (["--optimizer", "adaptive_muon"], "not in rapidtrain")):
        with pytest.raises(FlagRefused, match=reason):
            arguments.parse_args(["--optimizer", "muon", *refused])


def test_help_lists_only_optimizers_that_run():
    help_text = arguments.build_parser().format_help()
    listed = help_text.split("--optimizer {")[1].split("}")[0].split(",")
    assert "muon" in listed and "dist_muon" in listed
    assert not {"lion", "soap", "adaptive_muon"} & set(listed)


def test_plan_names_muon_and_adamw_parameter_sets():
    from rapidtrain.config import rules
    from rapidtrain.config.describe import describe_plan
    from rapidtrain.config.plan import from_args
    from rapidtrain.config.settings import RunContext

    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--ffn-hidden-size", "64",
             "--seq-length", "16", "--max-position-embeddings", "16", "--num-experts", "0", "4", "--swiglu",
             "--train-iters", "4", "--lr", "1e-3", "--optimizer", "muon"]
    args = arguments.parse_args(flags)
    rules.validate(args, RunContext())
    plan = from_args(args, RunContext())
    (muon_tensors, muon_elements), (adamw_tensors, adamw_elements) = muon_parameter_counts(plan.model)
    text = describe_plan(plan)
    assert "torch.optim.Muon(momentum=0.9" in text
    assert (f"Muon {muon_tensors} tensors ({muon_elements:,} elements), AdamW {adamw_tensors} tensors "
            f"({adamw_elements:,} elements)") in text
    model = build_model(plan.model, seed=1)
    assert muon_tensors + adamw_tensors == len(list(model.parameters()))
    assert muon_tensors == 15  # 8 projections, dense fc1/gate/fc2, the router, 3 stacked expert weights


def test_memory_estimate_counts_muons_momentum_and_adamws_moments():
    """The plan's optimizer state per parameter is what the built optimizer holds after a step."""
    from rapidtrain.config.memory import optimizer_state_bytes_per_parameter
    from rapidtrain.optim.state_bytes import measured_state_bytes

    model = tiny_model()
    settings = OptimizerSettings(name="muon", lr=0.01)
    optimizer, _ = build_optimizer(model, settings, "cpu")
    backward(model, seed=0)
    optimizer.step()
    parameters = sum(p.numel() for p in model.parameters())
    assert optimizer_state_bytes_per_parameter(TINY, settings, "cpu") * parameters == measured_state_bytes(optimizer)


@pytest.mark.parametrize("config", [
    TINY,
    # DeepSeek-style: latent attention, a shared expert, two multi-token prediction depths (each a layer and an
    # [h, 2h] projection, Muon's too), attention sinks, an untied head.
    ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=64, seq_length=16,
                max_position_embeddings=16, num_experts=(0, 4), swiglu=True, mtp_num_layers=2,
                multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=8, moe_shared_expert_intermediate_size=32,
                softmax_type="learnable", position_embedding_type="rope", tie_embeddings=False),
], ids=["gpt_moe", "deepseek_style"])
def test_plan_counts_are_the_built_models_split(config):
    model = build_model(config, seed=1)
    optimizer, _ = build_optimizer(model, OptimizerSettings(name="muon"), "cpu")
    muon = [p for g in optimizer.param_groups if g["use_muon"] for p in g["params"]]
    adamw = [p for g in optimizer.param_groups if not g["use_muon"] for p in g["params"]]
    assert muon_parameter_counts(config) == ((len(muon), sum(p.numel() for p in muon)),
                                             (len(adamw), sum(p.numel() for p in adamw)))
    name_of = {id(p): name for name, p in model.named_parameters()}
    assert {name_of[id(p)] for p in adamw if p.ndim >= 2} <= {
        "embedding.word_embeddings.weight", "embedding.position_embeddings.weight", "output.weight"} | {
        name_of[id(p)] for p in adamw if name_of[id(p)].endswith(STACKED_BIAS_SUFFIXES)}
