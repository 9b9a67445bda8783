"""The plan: what the flags resolve to, before anything starts.

Pure and frozen: layout, batch arithmetic, precision, the engine behind each switch (with the reason
when a substitute serves) and an estimate of model-state bytes per rank. `rapidtrain plan` prints it,
and every run logs it first. Batch arithmetic and precision resolution live here and nowhere else.
"""

from __future__ import annotations

import argparse
import dataclasses

from rapidtrain.config.arguments import MEGATRON_TASKS
from rapidtrain.config.engines import engines_for
from rapidtrain.config.estimate import plan_estimate
from rapidtrain.config.memory import (
    activation_context,
    auto_micro_batch_size,
    bucket_warnings,
    memory_estimate,
    size_multiple_warnings,
    with_peak,
)
from rapidtrain.config.pipeline_split import SplitError
from rapidtrain.config.resolve import (
    attention_settings,
    batch_schedule_of,
    builtin_vocab_size,
    checkpoint_settings,
    data_settings,
    distributed_settings,
    logging_settings,
    lora_settings,
    loss_scale_settings,
    model_config_from_args,
    optimizer_settings,
    pipeline_schedule_of,
    pipeline_split_of,
    precision_of,
    precision_warnings,
    profile_settings,
    schedule_settings,
    switches_of,
    tokenizer_settings_of,
    training_settings,
    virtual_stages_of,
    zero_settings,
)
from rapidtrain.config.settings import Batches, Layout, Plan, RunContext, context_parallel_of, data_parallel_size
from rapidtrain.models.config import ModelConfig


def template_of(args: argparse.Namespace, ctx: RunContext) -> str:
    if ctx.script:
        return f"user script {ctx.script}"
    if args.task == "pretraining":
        return "PreTrainer (built-in model)"
    if args.task in MEGATRON_TASKS:
        head = "3 classes" if args.task == "MNLI" else "one score per option"
        return f"Finetuner (built-in BERT + a head of {head} on the pooled [CLS], Megatron's {args.task} task)"
    return "Finetuner (Hugging Face model)"


def layout_of(args: argparse.Namespace, ctx: RunContext, model: ModelConfig | None = None,
              strict: bool = False) -> Layout:
    """The parallel layout; its pipeline split where the flags make one (`strict`: raise the split's SplitError, as
    the plan does after the rules have run; otherwise an impossible split is left empty for the rule to name)."""
    tp, pp = args.tensor_model_parallel_size, args.pipeline_model_parallel_size
    try:
        virtual = virtual_stages_of(args)
        split = pipeline_split_of(args, model) if pp > 1 else ()
    except SplitError:
        if strict:
            raise
        virtual, split = 1, ()
    cp, comm = context_parallel_of(args)
    return Layout(ctx.world_size, data_parallel_size(ctx.world_size, tp, pp, cp), tp, pp,
                  args.expert_model_parallel_size, virtual, args.sequence_parallel, stage_layers=split,
                  pipeline_schedule=pipeline_schedule_of(args), context_parallel_size=cp,
                  cp_comm_type=comm)


