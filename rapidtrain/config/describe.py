"""The Plan rendered for people: what `rapidtrain plan` prints and every run logs first."""

from __future__ import annotations

from rapidtrain.config.memory import mib_text
from rapidtrain.config.pipeline_split import stages_of_rank
from rapidtrain.config.settings import (
    DataSettings,
    Layout,
    MemoryEstimate,
    Plan,
    ScheduleSettings,
    StepEstimate,
    TrainingSettings,
)
from rapidtrain.data.tokenizer import TokenizerSettings
from rapidtrain.models.config import ModelConfig

ON_SIGTERM = {
    "save": "save a checkpoint at the end of the iteration, exit 0 (a repeated SIGTERM cannot cut the save); "
            "Ctrl-C the same, exit 130 (a second Ctrl-C aborts at once)",
    "stop": "stop at the end of the iteration and exit 0, nothing saved (--exit-signal-handler without --save); "
            "Ctrl-C the same, exit 130",
    "default": "the process ends at once, nothing saved (give --save, or --exit-signal-handler to stop cleanly)",
}


def _training_length(t: TrainingSettings) -> str:
    length = f"{t.train_iters} iterations" if t.train_iters else f"{t.epochs or 1} epoch(s)"
    if t.train_samples is not None:
        length = f"{t.train_samples:,} samples (--train-samples) = {t.train_iters} iterations"
    evaluation = f"evaluation every {t.eval_interval} iterations" if t.eval_interval else "evaluation after each epoch"
    return f"{length}, {evaluation}, seed {t.seed}"


def _schedule(s: ScheduleSettings, clip_grad: float, decoupled: tuple[float, float] | None = None) -> str:
    if s.warmup_fraction is not None:
        warmup = f"warm-up {s.warmup_fraction:g} of the decay horizon"
    elif s.decay_samples is not None:
        warmup = f"warm-up {s.warmup_samples:,} samples"
    else:
        warmup = f"warm-up {s.warmup_iters} iterations"
    if s.warmup_init:
        warmup += f" from {s.warmup_init:.1E}"
    horizon = f" over {s.decay_iters} iterations" if s.decay_iters else ""
    if s.decay_samples is not None:
        horizon = f" over {s.decay_samples:,} samples"
    clipping = f"clip grad {clip_grad:g}" if clip_grad > 0 else "no clipping"
    own = (f"; word embedding and output layer lr {decoupled[0]:.1E} → min {decoupled[1]:.1E} (--decoupled-lr, "
           "same warm-up and decay)" if decoupled else "")
    return f"lr {s.lr:.1E} → min {s.min_lr:.1E}, {s.decay_style} decay{horizon}, {warmup}{own}; {clipping}"


def _data_source(data: DataSettings, tokenizer: TokenizerSettings | None) -> str:
    words = {"demo": "the built-in demo corpus (no --data-path; the demo's small-model defaults apply)",
             "indexed": "Megatron indexed data " + " ".join(data.data_path),
             "finetune": f"fine-tuning set {data.data_dir or ''} {data.data_name or ''}".rstrip(),
             "script": "provided by the user script",
             "task": "task files --train-data " + " ".join(data.train_data) + "; validation, each file scored "
                     "apart: " + " ".join(data.valid_data)}
    text = words[data.source]
    if data.raw_json:
        files = [paths[0] for paths in data.split_paths or () if paths]
        text = f"{data.raw_json} JSON records {' '.join(files)}, {data.max_padding_length} tokens a sample"
    if data.idxmap_sft:
        text += (f" as Pai's SFT idxmap ({2 * data.seq_length} ids a document: {data.seq_length} tokens, then their "
                 "labels; loss the mean over " + ("conversations, packed" if data.reset_position_ids else "rows")
                 + ")")
    if data.weighted_splits:
        text = "Megatron indexed data, weighted splits " + " | ".join(
            f"{split}: " + "; ".join(group.describe() for group in groups)
            for split, groups in zip(("train", "valid", "test"), data.weighted_splits, strict=True) if groups)
    if tokenizer is not None and data.source != "finetune":
        text += f"; tokenizer {tokenizer.tokenizer_type}"
    workers = f"{data.num_workers} loader workers per rank" if data.num_workers else "no loader workers"
    return text + f"; {workers}" + (f": {data.loader_reason}" if data.loader_reason else "")


