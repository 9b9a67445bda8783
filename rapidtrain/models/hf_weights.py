"""Hugging Face weights ↔ the built-in models, both ways.

`load_hf_weights` reads a `save_pretrained` folder (safetensors, or pytorch_model.bin through
`torch.load(weights_only=True)`: never code) into a built-in GPT or BERT of any layout: a whole model, a
pipeline stage, or one whose parameters are DTensor shards. `save_hf_folder` writes a built-in model's whole
state dict as a folder transformers loads (config.json + safetensors, in the hub's canonical names).

Each family's map is a list of Links: built-in tensors on one side, Hugging Face tensors on the other, and a
function each way (GPT-2 fuses q/k/v and stores Conv1D weights transposed; Mixtral keeps one matrix per
expert, the built-in MoE stacks them input-major; DeepSeek's rotary rows are interleaved pairs; gpt-oss interleaves
each expert's gate and up columns).
"""

from __future__ import annotations

import json
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_config import (
    DEEPSEEK_FAMILY,
    LLAMA_FAMILY,
    QWEN_MOE,
    TOKENIZER_FILES,
    UnsupportedModel,
    family,
    read_config,
    refuse_pickled_weights,
    rope_interleaved,
)
from rapidtrain.models.rope import rope_attention_factor
from rapidtrain.models.transformer import canonical_name, canonical_parameters, set_parameter

Tensors = list[torch.Tensor]


def _same(tensors: Tensors) -> Tensors:
    return list(tensors)


def _transposed(tensors: Tensors) -> Tensors:
    return [t.t() for t in tensors]


@dataclass(frozen=True)
class Link:
    """Built-in tensors `ours` are made from Hugging Face tensors `theirs` by `to_ours`, and back by `to_theirs`."""

    ours: tuple[str, ...]
    theirs: tuple[str, ...]
    to_ours: Callable[[Tensors], Tensors] = _same
    to_theirs: Callable[[Tensors], Tensors] = _same


def one(ours: str, theirs: str, transpose: bool = False) -> Link:
    how = _transposed if transpose else _same
    return Link((ours,), (theirs,), how, how)


def same_leaves(ours: str, theirs: str, leaves: tuple[str, ...] = ("weight", "bias")) -> list[Link]:
    return [one(f"{ours}.{leaf}", f"{theirs}.{leaf}") for leaf in leaves]


# ---- the maps ----


def _gpt2_links(config: ModelConfig) -> list[Link]:
    links = [one("embedding.word_embeddings.weight", "transformer.wte.weight"),
             one("embedding.position_embeddings.weight", "transformer.wpe.weight"),
             *same_leaves("final_norm", "transformer.ln_f")]
    if not config.tie_embeddings:
        links.append(one("output.weight", "lm_head.weight"))
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        qkv = tuple(f"{ours}.attention.{p}_proj.weight" for p in "qkv")
        links.append(Link(qkv, (f"{theirs}.attn.c_attn.weight",),
                          to_ours=lambda t: list(t[0].t().chunk(3, dim=0)),
                          to_theirs=lambda t: [torch.cat(t, dim=0).t()]))
        qkv_bias = tuple(f"{ours}.attention.{p}_proj.bias" for p in "qkv")
        links.append(Link(qkv_bias, (f"{theirs}.attn.c_attn.bias",),
                          to_ours=lambda t: list(t[0].chunk(3)), to_theirs=lambda t: [torch.cat(t)]))
        links += same_leaves(f"{ours}.ln1", f"{theirs}.ln_1") + same_leaves(f"{ours}.ln2", f"{theirs}.ln_2")
        for our_name, their_name in (("attention.o_proj", "attn.c_proj"), ("mlp.fc1", "mlp.c_fc"),
                                     ("mlp.fc2", "mlp.c_proj")):
            links.append(one(f"{ours}.{our_name}.weight", f"{theirs}.{their_name}.weight", transpose=True))
            links.append(one(f"{ours}.{our_name}.bias", f"{theirs}.{their_name}.bias"))
    return links


def _bloom_qkv(ours: tuple[str, ...], theirs: str, heads: int) -> Link:
    """BLOOM's fused query_key_value holds, head after head, that head's q, k and v rows; ours are three matrices
    (or bias vectors) of all heads' q, all k, all v."""

    def to_ours(t: Tensors) -> Tensors:
        per_head = t[0].reshape(heads, 3, -1, *t[0].shape[1:])
        return [part.reshape(-1, *t[0].shape[1:]) for part in per_head.unbind(1)]

    def to_theirs(t: Tensors) -> Tensors:
        per_head = torch.stack([part.reshape(heads, -1, *part.shape[1:]) for part in t], dim=1)
        return [per_head.reshape(-1, *t[0].shape[1:])]

    return Link(ours, (theirs,), to_ours, to_theirs)


def _bloom_links(config: ModelConfig) -> list[Link]:
    links = [one("embedding.word_embeddings.weight", "transformer.word_embeddings.weight"),
             *same_leaves("embedding.word_embeddings_norm", "transformer.word_embeddings_layernorm"),
             *same_leaves("final_norm", "transformer.ln_f")]
    if not config.tie_embeddings:
        links.append(one("output.weight", "lm_head.weight"))
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"transformer.h.{i}"
        for leaf in ("weight", "bias"):
            links.append(_bloom_qkv(tuple(f"{ours}.attention.{p}_proj.{leaf}" for p in "qkv"),
                                    f"{theirs}.self_attention.query_key_value.{leaf}", config.num_attention_heads))
        links += same_leaves(f"{ours}.attention.o_proj", f"{theirs}.self_attention.dense")
        links += same_leaves(f"{ours}.ln1", f"{theirs}.input_layernorm")
        links += same_leaves(f"{ours}.ln2", f"{theirs}.post_attention_layernorm")
        links += same_leaves(f"{ours}.mlp.fc1", f"{theirs}.mlp.dense_h_to_4h")
        links += same_leaves(f"{ours}.mlp.fc2", f"{theirs}.mlp.dense_4h_to_h")
    return links


def _stacked_experts(ours: str, theirs: list[str]) -> Link:
    """[E, in, out] built-in ↔ E Hugging Face Linear weights [out, in]."""
    return Link((ours,), tuple(theirs),
                to_ours=lambda t: [torch.stack([m.t() for m in t])],
                to_theirs=lambda t: [m.t() for m in t[0].unbind(0)])