def from_args(args: argparse.Namespace, ctx: RunContext) -> Plan:
    """Resolve validated flags into the Plan, once: every component's settings, the padded vocabulary of the
    built-in model included (read from the tokenizer files; the demo corpus's is known without building it)."""
    precision = precision_of(args, ctx)
    tokenizer = tokenizer_settings_of(args)
    vocab_size = builtin_vocab_size(args, tokenizer)
    model = model_config_from_args(args, vocab_size) if vocab_size else None
    layout = layout_of(args, ctx, model, strict=True)
    switches = switches_of(args, layout, ctx)
    memory = memory_estimate(args, model, layout, precision, ctx, switches) if model else None
    # The micro batch is chosen before the batch arithmetic, which every later setting follows.
    micro, choice, global_batch = args.micro_batch_size, None, args.global_batch_size
    if args.auto_micro_batch_size and model and memory and args.memory_budget_gb:
        micro, choice = auto_micro_batch_size(args, layout, model, memory, switches.recompute,
                                              activation_context(model, precision, layout, switches, ctx.device_type))
        # Without --global-batch-size the flags mean --micro-batch-size × data parallel: keep that batch.
        global_batch = global_batch or args.micro_batch_size * layout.data_parallel_size
    batches = dataclasses.replace(Batches.resolve(micro, global_batch, layout.data_parallel_size,
                                                  batch_schedule_of(args)), micro_batch_choice=choice)
    if model and memory:
        memory = with_peak(memory, model, batches.micro_batch_size, batches.accumulation_steps, layout,
                           switches.recompute, activation_context(model, precision, layout, switches, ctx.device_type))
    engines, notes = engines_for(args, ctx, layout, precision, switches, model,
                                 batches.accumulation_steps)
    notes += getattr(args, "compat_notes", [])  # Megatron's and Rapidformer's meanings applied to these flags
    from rapidtrain.config.meanings import hugging_face_notes

    notes += hugging_face_notes(args, has_script=bool(ctx.script))
    if args.pp_partition_method and layout.pipeline_parallel_size == 1:
        notes.append(f"--pp-partition-method {args.pp_partition_method}: no effect here; without pipeline "
                     "parallelism one stage holds every layer")
    if not switches.recompute.enabled and (args.recompute_method or args.recompute_num_layers is not None):
        # Megatron reads them only under full recompute, and its own functional tests pass them alone.
        notes.append("--recompute-method / --recompute-num-layers: no effect here; they choose the layers that "
                     "--recompute-granularity full (or op) recomputes, and no recompute was asked for")
    if args.recompute_modules is not None and switches.recompute.granularity != "selective":
        notes.append("--recompute-modules: no effect here; it chooses what --recompute-granularity selective "
                     "recomputes, and " + (f"--recompute-granularity {switches.recompute.granularity} recomputes "
                                           "otherwise" if switches.recompute.enabled else "no recompute was asked for"))
    if "mla_up_proj" in switches.recompute.modules and switches.recompute.granularity == "selective":
        notes.append("--recompute-modules mla_up_proj: no effect here; the built-in MLA's up projections keep only "
                     "their inputs, which their weights' gradients need anyway, and their outputs are the queries, "
                     "keys and values the attention core keeps (core_attn recomputes from those)")
    if args.padding_free and ctx.script:
        notes.append("--padding-free: rapidtrain's casual_lm task packs its own micro-batches; a user script's "
                     "collate_fn decides how its batches are built (rapidtrain.tasks.base.FlattenCollator packs "
                     "them the same way)")
    warnings = precision_warnings(args, ctx, precision) + size_multiple_warnings(model, batches, precision, ctx) \
        + bucket_warnings(args, memory)
    resolved = Plan(template_of(args, ctx), args.task, layout, batches, precision, tuple(engines), memory, model,
                    switches, training_settings(args, batches),
                    dataclasses.replace(data_settings(args, ctx), micro_batch_size=batches.micro_batch_size),
                    tokenizer, optimizer_settings(args, layout, switches), schedule_settings(args),
                    loss_scale_settings(args), args.clip_grad, checkpoint_settings(args, vocab_size, batches),
                    logging_settings(args, ctx, precision, switches.tf32), tuple(notes),
                    lora_settings(args), zero_settings(args, layout, ctx), profile_settings(args),
                    distributed_settings(args, ctx), tuple(warnings), attention_settings(args))
    return with_estimate(resolved, ctx)


def with_estimate(plan: Plan, ctx: RunContext) -> Plan:
    """The plan with its expected step time on the context's device (config/estimate.py)."""
    return dataclasses.replace(plan, estimate=plan_estimate(plan, ctx.device_type, ctx.capability.name))


