"""Hugging Face weights both ways: tiny models built with from_config and save_pretrained here start the
built-in model through the flags (--task pretraining --pretrained-model-name-or-path DIR), give the same
logits (fp32, within 1e-5) and the same training step; built-in models exported with save_hf_folder load
in transformers with the same logits."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rapidtrain.config import arguments, plan, resolve, rules, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.models import build_model
from rapidtrain.models.hf_config import UnsupportedModel
from rapidtrain.models.hf_weights import WeightsReader, export_family, hf_state_dict, save_hf_folder

TOLERANCE = 1e-5
SHAPE = dict(vocab_size=256, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
             max_position_embeddings=64)
LLAMA = SHAPE | dict(num_key_value_heads=2, tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=50000.0)
# Llama 3.1's rope scaling; with theta 50000 and 16-dimension heads the slowest pairs' wavelengths pass 8192 / 1, the
# middle ones are blended, so the scaling changes the logits.
LLAMA31_ROPE = {"rope_type": "llama3", "rope_theta": 50000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


# DeepSeek with dense layers only (first_k_dense_replace = layers): MLA with a query bottleneck or a plain q_proj.
DEEPSEEK = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=12, first_k_dense_replace=2, max_position_embeddings=64)
# YaRN over an original context of 16 (so 16-token inputs reach the stretched pairs); equal mscales leave cos/sin
# alone and scale the softmax by mscale(4, 1)²; unequal ones scale cos/sin too.
DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 16,
                 "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}
DEEPSEEK_V2_YARN = DEEPSEEK_YARN | {"mscale": 0.707, "mscale_all_dim": 0.5, "truncate": False}
DEEPSEEK_MOE = dict(first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=16,
                    n_shared_experts=1)


LLAMA_YARN = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 16}


def hf_configs():
    import transformers as t

    return {
        "gpt2": (t.GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4, n_positions=64, n_inner=96),
                 t.GPT2LMHeadModel),
        "llama": (t.LlamaConfig(**LLAMA), t.LlamaForCausalLM),
        "mistral": (t.MistralConfig(**LLAMA, sliding_window=6), t.MistralForCausalLM),  # 6 < the 16 tokens
        # 6 heads: ALiBi's slopes beyond a power of two (the interleaved extension).
        "bloom": (t.BloomConfig(vocab_size=256, hidden_size=96, n_layer=2, n_head=6), t.BloomForCausalLM),
        "qwen2": (t.Qwen2Config(**LLAMA | {"tie_word_embeddings": True}), t.Qwen2ForCausalLM),
        # Qwen3: q/k norms, and a head size (32) apart from hidden / heads (16)
        "qwen3": (t.Qwen3Config(**LLAMA | {"head_dim": 32}), t.Qwen3ForCausalLM),
        "llama3.1": (t.LlamaConfig(**LLAMA | {"rope_parameters": LLAMA31_ROPE}), t.LlamaForCausalLM),
        # YaRN on a Llama (Qwen's long-context recipe): cos/sin × mscale(4) = 1.1386, the softmax scale as plain
        "llama-yarn": (t.LlamaConfig(**LLAMA | {"rope_parameters": LLAMA_YARN}), t.LlamaForCausalLM),
        "mixtral": (t.MixtralConfig(**LLAMA, num_local_experts=4, num_experts_per_tok=2), t.MixtralForCausalLM),
        # Qwen-MoE: routed experts of their own size, a dense first layer (mlp_only_layers), Qwen2-MoE's gated
        # shared expert and q/k/v biases, probabilities kept as they are (norm_topk_prob off) or renormalised
        "qwen2_moe": (t.Qwen2MoeConfig(**LLAMA, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=40,
                                       shared_expert_intermediate_size=48, mlp_only_layers=[0]),
                      t.Qwen2MoeForCausalLM),
        "qwen3_moe": (t.Qwen3MoeConfig(**LLAMA | {"head_dim": 32}, num_experts=6, num_experts_per_tok=2,
                                       moe_intermediate_size=40, norm_topk_prob=True), t.Qwen3MoeForCausalLM),
        "deepseek_v3": (t.DeepseekV3Config(**DEEPSEEK), t.DeepseekV3ForCausalLM),
        "deepseek_v3-plain-q": (t.DeepseekV3Config(**DEEPSEEK | {"q_lora_rank": None}), t.DeepseekV3ForCausalLM),
        "deepseek_v3-yarn": (t.DeepseekV3Config(**DEEPSEEK, rope_parameters=DEEPSEEK_YARN), t.DeepseekV3ForCausalLM),
        "deepseek_v3-halves": (t.DeepseekV3Config(**DEEPSEEK, rope_interleave=False), t.DeepseekV3ForCausalLM),
        "deepseek_v2": (t.DeepseekV2Config(**DEEPSEEK | {"q_lora_rank": None}), t.DeepseekV2ForCausalLM),
        "deepseek_v2-yarn": (t.DeepseekV2Config(**DEEPSEEK, rope_parameters=DEEPSEEK_V2_YARN),
                             t.DeepseekV2ForCausalLM),
        # DeepSeek's MoE: a dense first layer; V3's sigmoid router with its score-correction bias (perturbed by
        # save_tiny), groups and routed scaling, a shared expert; V2's softmax kept as it is, two shared experts
        "deepseek_v3-moe": (t.DeepseekV3Config(**DEEPSEEK | DEEPSEEK_MOE, n_group=4, topk_group=2,
                                               routed_scaling_factor=2.5, norm_topk_prob=True),
                            t.DeepseekV3ForCausalLM),
        "deepseek_v2-moe": (t.DeepseekV2Config(**DEEPSEEK | DEEPSEEK_MOE | {"n_shared_experts": 2, "q_lora_rank": None},
                                               routed_scaling_factor=1.5, topk_method="greedy"),
                            t.DeepseekV2ForCausalLM),
        "bert": (t.BertConfig(**SHAPE), t.BertForPreTraining),
        "megatron-bert": (t.MegatronBertConfig(**SHAPE), t.MegatronBertForMaskedLM),
    }


def save_tiny(kind: str, folder: Path, **overrides) -> Path:
    config, model_class = hf_configs()[kind]
    for key, value in overrides.items():
        setattr(config, key, value)
    torch.manual_seed(0)
    model = model_class(config)
    with torch.no_grad():  # BERT's LayerNorms start at (1, 0); make every parameter matter
        for param in model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
        for name, buffer in model.named_buffers():  # DeepSeek-V3's expert bias (zeros when made) must matter too
            if name.endswith("e_score_correction_bias"):
                buffer.add_(torch.randn_like(buffer) * 0.05)
    model.save_pretrained(folder)
    return folder


def flags(folder: Path, *extra: str) -> list[str]:
    return ["--pretrained-model-name-or-path", str(folder), "--data-path", "unused", "--train-iters", "1",
            "--lr", "0.1", "--seq-length", "16", "--hidden-dropout", "0", "--attention-dropout", "0", *extra]


def builtin_from(folder: Path, *extra: str):
    """The built-in model the run's flags make: parsed, checked by the rules, resolved by the plan."""
    args = arguments.parse_args(flags(folder, *extra))
    rules.validate(args, settings.RunContext(1, "cpu"))
    vocab = resolve.builtin_vocab_size(args, None)
    config = resolve.model_config_from_args(args, vocab)
    return build_model(config, seed=1), args