def _llama_outer_links(config: ModelConfig) -> list[Link]:
    """What every Llama-shaped family names alike outside its layers: the embedding, the final norm, the untied head."""
    links = [one("embedding.word_embeddings.weight", "model.embed_tokens.weight"),
             one("final_norm.weight", "model.norm.weight")]
    return links + ([] if config.tie_embeddings else [one("output.weight", "lm_head.weight")])


def _qwen_moe_links(config: ModelConfig, ours: str, theirs: str, experts: int,
                    shared_name: str = "shared_expert") -> list[Link]:
    """One Qwen-MoE (or DeepSeek) layer's MLP: the router (`gate`), the experts' gate/up/down projections, the
    shared expert(s) (Qwen's `shared_expert`, DeepSeek's `shared_experts`) and Qwen2-MoE's shared-expert gate."""
    links = [one(f"{ours}.mlp.router.weight", f"{theirs}.gate.weight")]
    for our_name, their_name in (("w_gate", "gate_proj"), ("w1", "up_proj"), ("w2", "down_proj")):
        links.append(_stacked_experts(f"{ours}.mlp.experts.{our_name}",
                                      [f"{theirs}.experts.{e}.{their_name}.weight" for e in range(experts)]))
    if config.moe_shared_expert_intermediate_size:
        links += [one(f"{ours}.mlp.shared_experts.fc1.weight", f"{theirs}.{shared_name}.up_proj.weight"),
                  one(f"{ours}.mlp.shared_experts.gate.weight", f"{theirs}.{shared_name}.gate_proj.weight"),
                  one(f"{ours}.mlp.shared_experts.fc2.weight", f"{theirs}.{shared_name}.down_proj.weight")]
        if config.moe_shared_expert_gate:
            links.append(one(f"{ours}.mlp.shared_expert_gate.weight", f"{theirs}.shared_expert_gate.weight"))
    return links


def _llama_links(config: ModelConfig, hf_model_type: str = "llama") -> list[Link]:
    links = _llama_outer_links(config)
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        links += [one(f"{ours}.ln1.weight", f"{theirs}.input_layernorm.weight"),
                  one(f"{ours}.ln2.weight", f"{theirs}.post_attention_layernorm.weight")]
        for p in "qkvo":
            links.append(one(f"{ours}.attention.{p}_proj.weight", f"{theirs}.self_attn.{p}_proj.weight"))
            if config.add_qkv_bias and p != "o":
                links.append(one(f"{ours}.attention.{p}_proj.bias", f"{theirs}.self_attn.{p}_proj.bias"))
        if config.qk_layernorm:  # Qwen3
            links += [one(f"{ours}.attention.{p}_norm.weight", f"{theirs}.self_attn.{p}_norm.weight") for p in "qk"]
        experts = config.experts_in_layer(i)
        if not experts:
            links += [one(f"{ours}.mlp.fc1.weight", f"{theirs}.mlp.up_proj.weight"),
                      one(f"{ours}.mlp.gate.weight", f"{theirs}.mlp.gate_proj.weight"),
                      one(f"{ours}.mlp.fc2.weight", f"{theirs}.mlp.down_proj.weight")]
            continue
        if hf_model_type in QWEN_MOE:
            links += _qwen_moe_links(config, ours, f"{theirs}.mlp", experts)
            continue
        moe = f"{theirs}.block_sparse_moe"
        links.append(one(f"{ours}.mlp.router.weight", f"{moe}.gate.weight"))
        # Mixtral's w1 is the gate, w3 the up projection, w2 the down projection.
        for our_name, their_name in (("w_gate", "w1"), ("w1", "w3"), ("w2", "w2")):
            links.append(_stacked_experts(f"{ours}.mlp.experts.{our_name}",
                                          [f"{moe}.experts.{e}.{their_name}.weight" for e in range(experts)]))
    return links


def _halves_of_pairs(rows: torch.Tensor) -> torch.Tensor:
    """Rotary rows in interleaved pairs (x0, x1), (x2, x3), ... → halves (x0, x2, ...), (x1, x3, ...): rotating the
    halves (the built-in rope) gives the same dot products as rotating the pairs (DeepSeek's)."""
    return torch.cat([rows[0::2], rows[1::2]])


def _pairs_of_halves(rows: torch.Tensor) -> torch.Tensor:
    """The inverse of _halves_of_pairs."""
    pairs = torch.empty_like(rows)
    half = rows.shape[0] // 2
    pairs[0::2], pairs[1::2] = rows[:half], rows[half:]
    return pairs


def _rotary_rows(ours: str, theirs: str, heads: int, rows: int, rotary: int, interleaved: bool) -> Link:
    """A projection whose output is `heads` blocks of `rows` rows, the last `rotary` of each rotated by rope; with
    `interleaved` those rows are reordered between DeepSeek's pairs and the built-in halves."""
    if not interleaved:
        return one(ours, theirs)

    def reorder(how: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[Tensors], Tensors]:
        def apply(t: Tensors) -> Tensors:
            blocks = t[0].reshape(heads, rows, *t[0].shape[1:])
            rotated = torch.stack([how(block[rows - rotary:]) for block in blocks])
            return [torch.cat([blocks[:, :rows - rotary], rotated], dim=1).reshape(t[0].shape)]
        return apply

    return Link((ours,), (theirs,), reorder(_halves_of_pairs), reorder(_pairs_of_halves))


def _interleaved(ours: tuple[str, str], theirs: str) -> Link:
    """gpt-oss's fused gate_up_proj [E, h, 2f] (or its bias [E, 2f]) holds gate and up interleaved along the last
    dimension (gate at even columns, up at odd); ours are the gate (w_gate / b_gate) and the linear half (w1 / b1)."""
    return Link(ours, (theirs,), to_ours=lambda t: [t[0][..., 0::2], t[0][..., 1::2]],
                to_theirs=lambda t: [torch.stack(t, dim=-1).flatten(-2)])


