"""The engine behind each switch (DESIGN.md's table), with the reason when a substitute serves: the lines
of the plan that say what will run."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from rapidtrain.config.memory import (
    bf16_weight_copies,
    expert_second_dims,
    experts_sharded_by_fsdp2,
    flat_optimizer_step,
    short_attention_planned,
)
from rapidtrain.config.partitioning import chosen_partitioning, zero_stage
from rapidtrain.config.pipeline_split import SPLIT_BACKWARD, V_SHAPED, bubble_fraction, schedule_title
from rapidtrain.config.resolve import (
    attention_settings,
    is_pretraining,
    lora_settings,
    model_construction,
    optimizer_settings,
    ort_status,
    recompute_of,
    zero_by_fsdp2,
    zero_settings,
)
from rapidtrain.config.settings import EngineChoice, Layout, Precision, RunContext, Switches, ZeroSettings
from rapidtrain.models.config import ModelConfig
from rapidtrain.models.hf_config import trains_builtin_model

if TYPE_CHECKING:
    pass

if TYPE_CHECKING:
    pass


def _threads(count: int) -> str:
    return f"{count} OpenMP thread" + ("s" if count != 1 else "")


def describe_zero(zero: ZeroSettings) -> str:
    parts = [f"overlap_comm {zero.overlap_comm}", f"contiguous gradients {zero.contiguous_gradients}",
             f"reduce bucket {zero.reduce_bucket_size:,}"]
    if zero.stage == 3:
        parts += [f"prefetch bucket {zero.stage3_prefetch_bucket_size:,}",
                  f"parameters under {zero.stage3_param_persistence_threshold:,} elements stay gathered",
                  f"at most {zero.stage3_max_live_parameters:,} live parameters"]
    else:
        parts.append(f"allgather bucket {zero.allgather_bucket_size:,}")
    return "DeepSpeed ZeRO: " + ", ".join(parts) + " (bucket sizes in elements)"


PARTITIONING_ENGINES = {
    "oss_memory_optimization": "torch.distributed.optim.ZeroRedundancyOptimizer + DistributedDataParallel",
    "oss_sdp_memory_optimization": "FSDP2 fully_shard(reshard_after_forward=False)",
    "fsdp_memory_optimization": "FSDP2 fully_shard (parameters, gradients, optimizer state)",
    "zero_1_memory_optimization": "DeepSpeed ZeRO stage 1 (deepspeed.initialize, generated config)",
    "zero_2_memory_optimization": "DeepSpeed ZeRO stage 2 (deepspeed.initialize, generated config)",
    "zero_3_memory_optimization": "DeepSpeed ZeRO stage 3 (model built under deepspeed.zero.Init)",
}


FAIRSCALE_ENGINES = {
    "oss_memory_optimization": "fairscale.optim.OSS + DistributedDataParallel",
    "oss_sdp_memory_optimization": "fairscale.optim.OSS + fairscale ShardedDataParallel",
}


def _flag(dest: str) -> str:
    return "--" + dest.replace("_", "-")






def _expert_partitioning_note(dest: str, layout: Layout, model: ModelConfig | None) -> str:
    """How a partitioning switch treats the expert slices, which differ from one expert-parallel rank to the next."""
    dp, ep = layout.data_parallel_size, layout.expert_parallel_size
    if dest == "oss_memory_optimization":
        return ("expert slices stay out of ZeroRedundancyOptimizer's partitioning (it broadcasts each parameter from "
                "its owner over all data-parallel ranks, and each expert-parallel rank holds other experts): every "
                "rank's local optimizer steps its own slices, whose gradients are all-reduced over the "
                f"{dp // ep} ranks holding the same experts")
    if experts_sharded_by_fsdp2(layout, expert_second_dims(model)):
        return (f"expert slices (1/{ep} of each MoE layer's experts) are fully_shard-ed on their second dimension over "
                f"the {dp // ep} ranks holding the same experts, gradients averaged over all {dp} data-parallel ranks")
    if layout.tensor_parallel_size > 1:
        why = "under tensor parallelism"
    elif dp == ep:
        why = f"no other rank holds the same experts (data parallel {dp} = expert parallel {ep})"
    else:
        why = (f"their second dimensions {expert_second_dims(model)} (hidden, FFN) do not split evenly over the "
               f"{dp // ep} ranks holding the same experts")
    return (f"expert slices (1/{ep} of each MoE layer's experts) stay out of FSDP2: {why}; their gradients are "
            "averaged by the expert all-reduce")


def _partitioning_choice(args: argparse.Namespace, layout: Layout, model: ModelConfig | None) -> EngineChoice | None:
    chosen = chosen_partitioning(args)
    if not chosen:
        return None
    dest = chosen[0]
    experts = _expert_partitioning_note(dest, layout, model) if layout.expert_parallel_size > 1 else ""
    if zero_by_fsdp2(args) and dest in ("zero_1_memory_optimization", "zero_2_memory_optimization"):
        splits = [name for name, size in (("tensor", layout.tensor_parallel_size),
                                          ("pipeline", layout.pipeline_parallel_size)) if size > 1]
        cannot = [f"wrap the {'/'.join(splits)}-parallel model"] if splits else []
        if layout.expert_parallel_size > 1:
            cannot.append("reduce expert slices over their own group")
        return EngineChoice(_flag(dest), "FSDP2 fully_shard over the data-parallel mesh dimension, "
                            "reshard_after_forward=False", f"DeepSpeed cannot {' or '.join(cannot)}; FSDP2 keeps "
                            "parameters unsharded between forward and backward, so memory is ZeRO-2's (optimizer "
                            "state and gradients partitioned)" + (f"; {experts}" if experts else ""))
    if args.sharding_backend == "fairscale" and dest in FAIRSCALE_ENGINES:
        return EngineChoice(_flag(dest), FAIRSCALE_ENGINES[dest], "--sharding-backend fairscale")
    if layout.data_parallel_size == 1 and not args.cpu_offload and not getattr(args, "nvme_offload_dir", None):
        # Partitioning over one data-parallel rank keeps every state whole: the engine still runs (its checkpoint
        # format, its buffers), which a user expecting savings should hear from the plan, not from a memory profile.
        experts = "; ".join(filter(None, [experts, "one data-parallel rank: nothing is partitioned, every rank holds "
                                          "whole parameters, gradients and optimizer state (as without the switch), "
                                          "plus the engine's buffers; it saves memory only with more data-parallel "
                                          "ranks or with --cpu-offload"]))
    return EngineChoice(_flag(dest), PARTITIONING_ENGINES[dest], experts)




def describe_compile(args: argparse.Namespace) -> str:
    return f"torch.compile(backend={args.torch_compile_backend!r}, mode={args.torch_compile_mode or 'default'!r})"


def pipeline_schedule(layout: Layout, micro_batches: int) -> str:
    """The schedule parallel/pipeline.py runs, named by what it is, with the micro-batches, stages and bubble."""
    p, v, m = layout.pipeline_parallel_size, layout.virtual_pipeline_stages, micro_batches
    schedule = running_schedule(layout, micro_batches)
    bubble = bubble_fraction(schedule, p, m, v)
    title = schedule_title(schedule, v)
    chunks = f", {v} model chunks per rank" if v > 1 else ""
    if schedule in V_SHAPED:
        chunks = ", 2 stages per rank in a V (rank r runs stages r and 2p-1-r)"
    formula = {"1f1b": "(p - 1)/(v·m)" if v > 1 else "(p - 1)/m", "gpipe": "(p - 1)/m"}.get(
        schedule, "(p - 1)/(3·v·m)" if bubble < (p - 1) / (v * m) else "(p - 1)/(v·m), too few micro-batches to fill")
    why = (" (1F1B needs at least as many micro-batches as stages)" if schedule == "gpipe"
           and layout.pipeline_schedule == "1f1b" else "")
    split = ("; backward split into input and weight gradients (torch's stage_backward_input / _weight)"
             if schedule in SPLIT_BACKWARD else "")
    return (f"{title}{chunks}, {m} micro-batches over {p} ranks{why} (bubble {formula} = {bubble:.1%}){split}")


def running_schedule(layout: Layout, micro_batches: int) -> str:
    """The schedule that runs: the layout's, with 1F1B on one stage per rank falling back to GPipe when there are
    fewer micro-batches than stages (the result is the same)."""
    if layout.pipeline_schedule == "1f1b" and layout.virtual_pipeline_stages == 1 \
            and micro_batches < layout.pipeline_parallel_size:
        return "gpipe"
    return layout.pipeline_schedule


def engines_for(args: argparse.Namespace, ctx: RunContext, layout: Layout, precision: Precision,
                switches: Switches, model: ModelConfig | None = None,
                micro_batches: int = 1) -> tuple[list[EngineChoice], list[str]]:
    """The engine behind each switch, in the plan's order, and notes on flags that need a word."""
    notes: list[str] = []
    partitioning = _partitioning_choice(args, layout, model)
    engines = (_data_parallel_choices(args, ctx, layout, partitioning)
               + _model_parallel_choices(args, layout, micro_batches)
               + _precision_choices(layout, precision, partitioning, switches)
               + recompute_choices(args) + _kernel_choices(args, ctx, layout, precision, model)
               + _host_choices(args, ctx, layout, precision, switches, notes)
               + _data_choices(args, ctx)
               + [_optimizer_choice(args, ctx, layout, switches, model, precision)])
    if args.cpu_offload:
        notes.append("--cpu-offload: the optimizer comes from DeepSpeed's config (DeepSpeedCPUAdam), so --optimizers "
                     "selects Adam there")
    return engines, notes