def describe_plan(plan: Plan) -> str:
    lay, bat = plan.layout, plan.batches
    lines = [
        f"rapidtrain plan — template: {plan.template}, task: {plan.task}",
        f"  layout: world {lay.world_size} = data {lay.data_parallel_size} × tensor {lay.tensor_parallel_size} × "
        f"pipeline {lay.pipeline_parallel_size}"
        + (f" × context {lay.context_parallel_size} (--cp-comm-type {lay.cp_comm_type})"
           if lay.context_parallel_size > 1 else "")
        + (f", expert parallel {lay.expert_parallel_size}" if lay.expert_parallel_size > 1 else ""),
    ]
    if lay.world_size > 1 and (lay.tensor_parallel_size > 1 or lay.pipeline_parallel_size > 1
                               or lay.context_parallel_size > 1):
        lines += _rank_lines(lay)
    if lay.pipeline_parallel_size > 1 and plan.model is not None:
        lines += pipeline_stage_lines(lay, plan.model.num_layers, plan.model.mtp_num_layers)
    lines += [
        *([f"  micro batch: {bat.micro_batch_choice}"] if bat.micro_batch_choice else []),
        f"  batches: micro {bat.micro_batch_size} × accumulation steps {bat.accumulation_steps} × data parallel "
        f"{lay.data_parallel_size} = global {bat.global_batch_size}"
        + (f"; {bat.schedule.describe(bat.global_batch_size)}, the accumulation steps following it"
           if bat.schedule else ""),
        "  training length: " + _training_length(plan.training),
        "  data: " + _data_source(plan.data, plan.tokenizer),
        "  schedule: " + _schedule(plan.schedule, plan.clip_grad, plan.optimizer.decoupled if plan.optimizer else None),
        f"  precision: {plan.precision.dtype}, loss scaling {plan.precision.loss_scaling} ({plan.precision.reason})",
        "  engines:",
    ]
    for choice in plan.engines:
        lines.append(f"    {choice.switch:<30} → {choice.engine}" + (f"\n{'':36}because {choice.reason}"
                                                                        if choice.reason else ""))
    lines += _model_lines(plan) + _checkpoint_lines(plan) + _reporting_lines(plan)
    exit_signal = plan.training.exit_signal
    also = f" and {exit_signal} (--exit-signal)" if exit_signal not in ("SIGTERM", "SIGINT") else ""
    if also and plan.training.on_sigterm == "default":
        also = f" ({exit_signal}, --exit-signal, is caught only with --save or --exit-signal-handler: it ends the run)"
    lines.append(f"  on SIGTERM{also}: " + ON_SIGTERM[plan.training.on_sigterm])
    lines.append(f"  distributed: process-group backend {_backends(plan.distributed.backend)}, collectives time "
                 f"out after {plan.distributed.timeout_minutes:g} minutes (--distributed-timeout-minutes)")
    lines.append("  MFU: " + (f"against {plan.logging.peak_tflops:g} TFLOP/s per device ({plan.logging.peak_source})"
                              if plan.logging.peak_tflops else f"not reported: {plan.logging.peak_source}"))
    lines += [f"  note: {n}" for n in plan.notes]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


def _attention_details(m: ModelConfig) -> str:
    """Head size, q/k norms and rope scaling where the flags ask for them (Qwen3, Llama 3.1)."""
    parts = [f"head size {m.head_dim} (--kv-channels)"] if m.kv_channels else []
    if m.qk_layernorm and not m.multi_latent_attention:  # MLA's latent norms are in its own words
        parts.append(f"q/k {m.normalization} per head (--qk-layernorm)")
    rotary = m.position_embedding_type == "rope" or m.multi_latent_attention
    if rotary and m.rope_scaling == "llama3":
        parts.append(f"Llama 3.1 rope scaling ×{m.rope_scaling_factor:g} (low/high frequency factors "
                     f"{m.rope_low_freq_factor:g}/{m.rope_high_freq_factor:g}, original "
                     f"{m.rope_original_max_positions})")
    if rotary and m.rope_scaling == "yarn":
        parts.append(_yarn_words(m))
    if rotary and m.rotary_interleaved:
        parts.append("rope on adjacent pairs (2i, 2i + 1) (--rotary-interleaved)")
    if rotary and m.rotary_interpolation_factor != 1:
        parts.append(f"rope positions / {m.rotary_interpolation_factor:g} (linear interpolation)")
    return "".join(f", {part}" for part in parts)