def _gpt_oss_links(config: ModelConfig) -> list[Link]:
    links = _llama_outer_links(config)
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        links += [one(f"{ours}.ln1.weight", f"{theirs}.input_layernorm.weight"),
                  one(f"{ours}.ln2.weight", f"{theirs}.post_attention_layernorm.weight"),
                  one(f"{ours}.attention.sink.logits", f"{theirs}.self_attn.sinks")]
        for p in "qkvo":
            links += same_leaves(f"{ours}.attention.{p}_proj", f"{theirs}.self_attn.{p}_proj")
        links += same_leaves(f"{ours}.mlp.router", f"{theirs}.mlp.router")
        experts, moe = f"{ours}.mlp.experts", f"{theirs}.mlp.experts"
        links += [_interleaved((f"{experts}.w_gate", f"{experts}.w1"), f"{moe}.gate_up_proj"),
                  _interleaved((f"{experts}.b_gate", f"{experts}.b1"), f"{moe}.gate_up_proj_bias"),
                  one(f"{experts}.w2", f"{moe}.down_proj"),  # both [E, f, h], input-major
                  one(f"{experts}.b2", f"{moe}.down_proj_bias")]
    return links


def _deepseek_links(config: ModelConfig, interleaved: bool) -> list[Link]:
    """DeepSeek-V2/V3 with dense layers: Llama's names outside attention, MLA's q_a/q_b/kv_a/kv_b inside."""
    links = _llama_outer_links(config)
    heads, rotary = config.num_attention_heads, config.qk_pos_emb_head_dim
    query_rows = config.qk_head_dim + rotary
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        attention, attn = f"{ours}.attention", f"{theirs}.self_attn"
        experts = config.experts_in_layer(i)
        if experts:  # DeepSeek's MoE: Qwen-MoE's names, shared_experts, V3's score-correction bias
            links += _qwen_moe_links(config, ours, f"{theirs}.mlp", experts, shared_name="shared_experts")
            if config.moe_router_enable_expert_bias:
                links.append(one(f"{ours}.mlp.expert_bias", f"{theirs}.mlp.gate.e_score_correction_bias"))
        else:
            links += [one(f"{ours}.mlp.fc1.weight", f"{theirs}.mlp.up_proj.weight"),
                      one(f"{ours}.mlp.gate.weight", f"{theirs}.mlp.gate_proj.weight"),
                      one(f"{ours}.mlp.fc2.weight", f"{theirs}.mlp.down_proj.weight")]
        links += [one(f"{ours}.ln1.weight", f"{theirs}.input_layernorm.weight"),
                  one(f"{ours}.ln2.weight", f"{theirs}.post_attention_layernorm.weight"),
                  one(f"{attention}.kv_down_norm.weight", f"{attn}.kv_a_layernorm.weight"),
                  one(f"{attention}.kv_up_proj.weight", f"{attn}.kv_b_proj.weight"),
                  one(f"{attention}.o_proj.weight", f"{attn}.o_proj.weight"),
                  # kv_a's rows: the latent, then the one rotary key (a single "head" of latent + rotary rows)
                  _rotary_rows(f"{attention}.kv_down_proj.weight", f"{attn}.kv_a_proj_with_mqa.weight", 1,
                               config.kv_lora_rank + rotary, rotary, interleaved)]
        if config.q_lora_rank is None:
            links.append(_rotary_rows(f"{attention}.q_proj.weight", f"{attn}.q_proj.weight", heads, query_rows,
                                      rotary, interleaved))
        else:
            links += [one(f"{attention}.q_down_proj.weight", f"{attn}.q_a_proj.weight"),
                      one(f"{attention}.q_down_norm.weight", f"{attn}.q_a_layernorm.weight"),
                      _rotary_rows(f"{attention}.q_up_proj.weight", f"{attn}.q_b_proj.weight", heads, query_rows,
                                   rotary, interleaved)]
    return links


def _bert_links(config: ModelConfig) -> list[Link]:
    """HF BERT (post-LN) or Megatron-BERT (pre-LN, as the built-in BERT's default)."""
    links = [one("embedding.word_embeddings.weight", "bert.embeddings.word_embeddings.weight"),
             one("embedding.position_embeddings.weight", "bert.embeddings.position_embeddings.weight"),
             one("embedding.tokentype_embeddings.weight", "bert.embeddings.token_type_embeddings.weight"),
             *same_leaves("lm_head.dense", "cls.predictions.transform.dense"),
             *same_leaves("lm_head.norm", "cls.predictions.transform.LayerNorm"),
             one("lm_head.output.bias", "cls.predictions.bias")]
    if config.post_layernorm:
        links += same_leaves("embedding.norm", "bert.embeddings.LayerNorm")
    else:
        links += same_leaves("final_norm", "bert.encoder.ln")
    if not config.tie_embeddings:
        links.append(one("lm_head.output.weight", "cls.predictions.decoder.weight"))
    if config.bert_binary_head:
        links += same_leaves("pooler.dense", "bert.pooler.dense") + same_leaves("binary_head", "cls.seq_relationship")
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}", f"bert.encoder.layer.{i}"
        for p, name in zip("qkv", ("query", "key", "value"), strict=True):
            links += same_leaves(f"{ours}.attention.{p}_proj", f"{theirs}.attention.self.{name}")
        links += same_leaves(f"{ours}.attention.o_proj", f"{theirs}.attention.output.dense")
        links += same_leaves(f"{ours}.mlp.fc1", f"{theirs}.intermediate.dense")
        links += same_leaves(f"{ours}.mlp.fc2", f"{theirs}.output.dense")
        if config.post_layernorm:
            links += same_leaves(f"{ours}.ln1", f"{theirs}.attention.output.LayerNorm")
            links += same_leaves(f"{ours}.ln2", f"{theirs}.output.LayerNorm")
        else:
            links += same_leaves(f"{ours}.ln1", f"{theirs}.attention.ln") + same_leaves(f"{ours}.ln2", f"{theirs}.ln")
    return links


def links_for(hf_model_type: str, config: ModelConfig, interleaved: bool = True) -> list[Link]:
    """The family's map; `interleaved`: DeepSeek's rotary rows are in pairs (what the export writes)."""
    if hf_model_type in DEEPSEEK_FAMILY:
        return _deepseek_links(config, interleaved)
    if hf_model_type == "gpt2":
        return _gpt2_links(config)
    if hf_model_type == "bloom":
        return _bloom_links(config)
    if hf_model_type in LLAMA_FAMILY:
        return _llama_links(config, hf_model_type)
    if hf_model_type == "gpt_oss":
        return _gpt_oss_links(config)
    return _bert_links(config)


