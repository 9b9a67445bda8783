"""Multi-head latent attention (--multi-latent-attention) and YaRN rope scaling (--rope-type yarn): YaRN's
frequencies and attention factor against transformers' own (ROPE_INIT_FUNCTIONS["yarn"], the oracle), MLA's
decoding through the KV cache, its flags, rules and plan words. DeepSeek's Hugging Face folders both ways are in
test_hf_weights.py."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.config import arguments, plan, rules, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.resolve import model_config_from_args
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.mla import MultiLatentAttention, mla_softmax_scale_factor
from rapidtrain.models.rope import inverse_frequency, rope_attention_factor
from rapidtrain.models.transformer import KVCache, StaticKVCache
from tests.launch import spawn_ranks

SMALL = dict(num_layers=2, hidden_size=64, num_attention_heads=4, vocab_size=128, seq_length=16,
             max_position_embeddings=16, hidden_dropout=0.0, attention_dropout=0.0, normalization="RMSNorm",
             swiglu=True, add_bias_linear=False, position_embedding_type="rope", ffn_hidden_size=96)
MLA = dict(multi_latent_attention=True, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
           v_head_dim=12, qk_layernorm=True)
YARN = dict(rope_scaling="yarn", rope_scaling_factor=40.0, rope_original_max_positions=4096, yarn_mscale=1.0,
            yarn_mscale_all_dim=1.0)


def hf_yarn(dim: int, base: float, parameters: dict) -> tuple[torch.Tensor, float]:
    """transformers' YaRN inverse frequencies and attention factor for a head of `dim` rotated dimensions."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = LlamaConfig(hidden_size=dim * 4, num_attention_heads=4, head_dim=dim, max_position_embeddings=8192,
                         rope_parameters={"rope_type": "yarn", "rope_theta": base, **parameters})
    return ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")


@pytest.mark.parametrize("dim, base, factor, fast, slow, original, truncate, mscale, mscale_all_dim", [
    (64, 10000.0, 40.0, 32.0, 1.0, 4096, True, 1.0, 1.0),  # DeepSeek-V3's rotary part
    (128, 1000000.0, 4.0, 32.0, 1.0, 32768, True, None, None),  # Qwen's YaRN: attention factor from the factor
    (32, 10000.0, 8.0, 16.0, 2.0, 2048, False, 0.707, 0.707),  # fractional ramp ends, DeepSeek-V2's mscales
    (16, 500000.0, 16.0, 64.0, 0.5, 1024, True, 1.0, 0.8),  # an attention factor other than 1
    (64, 10000.0, 1.0, 32.0, 1.0, 4096, True, 1.0, 1.0),  # factor 1: plain rope
])
def test_yarn_frequencies_and_attention_factor_match_transformers(dim, base, factor, fast, slow, original, truncate,
                                                                 mscale, mscale_all_dim):
    parameters = {"factor": factor, "beta_fast": fast, "beta_slow": slow, "original_max_position_embeddings": original,
                  "truncate": truncate}
    if mscale is not None:
        parameters |= {"mscale": mscale, "mscale_all_dim": mscale_all_dim}
    expected_frequency, expected_factor = hf_yarn(dim, base, parameters)
    config = ModelConfig(**SMALL, kv_channels=dim, rotary_base=base, rope_scaling="yarn", rope_scaling_factor=factor,
                         rope_original_max_positions=original, yarn_beta_fast=fast, yarn_beta_slow=slow,
                         yarn_round_range=truncate, yarn_mscale=1.0 if mscale is None else mscale,
                         yarn_mscale_all_dim=0.0 if mscale_all_dim is None else mscale_all_dim)
    torch.testing.assert_close(inverse_frequency(config), expected_frequency, rtol=1e-6, atol=0)
    assert rope_attention_factor(config) == pytest.approx(expected_factor, rel=1e-12)
    if factor > 1:  # the scaling reaches the slow pairs
        assert (inverse_frequency(config)[-1] / inverse_frequency(ModelConfig(**SMALL, kv_channels=dim,
                                                                              rotary_base=base))[-1]) < 0.5