CP_EXCHANGES = {
    "p2p": "ring: K/V blocks passed around the context-parallel ranks (send/recv), each step's partial attention "
           "merged by log-sum-exp, causal chunk pairs wholly in the future skipped; forward keeps only the local "
           "K/V, output and log-sum-exp, backward passes the K/V with their dK/dV around again (Megatron-Core's "
           "memory); block pairs through the CPU's flash kernel for plain causal attention on a CPU, else written "
           "out",
    "allgather": "K/V all-gathered over the context-parallel ranks, local queries attend over the whole sequence",
    "a2a": "DeepSpeed-Ulysses (deepspeed.sequence.layer.DistributedAttention): all-to-all from the sequence split "
           "to a head split, the attention kernel over the whole sequence on heads/CP, all-to-all back",
}


def context_parallel_choice(args: argparse.Namespace, layout: Layout) -> EngineChoice:
    cp, comm = layout.context_parallel_size, layout.cp_comm_type
    flag = (f"--ds-sequence-parallel-size {cp}" if (getattr(args, "ds_sequence_parallel_size", 1) or 1) > 1
            else f"--context-parallel-size {cp}")
    split = (f"{cp} contiguous parts" if comm == "a2a"
             else f"{2 * cp} chunks, rank r keeping chunks r and {2 * cp - 1}-r (Megatron-Core's load balance)")
    how = "" if comm == "a2a" else " (torch.distributed collectives with autograd)"
    return EngineChoice(flag, f"rapidtrain context parallelism, --cp-comm-type {comm}: each sequence split into "
                        f"{split}; {CP_EXCHANGES[comm]}{how}",
                        "torch's context_parallel patches CUDA's SDPA kernels only and takes no document mask; the "
                        "global causal, document and window masks are built from the ranks' positions")