# ---- reading a folder ----

_BASE_PREFIXES = ("transformer.", "model.", "bert.")


def _normalized(name: str) -> str:
    """One spelling for names saved by the head class or the base class, and old BERT's gamma/beta."""
    for prefix in _BASE_PREFIXES:
        if name.startswith(prefix):
            name = name[len(prefix):]
            break
    if name.endswith(".gamma"):
        name = name[: -len("gamma")] + "weight"
    elif name.endswith(".beta"):
        name = name[: -len("beta")] + "bias"
    return name


class WeightsReader:
    """The tensors of a save_pretrained folder by name, read when asked for (safetensors memory-maps them)."""

    def __init__(self, folder: str | Path) -> None:
        self.folder = Path(folder)
        self._opened: dict[Path, Any] = {}
        self.location: dict[str, tuple[Path, str]] = {}  # normalized name → (file, name in the file)
        for file in self._weight_files():
            for name in self._open(file).keys():
                self.location[_normalized(name)] = (file, name)

    def _weight_files(self) -> list[Path]:
        for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                                   ("pytorch_model.bin.index.json", "pytorch_model.bin")):
            index = self.folder / index_name
            if index.exists():
                return [self.folder / shard for shard in _shards(index)]
            if (self.folder / single).exists():
                return [self.folder / single]
        raise UnsupportedModel(
            f"{self.folder} holds no model.safetensors or pytorch_model.bin (nor their .index.json shards)"
        )

    def _open(self, file: Path) -> Any:
        if file not in self._opened:
            try:
                if file.suffix == ".safetensors":
                    from safetensors import safe_open

                    self._opened[file] = safe_open(str(file), framework="pt")
                else:  # weights_only: plain tensors only, no pickled code runs
                    loaded = _load_state_dict(file)
                    if not isinstance(loaded, dict):
                        raise TypeError(f"a {type(loaded).__name__}, not a state dict")
                    self._opened[file] = loaded
            except pickle.UnpicklingError as error:
                raise refuse_pickled_weights(file, error) from None
            except Exception as error:  # noqa: BLE001 - safetensors and torch say "damaged" in their own types
                raise _damaged(file, error) from None
        return self._opened[file]

    def get(self, name: str) -> torch.Tensor:
        if _normalized(name) not in self.location:
            raise UnsupportedModel(f"{self.folder}: no weight {name!r} in the folder's files")
        file, stored = self.location[_normalized(name)]
        opened = self._open(file)
        try:
            value = opened.get_tensor(stored) if file.suffix == ".safetensors" else opened[stored]
        except Exception as error:  # noqa: BLE001 - a header that promises bytes the file does not hold
            raise _damaged(file, error) from None
        if not isinstance(value, torch.Tensor):
            raise _damaged(file, TypeError(f"{stored} is a {type(value).__name__}, not a tensor"))
        return value


def _load_state_dict(file: Path) -> Any:
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as error:
        if "mmap can only be used" not in str(error):
            raise
        # torch's legacy (pre-zip) format: read whole, memory-mapping needs the zip layout
        return torch.load(file, map_location="cpu", weights_only=True)


def _damaged(file: Path, error: BaseException) -> UnsupportedModel:
    reason = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
    return UnsupportedModel(f"{file}: cannot be read ({type(error).__name__}: {reason}); the weights are damaged or "
                            "truncated: copy or save the model again (save_pretrained)")


def _shards(index: Path) -> list[str]:
    """The shard files a .index.json names: file names in its folder (a damaged index is refused, naming it)."""
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        shards = sorted(set(weight_map.values()))
        if not all(isinstance(shard, str) and shard and Path(shard).name == shard for shard in shards):
            raise TypeError("its shard names are not file names")
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise UnsupportedModel(f"{index}: damaged ({type(error).__name__}: {error}); save the model again "
                               "(save_pretrained)") from None
    missing = [shard for shard in shards if not (index.parent / shard).is_file()]
    if missing:
        raise UnsupportedModel(f"{index} names shards that are not in {index.parent}: {', '.join(missing[:3])}; "
                               "copy the whole folder")
    return shards


# ---- into a built-in model ----

VOCABULARY_ROWS = ("embedding.word_embeddings.weight", "output.weight", "lm_head.output.weight", "lm_head.output.bias")


def _fit(name: str, value: torch.Tensor, shape: torch.Size, source: str) -> torch.Tensor:
    """The value for a parameter of `shape`; vocabulary rows the padding added start at zero."""
    if name in VOCABULARY_ROWS and value.shape[0] < shape[0] and value.shape[1:] == shape[1:]:
        padding = value.new_zeros((shape[0] - value.shape[0], *value.shape[1:]))
        value = torch.cat([value, padding])
    if value.shape != shape:
        raise UnsupportedModel(f"{source}: {name} needs shape {tuple(shape)}, the folder's weights give "
                               f"{tuple(value.shape)}")
    return value


def load_hf_weights(model: nn.Module, folder: str | Path) -> None:
    """Give every parameter of a built-in model (whole, a pipeline stage, or DTensor-sharded) its value from
    the Hugging Face folder; the model's shape must be the folder's (hf_config.builtin_flags)."""
    config: ModelConfig = model.config  # type: ignore[assignment]
    hf_config = read_config(str(folder))
    links = links_for(family(hf_config), config, rope_interleaved(hf_config))
    by_name = {name: link for link in links for name in link.ours}
    reader = WeightsReader(folder)
    ready: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, _module, param in canonical_parameters(model):
            if name not in by_name:
                raise UnsupportedModel(f"{folder}: nothing in the Hugging Face map gives the built-in {name}")
            if name not in ready:  # a link may make several tensors at once (GPT-2's q, k, v)
                link = by_name[name]
                ready.update(zip(link.ours, link.to_ours([reader.get(t) for t in link.theirs]), strict=True))
            value = _fit(name, ready.pop(name), param.shape, str(folder))
            set_parameter(param, value.to(param.dtype))
        for buffer_name, buffer in model.named_buffers():  # buffers the map names (DeepSeek-V3's expert bias)
            name = canonical_name(buffer_name)
            if name in by_name:
                buffer.copy_(by_name[name].to_ours([reader.get(t) for t in by_name[name].theirs])[0])