def load_hf(folder: Path):
    import transformers

    config = transformers.AutoConfig.from_pretrained(folder)
    return getattr(transformers, config.architectures[0]).from_pretrained(folder, attn_implementation="eager")


def tokens(vocab: int = 256, length: int = 16) -> torch.Tensor:
    return torch.randint(0, vocab, (2, length), generator=torch.Generator().manual_seed(3))


def logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        if model.config.model_type == "bert":
            out = model(ids, attention_mask=torch.ones_like(ids), tokentype_ids=torch.zeros_like(ids))
            return out[0] if isinstance(out, tuple) else out
        return model(ids)


def hf_logits_of(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids, attention_mask=torch.ones_like(ids))
    return out.prediction_logits if hasattr(out, "prediction_logits") else out.logits


DEEPSEEK_KINDS = ["deepseek_v3", "deepseek_v3-plain-q", "deepseek_v3-yarn", "deepseek_v3-halves", "deepseek_v2",
                  "deepseek_v2-yarn", "deepseek_v3-moe", "deepseek_v2-moe"]
FAMILIES = ["gpt2", "bloom", "llama", "mistral", "qwen2", "qwen3", "llama3.1", "llama-yarn", "mixtral", "qwen2_moe",
            "qwen3_moe", "bert", "megatron-bert", *DEEPSEEK_KINDS]