def _data_parallel_choices(args: argparse.Namespace, ctx: RunContext, layout: Layout,
                           partitioning: EngineChoice | None) -> list[EngineChoice]:
    """Data parallelism, the model-state partitioning, ZeRO's communication and what is offloaded."""
    engines: list[EngineChoice] = []
    backend = args.distributed_backend or ("nccl" if ctx.device_type == "cuda" else "gloo")
    three_d = layout.tensor_parallel_size > 1 or layout.pipeline_parallel_size > 1
    if layout.data_context_parallel_size > 1 and (partitioning is None
                                                  or "DistributedDataParallel" in partitioning.engine):
        # replicate() under TP only (DDP cannot reduce DTensor parameters): it keeps a second copy of the parameters
        # and accumulates gradients apart from them, which DDP with bucket-view gradients does not
        how = ("composable replicate() over the data-parallel mesh dimension (DDP cannot reduce tensor-parallel "
               "DTensors)" if layout.tensor_parallel_size > 1
               else "DistributedDataParallel around each pipeline stage" if layout.pipeline_parallel_size > 1
               else "DistributedDataParallel")
        unused = ("" if three_d else "; DistributedDataParallel looks for weights a step leaves without a gradient "
                  "(find_unused_parameters) unless the model is the built-in GPT or BERT, which use every weight")
        if layout.context_parallel_size > 1:
            how += f" over data × context ranks ({layout.data_context_parallel_size}: Megatron's dp_cp group)"
        engines.append(EngineChoice("data parallel", f"torch {how} ({backend})",
                                    "no all-reduce on accumulation micro-batches (no_sync)" + unused))
    if partitioning:
        engines.append(partitioning)
    zero = zero_settings(args, layout, ctx)
    if zero is not None:
        file_values = ("where no --zero-* flag sets them, --deepspeed_config's values replace these"
                       if args.deepspeed_config and zero.defaulted else "")
        engines.append(EngineChoice("ZeRO communication", describe_zero(zero), file_values))
    pinned = "pinned host buffers" if zero is not None and zero.pin_memory else "no pinned buffers (CPU run)"
    if args.cpu_offload:
        threads = f", {_threads(zero.cpu_adam_threads)} per rank" if zero and zero.cpu_adam_threads else ""
        engines.append(EngineChoice("--cpu-offload", f"DeepSpeed offload_optimizer: cpu with DeepSpeedCPUAdam{threads}"
                                    f", {pinned}", "DeepSpeedCPUAdam steps with the cores per rank (or "
                                    "OMP_NUM_THREADS when set above 1), not torchrun's single thread"))
    if args.cpu_offload_params:
        engines.append(EngineChoice("--cpu-offload-params", f"DeepSpeed ZeRO-3 offload_param: cpu, {pinned}",
                                    "each rank's parameter partition lives in host memory and is gathered to the "
                                    "device layer by layer"))
    if args.nvme_offload_dir:
        threads = f", DeepSpeedCPUAdam on {_threads(zero.cpu_adam_threads)}" if zero and zero.cpu_adam_threads else ""
        engines.append(EngineChoice("--nvme-offload-dir", "DeepSpeed ZeRO-Infinity: offload_optimizer and "
                                    f"offload_param to nvme at {args.nvme_offload_dir} (async_io){threads}, {pinned}",
                                    "parameter shards of at least DeepSpeed's 1 MiB I/O block are swapped to files; "
                                    "smaller ones stay in host memory"))
    return engines


