"""What a `--pretrained-model-name-or-path` folder holds, and the built-in model's flags that a Hugging Face
config.json fixes (GPT-2, BLOOM, Llama, Mistral, Qwen2, Qwen3, Mixtral, Qwen-MoE, DeepSeek-V2/V3, gpt-oss, BERT,
Megatron-BERT).

Reads config.json as JSON only: nothing from the folder is imported or run. With `--task pretraining` a
Hugging Face folder initialises the built-in model; the shape flags not given are taken from the config,
and flags that contradict it are refused (rules.py), naming both values.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
from pathlib import Path
from typing import Any, Literal

from rapidtrain.core.errors import UserError
from rapidtrain.models.config import shape_past_bounds

FolderKind = Literal["huggingface", "rapidtrain", "missing", "other"]

# Hugging Face model_type → what the built-in model becomes.
SUPPORTED = {
    "gpt2": "GPT (GPT-2)",
    "bloom": "GPT (BLOOM: ALiBi, embedding LayerNorm)",
    "llama": "GPT (Llama-family)",
    "mistral": "GPT (Llama-family, Mistral)",
    "qwen2": "GPT (Llama-family, Qwen2)",
    "qwen3": "GPT (Llama-family, Qwen3: q/k norms)",
    "mixtral": "GPT (Llama-family MoE, Mixtral)",
    "qwen2_moe": "GPT (Llama-family MoE, Qwen1.5/2-MoE: gated shared experts)",
    "qwen3_moe": "GPT (Llama-family MoE, Qwen3-MoE: q/k norms)",
    "deepseek_v2": "GPT (DeepSeek-V2: multi-head latent attention, softmax-routed experts with shared ones)",
    "deepseek_v3": "GPT (DeepSeek-V3: multi-head latent attention, sigmoid-routed experts with bias and groups)",
    "gpt_oss": "GPT (gpt-oss: attention sinks, clamped quick-GEGLU experts, biased router, alternating window)",
    "bert": "BERT",
    "megatron-bert": "BERT (Megatron pre-LN)",
}
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "mixtral", "qwen2_moe", "qwen3_moe")
QWEN_MOE = ("qwen2_moe", "qwen3_moe")
DEEPSEEK_FAMILY = ("deepseek_v2", "deepseek_v3")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "vocab.txt", "tokenizer.model")


class UnsupportedModel(UserError, ValueError):
    """A Hugging Face config the built-in models cannot reproduce exactly."""


class UnsafeModelFolder(UserError, ValueError):
    """A model folder that only loads by running code from it (custom architectures, pickled objects)."""


def refuse_remote_code(folder: str | Path, flag: str = "--pretrained-model-name-or-path") -> None:
    """A folder whose config.json maps its classes to Python files in the folder (`auto_map`) loads only with
    trust_remote_code, which would run that code (and prompts on the terminal): refused in one line instead."""
    config = Path(folder) / "config.json"
    try:
        mapped = json.loads(config.read_text()).get("auto_map")
    except (OSError, ValueError, AttributeError):
        return  # no readable config.json: the loader names that itself
    if mapped:
        raise UnsafeModelFolder(
            f"{flag} {folder}: config.json maps the model to code in the folder (auto_map: "
            f"{', '.join(sorted(mapped))}), which loads only with trust_remote_code; rapidtrain runs no code from a "
            "model folder. Use a model whose architecture transformers has built in.")


PICKLED_WEIGHT_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt")


def pickled_file_in(folder: Path) -> Path | None:
    """The first weights file in `folder` that weights-only loading refuses (what transformers' error, raised from
    inside its loader, does not name); None if none is. Only read, as the loader did: nothing in it runs."""
    import pickle

    import torch

    for path in sorted(p for p in folder.iterdir() if p.suffix in PICKLED_WEIGHT_SUFFIXES and p.is_file()):
        try:
            torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError:
            return path
        except (OSError, RuntimeError, ValueError, EOFError):
            continue  # damaged or not a torch file: not the one weights-only loading refused
    return None


def refuse_pickled_weights(file: str | Path, error: BaseException) -> UnsafeModelFolder:
    """torch.load(weights_only=True) refused a weights file holding more than tensors: one line, not torch's
    traceback that suggests weights_only=False (which would run what the file holds). Given a model folder, the
    line names the file in it that was refused."""
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    named = Path(file)
    if named.is_dir():
        named = pickled_file_in(named) or named
    return UnsafeModelFolder(f"{named}: refused, it holds pickled objects beyond plain tensors and nothing in it ran "
                             f"({reason[:160]}). Save the weights as safetensors (save_pretrained's default).")


def classify_folder(path: str | Path) -> FolderKind:
    """What a --pretrained-model-name-or-path folder is: a Hugging Face model (config.json), a rapidtrain or
    Megatron-style checkpoint (latest_checkpointed_iteration.txt; config.meanings loads it as --load), missing,
    or something else."""
    folder = Path(path)
    if not folder.is_dir():
        return "missing"
    if (folder / "latest_checkpointed_iteration.txt").exists():
        return "rapidtrain"
    if (folder / "config.json").is_file():
        return "huggingface"
    return "other"


def is_megatron_checkpoint(args: argparse.Namespace) -> bool:
    """--pretrained-model-name-or-path names a Megatron-format (rapidtrain) checkpoint folder, as in
    Rapidformer's Megatron-model scripts, or the run's own --save folder before its first checkpoint (their
    idiom for "resume if there is one")."""
    folder = getattr(args, "pretrained_model_name_or_path", None)
    if not folder:
        return False
    path = Path(folder)
    if (path / "latest_checkpointed_iteration.txt").exists():
        return True
    fresh = not path.exists() or (path.is_dir() and not any(path.iterdir()))
    save = getattr(args, "save", None)
    if not fresh or not save:
        return False
    return path.resolve() == Path(save).resolve()


@functools.lru_cache(maxsize=8)
def read_config(path: str) -> dict[str, Any]:
    """config.json of a Hugging Face folder, as plain JSON."""
    file = Path(path) / "config.json"
    try:
        config = json.loads(file.read_text())
    except (OSError, ValueError) as error:  # ValueError: not JSON, or not UTF-8
        raise UnsupportedModel(f"--pretrained-model-name-or-path {path}: cannot read {file} ({error})") from None
    if not isinstance(config, dict):
        raise UnsupportedModel(f"--pretrained-model-name-or-path {path}: {file} holds a JSON "
                               f"{type(config).__name__}, not a model config (an object)")
    return config


def trains_builtin_model(args: argparse.Namespace) -> bool:
    """The run trains a built-in model (no Hugging Face model), perhaps from Hugging Face weights
    (args.builtin_from_pretrained, decided by arguments.parse_args) or from a Megatron-format checkpoint."""
    return not args.pretrained_model_name_or_path or bool(getattr(args, "builtin_from_pretrained", False)) \
        or is_megatron_checkpoint(args)


def initialises_builtin(args: argparse.Namespace) -> bool:
    """The built-in model starts from the weights of the Hugging Face folder the flags name."""
    folder = args.pretrained_model_name_or_path
    return bool(getattr(args, "builtin_from_pretrained", False) and folder) and classify_folder(folder) == "huggingface"


def family(config: dict[str, Any]) -> str:
    kind = config.get("model_type")
    if not isinstance(kind, str) or kind not in SUPPORTED:
        raise UnsupportedModel(
            f"config.json model_type {kind!r} cannot initialise a built-in model; supported: "
            f"{', '.join(SUPPORTED)}"
        )
    return kind


# ---- config.json → flags ----


# Llama 3.1's rope scaling as Megatron's --use-rope-scaling fixes it (only the factor is a flag there).
LLAMA3_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _rope_flags(config: dict[str, Any]) -> dict[str, Any]:
    """rope theta and scaling (transformers 4's rope_scaling and 5's rope_parameters keys): plain, Llama 3.1's
    llama3 with Megatron's fixed factors, linear, or YaRN; other scalings are refused."""
    parameters = config.get("rope_parameters") or config.get("rope_scaling") or {}
    kind = parameters.get("rope_type") or parameters.get("type") or "default"
    if config.get("partial_rotary_factor", 1.0) != 1.0:
        raise UnsupportedModel("config.json has partial_rotary_factor; Llama-family models rotate whole heads")
    flags = {"rotary_base": float(parameters.get("rope_theta", config.get("rope_theta", 10000.0))),
             "use_rope_scaling": False, "rope_scaling_factor": 8.0, "rotary_seq_len_interpolation_factor": None}
    if kind == "yarn":
        return flags | _yarn_flags(config, parameters)
    if kind == "llama3":
        other = {key: parameters.get(key) for key in LLAMA3_FIXED if parameters.get(key) != LLAMA3_FIXED[key]}
        if other:
            raise UnsupportedModel(f"config.json's llama3 rope scaling has {other}; --use-rope-scaling fixes them "
                                   f"at Megatron's {LLAMA3_FIXED}")
        return flags | {"use_rope_scaling": True, "rope_scaling_factor": float(parameters["factor"])}
    if kind == "linear":
        return flags | {"rotary_seq_len_interpolation_factor": float(parameters["factor"])}
    if kind != "default":
        raise UnsupportedModel(f"config.json uses rope scaling {kind!r}; the built-in rotary embedding implements "
                               "plain rope, llama3, linear and yarn")
    return flags