@pytest.mark.parametrize("kind", FAMILIES)
def test_hugging_face_weights_give_the_builtin_model_the_same_logits(kind, tmp_path):
    folder = save_tiny(kind, tmp_path / kind)
    ours, args = builtin_from(folder)
    theirs = load_hf(folder).eval()
    ours.eval()
    ids = tokens()
    difference = (logits_of(ours, ids) - hf_logits_of(theirs, ids)).abs().max()
    assert difference < TOLERANCE, f"{kind}: {difference}"
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert f"initialised from Hugging Face weights in {folder}" in described


def test_bert_binary_head_and_tie_follow_the_config(tmp_path):
    folder = save_tiny("bert", tmp_path / "bert")
    ours, args = builtin_from(folder)
    assert args.bert_binary_head and args.post_layernorm and args.model_type == "bert"
    assert ours.lm_head.output.weight is ours.embedding.word_embeddings.weight
    theirs = load_hf(folder).eval()
    ids = tokens()
    with torch.no_grad():
        _, binary = ours.eval()(ids, attention_mask=torch.ones_like(ids), tokentype_ids=torch.zeros_like(ids))
        expected = theirs(ids, attention_mask=torch.ones_like(ids)).seq_relationship_logits
    assert (binary - expected).abs().max() < TOLERANCE


def test_bloom_and_mistral_folders_set_alibi_the_embedding_norm_and_the_window(tmp_path):
    args = arguments.parse_args(flags(save_tiny("bloom", tmp_path / "bloom")))
    assert args.position_embedding_type == "alibi" and args.embed_layernorm and args.openai_gelu
    assert (args.num_attention_heads, args.ffn_hidden_size, args.sliding_window) == (6, 384, None)
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert "model: built-in GPT (BLOOM-style) initialised from Hugging Face weights" in described
    args = arguments.parse_args(flags(save_tiny("mistral", tmp_path / "mistral")))
    assert args.sliding_window == 6
    assert "sliding-window attention over the last 6 keys" in describe_plan(
        plan.from_args(args, settings.RunContext(1, "cpu")))


