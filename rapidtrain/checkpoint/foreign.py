"""--load of another tool's checkpoint (Megatron-LM legacy and torch_dist, DeepSpeed / Megatron-DeepSpeed, DeepSpeed's
universal checkpoints) into this run's layout.

Every rank reads the whole model from the files (data only, foreign_pickle), merged from the saved tensor and
pipeline ranks into the built-in GPT's names (megatron_layout), checks the saved run's model flags against this
run's, and fills its runner's load template from it: each parameter whole, or the shard this rank holds (a DTensor
under tensor parallelism or FSDP, a ZeRO partition), as resuming a rapidtrain checkpoint in another layout does.
The position (iteration, consumed samples) and the learning-rate schedule carry over with --load; --finetune
(and a `release` checkpoint, as in Megatron) takes the weights only, from iteration 0. Adam's moments carry over
where the format keeps them by parameter name (DeepSpeed ZeRO stage 1/2's optimizer files, a universal checkpoint's
zero/<parameter>/exp_avg*.pt), merged as the weights
are and put into this run's optimizer state template; Megatron-LM's optimizer state (kept per rank in its own flat
or per-parameter orders) is not mapped, and the optimizer then starts fresh; the log says which.
"""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from rapidtrain.checkpoint.checkpointer import LoadedState, RunnerState
from rapidtrain.checkpoint.compatibility import CheckpointError
from rapidtrain.checkpoint.foreign_formats import ForeignCheckpoint
from rapidtrain.checkpoint.megatron_layout import fit_vocabulary, merge_stages
from rapidtrain.checkpoint.megatron_legacy import ForeignState
from rapidtrain.checkpoint.resume import changed_schedule_flags, load_schedule
from rapidtrain.models.config import ModelConfig

# The saved run's Megatron args that fix the model's shape: (arg, this run's value from its ModelConfig, the flag).
_SHAPE_ARGS: tuple[tuple[str, typing.Callable[[ModelConfig], Any], str], ...] = (
    ("num_layers", lambda c: c.num_layers, "--num-layers"),
    ("hidden_size", lambda c: c.hidden_size, "--hidden-size"),
    ("num_attention_heads", lambda c: c.num_attention_heads, "--num-attention-heads"),
    ("ffn_hidden_size", lambda c: c.ffn_size, "--ffn-hidden-size"),
    ("kv_channels", lambda c: c.head_dim, "--kv-channels"),
    ("swiglu", lambda c: c.swiglu, "--swiglu"),
    ("normalization", lambda c: c.normalization, "--normalization"),
    ("position_embedding_type", lambda c: c.position_embedding_type, "--position-embedding-type"),
    ("untie_embeddings_and_output_weights", lambda c: not c.tie_embeddings, "--untie-embeddings-and-output-weights"),
    ("add_bias_linear", lambda c: c.add_bias_linear, "--disable-bias-linear"),
    ("qk_layernorm", lambda c: c.qk_layernorm, "--qk-layernorm"),
    ("multi_latent_attention", lambda c: c.multi_latent_attention, "--multi-latent-attention"),
)
# Multi-head latent attention's sizes, compared where the checkpoint has it (Megatron saves its defaults otherwise).
_MLA_ARGS: tuple[tuple[str, typing.Callable[[ModelConfig], Any], str], ...] = (
    ("q_lora_rank", lambda c: c.q_lora_rank, "--q-lora-rank"),
    ("kv_lora_rank", lambda c: c.kv_lora_rank, "--kv-lora-rank"),
    ("qk_head_dim", lambda c: c.qk_head_dim, "--qk-head-dim"),
    ("qk_pos_emb_head_dim", lambda c: c.qk_pos_emb_head_dim, "--qk-pos-emb-head-dim"),
    ("v_head_dim", lambda c: c.v_head_dim, "--v-head-dim"),
)
# Mixture-of-experts sizes, compared where the checkpoint has experts.
_MOE_ARGS: tuple[tuple[str, typing.Callable[[ModelConfig], Any], str], ...] = (
    ("moe_ffn_hidden_size", lambda c: c.expert_ffn_size, "--moe-ffn-hidden-size"),
    ("moe_shared_expert_intermediate_size", lambda c: c.moe_shared_expert_intermediate_size,
     "--moe-shared-expert-intermediate-size"),
    ("moe_shared_expert_gate", lambda c: c.moe_shared_expert_gate, "--moe-shared-expert-gate"),
    ("moe_router_enable_expert_bias", lambda c: c.moe_router_enable_expert_bias, "--moe-router-enable-expert-bias"),
)