def test_yarn_scales_cos_and_sin_in_the_model_and_mla_scales_the_softmax():
    """cos/sin × attention factor changes a plain GPT's logits; MLA's softmax takes mscale(40, 1)² = 1.3689²."""
    plain = build_model(ModelConfig(**SMALL), seed=3).eval()
    scaled_config = ModelConfig(**SMALL, **YARN | {"yarn_mscale_all_dim": 0.5})
    assert rope_attention_factor(scaled_config) != 1
    scaled = build_model(scaled_config, seed=3).eval()
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (plain(ids) - scaled(ids)).abs().max() > 1e-3
    mla = ModelConfig(**SMALL, **MLA, **YARN)
    assert mla_softmax_scale_factor(mla) == pytest.approx((0.1 * torch.log(torch.tensor(40.0)).item() + 1) ** 2)
    assert mla_softmax_scale_factor(ModelConfig(**SMALL, **MLA)) == 1


@pytest.mark.parametrize("shape", [MLA, MLA | {"q_lora_rank": None, "qk_layernorm": False}, MLA | YARN],
                         ids=["q-lora", "plain-q", "yarn"])
def test_mla_decoding_through_the_kv_cache_gives_the_full_forward_logits(shape):
    model = build_model(ModelConfig(**SMALL, **shape), seed=5).eval()
    assert isinstance(model.layers["0"].attention, MultiLatentAttention)
    ids = torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model(ids)
        cache = KVCache()
        steps = [model(ids[:, :5], kv_cache=cache), model(ids[:, 5:6], kv_cache=cache),
                 model(ids[:, 6:], kv_cache=cache)]
        torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
        # The static cache keeps keys (8 + 4 per head) and values (12) in buffers of their own sizes.
        static = StaticKVCache(12)
        prompt = model(ids[:, :5], kv_cache=static)
        assert static.keys["0"].shape[-1] == 12 and static.values["0"].shape[-1] == 12
        assert static.values["0"].shape[-2] == 12
    torch.testing.assert_close(prompt, full[:, :5], rtol=1e-5, atol=1e-5)


def test_mla_trains_its_parameters():
    """Every MLA parameter gets a gradient (the shared rotary key reaches kv_down_proj through both of its parts)."""
    model = build_model(ModelConfig(**SMALL, **MLA), seed=2)
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    model(ids[:, :-1], labels=ids[:, 1:]).mean().backward()
    attention = model.layers["1"].attention
    for name, param in attention.named_parameters():
        assert param.grad is not None and param.grad.abs().sum() > 0, name
    # o_proj writes into the residual stream: Megatron's scaled init std / sqrt(2 L) applies to MLA's too.
    std = attention.o_proj.weight.std().item()
    assert std == pytest.approx(0.02 / 2, rel=0.1)


FLAGS = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
         "--disable-bias-linear", "--qk-layernorm", "--num-layers", "2", "--hidden-size", "64", "--kv-lora-rank", "16",
         "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--seq-length", "16",
         "--train-iters", "1", "--lr", "0.1"]


def test_flags_build_mla_with_pai_spellings_and_megatron_yarn_default():
    args = arguments.parse_args([*FLAGS, "--qk-nope-head-dim", "8", "--q-lora-rank", "24",
                                 "--rotary-scaling-factor", "40", "--mscale-all-dim", "1"])
    rules.validate(args, settings.RunContext(1, "cpu"))
    config = model_config_from_args(args, 128)
    assert (config.multi_latent_attention, config.q_lora_rank, config.kv_lora_rank) == (True, 24, 16)
    assert (config.qk_head_dim, config.qk_pos_emb_head_dim, config.v_head_dim) == (8, 4, 12)
    # Megatron-Core's MLA uses YaRN unless --rope-type says otherwise; its original context defaults to 4096.
    assert config.rope_scaling == "yarn" and config.rope_scaling_factor == 40
    assert config.rope_original_max_positions == 4096 and config.yarn_mscale_all_dim == 1
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert "built-in GPT (DeepSeek-family)" in described
    assert "multi-head latent attention (queries through rank 24, keys/values from a rank 16 latent" in described
    assert "YaRN rope ×40 (original 4096" in described and "softmax scale ×1.874" in described
    plain = model_config_from_args(arguments.parse_args([*FLAGS, "--rope-type", "rope",
                                                         "--rotary-scaling-factor", "40"]), 128)
    assert plain.rope_scaling == "none"