def test_flags_not_given_come_from_the_config_and_the_plan_says_llama(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama")
    args = arguments.parse_args(flags(folder))
    assert (args.num_layers, args.hidden_size, args.num_attention_heads, args.ffn_hidden_size) == (2, 64, 4, 96)
    assert args.normalization == "RMSNorm" and args.swiglu and not args.add_bias_linear
    assert args.group_query_attention and args.num_query_groups == 2
    assert args.position_embedding_type == "rope" and args.rotary_base == 50000.0
    assert args.untie_embeddings_and_output_weights and args.layernorm_epsilon == 1e-6
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert f"model: built-in GPT (Llama-family) initialised from Hugging Face weights in {folder}" in described


def test_flags_that_contradict_the_config_are_refused_naming_both_values(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama")
    args = arguments.parse_args(flags(folder, "--num-layers", "3", "--normalization", "LayerNorm"))
    with pytest.raises(rules.FlagConflict) as refused:
        rules.validate(args, settings.RunContext(1, "cpu"))
    message = str(refused.value)
    assert "--num-layers 3 (config.json needs --num-layers 2)" in message
    assert "--normalization LayerNorm (config.json needs --normalization RMSNorm)" in message


def test_kv_channels_of_hidden_over_heads_agrees_with_a_config_without_head_dim(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama")  # hidden 64, 4 heads: head size 16
    args = arguments.parse_args(flags(folder, "--kv-channels", "16"))
    assert rules.violations(args, settings.RunContext(1, "cpu")) == []
    args = arguments.parse_args(flags(folder, "--kv-channels", "32"))
    assert any("--kv-channels 32 (config.json needs no --kv-channels)" in v
               for v in rules.violations(args, settings.RunContext(1, "cpu")))


def test_fine_tuning_tasks_keep_the_hugging_face_model(tmp_path):
    folder = save_tiny("llama", tmp_path / "llama")
    args = arguments.parse_args(["--pretrained-model-name-or-path", str(folder), "--task", "casual_lm",
                                 "--epochs", "1", "--lr", "1e-4"])
    assert args.num_layers == 4 and not args.swiglu  # nothing taken from the folder
    resolved = plan.from_args(args, settings.RunContext(1, "cpu"))
    assert resolved.template == "Finetuner (Hugging Face model)" and resolved.model is None


def test_a_user_script_decides_what_the_folder_is_for(tmp_path):
    """With --user-script (a white-box Finetuner, say) the folder stays a Hugging Face model for the script to load,
    even at the default --task pretraining: nothing is taken from it and nothing is refused."""
    folder = save_tiny("bert", tmp_path / "bert")
    args = arguments.parse_args(["--user-script", "my_finetuner.py", "--pretrained-model-name-or-path", str(folder),
                                 "--epochs", "1", "--lr", "1e-4"])
    assert not args.builtin_from_pretrained and args.model_type == "gpt" and args.tokenizer_type is None
    context = settings.RunContext(1, "cpu")
    assert "pretrained-shape-flags" not in {r.name for r in rules.RULES if r.violated(args, context)}
    assert plan.from_args(args, settings.RunContext(1, "cpu")).model is None


def test_padded_vocabulary_rows_start_at_zero(tmp_path):
    """A vocabulary of 250 pads to 256: the real rows give Hugging Face's logits, the padding logit 0."""
    folder = save_tiny("llama", tmp_path / "llama", vocab_size=250)
    ours, _ = builtin_from(folder)
    assert ours.config.vocab_size == 256
    ids = tokens(vocab=250)
    logits = logits_of(ours.eval(), ids)
    assert (logits[..., :250] - hf_logits_of(load_hf(folder).eval(), ids)).abs().max() < TOLERANCE
    assert logits[..., 250:].abs().max() == 0


def test_pytorch_bin_folders_load_without_running_code(tmp_path):
    """pytorch_model.bin goes through torch.load(weights_only=True): a pickle that would run code is refused."""
    folder = save_tiny("gpt2", tmp_path / "gpt2")
    from safetensors.torch import load_file

    state = load_file(folder / "model.safetensors")
    (folder / "model.safetensors").unlink()
    torch.save({f"transformer.{k}" if not k.startswith("transformer.") else k: v for k, v in state.items()},
               folder / "pytorch_model.bin")
    ours, _ = builtin_from(folder)
    ids = tokens()
    assert (logits_of(ours.eval(), ids) - hf_logits_of(load_hf(folder).eval(), ids)).abs().max() < TOLERANCE

    class Payload:
        def __reduce__(self):
            return (print, ("code ran",))

    torch.save({"transformer.wte.weight": Payload()}, folder / "pytorch_model.bin")
    with pytest.raises(Exception, match="Weights only load failed|weights_only"):
        WeightsReader(folder)


def one_sgd_step(model, loss: torch.Tensor) -> None:
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            if param.grad is not None:
                param.sub_(0.1 * param.grad)


@pytest.mark.parametrize("kind", ["gpt2", "llama"])
def test_one_training_step_equals_hugging_face(kind, tmp_path):
    """Same loss, and after one SGD step (lr 0.1) the same weights, in Hugging Face's names."""
    folder = save_tiny(kind, tmp_path / kind, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    ours, _ = builtin_from(folder)
    theirs = load_hf(folder)
    ours.train(), theirs.train()
    ids = tokens()
    our_loss = ours(ids[:, :-1], labels=ids[:, 1:]).mean()
    their_loss = theirs(ids, labels=ids).loss  # transformers shifts the labels itself
    assert abs(our_loss.item() - their_loss.item()) < TOLERANCE
    one_sgd_step(ours, our_loss)
    one_sgd_step(theirs, their_loss)
    updated = hf_state_dict(ours.state_dict(), ours.config, kind)
    expected = theirs.state_dict()
    worst = max(float((updated[name] - expected[name]).abs().max()) for name in updated)
    assert worst < TOLERANCE


@pytest.mark.parametrize("shape, kind", [
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, openai_gelu=True), "gpt2"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
          rotary_base=50000.0, tie_embeddings=False, layernorm_epsilon=1e-6), "llama"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, add_bias_linear=False, add_qkv_bias=True, position_embedding_type="rope"), "qwen2"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
          tie_embeddings=False, num_experts=(4, 4), moe_router_topk=2, moe_token_dropping=False), "mixtral"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
          qk_layernorm=True, kv_channels=24, rotary_base=1e6), "qwen3"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, add_bias_linear=False, position_embedding_type="rope", rotary_base=50000.0,
          rope_scaling="llama3", rope_scaling_factor=32.0), "llama"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, add_bias_linear=False, position_embedding_type="rope", rotary_interpolation_factor=4.0),
     "llama"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, add_bias_linear=False, position_embedding_type="rope", rope_scaling="yarn",
          rope_scaling_factor=4.0, rope_original_max_positions=16, yarn_beta_fast=8.0, yarn_mscale=0.5), "llama"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, normalization="RMSNorm", swiglu=True,
          add_bias_linear=False, position_embedding_type="rope", multi_latent_attention=True, qk_layernorm=True,
          layernorm_epsilon=1e-6, q_lora_rank=24, kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=4,
          v_head_dim=12, rope_scaling="yarn", rope_scaling_factor=4.0, rope_original_max_positions=16,
          yarn_mscale=0.707, yarn_mscale_all_dim=0.5), "deepseek_v3"),
    (dict(model_type="bert", num_layers=2, hidden_size=64, num_attention_heads=4, num_tokentypes=2,
          bert_binary_head=True), "megatron-bert"),
    (dict(model_type="bert", num_layers=2, hidden_size=64, num_attention_heads=4, num_tokentypes=2,
          post_layernorm=True), "bert"),
    (dict(num_layers=2, hidden_size=96, num_attention_heads=6, position_embedding_type="alibi",
          embed_layernorm=True, openai_gelu=True), "bloom"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
          sliding_window=5), "mistral"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, num_query_groups=2, add_bias_linear=False, add_qkv_bias=True, position_embedding_type="rope",
          tie_embeddings=False, num_experts=(0, 4), moe_router_topk=2, moe_token_dropping=False,
          moe_ffn_hidden_size=40, moe_shared_expert_intermediate_size=48, moe_shared_expert_gate=True,
          moe_router_pre_softmax=True), "qwen2_moe"),
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, num_query_groups=2, add_bias_linear=False, position_embedding_type="rope",
          qk_layernorm=True, num_experts=(4, 4), moe_router_topk=2, moe_token_dropping=False,
          moe_ffn_hidden_size=40), "qwen3_moe"),
    # DeepSeek-V3's MoE from a model rapidtrain built: sigmoid router, expert bias, groups, scaling, a shared expert,
    # and a multi-token prediction depth, which the export drops
    (dict(num_layers=2, hidden_size=64, num_attention_heads=4, ffn_hidden_size=96, normalization="RMSNorm",
          swiglu=True, add_bias_linear=False, position_embedding_type="rope", tie_embeddings=False,
          multi_latent_attention=True, qk_layernorm=True, layernorm_epsilon=1e-6, kv_lora_rank=16, qk_head_dim=16,
          qk_pos_emb_head_dim=8, v_head_dim=16, num_experts=(0, 8), moe_router_topk=3, moe_token_dropping=False,
          moe_ffn_hidden_size=32, moe_shared_expert_intermediate_size=32, moe_router_score_function="sigmoid",
          moe_router_enable_expert_bias=True, moe_router_num_groups=4, moe_router_group_topk=2,
          moe_router_topk_scaling_factor=2.5, mtp_num_layers=1), "deepseek_v3"),
], ids=["gpt2", "llama", "qwen2", "mixtral", "qwen3", "llama3.1", "linear-rope", "yarn-rope", "mla-yarn",
        "megatron-bert", "bert", "bloom", "mistral", "qwen2_moe", "qwen3_moe", "deepseek_v3-moe-mtp"])