def _model_parallel_choices(args: argparse.Namespace, layout: Layout, micro_batches: int) -> list[EngineChoice]:
    """Tensor, pipeline and expert parallelism."""
    engines: list[EngineChoice] = []
    if layout.tensor_parallel_size > 1:
        engines.append(EngineChoice("--tensor-model-parallel-size", "DTensor parallelize_module: column/row split of "
                                    "attention and MLP, vocab-parallel embedding and loss"
                                    + (", sequence parallel norms/dropout" if layout.sequence_parallel else "")))
    if layout.pipeline_parallel_size > 1:
        engines.append(EngineChoice("--pipeline-model-parallel-size", "torch.distributed.pipelining, "
                                    + pipeline_schedule(layout, micro_batches)))
    if layout.context_parallel_size > 1:
        engines.append(context_parallel_choice(args, layout))
    if args.num_experts:
        ep = f", experts sharded over {layout.expert_parallel_size} ranks (all-to-all)" \
            if layout.expert_parallel_size > 1 else ""
        residual = (", PR-MoE (--mlp-type residual): a dense MLP beside the experts, mixed in by learned per-token "
                    "coefficients" if args.mlp_type == "residual" else "")
        capacity = ("dropless (--disable-moe-token-dropping: every token reaches its experts, no capacity "
                    "factor)" if args.disable_moe_token_dropping
                    else f"capacity factor {args.moe_capacity_factor:g} (tokens over capacity dropped)")
        engines.append(EngineChoice("--num-experts", f"rapidtrain MoE layers: top-{args.moe_router_topk} router, "
                                    f"load-balancing loss, {capacity}{ep}{residual}"))
    return engines


def _precision_choices(layout: Layout, precision: Precision, partitioning: EngineChoice | None,
                       switches: Switches) -> list[EngineChoice]:
    if precision.dtype == "fp32":
        return []
    deepspeed_own = partitioning is not None and partitioning.engine.startswith("DeepSpeed")
    engine = f"DeepSpeed {precision.dtype} engine" if deepspeed_own else f"torch.autocast({precision.dtype})"
    if not deepspeed_own and precision.dtype == "bf16":
        engine += (" over bf16 copies of the linear layers' weights, refreshed from the fp32 masters after each "
                   "optimizer step; gradients added into the fp32 masters' (parallel/low_precision_weights.py)"
                   if bf16_weight_copies(precision, layout, switches) else
                   ", which casts the fp32 linear weights to bf16 in every forward (bf16 copies kept by the step "
                   "serve one process without --torch-compile only)")
    if precision.loss_scaling != "none":
        engine += f" + {precision.loss_scaling} loss scaling"
    if partitioning is not None and "FSDP2" in partitioning.engine and layout.data_parallel_size > 1:
        engine += (f"; FSDP2 MixedPrecisionPolicy on the transformer blocks ({precision.dtype} all-gather and "
                   "compute, fp32 reduce-scatter and accumulation; embeddings, final norm and head in fp32)")
    return [EngineChoice("precision", engine, precision.reason)]