def _yarn_flags(config: dict[str, Any], parameters: dict[str, Any]) -> dict[str, Any]:
    """Megatron's YaRN flags for transformers' yarn rope_parameters. transformers scales cos/sin by
    attention_factor, else mscale(factor, mscale) / mscale(factor, mscale_all_dim) when both are given, else
    mscale(factor, 1): the flags' mscale(factor, --mscale) / mscale(factor, --mscale-all-dim) in each case, except
    mscale_all_dim without mscale (refused), and an attention_factor other than that quotient (refused)."""
    from rapidtrain.models.rope import yarn_mscale

    original = parameters.get("original_max_position_embeddings") or config["max_position_embeddings"]
    factor = float(parameters.get("factor") or config["max_position_embeddings"] / original)
    mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
    if mscale_all_dim and not mscale:
        raise UnsupportedModel("config.json's yarn rope has mscale_all_dim without mscale: transformers then scales "
                               "cos/sin by mscale(factor) but not the softmax by it, which Megatron's --mscale / "
                               "--mscale-all-dim cannot say")
    if not (mscale and mscale_all_dim):  # transformers ignores a lone mscale
        mscale, mscale_all_dim = 1.0, mscale_all_dim or 0.0
    expected = yarn_mscale(factor, float(mscale)) / yarn_mscale(factor, float(mscale_all_dim))
    given = parameters.get("attention_factor")
    if given is not None and abs(float(given) - expected) > 1e-9 * expected:
        raise UnsupportedModel(f"config.json's yarn attention_factor {given} is not mscale's {expected:.6g}; "
                               "Megatron's YaRN flags derive it from --mscale / --mscale-all-dim")
    return {"rope_type": "yarn", "rotary_scaling_factor": factor, "mscale": float(mscale),
            "mscale_all_dim": float(mscale_all_dim), "yarn_beta_fast": float(parameters.get("beta_fast") or 32),
            "yarn_beta_slow": float(parameters.get("beta_slow") or 1),
            "yarn_original_max_position_embeddings": int(original),
            "yarn_correction_range_round_to_int": bool(parameters.get("truncate", True))}