def test_builtin_models_export_to_folders_transformers_loads_with_the_same_logits(shape, kind, tmp_path):
    from rapidtrain.models import ModelConfig

    config = ModelConfig(vocab_size=256, seq_length=16, max_position_embeddings=64, hidden_dropout=0.0,
                         attention_dropout=0.0, **shape)
    ours = build_model(config, seed=5).eval()
    with torch.no_grad():  # expert biases start at zero: give them values that change the choice
        for name, buffer in ours.named_buffers():
            if name.endswith("expert_bias"):
                buffer.copy_(torch.randn(buffer.shape, generator=torch.Generator().manual_seed(2)) * 0.1)
    assert export_family(config) == kind
    assert save_hf_folder(ours.state_dict(), config, tmp_path / "out") == kind
    theirs = load_hf(tmp_path / "out").eval()
    ids = tokens()
    assert (logits_of(ours, ids) - hf_logits_of(theirs, ids)).abs().max() < TOLERANCE


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe"])
def test_hugging_face_round_trip_keeps_every_tensor(kind, tmp_path):
    folder = save_tiny(kind, tmp_path / "in")
    ours, _ = builtin_from(folder)
    save_hf_folder(ours.state_dict(), ours.config, tmp_path / "out")
    source, again = WeightsReader(folder), WeightsReader(tmp_path / "out")
    assert set(source.location) == set(again.location)
    for name in source.location:
        assert torch.equal(source.get(name), again.get(name)), name