# Saved args that change what the model computes, not its shape: (args, this run's value, the flag). A difference is
# said in the log (the weights still load: a user may mean it, as when extending the context by the rope base).
_FUNCTION_ARGS: tuple[tuple[tuple[str, ...], typing.Callable[[ModelConfig], Any], str], ...] = (
    (("rotary_base",), lambda c: c.rotary_base, "--rotary-base"),
    (("rotary_percent",), lambda c: c.rotary_percent, "--rotary-percent"),
    (("norm_epsilon", "layernorm_epsilon"), lambda c: c.layernorm_epsilon, "--norm-epsilon"),
    (("moe_router_topk",), lambda c: c.moe_router_topk if any(c.num_experts) else None, "--moe-router-topk"),
)


def function_differences(saved_args: dict[str, Any], config: ModelConfig) -> list[str]:
    """`--flag (checkpoint A, now B)` for each flag that changes the model's function (not its shape)."""
    differing = []
    rope = config.position_embedding_type == "rope"
    for names, ours, flag in _FUNCTION_ARGS:
        saved = next((saved_args[n] for n in names if isinstance(saved_args.get(n), (int, float))), None)
        if saved is None or (flag.startswith("--rotary") and not rope) or ours(config) is None:
            continue
        if abs(float(saved) - float(ours(config))) > 1e-12 * max(1.0, abs(float(saved))):
            differing.append(f"{flag} (checkpoint {saved}, now {ours(config)})")
    return differing


def model_config(plan_model: dict[str, Any]) -> ModelConfig:
    """This run's ModelConfig from the plan's model settings as JSON values (lists back to tuples)."""
    names = {f.name for f in dataclasses.fields(ModelConfig)}
    values: dict[str, Any] = {k: tuple(v) if isinstance(v, list) else v for k, v in plan_model.items() if k in names}
    return ModelConfig(**values)


def read_foreign(checkpoint: ForeignCheckpoint) -> ForeignState:
    if checkpoint.kind == "megatron-legacy":
        from rapidtrain.checkpoint.megatron_legacy import read_megatron_legacy

        return read_megatron_legacy(checkpoint)
    if checkpoint.kind == "deepspeed":
        from rapidtrain.checkpoint.deepspeed_folder import read_deepspeed

        return read_deepspeed(checkpoint)
    if checkpoint.kind == "deepspeed-universal":
        from rapidtrain.checkpoint.deepspeed_universal import read_deepspeed_universal

        return read_deepspeed_universal(checkpoint)
    if checkpoint.kind == "megatron-torch-dist":
        from rapidtrain.checkpoint.megatron_dist import read_megatron_dist

        return read_megatron_dist(checkpoint)
    raise CheckpointError(f"--load {checkpoint.root}: a {checkpoint.describe()}, which this rapidtrain does not read")


def saved_experts(saved_args: dict[str, Any]) -> tuple[int, ...] | None:
    """Experts per layer of the saved run (Megatron-Core's --num-experts and --moe-layer-freq: every Nth layer from
    the first, or a 0/1 list); None where its args do not say."""
    layers, experts, freq = (saved_args.get(k) for k in ("num_layers", "num_experts", "moe_layer_freq"))
    if not isinstance(layers, int) or "num_experts" not in saved_args:
        return None
    if not experts:
        return (0,) * layers
    if isinstance(freq, (list, tuple)) and len(freq) == layers:
        return tuple(experts if bit else 0 for bit in freq)
    every = freq if isinstance(freq, int) and freq > 0 else 1
    return tuple(experts if i % every == 0 else 0 for i in range(layers))