# ---- out of a built-in model ----


def export_family(config: ModelConfig) -> str:
    """The Hugging Face model_type that holds this built-in model exactly, or UnsupportedModel saying why not."""
    if config.rotary_interleaved:
        raise UnsupportedModel("the Hugging Face export's rotary families (Llama, Qwen, DeepSeek, gpt-oss) rotate "
                               "halves; --rotary-interleaved's adjacent pairs are none of them")
    if config.squared_relu:
        raise UnsupportedModel("the Hugging Face export writes GELU or gated MLPs; --squared-relu's relu(x)² is "
                               "in none of its families")
    if config.multi_latent_attention:
        return _deepseek_export(config)
    problems: list[str] = []

    def need(condition: bool, text: str) -> None:
        if not condition:
            problems.append(text)

    gelu_mlp = not config.gated_linear_unit
    need(config.position_embedding_type != "rope" or config.rotary_percent == 1.0, "--rotary-percent 1.0")
    if config.normalization == "LayerNorm" or config.model_type == "bert":
        need(not config.qk_layernorm and config.head_dim * config.num_attention_heads == config.hidden_size,
             "no --qk-layernorm and no --kv-channels (Hugging Face has them in Llama-family models only)")
    if config.model_type == "bert":
        need(config.normalization == "LayerNorm", "--normalization LayerNorm")
        need(config.position_embedding_type == "learned_absolute", "learned absolute positions")
        need(gelu_mlp and config.add_bias_linear and config.query_groups == config.num_attention_heads,
             "GELU MLPs with biases and one key/value head per head")
        need(not any(config.num_experts), "dense MLPs (no --num-experts)")
        need(not config.embed_layernorm, "no --embed-layernorm")
        kind = "bert" if config.post_layernorm else "megatron-bert"
    elif config.normalization == "LayerNorm" and (config.position_embedding_type == "alibi" or config.embed_layernorm):
        need(config.position_embedding_type == "alibi" and config.embed_layernorm,
             "--position-embedding-type alibi with --embed-layernorm (BLOOM has both)")
        need(gelu_mlp and config.add_bias_linear and config.openai_gelu,
             "GELU MLPs with biases and --openai-gelu (BLOOM's tanh GELU)")
        need(config.ffn_size == 4 * config.hidden_size, "--ffn-hidden-size 4 × hidden (BLOOM)")
        need(config.query_groups == config.num_attention_heads, "one key/value head per head (BLOOM)")
        need(not any(config.num_experts) and not config.post_layernorm, "dense pre-LN layers (BLOOM)")
        kind = "bloom"
    elif config.normalization == "LayerNorm":
        need(config.position_embedding_type == "learned_absolute", "learned absolute positions (GPT-2)")
        need(gelu_mlp and config.add_bias_linear, "GELU MLPs with biases (GPT-2)")
        need(config.query_groups == config.num_attention_heads, "one key/value head per head (GPT-2)")
        need(not any(config.num_experts) and not config.post_layernorm, "dense pre-LN layers (GPT-2)")
        kind = "gpt2"
    elif config.quick_geglu or config.softmax_type != "vanilla":
        kind = "gpt_oss"
        _need_gpt_oss(config, need)
    else:
        kind = _llama_kind(config, need)
        need(kind not in ("qwen2", "qwen2_moe")
             or config.kv_channels in (None, config.hidden_size // config.num_attention_heads),
             "no --kv-channels (Qwen2's config has no head_dim)")
    if kind != "gpt_oss":
        need(config.softmax_type == "vanilla", "--softmax-type vanilla (of the Hugging Face families here only "
             "gpt-oss has attention sinks)")
        need(config.activation_clamp is None and not config.glu_linear_offset,
             "no --activation-func-clamp-value or --glu-linear-offset (gpt-oss's alone)")
    need(config.rope_scaling == "none" or config.rotary_interpolation_factor == 1,
         "one rope scaling (--use-rope-scaling or --rotary-seq-len-interpolation-factor, not both)")
    need(config.sliding_window is None or kind in ("mistral", "mixtral", "gpt_oss"),
         "no --sliding-window (of the Hugging Face families here only Mistral, Mixtral and gpt-oss have one)")
    need(not (config.sliding_window and config.window_skip_freq) or kind == "gpt_oss",
         "no --window-attn-skip-freq (Mistral's window covers every layer)")
    if problems:
        raise UnsupportedModel(
            f"no Hugging Face architecture holds this {config.architecture} exactly; exporting it as "
            f"{kind} needs " + "; ".join(problems)
        )
    return kind


def _deepseek_export(config: ModelConfig) -> str:
    """DeepSeek-V3 holds a dense GPT with multi-head latent attention (V3's config also reads every V2)."""
    problems = [text for holds, text in (
        (config.model_type == "gpt", "a GPT (DeepSeek is a causal LM)"),
        (config.normalization == "RMSNorm" and config.swiglu and not config.add_bias_linear,
         "--normalization RMSNorm, --swiglu and --disable-bias-linear"),
        (config.qk_layernorm, "--qk-layernorm (DeepSeek's RMSNorms on the latents)"),
        (config.position_embedding_type == "rope", "--position-embedding-type rope (no learned position table)"),
        (config.layernorm_epsilon == 1e-6, "--norm-epsilon 1e-6 (transformers' DeepSeek normalises the latents "
                                           "with it whatever rms_norm_eps says)"),
        *_deepseek_moe_needs(config),
        (not config.post_layernorm and not config.embed_layernorm, "pre-norm layers, no --embed-layernorm"),
        (config.sliding_window is None, "no --sliding-window"),
        (config.rotary_interpolation_factor == 1 and config.rope_scaling in ("none", "yarn"),
         "plain rope or YaRN (no --use-rope-scaling or --rotary-seq-len-interpolation-factor)"),
    ) if not holds]
    kind = "deepseek_v2" if any(config.num_experts) and config.moe_router_score_function == "softmax" \
        else "deepseek_v3"
    if problems:
        raise UnsupportedModel(f"no Hugging Face architecture holds this {config.architecture} exactly; exporting it "
                               f"as {kind} needs " + "; ".join(problems))
    return kind


def _deepseek_moe_needs(config: ModelConfig) -> list[tuple[bool, str]]:
    """What DeepSeek's MoE layers need of the built-in ones: dense layers first then one expert count, shared experts
    a multiple of the routed size, no gate or PR-MoE; V3's sigmoid router (normalised k > 1, as Megatron's) or V2's
    softmax kept as it is."""
    if not any(config.num_experts):
        return []
    dense = _leading_dense(config)
    routed = set(config.num_experts[dense:])
    shared = config.moe_shared_expert_intermediate_size or 0
    softmax = config.moe_router_score_function == "softmax"
    return [
        (len(routed) == 1 and 0 not in routed, "dense layers first, then MoE layers of one expert count "
                                               "(first_k_dense_replace)"),
        (shared % config.expert_ffn_size == 0, "shared experts of a multiple of the routed experts' size"),
        (not config.moe_shared_expert_gate and not config.moe_residual, "no --moe-shared-expert-gate or PR-MoE"),
        (config.moe_router_score_function in ("softmax", "sigmoid"), "a softmax (V2) or sigmoid (V3) router"),
        (not softmax or config.moe_router_pre_softmax or config.moe_router_topk == 1,
         "--moe-router-pre-softmax with a softmax router (DeepSeek-V2 keeps the k probabilities as they are)"),
        (not softmax or not (config.moe_router_num_groups or config.moe_router_enable_expert_bias),
         "no groups or expert bias with a softmax router (DeepSeek-V2's greedy routing)"),
    ]


def _leading_dense(config: ModelConfig) -> int:
    """How many layers come before the first MoE layer (DeepSeek's first_k_dense_replace)."""
    return next((i for i, experts in enumerate(config.num_experts) if experts), config.num_layers)


def _need_gpt_oss(config: ModelConfig, need: Callable[[bool, str], None]) -> None:
    """What Hugging Face's GptOss fixes: its attention (rope, biases, learned sinks), every layer MoE with a biased
    router and top-k > 1, and experts with biases and the clamped quick-GEGLU (offset 1)."""
    need(config.position_embedding_type == "rope" and config.rotary_percent == 1.0, "rope over whole heads")
    need(config.softmax_type == "learnable", "--softmax-type learnable (gpt-oss's sinks)")
    need(config.quick_geglu and config.activation_clamp is not None and config.glu_linear_offset == 1.0,
         "--quick-geglu with --activation-func-clamp-value and --glu-linear-offset 1 (gpt-oss's experts)")
    need(config.add_bias_linear and config.moe_router_bias, "biases in every linear layer and the router")
    need(bool(config.num_experts) and all(config.num_experts) and len(set(config.num_experts)) == 1,
         "the same number of experts in every layer (gpt-oss has no dense layer)")
    need(config.moe_router_topk > 1, "--moe-router-topk 2 or more (gpt-oss renormalises the top-k weights)")
    need(not config.qk_layernorm and not config.post_layernorm and not config.embed_layernorm and
         not config.moe_residual, "pre-norm layers without --qk-layernorm, --embed-layernorm or PR-MoE")


def hf_rope_parameters(config: ModelConfig) -> dict[str, Any]:
    """Hugging Face's rope_parameters of the built-in rope: default, llama3 (Megatron's fixed factors) or linear."""
    parameters: dict[str, Any] = {"rope_type": "default", "rope_theta": float(config.rotary_base)}
    if config.rope_scaling == "llama3":
        parameters |= {"rope_type": "llama3", "factor": config.rope_scaling_factor,
                       "low_freq_factor": config.rope_low_freq_factor,
                       "high_freq_factor": config.rope_high_freq_factor,
                       "original_max_position_embeddings": config.rope_original_max_positions}
    elif config.rope_scaling == "yarn":  # attention_factor written out: transformers ignores a lone mscale
        parameters |= {"rope_type": "yarn", "factor": config.rope_scaling_factor,
                       "original_max_position_embeddings": config.rope_original_max_positions,
                       "beta_fast": config.yarn_beta_fast, "beta_slow": config.yarn_beta_slow,
                       "mscale": config.yarn_mscale, "mscale_all_dim": config.yarn_mscale_all_dim,
                       "truncate": config.yarn_round_range, "attention_factor": rope_attention_factor(config)}
    elif config.rotary_interpolation_factor != 1:
        parameters |= {"rope_type": "linear", "factor": config.rotary_interpolation_factor}
    return parameters


def _llama_kind(config: ModelConfig, need: Callable[[bool, str], None]) -> str:
    """The Llama-family architecture the built-in model's flags describe: Mixtral, Qwen3, Qwen2, Mistral or Llama."""
    need(config.position_embedding_type == "rope" and config.swiglu and not config.add_bias_linear,
         "rope, --swiglu and --disable-bias-linear (Llama)")
    need(not config.moe_router_bias, "a router without a bias")
    need(not config.post_layernorm and not config.embed_layernorm, "pre-norm layers, no --embed-layernorm")
    if any(config.num_experts):
        need(config.moe_router_score_function == "softmax" and not config.moe_router_enable_expert_bias
             and not config.moe_router_num_groups and not config.moe_router_topk_scaling_factor
             and not config.moe_residual,
             "a softmax router without expert bias, groups or scaling, and no PR-MoE (Mixtral, Qwen-MoE)")
        routed = {experts for experts in config.num_experts if experts}
        need(len(routed) == 1, "the same number of experts in every MoE layer")
        if config.moe_shared_expert_intermediate_size or config.qk_layernorm:
            kind = "qwen3_moe" if config.qk_layernorm else "qwen2_moe"
            need(not (config.moe_shared_expert_intermediate_size and config.qk_layernorm),
                 "shared experts (Qwen2-MoE) or --qk-layernorm (Qwen3-MoE), not both")
            need(kind == "qwen3_moe" or config.moe_shared_expert_gate,
                 "--moe-shared-expert-gate with shared experts (Qwen2-MoE gates its shared expert)")
            need(kind == "qwen2_moe" or not config.add_qkv_bias, "no --add-qkv-bias (Qwen3-MoE)")
            need(config.moe_router_topk > 1 or config.moe_router_pre_softmax,
                 "--moe-router-pre-softmax with top-1 (Qwen-MoE renormalises a single weight to 1 otherwise)")
            return kind
        need(all(config.num_experts), "every layer MoE (Mixtral; dense layers export as Qwen-MoE's mlp_only_layers "
             "with --qk-layernorm or shared experts)")
        need(config.expert_ffn_size == config.ffn_size, "no --moe-ffn-hidden-size other than --ffn-hidden-size "
             "(Mixtral)")
        need(config.moe_router_topk > 1 and not config.moe_router_pre_softmax,
             "--moe-router-topk 2 or more without --moe-router-pre-softmax (Mixtral renormalises the top-k weights)")
        need(not config.add_qkv_bias, "no --add-qkv-bias (Mixtral)")
        return "mixtral"
    if config.qk_layernorm:
        need(not config.add_qkv_bias, "no --add-qkv-bias (Qwen3)")
        need(not config.sliding_window, "no --sliding-window (Qwen3's window covers some layers only)")
        return "qwen3"
    if config.add_qkv_bias:
        return "qwen2"
    return "mistral" if config.sliding_window else "llama"


def hf_config_for(config: ModelConfig, kind: str) -> Any:
    """The transformers config object (GPT2Config, LlamaConfig, ...) of the exported model."""
    import transformers

    tie, dropout = config.tie_embeddings, config.attention_dropout
    if kind == "gpt2":
        return transformers.GPT2Config(
            vocab_size=config.vocab_size, n_positions=config.max_position_embeddings, n_embd=config.hidden_size,
            n_layer=config.num_layers, n_head=config.num_attention_heads, n_inner=config.ffn_size,
            activation_function="gelu_new" if config.openai_gelu else "gelu", resid_pdrop=config.hidden_dropout,
            embd_pdrop=config.hidden_dropout, attn_pdrop=dropout, layer_norm_epsilon=config.layernorm_epsilon,
            initializer_range=config.init_method_std, tie_word_embeddings=tie, bos_token_id=None, eos_token_id=None,
            architectures=["GPT2LMHeadModel"])
    if kind == "bloom":
        return transformers.BloomConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, n_layer=config.num_layers,
            n_head=config.num_attention_heads, layer_norm_epsilon=config.layernorm_epsilon,
            hidden_dropout=config.hidden_dropout, attention_dropout=dropout, initializer_range=config.init_method_std,
            apply_residual_connection_post_layernorm=False, tie_word_embeddings=tie, bos_token_id=None,
            eos_token_id=None, architectures=["BloomForCausalLM"])
    if kind == "gpt_oss":
        if config.activation_clamp is None:  # export_family requires it: gpt-oss always clamps
            raise UnsupportedModel("gpt-oss's experts clamp: give --activation-func-clamp-value")
        return transformers.GptOssConfig(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.query_groups, head_dim=config.head_dim,
            max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
            rope_parameters=hf_rope_parameters(config), tie_word_embeddings=tie, attention_dropout=dropout,
            initializer_range=config.init_method_std, num_local_experts=max(config.num_experts),
            num_experts_per_tok=config.moe_router_topk, router_aux_loss_coef=config.moe_aux_loss_coeff,
            swiglu_limit=config.activation_clamp, sliding_window=config.sliding_window, attention_bias=True,
            layer_types=["full_attention" if config.window_of_layer(i) is None else "sliding_attention"
                         for i in range(config.num_layers)],
            bos_token_id=None, eos_token_id=None, architectures=["GptOssForCausalLM"])
    if kind in DEEPSEEK_FAMILY:
        layers = config.num_layers
        experts = max(config.num_experts) if any(config.num_experts) else None
        moe: dict[str, Any] = {}
        if experts:
            moe = dict(n_routed_experts=experts, num_experts_per_tok=config.moe_router_topk,
                       moe_intermediate_size=config.expert_ffn_size,
                       n_shared_experts=(config.moe_shared_expert_intermediate_size or 0) // config.expert_ffn_size,
                       routed_scaling_factor=config.moe_router_topk_scaling_factor or 1.0)
        if kind == "deepseek_v2":
            return transformers.DeepseekV2Config(
                vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
                num_hidden_layers=layers, first_k_dense_replace=_leading_dense(config), **moe, topk_method="greedy",
                n_group=1, topk_group=1, num_attention_heads=config.num_attention_heads,
                num_key_value_heads=config.num_attention_heads, q_lora_rank=config.q_lora_rank,
                kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_head_dim,
                qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim,
                max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
                rope_parameters=hf_rope_parameters(config), tie_word_embeddings=tie, attention_bias=False,
                attention_dropout=dropout, initializer_range=config.init_method_std, hidden_act="silu",
                bos_token_id=None, eos_token_id=None, architectures=["DeepseekV2ForCausalLM"])
        if experts:
            groups = config.moe_router_num_groups or 1
            moe |= dict(n_group=groups, topk_group=config.moe_router_group_topk or groups,
                        norm_topk_prob=config.moe_router_topk > 1)
        return transformers.DeepseekV3Config(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
            num_hidden_layers=layers, first_k_dense_replace=_leading_dense(config), **moe,
            num_attention_heads=config.num_attention_heads, num_key_value_heads=config.num_attention_heads,
            q_lora_rank=config.q_lora_rank, kv_lora_rank=config.kv_lora_rank, qk_nope_head_dim=config.qk_head_dim,
            qk_rope_head_dim=config.qk_pos_emb_head_dim, v_head_dim=config.v_head_dim, rope_interleave=True,
            max_position_embeddings=config.max_position_embeddings, rms_norm_eps=config.layernorm_epsilon,
            rope_parameters=hf_rope_parameters(config), tie_word_embeddings=tie, attention_bias=False,
            attention_dropout=dropout, initializer_range=config.init_method_std, hidden_act="silu",
            bos_token_id=None, eos_token_id=None, architectures=["DeepseekV3ForCausalLM"])
    if kind in LLAMA_FAMILY:
        # Any: the values are of mixed types, each the one its transformers keyword takes.
        common: dict[str, Any] = dict(
            vocab_size=config.vocab_size, hidden_size=config.hidden_size, intermediate_size=config.ffn_size,
            num_hidden_layers=config.num_layers, num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.query_groups, max_position_embeddings=config.max_position_embeddings,
            rms_norm_eps=config.layernorm_epsilon, rope_parameters=hf_rope_parameters(config),
            tie_word_embeddings=tie, attention_dropout=dropout, initializer_range=config.init_method_std,
            hidden_act="silu", bos_token_id=None, eos_token_id=None)
        if kind not in ("qwen2", "qwen2_moe"):  # Qwen2's config has no head_dim (export_family refuses --kv-channels)
            common["head_dim"] = config.head_dim
        if kind in QWEN_MOE:
            qwen_moe: dict[str, Any] = dict(
                moe_intermediate_size=config.expert_ffn_size, num_experts=max(config.num_experts),
                num_experts_per_tok=config.moe_router_topk, norm_topk_prob=not config.moe_router_pre_softmax,
                decoder_sparse_step=1, mlp_only_layers=[i for i, e in enumerate(config.num_experts) if not e],
                router_aux_loss_coef=config.moe_aux_loss_coeff, use_sliding_window=False)
            if kind == "qwen2_moe":
                return transformers.Qwen2MoeConfig(
                    **common, **qwen_moe, qkv_bias=config.add_qkv_bias,
                    shared_expert_intermediate_size=config.moe_shared_expert_intermediate_size or 0,
                    architectures=["Qwen2MoeForCausalLM"])
            return transformers.Qwen3MoeConfig(**common, **qwen_moe, attention_bias=False,
                                               architectures=["Qwen3MoeForCausalLM"])
        if kind == "qwen3":
            return transformers.Qwen3Config(**common, attention_bias=False, use_sliding_window=False,
                                            architectures=["Qwen3ForCausalLM"])
        if kind == "mixtral":
            return transformers.MixtralConfig(
                **common, sliding_window=config.sliding_window, num_local_experts=max(config.num_experts),
                num_experts_per_tok=config.moe_router_topk,
                router_aux_loss_coef=config.moe_aux_loss_coeff, router_jitter_noise=config.moe_jitter_eps,
                architectures=["MixtralForCausalLM"])
        if kind == "qwen2":
            return transformers.Qwen2Config(**common, use_sliding_window=False, architectures=["Qwen2ForCausalLM"])
        if kind == "mistral":
            return transformers.MistralConfig(**common, sliding_window=config.sliding_window,
                                              architectures=["MistralForCausalLM"])
        return transformers.LlamaConfig(**common, attention_bias=False, mlp_bias=False,
                                        architectures=["LlamaForCausalLM"])
    bert_class = transformers.BertConfig if kind == "bert" else transformers.MegatronBertConfig
    head = "ForPreTraining" if config.bert_binary_head else "ForMaskedLM"
    return bert_class(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size, num_hidden_layers=config.num_layers,
        num_attention_heads=config.num_attention_heads, intermediate_size=config.ffn_size,
        hidden_act="gelu_new" if config.openai_gelu else "gelu",
        hidden_dropout_prob=config.hidden_dropout, attention_probs_dropout_prob=dropout,
        max_position_embeddings=config.max_position_embeddings, type_vocab_size=2,
        layer_norm_eps=config.layernorm_epsilon, initializer_range=config.init_method_std, tie_word_embeddings=tie,
        architectures=[("Bert" if kind == "bert" else "MegatronBert") + head])