def _yarn_words(m: ModelConfig) -> str:
    """YaRN's settings, and what they make of cos/sin and (MLA) the softmax scale."""
    from rapidtrain.models.mla import mla_softmax_scale_factor
    from rapidtrain.models.rope import rope_attention_factor

    words = (f"YaRN rope ×{m.rope_scaling_factor:g} (original {m.rope_original_max_positions}, beta fast/slow "
             f"{m.yarn_beta_fast:g}/{m.yarn_beta_slow:g}, mscale {m.yarn_mscale:g}/{m.yarn_mscale_all_dim:g}: cos/sin "
             f"×{rope_attention_factor(m):.4g}")
    if m.multi_latent_attention:
        words += f", softmax scale ×{mla_softmax_scale_factor(m):.4g}"
    return words + ")"


def _model_lines(plan: Plan) -> list[str]:
    """The model (the built-in one the flags describe, or a script's own as built), its memory and step time."""
    lines = [f"  model: {plan.script_model} (built by the script)"] if plan.script_model else []
    if plan.model:
        m = plan.model
        groups = f" ({m.query_groups} key/value groups)" if m.query_groups != m.num_attention_heads else ""
        lines.append(f"  model: {m.architecture}"
                     + (f" initialised from Hugging Face weights in {m.hf_weights}" if m.hf_weights else "")
                     + f": {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads{groups}"
                     + _attention_details(m) + f", ffn {m.ffn_size}, seq {m.seq_length}, padded vocab {m.vocab_size}"
                     + (f", experts {list(m.num_experts)}" if m.num_experts else "")
                     + "".join(f"; {feature}" for feature in m.attention_features + m.mlp_features))
        if m.moe_router_features:
            lines.append("  mixture of experts: " + "; ".join(m.moe_router_features))
    if plan.memory:
        mem = plan.memory
        lines += [
            f"  parameters: {mem.total_params:,} total, {mem.active_params:,} active per token; "
            f"{mem.parameters:,} per model-parallel rank",
            f"  model-state memory per rank (estimate, ZeRO accounting): parameters {mib_text(mem.param_bytes)}"
            + (f" (offloaded to {mem.params_offloaded})" if mem.params_offloaded != "none" else "") + ", "
            f"gradients {mib_text(mem.grad_bytes)}, optimizer {mib_text(mem.optimizer_bytes)}"
            + (" (on CPU)" if mem.optimizer_on_cpu else "")
            + (f" on average ({mib_text(min(mem.optimizer_bytes_by_rank))} to "
               f"{mib_text(max(mem.optimizer_bytes_by_rank))} by rank: OSS gives each rank whole tensors)"
               if mem.optimizer_bytes_by_rank else "")
            + (f", {ENGINE_BUFFERS.get(plan.switches.partitioning_engine, 'engine buffers')} "
               f"{mib_text(mem.engine_bytes)}" if mem.engine_bytes else "")
            + f"; total {mib_text(mem.total_bytes)}"
            + (f"; and FSDP2's (or replicate()'s) whole gradients between the micro-batches of an iteration "
               f"(gradient sync off until "
               f"the last) {mib_text(mem.accumulated_grad_bytes)}"
               + (" on the average stage" if plan.layout.pipeline_parallel_size > 1 else "") + ", in the peak below"
               if mem.accumulated_grad_bytes and plan.batches.accumulation_steps > 1 else ""),
            *_peak_memory_lines(mem, plan),
        ]
    return lines + (_estimate_lines(plan.estimate) if plan.estimate else [])