def _moe_differences(saved_args: dict[str, Any], config: ModelConfig) -> list[str]:
    saved = saved_experts(saved_args)
    if saved is None:
        return []
    ours = config.num_experts or (0,) * config.num_layers
    if len(saved) == len(ours) and saved != tuple(ours):
        def words(counts: tuple[int, ...]) -> str:
            moe = [str(i) for i, count in enumerate(counts) if count]
            return f"{max(counts)} experts in layers {', '.join(moe)}" if moe else "no experts"
        return [f"--num-experts / --moe-layer-freq (checkpoint {words(saved)}, now {words(tuple(ours))})"]
    if not any(saved):
        return []
    return [f"{flag} (checkpoint {saved_args[name]!r}, now {ours_value!r})" for name, value, flag in _MOE_ARGS
            if name in saved_args and saved_args[name] != (ours_value := value(config))
            and not (saved_args[name] in (None, False, 0) and ours_value in (None, False, 0))]


def shape_differences(saved_args: dict[str, Any], config: ModelConfig) -> list[str]:
    """`--flag (checkpoint A, now B)` for each shape flag the saved args record with another value."""
    differing = []
    latent = bool(saved_args.get("multi_latent_attention"))
    for name, ours, flag in _SHAPE_ARGS:
        saved = saved_args.get(name)
        if saved is None or (name == "kv_channels" and (latent or saved == config.hidden_size // max(
                config.num_attention_heads, 1) and config.kv_channels is None)):
            continue
        if saved != ours(config):
            differing.append(f"{flag} (checkpoint {saved!r}, now {ours(config)!r})")
    if latent and config.multi_latent_attention:
        differing += [f"{flag} (checkpoint {saved_args[name]!r}, now {value(config)!r})"
                      for name, value, flag in _MLA_ARGS if name in saved_args and saved_args[name] != value(config)]
    grouped = saved_args.get("group_query_attention")
    groups = saved_args.get("num_query_groups") if grouped else saved_args.get("num_attention_heads")
    if groups is not None and groups != config.query_groups and not latent:
        differing.append(f"--num-query-groups (checkpoint {groups}, now {config.query_groups})")
    differing += _moe_differences(saved_args, config)
    depths = saved_args.get("mtp_num_layers") or 0  # Megatron saves None without multi-token prediction
    if "mtp_num_layers" in saved_args and depths != config.mtp_num_layers:
        differing.append(f"--mtp-num-layers (checkpoint {depths}, now {config.mtp_num_layers})")
    if saved_args.get("position_embedding_type", "learned_absolute") == "learned_absolute" and saved_args.get(
            "max_position_embeddings") not in (None, config.max_position_embeddings):
        differing.append(f"--max-position-embeddings (checkpoint {saved_args['max_position_embeddings']}, now "
                         f"{config.max_position_embeddings})")
    return differing


def whole_model(state: ForeignState, config: ModelConfig) -> dict[str, torch.Tensor]:
    """The saved model in the built-in GPT's names and this run's padded vocabulary; refused when its shape is not
    the flags' (naming each flag)."""
    if config.model_type != "gpt":
        raise CheckpointError(f"--load {state.source}: checkpoints of other tools load into the built-in GPT model "
                              "only (not --model-type bert: Megatron's BERT heads are not mapped)")
    differing = shape_differences(state.saved_args, config)
    if differing:
        raise CheckpointError(f"--load {state.source}: the checkpoint holds another model than the flags describe: "
                              + "; ".join(differing) + ". Give the checkpoint's values.")
    whole = merge_stages(state.stages, config, state.source)
    fit_vocabulary(whole, config.vocab_size, padding_multiple(state), state.source)
    if "output.weight" not in whole and config.tie_embeddings:
        whole["output.weight"] = whole["embedding.word_embeddings.weight"]
    elif "output.weight" in whole and config.tie_embeddings:
        raise CheckpointError(f"--load {state.source}: the checkpoint has an output layer of its own: give "
                              "--untie-embeddings-and-output-weights")
    return whole