def _rotary_decoder(config: dict[str, Any]) -> dict[str, Any]:
    """The flags every rotary decoder family (Llama-shaped, DeepSeek, gpt-oss) takes from config.json alike: the GPT's
    sizes and its rope over whole heads."""
    return {
        "model_type": "gpt",
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_attention_heads": config["num_attention_heads"],
        "ffn_hidden_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "position_embedding_type": "rope",
        **_rope_flags(config),
        "rotary_percent": 1.0,
    }


def _head_dim(config: dict[str, Any], hidden: int, heads: int) -> int | None:
    """--kv-channels for config.json's head_dim: None where it is hidden / heads (the built-in default)."""
    head_dim = config.get("head_dim")
    if head_dim is None or (hidden % heads == 0 and head_dim == hidden // heads):
        return None
    return int(head_dim)


def _gelu(activation: str) -> bool:
    """openai_gelu for a Hugging Face activation name."""
    if activation in ("gelu", "gelu_python"):
        return False
    if activation in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        return True
    raise UnsupportedModel(f"config.json activation {activation!r}: the built-in models use GELU (exact or tanh)")


def _gpt2_flags(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("scale_attn_by_inverse_layer_idx") or not config.get("scale_attn_weights", True):
        raise UnsupportedModel("config.json scales GPT-2's attention differently from 1/sqrt(head size)")
    hidden = config["n_embd"]
    return {
        "model_type": "gpt",
        "num_layers": config["n_layer"],
        "hidden_size": hidden,
        "num_attention_heads": config["n_head"],
        "ffn_hidden_size": config.get("n_inner") or 4 * hidden,
        "max_position_embeddings": config["n_positions"],
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "openai_gelu": _gelu(config.get("activation_function", "gelu_new")),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
    }


def _bloom_flags(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("apply_residual_connection_post_layernorm"):
        raise UnsupportedModel("config.json apply_residual_connection_post_layernorm: the built-in GPT adds the "
                               "residual before the norm (pre-LN)")
    hidden = config.get("hidden_size") or config["n_embed"]
    return {
        "model_type": "gpt",
        "num_layers": config["n_layer"],
        "hidden_size": hidden,
        "num_attention_heads": config["n_head"],
        "ffn_hidden_size": 4 * hidden,  # BLOOM's MLP is always 4h
        "position_embedding_type": "alibi",
        "embed_layernorm": True,
        "normalization": "LayerNorm",
        "layernorm_epsilon": config.get("layer_norm_epsilon", 1e-5),
        "openai_gelu": True,  # BLOOM's GELU is the tanh approximation
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
    }


def _llama_flags(config: dict[str, Any]) -> dict[str, Any]:
    kind = config["model_type"]
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    if kind in ("qwen3", *QWEN_MOE) and (config.get("use_sliding_window") or any(
            layer != "full_attention" for layer in config.get("layer_types") or [])):
        raise UnsupportedModel(f"config.json's {kind} uses sliding-window attention in some layers; the built-in "
                               "attention sees the whole sequence there")
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"config.json hidden_act {config['hidden_act']!r}: Llama-family MLPs use SwiGLU (silu)")
    if config.get("mlp_bias"):
        raise UnsupportedModel("config.json mlp_bias: the built-in SwiGLU MLP has biases only with every linear layer")
    if config.get("attention_bias"):
        raise UnsupportedModel(
            "config.json attention_bias (biases on q, k, v and o but not the MLP): no combination of "
            "--disable-bias-linear / --add-qkv-bias builds that"
        )
    groups = config.get("num_key_value_heads") or heads
    flags: dict[str, Any] = {
        **_rotary_decoder(config),
        "kv_channels": _head_dim(config, hidden, heads),
        "qk_layernorm": kind in ("qwen3", "qwen3_moe"),  # Qwen3's q_norm / k_norm: RMSNorm over head_dim
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.get("rms_norm_eps", 1e-6),
        "swiglu": True,
        "group_query_attention": groups != heads,
        "num_query_groups": groups if groups != heads else None,
        "add_bias_linear": False,
        # Qwen2's q/k/v projections always have biases, Qwen2-MoE's unless its qkv_bias is off
        "add_qkv_bias": kind == "qwen2" or (kind == "qwen2_moe" and bool(config.get("qkv_bias", True))),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        # Mistral's and Mixtral's window covers every layer (Qwen2's only some: the rules refuse what it changes).
        "sliding_window": config.get("sliding_window") if kind in ("mistral", "mixtral") else None,
    }
    if kind == "mixtral":
        topk = config["num_experts_per_tok"]
        if topk == 1:
            raise UnsupportedModel("Mixtral with num_experts_per_tok 1 renormalises its top-1 weight to 1; the "
                                   "built-in top-1 router (Switch) keeps the router probability")
        flags |= {
            "num_experts": [config["num_local_experts"]],
            "moe_layer_freq": 1,
            "moe_router_topk": topk,
            "disable_moe_token_dropping": True,  # Mixtral has no expert capacity
        }
    if kind in QWEN_MOE:
        flags |= _qwen_moe_flags(config)
    return flags


def _qwen_moe_flags(config: dict[str, Any]) -> dict[str, Any]:
    """Qwen1.5/2/3-MoE's experts: a layer is MoE unless listed in mlp_only_layers or off the decoder_sparse_step;
    softmax over all experts, the top k renormalised only with norm_topk_prob; Qwen2-MoE's shared expert with its
    sigmoid gate; no expert capacity (dropless)."""
    # transformers 5 writes Qwen3-MoE's num_experts as num_local_experts (its attribute map); 4 wrote num_experts
    experts = int(config["num_experts"] if "num_experts" in config else config["num_local_experts"])
    topk = int(config["num_experts_per_tok"])
    step, dense = int(config.get("decoder_sparse_step") or 1), set(config.get("mlp_only_layers") or [])
    if config.get("norm_topk_prob") and topk == 1:
        raise UnsupportedModel("config.json's norm_topk_prob with num_experts_per_tok 1 gives every token weight 1; "
                               "the built-in top-1 router (Switch) keeps the router probability")
    per_layer = [experts if experts > 0 and i not in dense and (i + 1) % step == 0 else 0
                 for i in range(int(config["num_hidden_layers"]))]
    flags: dict[str, Any] = {
        "num_experts": per_layer if any(per_layer) else None,
        "moe_layer_freq": 1,
        "moe_router_topk": topk,
        "moe_router_pre_softmax": not config.get("norm_topk_prob", False),
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "disable_moe_token_dropping": True,  # Qwen-MoE has no expert capacity
    }
    shared = config.get("shared_expert_intermediate_size") if config["model_type"] == "qwen2_moe" else None
    if shared:
        flags |= {"moe_shared_expert_intermediate_size": int(shared), "moe_shared_expert_gate": True}
    return flags


def deepseek_moe_flags(config: dict[str, Any]) -> dict[str, Any]:
    """The MoE flags of a DeepSeek config with routed-expert layers (layers from first_k_dense_replace on): V3's
    sigmoid router with its score-correction bias (the expert bias, loaded from the folder), group-limited routing,
    the k chosen normalised and the routed scaling; V2's softmax kept as it is (no renormalisation) times the routed
    scaling; n_shared_experts shared experts of the routed size; no expert capacity (dropless). {} for a dense
    config. What the built-in router cannot reproduce exactly is refused, saying why."""
    layers = int(config["num_hidden_layers"])
    dense = config.get("first_k_dense_replace")
    experts = config.get("n_routed_experts")
    if not experts or dense is None or dense >= layers:
        return {}
    kind, topk = config["model_type"], int(config["num_experts_per_tok"])
    groups, chosen = int(config.get("n_group") or 1), int(config.get("topk_group") or 1)
    normalise = bool(config.get("norm_topk_prob", kind == "deepseek_v3"))
    scaling = float(config.get("routed_scaling_factor") or 1.0)
    flags: dict[str, Any] = {
        "num_experts": [0] * int(dense) + [int(experts)] * (layers - int(dense)),
        "moe_layer_freq": 1,
        "moe_router_topk": topk,
        "moe_ffn_hidden_size": int(config["moe_intermediate_size"]),
        "moe_shared_expert_intermediate_size": int(config["moe_intermediate_size"]) * int(
            config.get("n_shared_experts") or 0) or None,
        "moe_router_topk_scaling_factor": scaling if scaling != 1.0 else None,
        "disable_moe_token_dropping": True,  # DeepSeek's experts have no capacity
    }
    if kind == "deepseek_v3":
        if topk > 1 and not normalise:
            raise UnsupportedModel("config.json's deepseek_v3 router keeps its k sigmoid scores as they are "
                                   "(norm_topk_prob false); Megatron-Core's sigmoid router, the built-in one, "
                                   "normalises them to sum 1 when k > 1")
        if topk == 1 and normalise:
            raise UnsupportedModel("config.json's norm_topk_prob with num_experts_per_tok 1 gives every token "
                                   "weight 1; the built-in sigmoid router keeps a single expert's score")
        flags |= {"moe_router_score_function": "sigmoid", "moe_router_enable_expert_bias": True,
                  "moe_router_num_groups": groups if groups > 1 and chosen < groups else None,
                  "moe_router_group_topk": chosen if groups > 1 and chosen < groups else None}
        return flags
    if config.get("topk_method", "greedy") != "greedy" and groups > 1 and chosen < groups:
        raise UnsupportedModel(f"config.json's deepseek_v2 routes by {config.get('topk_method')!r} (a group scores "
                               "its best expert); the built-in group-limited router scores a group by the sum of "
                               "its two best (Megatron-Core, DeepSeek-V3)")
    return flags | {"moe_router_score_function": "softmax", "moe_router_pre_softmax": True}


def _deepseek_flags(config: dict[str, Any]) -> dict[str, Any]:
    """DeepSeek-V2/V3: a Llama-shaped dense model (RMSNorm, SwiGLU, no biases) whose attention is MLA with its
    latent RMSNorms (--qk-layernorm)."""
    heads = config["num_attention_heads"]
    moe = deepseek_moe_flags(config)
    if config.get("hidden_act", "silu") != "silu":
        raise UnsupportedModel(f"config.json hidden_act {config['hidden_act']!r}: DeepSeek's MLPs use SwiGLU (silu)")
    if config.get("attention_bias"):
        raise UnsupportedModel("config.json attention_bias (biases on q_a_proj, kv_a_proj_with_mqa and o_proj "
                               "only): the built-in latent attention has no such biases")
    if (config.get("num_key_value_heads") or heads) != heads:
        raise UnsupportedModel(f"config.json num_key_value_heads {config['num_key_value_heads']} with {heads} heads: "
                               "multi-head latent attention makes a key and value per head")
    epsilon = config.get("rms_norm_eps", 1e-6)
    if epsilon != 1e-6:
        raise UnsupportedModel(f"config.json rms_norm_eps {epsilon}: transformers' DeepSeek normalises the latents "
                               "with epsilon 1e-6 whatever rms_norm_eps says, the built-in model every norm with "
                               "--norm-epsilon")
    decoder = _rotary_decoder(config)
    return {
        **decoder,
        "rope_type": decoder.get("rope_type", "rope"),
        "normalization": "RMSNorm",
        "layernorm_epsilon": epsilon,
        "swiglu": True,
        "add_bias_linear": False,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "multi_latent_attention": True,
        "qk_layernorm": True,  # DeepSeek's q_a_layernorm / kv_a_layernorm: Megatron builds them with --qk-layernorm
        "q_lora_rank": config.get("q_lora_rank"),
        "kv_lora_rank": config["kv_lora_rank"],
        "qk_head_dim": config["qk_nope_head_dim"],
        "qk_pos_emb_head_dim": config["qk_rope_head_dim"],
        "v_head_dim": config["v_head_dim"],
        **moe,
    }


def rope_interleaved(config: dict[str, Any]) -> bool:
    """Whether a DeepSeek folder's rotary rows are interleaved pairs (x0, x1), (x2, x3), ... (V2 always; V3 by
    rope_interleave, default true) rather than halves (x_i, x_{i + d/2}) as the built-in rope rotates."""
    return config.get("model_type") == "deepseek_v2" or bool(config.get("rope_interleave", True))


QUICK_GELU_ALPHA = 1.702  # the built-in quick GELU's gain (models/mlp.py); gpt-oss's swiglu_alpha


def window_pattern(layer_types: list[str]) -> int | None:
    """--window-attn-skip-freq N for Hugging Face's layer_types (sliding_attention / full_attention per layer): every
    Nth layer (1-based) full, the others sliding; None when every layer slides. UnsupportedModel for a pattern that
    no N gives (the built-in model's windows follow Megatron's every-Nth rule)."""
    sliding = [kind == "sliding_attention" for kind in layer_types]
    if all(sliding):
        return None
    for every in range(1, len(sliding) + 1):
        if all(slides == ((i + 1) % every != 0) for i, slides in enumerate(sliding)):
            return every
    raise UnsupportedModel(f"config.json's layer_types {layer_types}: the built-in model's full-attention layers are "
                           "every Nth (--window-attn-skip-freq), and no N gives these")


def _gpt_oss_flags(config: dict[str, Any]) -> dict[str, Any]:
    """gpt-oss: Llama-shaped attention with biases and per-head sinks, every layer MoE (biased router, softmax over
    the top-k logits = softmax, top-k, renormalise), experts with biases and the clamped quick-GEGLU, sliding
    windows in the layers layer_types names."""
    if config.get("quantization_config"):  # openai/gpt-oss-* ship MXFP4 expert blocks and scales
        method = (config["quantization_config"] or {}).get("quant_method", "quantized") \
            if isinstance(config["quantization_config"], dict) else "quantized"
        raise UnsupportedModel(f"config.json: {method} weights; the built-in model reads plain tensors. Save a "
                               "dequantized copy first (transformers: from_pretrained with "
                               "Mxfp4Config(dequantize=True), then save_pretrained)")
    if config.get("swiglu_alpha", QUICK_GELU_ALPHA) != QUICK_GELU_ALPHA:
        raise UnsupportedModel(f"config.json swiglu_alpha {config['swiglu_alpha']}: the built-in quick GELU's gain is "
                               f"{QUICK_GELU_ALPHA}")
    if not config.get("attention_bias", True):
        raise UnsupportedModel("config.json attention_bias false: gpt-oss's experts and router have biases, and the "
                               "built-in model's biases come with every linear layer (--disable-bias-linear drops all)")
    topk = config["num_experts_per_tok"]
    if topk == 1:
        raise UnsupportedModel("gpt-oss with num_experts_per_tok 1 gives its expert weight 1; the built-in top-1 "
                               "router (Switch) keeps the router probability")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    groups = config.get("num_key_value_heads") or heads
    window = config.get("sliding_window")
    layer_types = config.get("layer_types") or ["full_attention"] * config["num_hidden_layers"]
    if len(layer_types) != config["num_hidden_layers"]:
        raise UnsupportedModel(f"config.json has {len(layer_types)} layer_types for {config['num_hidden_layers']} "
                               "layers")
    skip = window_pattern(layer_types) if window else None
    if skip == 1:  # every layer attends to the whole sequence: the window is never used
        window, skip = None, None
    return {
        **_rotary_decoder(config),
        "kv_channels": _head_dim(config, hidden, heads),
        "normalization": "RMSNorm",
        "layernorm_epsilon": config.get("rms_norm_eps", 1e-5),
        "group_query_attention": groups != heads,
        "num_query_groups": groups if groups != heads else None,
        "add_bias_linear": True,
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", False),
        "softmax_type": "learnable",
        "quick_geglu": True,
        "glu_linear_offset": 1.0,
        "activation_func_clamp_value": float(config.get("swiglu_limit", 7.0)),
        "sliding_window": window,
        "window_attn_skip_freq": skip,
        "num_experts": [config["num_local_experts"]],
        "moe_layer_freq": 1,
        "moe_router_topk": topk,
        "disable_moe_token_dropping": True,  # gpt-oss has no expert capacity
    }


def _bert_flags(config: dict[str, Any]) -> dict[str, Any]:
    if config.get("position_embedding_type", "absolute") != "absolute":
        raise UnsupportedModel(
            f"config.json position_embedding_type {config['position_embedding_type']!r}: BERT's learned "
            "absolute positions only"
        )
    if config.get("type_vocab_size", 2) != 2:
        raise UnsupportedModel(f"config.json type_vocab_size {config['type_vocab_size']}: the built-in BERT has 2")
    architectures = config.get("architectures") or []
    return {
        "model_type": "bert",
        "num_layers": config["num_hidden_layers"],
        "hidden_size": config["hidden_size"],
        "num_attention_heads": config["num_attention_heads"],
        "ffn_hidden_size": config["intermediate_size"],
        "max_position_embeddings": config["max_position_embeddings"],
        "position_embedding_type": "learned_absolute",
        "normalization": "LayerNorm",
        "layernorm_epsilon": config.get("layer_norm_eps", 1e-12),
        "openai_gelu": _gelu(config.get("hidden_act", "gelu")),
        "post_layernorm": config["model_type"] == "bert",  # Megatron-BERT is pre-LN like the built-in BERT
        "bert_binary_head": any(name.endswith("ForPreTraining") for name in architectures),
        "untie_embeddings_and_output_weights": not config.get("tie_word_embeddings", True),
    }


# Flags every family fixes to their defaults unless it says otherwise (GPT-2's architecture).
_BASE = {
    "rotary_base": None,
    "rotary_percent": None,
    "kv_channels": None,
    "qk_layernorm": False,
    "use_rope_scaling": False,
    "rope_scaling_factor": 8.0,
    "rotary_seq_len_interpolation_factor": None,
    "swiglu": False,
    "group_query_attention": False,
    "num_query_groups": None,
    "add_bias_linear": True,
    "add_qkv_bias": False,
    "openai_gelu": False,
    "post_layernorm": False,
    "bert_binary_head": False,
    "num_experts": None,
    "embed_layernorm": False,
    "sliding_window": None,
    "moe_router_pre_softmax": False,
    "moe_ffn_hidden_size": None,
    "moe_shared_expert_intermediate_size": None,
    "moe_shared_expert_gate": False,
    "moe_router_score_function": "softmax",
    "moe_router_enable_expert_bias": False,
    "moe_router_num_groups": None,
    "moe_router_group_topk": None,
    "moe_router_topk_scaling_factor": None,
    # Megatron's defaults of MLA's and YaRN's flags (only DeepSeek and YaRN configs set them)
    "multi_latent_attention": False,
    "q_lora_rank": None,
    "kv_lora_rank": 32,
    "qk_head_dim": 128,
    "qk_pos_emb_head_dim": 64,
    "v_head_dim": 128,
    "rope_type": None,
    "rotary_scaling_factor": 1.0,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "yarn_beta_fast": None,
    "yarn_beta_slow": None,
    "yarn_original_max_position_embeddings": None,
    "yarn_correction_range_round_to_int": None,
    "window_attn_skip_freq": None,
    "softmax_type": "vanilla",
    "quick_geglu": False,
    "glu_linear_offset": 0.0,
    "activation_func_clamp_value": None,
}


# Flags taken from config.json that are counts (a positive int; bool is refused, JSON's true is no size).
_COUNT_FLAGS = ("num_layers", "hidden_size", "num_attention_heads", "ffn_hidden_size", "max_position_embeddings",
                "num_query_groups", "moe_router_topk", "kv_channels", "sliding_window", "moe_ffn_hidden_size",
                "moe_shared_expert_intermediate_size", "q_lora_rank", "kv_lora_rank", "qk_head_dim",
                "qk_pos_emb_head_dim", "v_head_dim", "yarn_original_max_position_embeddings")


def builtin_flags(config: dict[str, Any]) -> dict[str, Any]:
    """flag dest → the value the built-in model needs to hold these weights exactly. A config.json with keys
    missing or of the wrong type (damaged, or another library's) raises UnsupportedModel naming the key."""
    kind = family(config)
    try:
        if kind == "gpt2":
            flags = _gpt2_flags(config)
        elif kind == "bloom":
            flags = _bloom_flags(config)
        elif kind in LLAMA_FAMILY:
            flags = _llama_flags(config)
        elif kind in DEEPSEEK_FAMILY:
            flags = _deepseek_flags(config)
        elif kind == "gpt_oss":
            flags = _gpt_oss_flags(config)
        else:
            flags = _bert_flags(config)
    except KeyError as error:
        raise UnsupportedModel(f"config.json lacks {error} that a {kind} config has") from None
    except (TypeError, ValueError, AttributeError, ZeroDivisionError) as error:
        raise UnsupportedModel(f"config.json holds a value of the wrong type for a {kind} config ({error})") from None
    wrong = [dest for dest in _COUNT_FLAGS if dest in flags and flags[dest] is not None
             and (type(flags[dest]) is not int or flags[dest] <= 0)]
    wrong += [dest for dest in ("layernorm_epsilon", "rotary_base", "rope_scaling_factor",
                                "rotary_seq_len_interpolation_factor", "rotary_scaling_factor", "yarn_beta_fast",
                                "yarn_beta_slow", "activation_func_clamp_value") if flags.get(dest) is not None
              and (type(flags[dest]) not in (int, float) or not flags[dest] > 0)]
    if wrong:
        raise UnsupportedModel(f"config.json gives {', '.join(f'{d} = {flags[d]!r}' for d in wrong)}: "
                               "not a positive number")
    past = shape_past_bounds(flags | {"vocab_size": config.get("vocab_size")})
    if past:
        raise UnsupportedModel(f"config.json gives {', '.join(past)}: past any real model's size, so the file is "
                               "damaged or not a model's config; use the folder save_pretrained wrote")
    return _BASE | flags


def pretrained_vocab_size(args: argparse.Namespace) -> int | None:
    """vocab_size of the Hugging Face config when it initialises the built-in model, else None."""
    if not initialises_builtin(args):
        return None
    try:
        vocab_size = read_config(args.pretrained_model_name_or_path)["vocab_size"]
    except (UnsupportedModel, KeyError):
        return None
    return vocab_size if type(vocab_size) is int and vocab_size > 0 else None


# ---- applying it to the flags ----


def apply_pretrained_defaults(args: argparse.Namespace, given: set[str]) -> None:
    """Shape flags the user did not give take the Hugging Face config's values; so does the tokenizer, when
    the folder holds one. Flags given keep their values (rules.py refuses those that contradict the config)."""
    if not initialises_builtin(args):
        return
    folder = args.pretrained_model_name_or_path
    try:
        wanted = builtin_flags(read_config(folder))
    except UnsupportedModel:
        return  # the rules report it
    for dest, value in wanted.items():
        if dest not in given:
            setattr(args, dest, value)
    has_tokenizer = any((Path(folder) / name).exists() for name in TOKENIZER_FILES)
    if has_tokenizer and "tokenizer_type" not in given:
        args.tokenizer_type = "HuggingFaceTokenizer"
        if "tokenizer_model" not in given:
            args.tokenizer_model = folder


def _flag_text(dest: str, value: Any) -> str:
    """How a user writes `dest = value` on the command line."""
    if dest == "add_bias_linear":
        return "no --disable-bias-linear" if value else "--disable-bias-linear"
    if dest == "disable_moe_token_dropping":
        return "--disable-moe-token-dropping" if value else "no --disable-moe-token-dropping"
    flag = "--" + dest.replace("_", "-")
    if isinstance(value, bool):
        return flag if value else f"no {flag}"
    if value is None:
        return f"no {flag}"
    if isinstance(value, (list, tuple)):
        return f"{flag} {' '.join(map(str, value))}"
    return f"{flag} {value:g}" if isinstance(value, float) else f"{flag} {value}"


def _same(have: Any, want: Any) -> bool:
    if isinstance(have, (list, tuple)) or isinstance(want, (list, tuple)):
        return list(have or []) == list(want or [])
    return have == want


def pretrained_conflicts(args: argparse.Namespace) -> list[str]:
    """Each flag whose value contradicts the Hugging Face config, as 'FLAG VALUE (config.json: VALUE)'."""
    if not initialises_builtin(args):
        return []
    try:
        wanted = builtin_flags(read_config(args.pretrained_model_name_or_path))
    except UnsupportedModel:
        return []
    return [
        f"{_flag_text(dest, getattr(args, dest, None))} (config.json needs {_flag_text(dest, value)})"
        for dest, value in wanted.items()
        if not _same(getattr(args, dest, None), value) and not (
            dest == "kv_channels" and value is None and _default_head_size(args.kv_channels, args.hidden_size,
                                                                           args.num_attention_heads))
    ]


def _default_head_size(kv_channels: Any, hidden: Any, heads: Any) -> bool:
    """--kv-channels hidden / heads is the head size the built-in model takes without it (_head_dim maps that
    config.json to no --kv-channels): the same model, not a contradiction."""
    return bool(hidden) and bool(heads) and hidden % heads == 0 and kv_channels == hidden // heads


def unsupported_reason(args: argparse.Namespace) -> str | None:
    """Why the folder cannot initialise the built-in model (pretraining only); None when it can."""
    folder = args.pretrained_model_name_or_path
    if not getattr(args, "builtin_from_pretrained", False):
        return None
    kind = classify_folder(folder)
    if kind == "missing":
        return f"--pretrained-model-name-or-path {folder}: no such folder"
    if kind == "other":
        return (f"--pretrained-model-name-or-path {folder} has no config.json: give a folder written by "
                "save_pretrained (or scripts/convert_checkpoint.py --hf)")
    try:
        builtin_flags(read_config(folder))
    except UnsupportedModel as error:
        return f"--pretrained-model-name-or-path {folder}: {error}"
    return None


# ---- a Hugging Face model fine-tuned as it is: flags that describe it must agree with its config.json ----

# flag dest → config.json keys naming the same number (the first present one counts).
FINETUNE_SHAPE_KEYS = {
    "num_layers": ("num_hidden_layers", "n_layer", "num_layers"),
    "hidden_size": ("hidden_size", "n_embd", "d_model"),
    "num_attention_heads": ("num_attention_heads", "n_head", "num_heads"),
    "ffn_hidden_size": ("intermediate_size", "n_inner", "ffn_dim", "d_ff"),
    "max_position_embeddings": ("max_position_embeddings", "n_positions"),
}


def fine_tuned_config(args: argparse.Namespace) -> dict[str, Any] | None:
    """config.json of the Hugging Face model the run fine-tunes as it is (None: no such folder)."""
    folder = args.pretrained_model_name_or_path
    if not folder or trains_builtin_model(args) or classify_folder(folder) != "huggingface":
        return None
    try:
        return read_config(folder)
    except UnsupportedModel:
        return None


def finetune_conflicts(args: argparse.Namespace) -> list[str]:
    """Shape flags given beside a fine-tuned Hugging Face folder that contradict its config.json, as
    'FLAG VALUE (config.json KEY: VALUE)'; and a --seq-length past its position table."""
    config = fine_tuned_config(args)
    if config is None:
        return []
    given = set(getattr(args, "given_flags", ()))
    conflicts = []
    for dest, keys in FINETUNE_SHAPE_KEYS.items():
        key = next((k for k in keys if config.get(k) is not None), None)
        if dest in given and key is not None and getattr(args, dest) != config[key]:
            conflicts.append(f"--{dest.replace('_', '-')} {getattr(args, dest)} (config.json {key}: {config[key]})")
    positions = next((config[k] for k in FINETUNE_SHAPE_KEYS["max_position_embeddings"] if config.get(k)), None)
    if "seq_length" in given and positions and args.seq_length > positions:
        conflicts.append(f"--seq-length {args.seq_length} (config.json max positions: {positions})")
    return conflicts


# transformers' mask builders that detect packed sequences from position_ids (when the attention mask is None and
# there is no cache): masking_utils._preprocess_mask_arguments → find_packed_sequence_indices. Every
# attn_implementation (eager, sdpa, flex_attention, flash_attention_2) takes its mask or its varlen lengths from them.
PACKING_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask")


def packing_problem(path: str) -> str | None:
    """Why the Hugging Face causal LM in `path` would attend across packed sequences; None where its modeling
    code builds its mask with transformers' packed-sequence detection. Reads config.json and the installed
    transformers' modeling source as text: nothing is imported or run."""
    model_type = str(read_config(path).get("model_type", ""))
    spec = importlib.util.find_spec("transformers")
    if spec is None or not spec.submodule_search_locations:
        return "transformers is not installed (pip install transformers)"
    module = model_type.replace("-", "_")
    source = Path(next(iter(spec.submodule_search_locations))) / "models" / module / f"modeling_{module}.py"
    if not source.is_file():
        return f"its model_type {model_type!r} has no modeling code in the installed transformers"
    if not any(builder in source.read_text() for builder in PACKING_MASK_BUILDERS):
        return (f"its model_type {model_type!r} does not build its attention mask with transformers' "
                "create_causal_mask, which is what detects packed sequences from position ids (recurrent and "
                "older architectures carry state or attend across the whole row)")
    return None