def _checkpoint_lines(plan: Plan) -> list[str]:
    ck = plan.checkpoint
    if not (ck.save or ck.load):
        return []
    lines = ["  checkpoints: " + "; ".join(
        ([f"save to {ck.save}" + (f" every {ck.save_interval} iterations" if ck.save_interval else "")]
         if ck.save else [])
        + ([f"load from {ck.load}" + (" (model only, --finetune)" if ck.finetune else "")] if ck.load else []))]
    if ck.load and not ck.finetune and not ck.load_format:
        lines.append("  resume: what changed since the save in the data (paths, files, split, sequence length, seed) "
                     "or the global batch is said in one line each, and the consumed samples carry over (Megatron); "
                     "another tokenizer is refused (stricter than Megatron: the embeddings would read other text), "
                     "as is a changed learning-rate schedule without --override-opt-param-scheduler")
    if ck.load and ck.load_format:
        weights_only = ck.finetune or ck.load_format.endswith("release")
        kept = "its model weights only, from iteration 0" if weights_only else (
            "its model weights, iteration, consumed samples and learning-rate schedule")
        universal = ck.load_format.startswith("DeepSpeed universal")
        optimizer = ("Adam's moments come from its " + ("zero/<parameter>/exp_avg*.pt, its weights from the fp32.pt "
                     "beside them (the vocabulary's padding rows, which ds_to_universal drops, are zeros)" if universal
                     else "ZeRO stage 1/2 optimizer files") + " (the optimizer starts fresh where they hold none)"
                     if ck.load_format.startswith("DeepSpeed") and ck.load_optimizer else
                     "its optimizer state is not mapped (Megatron's per-rank optimizer layouts are not this run's): "
                     "the optimizer starts fresh")
        lines.append(f"    {ck.load_format}: {kept}; read as data, no stored code runs. "
                     + ("The optimizer starts fresh" if weights_only else optimizer[0].upper() + optimizer[1:])
                     + "; the random state is this run's")
    if ck.async_save and ck.save:
        lines.append("    async save: written by a background thread (torch.distributed.checkpoint async_save) "
                     "from a copy in host memory; published once every rank has finished writing")
    return lines


def _reporting_lines(plan: Plan) -> list[str]:
    """Where the run's scalars, config and traces go, beyond the log line."""
    lines, log = [], plan.logging
    if log.tensorboard_dir:
        lines.append(f"  tensorboard: scalars and the plan in {log.tensorboard_dir}")
    tracking = log.tracking
    if tracking and tracking.wandb_project:
        lines.append(f"  weights & biases: project {tracking.wandb_project}"
                     + (f", run {tracking.wandb_exp_name}" if tracking.wandb_exp_name else "")
                     + f", files in {tracking.wandb_save_dir or './wandb'} (WANDB_MODE=offline: no network)")
    if tracking and tracking.mlflow_experiment:
        where = tracking.mlflow_tracking_uri or "$MLFLOW_TRACKING_URI, else MLflow's default (sqlite:///mlflow.db)"
        lines.append(f"  mlflow: experiment {tracking.mlflow_experiment}"
                     + (f", run {tracking.mlflow_run_name}" if tracking.mlflow_run_name else "") + f" at {where}")
    profile = plan.profile
    if profile.enabled:
        lines.append(f"  profiler: PyTorch profiler on ranks {list(profile.ranks)} over iterations "
                     f"{profile.step_start + 1}-{profile.step_end}, traces in {profile.trace_dir}"
                     " (a CUDA memory snapshot beside them on GPUs)")
    return lines


def _backends(backend: str) -> str:
    if "," not in backend:
        return backend
    parts = dict(part.split(":") for part in backend.split(","))
    return ", ".join(f"{kind} tensors → {name}" for kind, name in parts.items()) + f" ({backend})"


FULL_RANK_GRID_UP_TO = 32  # ranks; beyond, the groups are summarized (first, last, stride)


def _rank_lines(layout: Layout) -> list[str]:
    """Which ranks form each group: the whole grid for a few ranks, else each kind of group summarized."""
    grid = layout.rank_grid()  # [stage][data · CP + context][tensor]
    cp = layout.context_parallel_size
    if layout.world_size <= FULL_RANK_GRID_UP_TO:
        def label(d: int) -> str:
            return f"dp{d // cp}cp{d % cp}" if cp > 1 else f"dp{d}"

        return [f"    pipeline stage {stage}: " + "  ".join(f"{label(d)}→ranks {row}" for d, row in enumerate(rows))
                for stage, rows in enumerate(grid)]
    tp, dp, pp = layout.tensor_parallel_size, layout.data_parallel_size, layout.pipeline_parallel_size
    kinds = [("tensor-parallel", tp, dp * cp * pp, [grid[0][0], grid[-1][-1]]),
             ("context-parallel", cp, tp * dp * pp, [[grid[0][c][0] for c in range(cp)],
                                                     [grid[-1][(dp - 1) * cp + c][-1] for c in range(cp)]]),
             ("data-parallel", dp, tp * cp * pp, [[grid[0][d * cp][0] for d in range(dp)],
                                                  [grid[-1][d * cp + cp - 1][-1] for d in range(dp)]]),
             ("pipeline", pp, tp * dp * cp, [[rows[0][0] for rows in grid], [rows[-1][-1] for rows in grid]])]
    lines = ["    rank groups (Megatron order: tensor ranks neighbours, then context, data, pipeline outermost):"]
    for name, size, count, (first, last) in kinds:
        if size > 1:
            lines.append(f"      {count:,} {name} groups of {size}: first {_ranks(first)}, last {_ranks(last)}")
    return lines