def padding_multiple(state: ForeignState) -> int:
    """What the saved run padded its vocabulary to a multiple of: --make-vocab-size-divisible-by × its TP size."""
    saved_tensor_parallel = state.saved_args.get("tensor_model_parallel_size")
    tensor_parallel = max(len(state.stages[0]), saved_tensor_parallel if isinstance(saved_tensor_parallel, int) else 1)
    divisible = state.saved_args.get("make_vocab_size_divisible_by")
    return (divisible if isinstance(divisible, int) and divisible > 0 else 128) * tensor_parallel


def fill_template(template: dict[str, Any], whole: dict[str, torch.Tensor], source: str) -> None:
    """Copy each whole value into the template's tensor: all of it, or this rank's shard of a DTensor. LoRA adapters
    of the built-in model (another tool's checkpoint has none) keep the values they start with."""
    from rapidtrain.models.lora import is_adapter_weight

    template = {name: slot for name, slot in template.items() if not (is_adapter_weight(name) and name not in whole)}
    missing = sorted(name for name in template if name not in whole)
    unused = sorted(set(whole) - set(template) - {"output.weight"})
    if missing or (unused and not _stage_of_pipeline(template)):
        raise CheckpointError(f"--load {source}: the checkpoint and this run's model differ: "
                              + (f"missing {', '.join(missing[:5])}" if missing else "")
                              + ("; " if missing and unused else "")
                              + (f"not in this model {', '.join(unused[:5])}" if unused else "")
                              + ". Give the checkpoint's model flags (--num-layers, --swiglu, --normalization, ...).")
    with torch.no_grad():
        for name, slot in template.items():
            value = whole[name]
            if not isinstance(slot, torch.Tensor):
                continue
            if tuple(value.shape) != tuple(slot.shape):
                raise CheckpointError(f"--load {source}: {name} has shape {tuple(value.shape)} in the checkpoint, "
                                      f"{tuple(slot.shape)} in this run's model: give the checkpoint's model flags")
            if isinstance(slot, DTensor):
                local = distribute_tensor(value.to(slot.device, slot.dtype), slot.device_mesh, slot.placements,
                                          src_data_rank=None).to_local()
                slot.to_local().copy_(local)
            else:
                slot.copy_(value.to(slot.dtype))


def _stage_of_pipeline(template: dict[str, Any]) -> bool:
    """Whether the template is one pipeline stage's (it then lacks the other stages' layers)."""
    return "embedding.word_embeddings.weight" not in template or "final_norm.weight" not in template


def scheduler_state(saved: dict[str, Any] | None, consumed_samples: int) -> dict[str, Any]:
    """The learning-rate schedule's state in rapidtrain's (Megatron-Core's) keys; older Megatron releases named
    them warmup_steps / decay_steps / decay_style. Without one, the schedule stands at the consumed samples (what
    Megatron's scheduler counts)."""
    if not saved:
        return {"num_steps": consumed_samples}
    renamed = {"warmup_steps": "lr_warmup_steps", "decay_steps": "lr_decay_steps", "decay_style": "lr_decay_style"}
    state = {renamed.get(key, key): value for key, value in saved.items()}
    if not isinstance(state.get("num_steps"), int) or isinstance(state.get("num_steps"), bool):
        state["num_steps"] = consumed_samples
    return state


