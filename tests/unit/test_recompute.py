"""Recompute granularities (Megatron's full and selective, torchtitan's op level): the activation bytes a forward
pass keeps for backward shrink in that order, and losses and gradients stay those of no recompute."""

from __future__ import annotations

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RecomputeSettings, RunContext
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.parallel.recompute import SelectiveRecompute, count_saved_activations
from tests.unit.test_training_step import trainer_for

CONFIG = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                     vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
MODES = {"none": [], "selective": ["--recompute-granularity", "selective"],
         "op": ["--recompute-granularity", "op"], "full": ["--recompute-granularity", "full"]}


def forward_backward(model: torch.nn.Module, tokens: torch.Tensor) -> tuple[float, dict, int, int]:
    """Loss, gradients by parameter name, bytes kept alive for backward, and bytes autograd's saved-tensor hooks
    saw outside checkpointed regions (parameters excluded from both)."""
    params = {StorageWeakRef(p.untyped_storage()) for p in model.parameters()}
    hooked: dict = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        ref = StorageWeakRef(t.untyped_storage())
        if ref not in params:
            hooked.setdefault(ref, t.untyped_storage().nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), \
            count_saved_activations(model.parameters()) as kept:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    return loss.item(), grads, kept["bytes"], sum(hooked.values())


def test_saved_activation_bytes_shrink_from_none_to_selective_to_op_to_full_with_equal_gradients():
    tokens = torch.randint(0, 128, (4, 33), generator=torch.Generator().manual_seed(0))
    results = {}
    for mode, flags in MODES.items():
        trainer = trainer_for(["--num-layers", "4"] + flags, build_model(CONFIG, seed=3))
        assert trainer.engine.plan.switches.recompute.granularity == mode
        results[mode] = forward_backward(trainer.model, tokens)
    kept = {mode: r[2] for mode, r in results.items()}
    assert kept["none"] > kept["selective"] > kept["op"] > kept["full"] > 0, kept
    assert kept["full"] < 0.25 * kept["none"]
    # Without recompute, everything kept is what autograd saved (plus the loss itself, 4 bytes per element).
    none_hooked = results["none"][3]
    assert none_hooked <= kept["none"] <= none_hooked + 64
    # Inside checkpointed regions the outer hooks see nothing: full and op-level recompute look alike to them,
    # which is why the bytes kept are counted from the storages still alive.
    assert results["full"][3] == results["op"][3] < none_hooked
    loss, grads = results["none"][0], results["none"][1]
    for mode in ("selective", "op", "full"):
        assert results[mode][0] == pytest.approx(loss, rel=1e-6)
        for name, grad in results[mode][1].items():
            torch.testing.assert_close(grad, grads[name], rtol=1e-5, atol=1e-6)


def test_op_level_recompute_with_dropout_gives_the_same_gradients():
    """Random ops' outputs are kept, so recomputing the ops after them cannot draw another dropout mask."""
    config = ModelConfig(**{**CONFIG.__dict__, "hidden_dropout": 0.1, "attention_dropout": 0.1})
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(1))
    results = []
    for flags in ([], MODES["op"], MODES["selective"]):
        trainer = trainer_for(["--num-layers", "4"] + flags, build_model(config, seed=3))
        torch.manual_seed(5)
        results.append(forward_backward(trainer.model, tokens))
    for loss, grads, _, _ in results[1:]:
        assert loss == pytest.approx(results[0][0], rel=1e-6)
        for name, grad in grads.items():
            torch.testing.assert_close(grad, results[0][1][name], rtol=1e-5, atol=1e-6)


def test_block_method_recomputes_only_the_first_layers():
    trainer = trainer_for(["--num-layers", "4", "--recompute-granularity", "selective"], build_model(CONFIG, seed=3))
    assert all(isinstance(layer, SelectiveRecompute) for layer in trainer.model.layers.values())
    trainer = trainer_for(["--num-layers", "4", "--recompute-granularity", "op", "--recompute-method", "block",
                           "--recompute-num-layers", "3"], build_model(CONFIG, seed=3))
    wrapped = [type(layer).__name__ for layer in trainer.model.layers.values()]
    assert wrapped == ["CheckpointWrapper"] * 3 + ["TransformerLayer"]


def plan_for(flags: list[str]):
    args = parse_args(["--num-layers", "4", "--train-iters", "10", "--lr", "1e-3"] + flags)
    rules.validate(args, RunContext())
    return from_args(args, RunContext())


@pytest.mark.parametrize("flags, expected", [
    (["--checkpoint-activations"], RecomputeSettings("full")),
    (["--recompute-activations"], RecomputeSettings("selective")),
    (["--recompute-granularity", "full", "--recompute-method", "uniform"], RecomputeSettings("full")),
    (["--activations-checkpoint-method", "block", "--checkpoint-num-layers", "2"],
     RecomputeSettings("full", "block", 2)),
    (["--recompute-granularity", "op", "--recompute-method", "block", "--recompute-num-layers", "1"],
     RecomputeSettings("op", "block", 1)),
])
def test_megatron_recompute_flags_resolve_in_the_plan(flags, expected):
    plan = plan_for(flags)
    assert plan.switches.recompute == expected
    assert plan.switches.activation_checkpointing
    described = describe_plan(plan)
    assert expected.describe() in described or "torch.utils.checkpoint per transformer layer" in described