def _ranks(group: list[int]) -> str:
    """A group of evenly spaced ranks in a few characters: [0, 8, …, 56] (stride 8)."""
    if len(group) <= 4:
        return str(group)
    stride = group[1] - group[0]
    return f"[{group[0]}, {group[1]}, …, {group[-1]}] (stride {stride})"


def pipeline_stage_lines(layout: Layout, num_layers: int, mtp_layers: int = 0) -> list[str]:
    """Each pipeline rank's stages and the transformer layers of each (the full model's layer numbers), the
    embedding on the first stage and the head (with any MTP depths) on the last; ranks between alike elided when
    there are many."""
    p, v = layout.pipeline_parallel_size, layout.virtual_pipeline_stages
    last = p * v - 1

    def stage_text(stage: int) -> str:
        layers = layout.layers_of_stage(stage, num_layers)
        parts = ["embedding"] if stage == 0 else []
        if len(layers):
            parts.append(f"layer {layers[0]}" if len(layers) == 1 else f"layers {layers[0]}–{layers[-1]}")
        if stage == last:
            parts.append(f"{mtp_layers} MTP depth(s) + head" if mtp_layers else "head")
        return f"stage {stage} " + " + ".join(parts) + f" ({len(layers)})"

    counts = layout.stage_layers or (num_layers // (p * v),) * (p * v)
    even = len(set(counts)) == 1
    rows = [f"      rank {r}: " + ", ".join(stage_text(s) for s in stages_of_rank(r, p, v, layout.pipeline_schedule))
            for r in range(p)]
    if len(rows) > 8:
        rows = rows[:3] + [f"      … ranks 3–{p - 3} alike in form"] + rows[-2:]
    split = f"even split, {counts[0]} transformer layers per stage" if even \
        else f"uneven split, transformer layers per stage {', '.join(map(str, counts))}"
    head = f"    pipeline stages ({split}; layer names stay the full model's, so checkpoints reshard):"
    return [head, *rows]


# What MemoryEstimate.engine_bytes holds, by engine (config/memory.py).
ENGINE_BUFFERS = {"deepspeed": "DeepSpeed's buffers", "fsdp2": "FSDP2's gathered parameters",
                  "ddp": "replicate()'s copy of the parameters"}  # "ddp" has engine bytes only beside TP


def _peak_memory_lines(mem: MemoryEstimate, plan: Plan) -> list[str]:
    """Model states and activations at each pipeline stage's peak (the first and last when there are many)."""
    if not mem.stage_state_bytes:
        return []
    count = len(mem.stage_state_bytes)
    shown = range(count) if count <= 4 else (0, 1, count - 1)
    stages = [f"stage {i}: {mib_text(mem.stage_state_bytes[i])} + activations "
              f"{mib_text(mem.stage_activation_bytes[i])}" for i in shown]
    recompute = plan.switches.recompute.granularity
    head = (f"  peak memory per rank (estimate, model states + activations by Korthikanti et al. 2022, recompute "
            f"{recompute}): {mib_text(mem.peak_bytes_per_rank)} on the largest rank")
    if count == 1:
        return [head + f" (model states {mib_text(mem.stage_state_bytes[0])} + activations "
                       f"{mib_text(mem.stage_activation_bytes[0])})"]
    return [head, "    " + "; ".join(stages) + (" (stages between alike, fewer micro-batches in flight)"
                                                   if count > 4 else "")]


def _estimate_lines(estimate: StepEstimate) -> list[str]:
    if estimate.reason:
        return [f"  expected step time: {estimate.reason}"]
    parts = ", ".join(f"{name} {seconds:.3g} s" for name, seconds in estimate.parts)
    return [f"  expected: {estimate.seconds_per_iteration:.3g} s/iteration, {estimate.tflops_per_device:.0f} TFLOP/s "
            f"per GPU, MFU {estimate.mfu:.0%} on {estimate.device} (model FLOPs; "
            f"{estimate.hardware_tflops_per_device:.0f} TFLOP/s with recomputation)",
            f"    where the time goes: {parts}",
            *(f"    assuming {a}" for a in estimate.assumptions)]
