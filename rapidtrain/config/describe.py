"""The Plan rendered for people: what `rapidtrain plan` prints and every run logs first."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rapidtrain.config.memory import mib_text
from rapidtrain.config.settings import DataSettings, Plan, ScheduleSettings, TrainingSettings
from rapidtrain.data.tokenizer import TokenizerSettings

if TYPE_CHECKING:
    pass

if TYPE_CHECKING:
    pass




ON_SIGTERM = {
    "save": "save a checkpoint at the end of the iteration, exit 0 (a repeated SIGTERM cannot cut the save)",
    "stop": "stop at the end of the iteration and exit 0, nothing saved (--exit-signal-handler without --save)",
    "default": "the process ends at once, nothing saved (give --save, or --exit-signal-handler to stop cleanly)",
}


def _training_length(t: TrainingSettings) -> str:
    length = f"{t.train_iters} iterations" if t.train_iters else f"{t.epochs or 1} epoch(s)"
    if t.train_samples is not None:
        length = f"{t.train_samples:,} samples (--train-samples) = {t.train_iters} iterations"
    evaluation = f"evaluation every {t.eval_interval} iterations" if t.eval_interval else "evaluation after each epoch"
    return f"{length}, {evaluation}, seed {t.seed}"


def _schedule(s: ScheduleSettings, clip_grad: float) -> str:
    if s.warmup_fraction is not None:
        warmup = f"warm-up {s.warmup_fraction:g} of the decay horizon"
    elif s.decay_samples is not None:
        warmup = f"warm-up {s.warmup_samples:,} samples"
    else:
        warmup = f"warm-up {s.warmup_iters} iterations"
    horizon = f" over {s.decay_iters} iterations" if s.decay_iters else ""
    if s.decay_samples is not None:
        horizon = f" over {s.decay_samples:,} samples"
    clipping = f"clip grad {clip_grad:g}" if clip_grad > 0 else "no clipping"
    return f"lr {s.lr:.1E} → min {s.min_lr:.1E}, {s.decay_style} decay{horizon}, {warmup}; {clipping}"


def _data_source(data: DataSettings, tokenizer: TokenizerSettings | None) -> str:
    words = {"demo": "the built-in demo corpus (no --data-path; the demo's small-model defaults apply)",
             "indexed": "Megatron indexed data " + " ".join(data.data_path),
             "finetune": f"fine-tuning set {data.data_dir or ''} {data.data_name or ''}".rstrip(),
             "script": "provided by the user script"}
    text = words[data.source]
    if tokenizer is not None and data.source != "finetune":
        text += f"; tokenizer {tokenizer.tokenizer_type}"
    return text + f"; {data.num_workers} loader workers per rank"


def describe_plan(plan: Plan) -> str:
    lay, bat = plan.layout, plan.batches
    lines = [
        f"rapidtrain plan — template: {plan.template}, task: {plan.task}",
        f"  layout: world {lay.world_size} = data {lay.data_parallel_size} × tensor {lay.tensor_parallel_size} × "
        f"pipeline {lay.pipeline_parallel_size}" + (f", expert parallel {lay.expert_parallel_size}"
                                                    if lay.expert_parallel_size > 1 else ""),
    ]
    if lay.world_size > 1 and (lay.tensor_parallel_size > 1 or lay.pipeline_parallel_size > 1):
        for stage, dp_rows in enumerate(lay.rank_grid()):
            lines.append(f"    pipeline stage {stage}: " + "  ".join(
                f"dp{d}→ranks {row}" for d, row in enumerate(dp_rows)))
    lines += [
        *([f"  micro batch: {bat.micro_batch_choice}"] if bat.micro_batch_choice else []),
        f"  batches: micro {bat.micro_batch_size} × accumulation steps {bat.accumulation_steps} × data parallel "
        f"{lay.data_parallel_size} = global {bat.global_batch_size}"
        + (f"; {bat.schedule.describe(bat.global_batch_size)}, the accumulation steps following it"
           if bat.schedule else ""),
        "  training length: " + _training_length(plan.training),
        "  data: " + _data_source(plan.data, plan.tokenizer),
        "  schedule: " + _schedule(plan.schedule, plan.clip_grad),
        f"  precision: {plan.precision.dtype}, loss scaling {plan.precision.loss_scaling} ({plan.precision.reason})",
        "  engines:",
    ]
    for choice in plan.engines:
        lines.append(f"    {choice.switch:<30} → {choice.engine}" + (f"\n{'':36}because {choice.reason}"
                                                                        if choice.reason else ""))
    if plan.model:
        m = plan.model
        groups = f" ({m.query_groups} key/value groups)" if m.query_groups != m.num_attention_heads else ""
        lines.append(f"  model: {m.architecture}"
                     + (f" initialised from Hugging Face weights in {m.hf_weights}" if m.hf_weights else "")
                     + f": {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads{groups}, "
                     f"ffn {m.ffn_size}, seq {m.seq_length}, padded vocab {m.vocab_size}"
                     + (f", experts {list(m.num_experts)}" if m.num_experts else ""))
    if plan.memory:
        mem = plan.memory
        lines += [
            f"  parameters: {mem.total_params:,} total, {mem.active_params:,} active per token; "
            f"{mem.parameters:,} per model-parallel rank",
            f"  model-state memory per rank (estimate, ZeRO accounting): parameters {mib_text(mem.param_bytes)}"
            + (f" (offloaded to {mem.params_offloaded})" if mem.params_offloaded != "none" else "") + ", "
            f"gradients {mib_text(mem.grad_bytes)}, optimizer {mib_text(mem.optimizer_bytes)}"
            + (" (on CPU)" if mem.optimizer_on_cpu else "") + f"; total {mib_text(mem.total_bytes)}",
        ]
    ck = plan.checkpoint
    if ck.save or ck.load:
        lines.append("  checkpoints: " + "; ".join(
            ([f"save to {ck.save}" + (f" every {ck.save_interval} iterations" if ck.save_interval else "")]
             if ck.save else [])
            + ([f"load from {ck.load}" + (" (model only, --finetune)" if ck.finetune else "")] if ck.load else [])))
        if ck.async_save and ck.save:
            lines.append("    async save: written by a background thread (torch.distributed.checkpoint async_save) "
                         "from a copy in host memory; published once every rank has finished writing")
    lines += _reporting_lines(plan)
    lines.append("  on SIGTERM: " + ON_SIGTERM[plan.training.on_sigterm])
    lines.append(f"  distributed: process-group backend {_backends(plan.distributed.backend)}, collectives time "
                 f"out after {plan.distributed.timeout_minutes:g} minutes (--distributed-timeout-minutes)")
    lines.append("  MFU: " + (f"against {plan.logging.peak_tflops:g} TFLOP/s per device ({plan.logging.peak_source})"
                              if plan.logging.peak_tflops else f"not reported: {plan.logging.peak_source}"))
    lines += [f"  note: {n}" for n in plan.notes]
    lines += [f"  warning: {w}" for w in plan.warnings]
    return "\n".join(lines)


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