@pytest.mark.parametrize("flags, words", [
    (["--recompute-activations", "--recompute-granularity", "full"], "different recompute granularities"),
    (["--recompute-granularity", "selective", "--recompute-method", "uniform"], "do not apply to it"),
    (["--recompute-granularity", "full", "--recompute-num-layers", "2"], "units of one layer"),
    (["--recompute-granularity", "full", "--recompute-method", "block", "--recompute-num-layers", "5"],
     "holds 4 layers"),
    (["--recompute-granularity", "selective", "--attention-backend", "unfused"], "nothing to recompute"),
])
def test_recompute_flags_that_cannot_hold_are_refused(flags, words):
    with pytest.raises(rules.FlagConflict) as refused:
        plan_for(flags)
    assert words in str(refused.value)


@pytest.mark.parametrize("flags", [["--recompute-method", "block"], ["--recompute-num-layers", "2"]])
def test_recompute_layer_choice_without_recompute_plans_and_says_it_does_nothing(flags):
    """Megatron reads --recompute-method / --recompute-num-layers only under full recompute, and its functional
    tests (gpt3_mcore_reruns_resume_check_grads) pass --recompute-num-layers alone: the plan runs no recompute and
    says so, instead of stopping."""
    plan = plan_for(flags)
    assert not plan.switches.recompute.enabled
    assert "--recompute-method / --recompute-num-layers: no effect here" in describe_plan(plan)


# DeepSeek-V3's kind of layer pair: MLA with a query bottleneck, a dense first layer, then routed and shared experts
MOE_MLA = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                      vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0, swiglu=True,
                      multi_latent_attention=True, q_lora_rank=16, kv_lora_rank=16, qk_head_dim=16,
                      qk_pos_emb_head_dim=8, v_head_dim=16, num_experts=(0, 4), moe_ffn_hidden_size=32,
                      moe_router_topk=2, moe_shared_expert_intermediate_size=32, normalization="RMSNorm",
                      position_embedding_type="rope")


@pytest.mark.parametrize("modules", [("layernorm",), ("mlp",), ("moe",), ("shared_experts",),
                                     ("moe_act",), ("core_attn", "moe_act", "layernorm", "mla_up_proj")])
def test_each_recompute_module_keeps_less_for_backward_with_equal_gradients(modules):
    """Megatron-Core's --recompute-modules in the built-in model: each part recomputed keeps fewer bytes for
    backward than no recompute, and the loss and every gradient are those of no recompute."""
    from rapidtrain.parallel.recompute import apply_recompute

    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(2))
    plain = forward_backward(build_model(MOE_MLA, seed=4), tokens)
    model = build_model(MOE_MLA, seed=4)
    assert apply_recompute(model, list(model.layers.values()), RecomputeSettings("selective", modules=modules)) > 0
    loss, grads, kept, _ = forward_backward(model, tokens)
    assert kept < plain[2], (modules, kept, plain[2])
    assert loss == pytest.approx(plain[0], rel=1e-6)
    assert sorted(grads) == sorted(plain[1])
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_recompute_modules_resolve_say_what_runs_and_refuse_what_the_model_lacks():
    """--recompute-modules chooses what selective recompute covers (Megatron-Core's default: core_attn); without
    selective recompute it changes nothing and the plan says so; a part the model does not have is refused."""
    plan = plan_for(["--recompute-granularity", "selective", "--recompute-modules", "layernorm", "mlp"])
    assert plan.switches.recompute.modules == ("layernorm", "mlp")
    assert plan.switches.recompute.counted_granularity == "none"  # the attention core's tensors stay kept
    assert "the two norms (before attention and before the MLP), the dense MLP" in describe_plan(plan)
    assert plan_for(["--recompute-activations"]).switches.recompute.modules == ("core_attn",)
    assert "--recompute-modules: no effect here" in describe_plan(plan_for(["--recompute-modules", "mlp"]))
    mla = ["--multi-latent-attention", "--q-lora-rank", "16", "--kv-lora-rank", "16", "--position-embedding-type",
           "rope", "--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj", "core_attn"]
    assert "--recompute-modules mla_up_proj: no effect here" in describe_plan(plan_for(mla))
    with pytest.raises(rules.FlagConflict, match="no multi-latent attention"):
        plan_for(["--recompute-granularity", "selective", "--recompute-modules", "mla_up_proj"])


def test_a_recomputed_moe_layer_is_not_wrapped_twice():
    """--moe-layer-recompute beside --recompute-modules moe: the second asks for what the first did."""
    from rapidtrain.parallel.recompute import apply_moe_recompute

    model = build_model(MOE_MLA, seed=4)
    assert apply_moe_recompute(model) == 1 and apply_moe_recompute(model) == 0