def test_export_refuses_models_without_a_hugging_face_twin():
    from rapidtrain.models import ModelConfig

    with pytest.raises(UnsupportedModel, match="learned absolute positions"):
        export_family(ModelConfig(position_embedding_type="rope"))
    with pytest.raises(UnsupportedModel, match="--rotary-percent 1.0"):
        export_family(ModelConfig(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                                  position_embedding_type="rope", rotary_percent=0.5))
    with pytest.raises(UnsupportedModel, match="alibi with --embed-layernorm"):
        export_family(ModelConfig(position_embedding_type="alibi", openai_gelu=True))
    with pytest.raises(UnsupportedModel, match="--openai-gelu"):
        export_family(ModelConfig(position_embedding_type="alibi", embed_layernorm=True))
    with pytest.raises(UnsupportedModel, match="no --sliding-window"):
        export_family(ModelConfig(sliding_window=8))
    with pytest.raises(UnsupportedModel, match="no --window-attn-skip-freq"):
        export_family(ModelConfig(normalization="RMSNorm", swiglu=True, add_bias_linear=False,
                                  position_embedding_type="rope", sliding_window=8, window_skip_freq=2))


def test_unsupported_configs_are_refused_and_checkpoint_folders_load(tmp_path):
    folder = save_tiny("llama", tmp_path / "scaled")
    import json

    config = json.loads((folder / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 500000.0, "factor": 8.0}
    (folder / "config.json").write_text(json.dumps(config))
    args = arguments.parse_args(flags(folder))
    with pytest.raises(rules.FlagConflict, match="rope scaling 'dynamic'"):
        rules.validate(args, settings.RunContext(1, "cpu"))
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    (checkpoint / "latest_checkpointed_iteration.txt").write_text("3\n")
    args = arguments.parse_args(flags(checkpoint))  # Rapidformer's meaning (issue 15): loaded as --load
    rules.validate(args, settings.RunContext(1, "cpu"))
    assert args.load == str(checkpoint) and not args.builtin_from_pretrained


def test_qwen3_and_llama31_configs_set_the_head_size_qk_norms_and_rope_scaling(tmp_path):
    qwen3 = arguments.parse_args(flags(save_tiny("qwen3", tmp_path / "qwen3")))
    assert qwen3.kv_channels == 32 and qwen3.qk_layernorm and not qwen3.use_rope_scaling
    llama = arguments.parse_args(flags(save_tiny("llama3.1", tmp_path / "llama")))
    assert llama.use_rope_scaling and llama.rope_scaling_factor == 8.0 and llama.kv_channels is None
    ours, _ = builtin_from(tmp_path / "llama")
    assert ours.config.rope_scaling == "llama3"


@pytest.mark.parametrize("kind", DEEPSEEK_KINDS)
def test_deepseek_folders_round_trip_to_the_same_tensors_and_logits(kind, tmp_path):
    """In through the flags, out through save_hf_folder (as DeepSeek-V3, rotary rows interleaved): every tensor the
    original holds comes back (reordered where the original kept halves), and transformers' logits agree."""
    folder = save_tiny(kind, tmp_path / "in")
    ours, args = builtin_from(folder)
    assert args.multi_latent_attention and args.qk_layernorm and args.kv_lora_rank == 16
    exported = "deepseek_v2" if kind == "deepseek_v2-moe" else "deepseek_v3"
    assert save_hf_folder(ours.state_dict(), ours.config, tmp_path / "out") == exported
    source, again = WeightsReader(folder), WeightsReader(tmp_path / "out")
    assert set(source.location) == set(again.location)
    interleaved = kind != "deepseek_v3-halves"
    for name in source.location:
        if interleaved or not any(part in name for part in ("q_b_proj", "q_proj", "kv_a_proj_with_mqa")):
            assert torch.equal(source.get(name), again.get(name)), name
    ids = tokens()
    expected = hf_logits_of(load_hf(folder).eval(), ids)
    assert (hf_logits_of(load_hf(tmp_path / "out").eval(), ids) - expected).abs().max() < TOLERANCE


def test_deepseek_yarn_and_ranks_become_megatron_flags_and_the_plan_says_so(tmp_path):
    args = arguments.parse_args(flags(save_tiny("deepseek_v2-yarn", tmp_path / "v2")))
    assert (args.q_lora_rank, args.kv_lora_rank, args.qk_head_dim, args.qk_pos_emb_head_dim, args.v_head_dim) == \
        (24, 16, 8, 4, 12)
    assert (args.rope_type, args.rotary_scaling_factor, args.mscale, args.mscale_all_dim) == ("yarn", 4.0, 0.707, 0.5)
    assert (args.yarn_original_max_position_embeddings, args.yarn_beta_fast, args.yarn_beta_slow) == (16, 8.0, 1.0)
    assert args.yarn_correction_range_round_to_int is False and args.untie_embeddings_and_output_weights
    described = describe_plan(plan.from_args(args, settings.RunContext(1, "cpu")))
    assert "model: built-in GPT (DeepSeek-family) initialised from Hugging Face weights" in described
    assert "YaRN rope ×4 (original 16" in described
    refused = arguments.parse_args(flags(tmp_path / "v2", "--kv-lora-rank", "32"))
    with pytest.raises(rules.FlagConflict, match="--kv-lora-rank 32 \\(config.json needs --kv-lora-rank 16\\)"):
        rules.validate(refused, settings.RunContext(1, "cpu"))


@pytest.mark.parametrize("change, says", [
    ({"first_k_dense_replace": 1, "norm_topk_prob": False}, "norm_topk_prob false"),
    ({"model_type": "deepseek_v2", "first_k_dense_replace": 1, "topk_method": "group_limited_greedy"},
     "a group scores its best expert"),
    ({"attention_bias": True}, "attention_bias"),
    ({"num_key_value_heads": 2}, "num_key_value_heads 2 with 4 heads"),
    ({"rms_norm_eps": 1e-5}, "rms_norm_eps 1e-05"),
    ({"rope_parameters": DEEPSEEK_YARN | {"attention_factor": 2.0}}, "attention_factor 2.0"),
])
def test_deepseek_configs_the_builtin_model_cannot_hold_are_refused_with_the_reason(change, says, tmp_path):
    import json

    folder = save_tiny("deepseek_v3", tmp_path / "v3")
    config = json.loads((folder / "config.json").read_text()) | change
    (folder / "config.json").write_text(json.dumps(config))
    args = arguments.parse_args(flags(folder))
    with pytest.raises(rules.FlagConflict, match=says):
        rules.validate(args, settings.RunContext(1, "cpu"))


def test_mla_exports_refuse_what_deepseek_cannot_hold():
    from rapidtrain.models import ModelConfig

    mla = dict(normalization="RMSNorm", swiglu=True, add_bias_linear=False, position_embedding_type="rope",
               multi_latent_attention=True, qk_layernorm=True, layernorm_epsilon=1e-6)
    assert export_family(ModelConfig(**mla)) == "deepseek_v3"
    with pytest.raises(UnsupportedModel, match="--qk-layernorm"):
        export_family(ModelConfig(**mla | {"qk_layernorm": False}))
    moe = mla | {"num_layers": 3, "num_experts": (0, 4, 4), "moe_router_topk": 2}
    assert export_family(ModelConfig(**moe | {"moe_router_score_function": "sigmoid"})) == "deepseek_v3"
    assert export_family(ModelConfig(**moe | {"moe_router_pre_softmax": True})) == "deepseek_v2"
    with pytest.raises(UnsupportedModel, match="dense layers first"):
        export_family(ModelConfig(**moe | {"num_experts": (4, 0, 4)}))
    with pytest.raises(UnsupportedModel, match="--moe-router-pre-softmax with a softmax router"):
        export_family(ModelConfig(**moe))