def hf_state_dict(state: dict[str, torch.Tensor], config: ModelConfig, kind: str) -> dict[str, torch.Tensor]:
    """The built-in model's whole state dict in the Hugging Face family's names and layouts."""
    out: dict[str, torch.Tensor] = {}
    for link in links_for(kind, config):
        missing = [name for name in link.ours if name not in state]
        if missing:
            raise UnsupportedModel(f"the checkpoint has no {', '.join(missing)} for the {kind} export")
        out.update(zip(link.theirs, link.to_theirs([state[name] for name in link.ours]), strict=True))
    if kind == "deepseek_v3":  # V3 always has its score-correction bias: zeros where the built-in router has none
        for i, experts in enumerate(config.num_experts):
            name = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
            if experts and name not in out:
                out[name] = torch.zeros(experts)
    if kind in ("bert", "megatron-bert"):  # transformers ties the decoder's bias to cls.predictions.bias
        out["cls.predictions.decoder.bias"] = out["cls.predictions.bias"].clone()
    return {name: tensor.contiguous() for name, tensor in out.items()}


def save_hf_folder(state: dict[str, torch.Tensor], config: ModelConfig, output: str | Path,
                   tokenizer_folder: str | None = None, max_shard_size: str = "5GB",
                   token_ids: dict[str, int] | None = None) -> str:
    """Write config.json and safetensors (sharded past `max_shard_size`) that transformers' from_pretrained
    loads; copy the Hugging Face tokenizer the model trained with, when there is one. `token_ids` (eos_token_id,
    bos_token_id, pad_token_id: data/hf_tokenizer.special_token_ids) go into config.json and generation_config.json,
    so that transformers' generate stops at the run's end of document by itself. Returns the family."""
    from huggingface_hub import split_torch_state_dict_into_shards
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    kind = export_family(config)
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    hf_config = hf_config_for(config, kind)
    for name, value in (token_ids or {}).items():
        setattr(hf_config, name, value)
    hf_config.save_pretrained(output)
    if token_ids and kind not in ("bert", "megatron-bert"):  # generate reads them from generation_config.json
        GenerationConfig.from_model_config(hf_config).save_pretrained(output)
    tensors = hf_state_dict(state, config, kind)
    split = split_torch_state_dict_into_shards(tensors, max_shard_size=max_shard_size)
    for file, names in split.filename_to_tensors.items():
        save_file({name: tensors[name] for name in names}, str(output / file), metadata={"format": "pt"})
    if split.is_sharded:
        index = {"metadata": {"total_size": split.metadata.get("total_size")}, "weight_map": split.tensor_to_filename}
        (output / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    if tokenizer_folder and any((Path(tokenizer_folder) / name).exists() for name in TOKENIZER_FILES):
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True).save_pretrained(output)
    return kind