def test_yarn_flags_work_for_a_llama_model_too():
    args = arguments.parse_args(["--position-embedding-type", "rope", "--rope-type", "yarn",
                                 "--rotary-scaling-factor", "4", "--yarn-beta-fast", "16", "--yarn-beta-slow", "2",
                                 "--yarn-original-max-position-embeddings", "64",
                                 "--no-yarn-correction-range-round-to-int"])
    config = model_config_from_args(args, 128)
    assert (config.rope_scaling, config.rope_scaling_factor, config.rope_original_max_positions) == ("yarn", 4, 64)
    assert (config.yarn_beta_fast, config.yarn_beta_slow, config.yarn_round_range) == (16, 2, False)


@pytest.mark.parametrize("extra, says", [
    (["--position-embedding-type", "alibi"], "--multi-latent-attention rotates"),
    (["--group-query-attention", "--num-query-groups", "2"], "drop --group-query-attention"),
    (["--qk-pos-emb-head-dim", "5"], "--qk-pos-emb-head-dim 5: rope rotates pairs"),
    (["--kv-lora-rank", "0"], "--kv-lora-rank 0: give at least 1"),
    (["--yarn-beta-fast", "1", "--yarn-beta-slow", "2"], "beta-slow below beta-fast"),
])
def test_rules_refuse_what_mla_and_yarn_cannot_be(extra, says):
    args = arguments.parse_args([*FLAGS, *extra])
    with pytest.raises(rules.FlagConflict, match=says):
        rules.validate(args, settings.RunContext(1, "cpu"))


def test_yarn_with_llama_rope_scaling_is_refused_but_mla_ignores_the_llama_scaling_as_megatron_core():
    """Standard attention takes one rope scaling; MLA builds its own rotary embedding (YaRN's here), and
    Megatron-Core's --use-rope-scaling only reaches the standard one, so DeepSeek-V3 scripts that pass it plan."""
    llama = arguments.parse_args(["--position-embedding-type", "rope", "--rope-type", "yarn", "--use-rope-scaling"])
    with pytest.raises(rules.FlagConflict, match="drop --use-rope-scaling"):
        rules.validate(llama, settings.RunContext(1, "cpu"))
    mla = arguments.parse_args([*FLAGS, "--rope-type", "yarn", "--use-rope-scaling"])
    assert rules.violations(mla, settings.RunContext(1, "cpu")) == [] and not mla.use_rope_scaling
    assert any(note.startswith("--use-rope-scaling: no effect with --multi-latent-attention")
               for note in mla.compat_notes)


def test_mla_under_tensor_parallelism_passes_the_rules():
    args = arguments.parse_args([*FLAGS, "--tensor-model-parallel-size", "2"])
    assert rules.violations(args, settings.RunContext(2, "cpu")) == []


def test_mla_and_yarn_values_without_their_switch_are_said_to_do_nothing():
    args = arguments.parse_args(["--kv-lora-rank", "16", "--mscale", "2"])
    notes = "\n".join(plan.from_args(args, settings.RunContext(1, "cpu")).notes)
    assert "--kv-lora-rank: no effect without --multi-latent-attention" in notes
    assert "--mscale: no effect without YaRN" in notes