def load_foreign_checkpoint(checkpoint: ForeignCheckpoint, runner: RunnerState, lr_scheduler: Any,
                            model: dict[str, Any] | None, *, finetune: bool, load_optimizer: bool, schedule_from: str,
                            flags: dict[str, Any] | None) -> LoadedState:
    """Fill the runner from another tool's checkpoint (every rank calls this; `model`: the plan's model settings):
    the model's weights, and with --load the position, the learning-rate schedule and, where the format keeps them
    by parameter (DeepSpeed ZeRO stage 1/2), Adam's moments; the RNG is this run's own."""
    if model is None:
        raise CheckpointError(f"--load {checkpoint.root}: a {checkpoint.describe()} loads into the built-in GPT "
                              "model only (not a Hugging Face model or a user script's own)")
    state = read_foreign(checkpoint)
    config = model_config(model)
    whole = whole_model(state, config)
    resume = not (finetune or state.release)
    notes = [*state.notes, "random state not restored: dropout and sampling continue from this run's seed"]
    differing = function_differences(state.saved_args, config)
    if differing:
        notes.append(f"the checkpoint was trained with other values of {'; '.join(differing)}: its weights load, but "
                     "the model computes another function than the one it learned; give the checkpoint's values "
                     "unless that is meant")
    moments = whole_moments(state, config) if resume and load_optimizer else None
    template = runner.state_dict_for_loading(moments is not None)
    fill_template(template["model"], whole, state.source)
    if moments is not None and not fill_optimizer_template(template.get("optimizer"), moments, state, notes):
        moments = None
        template = {"model": template["model"]}
    runner.load_state_dict(template, load_optimizer=moments is not None)
    if moments is not None:
        notes.append(f"Adam's moments and step count ({state.optimizer_step}) loaded from its optimizer files")
    else:
        notes.append("model weights only: its optimizer state is not mapped (Megatron's per-rank optimizer layouts "
                     "are not this run's), so the optimizer starts fresh")
    saved_dtypes = sorted({str(value.dtype).removeprefix("torch.") for value in whole.values()} - {"float32"})
    if saved_dtypes:
        notes.append(f"its weights were saved in {', '.join(saved_dtypes)} and are loaded as saved (a mixed-precision "
                     "run's fp32 master copy, kept with the optimizer state, is not read)")
    if resume and load_optimizer and hasattr(lr_scheduler, "load_state_dict"):
        changed = changed_schedule_flags(state.saved_args, flags or {})
        load_schedule(lr_scheduler, scheduler_state(state.scheduler, state.consumed_samples), schedule_from,
                      checkpoint.directory, changed)
    if _first_rank():
        for note in notes:
            print(f" note: {note}", flush=True)
    if not resume:
        return LoadedState(0, 0, {}, notes)
    return LoadedState(state.iteration, state.consumed_samples, {}, notes)


def whole_moments(state: ForeignState, config: ModelConfig) -> dict[str, dict[str, torch.Tensor]] | None:
    """Each Adam moment of every built-in parameter, merged as the weights are; None when the checkpoint has none."""
    if state.moments is None:
        return None
    merged = {}
    for key, stages in state.moments.items():
        values = merge_stages(stages, config, state.source)
        fit_vocabulary(values, config.vocab_size, padding_multiple(state), state.source)  # added padding rows: 0
        merged[key] = values
    return merged


def fill_optimizer_template(template: Any, moments: dict[str, dict[str, torch.Tensor]], state: ForeignState,
                            notes: list[str]) -> bool:
    """Put the moments and step into this run's optimizer state template (torch's get_state_dict form: `state`
    by parameter name); False (and a note) when this run's optimizer keeps other state than Adam's."""
    entries = template.get("state") if isinstance(template, dict) else None
    if not isinstance(entries, dict) or not entries:
        notes.append("this run's optimizer state has no per-parameter form to fill: the optimizer starts fresh")
        return False
    wanted = {*moments, "step"}
    for name, entry in entries.items():
        if not isinstance(entry, dict) or set(entry) != wanted:
            kept = ", ".join(sorted(entry)) if isinstance(entry, dict) else type(entry).__name__
            notes.append(f"this run's optimizer keeps {kept} for {name}, not Adam's {', '.join(sorted(wanted))}: "
                         "the optimizer starts fresh")
            return False
        if any(name not in values for values in moments.values()):
            notes.append(f"its optimizer files hold no moments of {name}: the optimizer starts fresh")
            return False
    with torch.no_grad():
        for name, entry in entries.items():
            fill_template({key: entry[key] for key in moments}, {key: moments[key][name] for key in moments},
                          state.source)
            step = entry["step"]
            if isinstance(step, torch.Tensor):
                step.fill_(float(state.optimizer_step or 0))
            else:
                entry["step"] = state.optimizer_step
    return True


def _first_rank() -> bool:
    import torch.distributed as dist

    return not dist.is_initialized() or dist.get_rank() == 0