def _kernel_choices(args: argparse.Namespace, ctx: RunContext, layout: Layout, precision: Precision,
                    model: ModelConfig | None) -> list[EngineChoice]:
    """Graph optimisation, k-bit bases and adapters, the attention kernel, compile."""
    engines: list[EngineChoice] = []
    if args.onnx_runtime_training:
        usable, why = ort_status()
        engines.append(EngineChoice("--onnx-runtime-training", "onnxruntime ORTModule" if usable
                                    else f"{describe_compile(args)} as the graph optimiser", why))
    lora = lora_settings(args)
    if lora is not None and lora.load_in_bits:
        from rapidtrain.models.lora import describe_quantization  # torch: kept off `rapidtrain plan`'s start-up

        engines.append(EngineChoice(f"--load-in-{lora.load_in_bits}bit",
                                    describe_quantization(lora.load_in_bits, precision.dtype)))
    if lora is not None and lora.rank > 0:
        engines.append(EngineChoice("--lora-rank", lora.describe()))
    attention = attention_settings(args)
    builtin = trains_builtin_model(args)
    short = builtin and model is not None and short_attention_planned(model, precision, layout, ctx.device_type)
    if "attention_backend" in getattr(args, "given_flags", ()) or attention.document_ids or short:
        engines.append(EngineChoice("--attention-backend", *attention.describe(builtin, short, precision.dtype)))
    if args.torch_compile:
        engines.append(EngineChoice("--torch-compile", f"{describe_compile(args)} per transformer layer",
                                    "it compiles what repeats: each layer, and on CUDA the built-in loss's "
                                    "vocabulary blocks (their elementwise work; models/chunked_loss.py)"))
    return engines


def _host_choices(args: argparse.Namespace, ctx: RunContext, layout: Layout, precision: Precision,
                  switches: Switches, notes: list[str]) -> list[EngineChoice]:
    """The CPU allocator, TF32 and how the model is constructed."""
    engines: list[EngineChoice] = []
    if ctx.device_type == "cpu":
        from rapidtrain.config.resolve import cpu_threads

        engines.append(EngineChoice("CPU threads", *cpu_threads(ctx)[1:]))
    if ctx.device_type == "cpu" and args.cpu_allocator_tuning:
        from rapidtrain.core.cpu_allocator import DESCRIPTION, glibc_version

        if glibc_version():
            engines.append(EngineChoice("CPU allocator", DESCRIPTION, "each step reuses the last step's "
                                        "pages instead of faulting them in again; --no-cpu-allocator-tuning turns it "
                                        "off"))
        else:
            notes.append("CPU allocator: the C library is not glibc, so malloc is left as it is")
    if args.tf32 or ctx.device_type == "cuda":
        engines.append(tf32_choice(args, ctx, precision))
    construction = construction_choice(args, ctx, layout, switches)
    return engines + ([construction] if construction is not None else [])


def _data_choices(args: argparse.Namespace, ctx: RunContext) -> list[EngineChoice]:
    """How batches are shaped and the data read."""
    engines: list[EngineChoice] = []
    if args.data_iterator == "dynamic-shape":
        how = "length-bucketed batches padded to the longest (multiple of 8)"
        if is_pretraining(args, ctx) and args.model_type == "gpt":
            how = "one document per sample (not packed, cut at --seq-length + 1 tokens), " + how
        elif is_pretraining(args, ctx):
            how = "BERT samples bucketed by length, each micro-batch cut to its longest (multiple of 8)"
        engines.append(EngineChoice("--data-iterator dynamic-shape", how))
    if args.padding_free:
        engines.append(EngineChoice("--padding-free", "each micro-batch's sequences concatenated into one row "
                                    "(no padding; its length varies per step), position ids restarting at 0 per "
                                    "sequence, no attention mask and use_cache=False, so transformers' "
                                    "create_causal_mask detects the packed sequences and keeps attention within "
                                    "each; no loss across a sequence boundary (flash_attention_2 runs each "
                                    "sequence alone; eager and sdpa mask one [row, row] block, whose cost grows "
                                    "with the row's length squared)",
                                    "--padding-free: no compute or memory spent on padded tokens"))
    if args.mmap_warmup:
        engines.append(EngineChoice("--mmap-warmup", "every .bin/.idx file of the data read once before training"))
    return engines