def _tensor_parallel_worker(rank: int, store: str) -> None:
    """Both ranks: MLA with a query bottleneck (and YaRN, sequence parallelism) and with a plain q_proj, split over
    2 ranks, against the whole model: logits, loss and every parameter's gradient."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from rapidtrain.models.gpt import GPTModel
    from rapidtrain.models.transformer import init_weights
    from rapidtrain.parallel.tensor_parallel import apply_tensor_parallel

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        for shape, sequence_parallel in ((MLA | YARN, True), (MLA | {"q_lora_rank": None}, False)):
            config = ModelConfig(**SMALL, **shape)
            whole = build_model(config, seed=8)
            with torch.device("meta"):
                model = GPTModel(config)
            apply_tensor_parallel(model, mesh, sequence_parallel=sequence_parallel)
            model.to_empty(device="cpu")
            init_weights(model, 8)
            up = model.layers["0"].attention.kv_up_proj.weight
            assert isinstance(up, DTensor) and up.to_local().shape[0] == up.shape[0] // 2  # 2 of 4 heads per rank
            ids = torch.randint(0, 128, (2, 17), generator=torch.Generator().manual_seed(4))
            loss = model(ids[:, :-1], labels=ids[:, 1:]).sum()
            expected = whole(ids[:, :-1], labels=ids[:, 1:]).sum()
            torch.testing.assert_close(loss, expected, rtol=1e-5, atol=1e-5)
            loss.backward()
            expected.backward()
            grads = dict(whole.named_parameters())
            for name, param in model.named_parameters():
                grad = param.grad.full_tensor() if isinstance(param.grad, DTensor) else param.grad
                torch.testing.assert_close(grad, grads[name].grad, rtol=1e-4, atol=1e-6, msg=name)
    finally:
        dist.destroy_process_group()


def test_tensor_parallel_mla_matches_one_process_loss_and_gradients(tmp_path):
    """TP 2 (one launch, two models): heads split in q_up/q_proj and kv_up, o_proj by rows, the latents whole; the
    shared rotary key's gradient summed over the ranks, so kv_down_proj's gradient equals one process's."""
    spawn_ranks(_tensor_parallel_worker, str(tmp_path / "store"))


@pytest.mark.parametrize("q_lora_rank", [24, None])
def test_the_activation_model_counts_what_mla_saves_for_backward(q_lora_rank):
    """The memory estimate's per-token attention widths (config/activations.py) against the bytes MLA's forward
    really saves for backward (fp32, the layer input and the weights excluded): within 10%."""
    from rapidtrain.config.activations import _attention_widths
    from rapidtrain.models.rope import rotary_cos_sin

    config = ModelConfig(**SMALL, **MLA | {"q_lora_rank": q_lora_rank})
    attention = MultiLatentAttention(config, causal=True)
    weights = {p.untyped_storage().data_ptr() for p in attention.parameters()}
    x = torch.randn(2, 16, 64, requires_grad=True)
    rope = rotary_cos_sin(torch.arange(16)[None], inverse_frequency(config))
    saved: dict[int, int] = {}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights | {x.untyped_storage().data_ptr()}:
            saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        attention(x, None, rope)
    measured = sum(saved.values()) / 4 / 32  # fp32 elements per token
    split, whole = _attention_widths(config)
    assert measured == pytest.approx(split + whole, rel=0.1)
    plain_split, _ = _attention_widths(ModelConfig(**SMALL))
    assert plain_split == 4 * 64  # Q, K, V and the output of hidden size each, as before


def test_a_trained_mla_checkpoint_exports_to_deepseek_with_the_same_logits(tmp_path, demo_data):
    """Two iterations of pretraining with MLA and YaRN (rapidtrain/pretrain.py, one process), then
    scripts/convert_checkpoint.py --hf: DeepseekV3ForCausalLM loads the folder and gives the checkpoint's logits."""
    import importlib.util
    import json

    from safetensors.torch import load_file
    from transformers import DeepseekV3ForCausalLM

    from rapidtrain.pretrain import main
    from tests.launch import REPO, TINY_GPT_SHAPE

    shape = ["--multi-latent-attention", "--position-embedding-type", "rope", "--normalization", "RMSNorm",
             "--norm-epsilon", "1e-6", "--swiglu", "--disable-bias-linear", "--qk-layernorm",
             "--untie-embeddings-and-output-weights", "--q-lora-rank", "24", "--kv-lora-rank", "16", "--qk-head-dim",
             "8", "--qk-pos-emb-head-dim", "4", "--v-head-dim", "12", "--rope-type", "yarn",
             "--rotary-scaling-factor", "4", "--mscale-all-dim", "1", "--yarn-original-max-position-embeddings", "16"]
    main([*TINY_GPT_SHAPE, *shape, "--micro-batch-size", "2", "--global-batch-size", "2", "--num-workers", "0",
          "--eval-iters", "0", "--lr", "1e-3", "--train-iters", "2", "--save", str(tmp_path / "ck")])
    spec = importlib.util.spec_from_file_location("convert_checkpoint", REPO / "scripts" / "convert_checkpoint.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    assert script.main(["--load", str(tmp_path / "ck"), "--output", str(tmp_path / "out"), "--hf"]) == 0
    saved = json.loads((tmp_path / "out" / "rapidtrain_config.json").read_text())
    config = ModelConfig(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    assert config.multi_latent_attention and config.rope_scaling == "yarn"
    ours = build_model(config, seed=None)
    ours.load_state_dict(load_file(tmp_path / "out" / "model.safetensors"))
    theirs = DeepseekV3ForCausalLM.from_pretrained(tmp_path / "out" / "hf", attn_implementation="eager")
    ids = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        difference = (ours.eval()(ids) - theirs.eval()(ids).logits).abs().max()
    assert difference < 1e-4


def test_megatrons_yarn_position_embedding_type_is_rope_with_yarn():
    args = arguments.parse_args(["--position-embedding-type", "yarn", "--rotary-scaling-factor", "8"])
    assert (args.position_embedding_type, args.rope_type) == ("rope", "yarn")
    config = model_config_from_args(args, 128)
    assert config.rope_scaling == "yarn" and config.rope_scaling_factor == 8
    from rapidtrain.config.flag_surface import FlagRefused

    with pytest.raises(FlagRefused, match="ask for different rotary embeddings"):
        arguments.parse_args(["--position-embedding-type", "yarn", "--rope-type", "rope"])


@pytest.mark.parametrize("v_head_dim", [16, 8])
def test_flash_and_cudnn_kernels_get_equal_head_sizes_and_the_same_logits(v_head_dim):
    """SDPA's flash kernel refuses q/k of 12 dimensions with values of 16 ("No available kernel"): MLA pads the
    smaller side for the pinned kernels, and the logits are those of the other kernels."""
    ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    logits = {}
    for kernel in ("sdpa", "sdpa_flash", "eager"):
        config = ModelConfig(**SMALL, **MLA | {"v_head_dim": v_head_dim}, attention_kernel=kernel)
        with torch.no_grad():
            logits[kernel] = build_model(config, seed=1).eval()(ids)
    torch.testing.assert_close(logits["sdpa_flash"], logits["sdpa"], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logits["eager"], logits["sdpa"], rtol=1e-5, atol=1e-5)


def test_mla_with_learned_positions_rotates_its_own_part_as_megatron():
    """Megatron-Core's MLA always rotates its --qk-pos-emb-head-dim part (its own rotary embedding), and a GPT with
    the default --position-embedding-type learned_absolute adds the learned table too (Megatron's MLA test script
    passes no position type): both act, and the export to DeepSeek (no learned table) is refused."""
    from rapidtrain.models.hf_config import UnsupportedModel
    from rapidtrain.models.hf_weights import export_family

    args = arguments.parse_args([*[f for f in FLAGS if f not in ("--position-embedding-type", "rope")],
                                 "--position-embedding-type", "learned_absolute"])
    rules.validate(args, settings.RunContext(1, "cpu"))
    config = model_config_from_args(args, 128)
    model = build_model(config, seed=1).eval()
    assert model.embedding.position_embeddings is not None
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    import dataclasses

    other_base = build_model(dataclasses.replace(config, rotary_base=7.0), seed=1).eval()
    other_base.load_state_dict(model.state_dict())
    with torch.no_grad():
        plain = model(ids)
        model.embedding.position_embeddings.weight.zero_()
        unlearned = model(ids)
    assert (plain - unlearned).abs().max() > 1e-4  # the learned table acts
    with torch.no_grad():  # and the rotation does: another rotary base, the same weights, other logits
        assert (other_base(ids) - plain).abs().max() > 1e-4
    with pytest.raises(UnsupportedModel, match="--position-embedding-type rope"):
        export_family(config)