def _optimizer_choice(args: argparse.Namespace, ctx: RunContext, layout: Layout, switches: Switches,
                      model: ModelConfig | None = None, precision: Precision | None = None) -> EngineChoice:
    from rapidtrain.optim.optimizers import (  # torch: see above
        FLAT_BUFFERS,
        describe_offload_optimizer,
        describe_optimizer,
    )

    if (args.cpu_offload or args.nvme_offload_dir) and zero_stage(args) > 0 and not zero_by_fsdp2(args):
        return EngineChoice("optimizer", describe_offload_optimizer(optimizer_settings(args)))
    settings = optimizer_settings(args, layout, switches)
    described = describe_optimizer(settings, ctx.device_type)
    if precision is not None and flat_optimizer_step(model, precision, layout, switches, settings, ctx.device_type):
        described += FLAT_BUFFERS
    if settings.name == "muon" and model is not None:
        from rapidtrain.optim.muon import muon_parameter_counts

        (muon_tensors, muon_elements), (adamw_tensors, adamw_elements) = muon_parameter_counts(model)
        described += (f"; the whole model's parameters: Muon {muon_tensors} tensors ({muon_elements:,} elements), "
                      f"AdamW {adamw_tensors} tensors ({adamw_elements:,} elements)")
    return EngineChoice("optimizer", described,
                        "the layout's parameters are " + ("DTensors (tensor parallel / FSDP2 / replicate)"
                                                          if settings.dtensor_parameters else "plain tensors"))


def recompute_choices(args: argparse.Namespace) -> list[EngineChoice]:
    recompute = recompute_of(args)
    if not recompute.enabled:
        flag = "--cpu-offloading" if recompute.offload_layers else "--moe-layer-recompute"
        return ([EngineChoice(flag, f"activation memory: {recompute.describe()}")]
                if recompute.moe_layers_recomputed or recompute.offload_layers else [])
    if args.checkpoint_activations and recompute.granularity == "full" and recompute.method == "uniform":
        hf_own = not trains_builtin_model(args)
        return [EngineChoice("--checkpoint-activations", "Hugging Face gradient_checkpointing_enable()" if hf_own
                             else "torch.utils.checkpoint per transformer layer")]
    given = [flag for flag, dest in (("--recompute-granularity", "recompute_granularity"),
                                     ("--recompute-activations", "recompute_activations"),
                                     ("--activations-checkpoint-method", "activations_checkpoint_method"),
                                     ("--checkpoint-activations", "checkpoint_activations"))
             if getattr(args, dest)]
    return [EngineChoice(given[0], f"recompute {recompute.granularity}: {recompute.describe()}")]


def construction_choice(args: argparse.Namespace, ctx: RunContext, layout: Layout,
                        switches: Switches) -> EngineChoice | None:
    on_meta, why = model_construction(args, ctx, layout, switches.partitioning, switches.partitioning_engine)
    if not why:
        return None
    if not on_meta:
        return EngineChoice("model construction", why)
    if switches.partitioning_engine == "deepspeed":
        return EngineChoice("model construction", "under deepspeed.zero.Init (each parameter partitioned as it is "
                            "created), then initialised one parameter at a time by (seed, name)",
                            f"the layout shards the model ({why}): no rank holds it whole, and the values are the "
                            "one-process ones")
    return EngineChoice("model construction", "on the meta device, split and wrapped first; each rank then "
                        "allocates only its shards and initialises them by (seed, parameter name)",
                        f"the layout shards the model ({why}): no rank holds it whole, and the values are the "
                        "one-process ones")


def tf32_choice(args: argparse.Namespace, ctx: RunContext, precision: Precision) -> EngineChoice:
    """Where --tf32 applies: every fp32 matmul of an fp32 run, only the ones autocast keeps in fp32 otherwise."""
    if ctx.device_type != "cuda":
        return EngineChoice("--tf32", "no effect", "TF32 is a tensor-core format of NVIDIA GPUs (Ampere or newer); "
                            "on a CPU fp32 matmuls stay fp32")
    if not args.tf32:
        return EngineChoice("TF32", "off: fp32 matmuls in full fp32 (PyTorch's default)", "--tf32 runs them on TF32 "
                            "tensor cores (10-bit mantissa; ~8× the fp32 peak on A100/H100, up to 3× on real models)")
    where = "every fp32 matmul" if precision.dtype == "fp32" else \
        f"the matmuls {precision.dtype} autocast keeps in fp32 (the MoE router, any op outside autocast)"
    return EngineChoice("--tf32", f"torch.backends.cuda.matmul.fp32_precision = 'tf32' and cuDNN convolutions in "
                        f"TF32: {where}")
