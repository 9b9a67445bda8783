"""Every key of a `--deepspeed_config` file DeepSpeed does not run (tensor or pipeline parallelism, ZeRO stage 0:
DDP or FSDP2 serve the layout), each by name: read as the flag it means, or said why it changes nothing here, or
refused with the reason. A key rapidtrain does not know is refused by name, never passed over.

(Where DeepSpeed runs the layout, parallel/deepspeed.py merges the file into the generated config, and DeepSpeed reads
every key; keys rapidtrain owns there, the optimizer and the schedule, are refused on conflict.)"""

from __future__ import annotations

import argparse
from typing import Any

# The keys read as flags are surface_meanings.DEEPSPEED_KEYS; "zero_optimization.stage" chooses the ZeRO switch.
READ_ELSEWHERE = {"zero_optimization", "zero_optimization.stage"}

# Keys that change no number of this run, with why (the leaf, or a whole block, by its dotted name).
WITHOUT_EFFECT: dict[str, str] = {
    "steps_per_print": "DeepSpeed's own progress line; rapidtrain prints its log line every --log-interval",
    "wall_clock_breakdown": "DeepSpeed's timers of its engine, which does not run; --timing-log-level times "
                            "rapidtrain's steps",
    "dump_state": "DeepSpeed's engine prints its state at start; rapidtrain prints its plan",
    "prescale_gradients": "DeepSpeed divides gradients by the data-parallel size before or after the reduction; DDP "
                          "and FSDP2 average them, the same mean",
    "gradient_predivide_factor": "DeepSpeed's order of dividing in the gradient reduction; DDP and FSDP2 average, the "
                                 "same mean",
    "zero_allow_untested_optimizer": "lets DeepSpeed's ZeRO wrap an optimizer it has not tested; ZeRO does not run "
                                     "here",
    "memory_breakdown": "DeepSpeed's memory printout of its engine; the plan estimates memory per rank",
    "communication_data_type": "DeepSpeed's dtype of its own gradient reduction; DDP and FSDP2 reduce in the "
                               "parameters' precision",
    "sparse_gradients": "DeepSpeed's sparse reduction of embedding gradients; DDP reduces them dense, the same sum",
    "tensorboard": "DeepSpeed's own TensorBoard writer; --tensorboard-dir is rapidtrain's",
    "wandb": "DeepSpeed's own Weights & Biases writer; --wandb-project is rapidtrain's",
    "csv_monitor": "DeepSpeed's own CSV monitor; --loss-log-file writes rapidtrain's",
    "comms_logger": "DeepSpeed's communication logger of its engine, which does not run",
    "flops_profiler": "DeepSpeed's FLOPs profiler of its engine; the log line reports TFLOP/s (and MFU with "
                      "--peak-tflops)",
    "aio": "DeepSpeed's NVMe reads and writes, for ZeRO-Infinity offload, which does not run in this layout",
}
# ZeRO's tuning: how DeepSpeed buckets and overlaps its own communication. FSDP2 (ZeRO-1/2 with tensor or pipeline
# parallelism) and DDP keep their own buckets: the same numbers.
ZERO_TUNING_KEYS = ("reduce_bucket_size", "allgather_bucket_size", "overlap_comm", "contiguous_gradients",
                    "reduce_scatter", "allgather_partitions", "round_robin_gradients", "elastic_checkpoint",
                    "load_from_fp32_weights", "sub_group_size", "stage3_max_live_parameters",
                    "stage3_max_reuse_distance", "stage3_prefetch_bucket_size", "stage3_param_persistence_threshold",
                    "stage3_param_persitence_threshold", "stage3_gather_16bit_weights_on_model_save",
                    "stage3_gather_fp16_weights_on_model_save", "ignore_unused_parameters", "legacy_stage1",
                    "use_multi_rank_bucket_allreduce", "zero_hpz_partition_size", "zero_quantized_weights",
                    "zero_quantized_gradients", "mics_shard_size", "memory_efficient_linear")
# Megatron-DeepSpeed's activation checkpointing block: its flags' meaning (each a DeepSpeed option of how to keep
# the checkpoints, beside torch.utils.checkpoint's recomputation, which --checkpoint-activations chooses).
ACTIVATION_KEYS = {"partition_activations": "--partition-activations",
                   "contiguous_memory_optimization": "--contigious-checkpointing",
                   "cpu_checkpointing": "--checkpoint-in-cpu", "synchronize_checkpoint_boundary":
                   "--synchronize-each-layer", "profile": "--profile-backward", "number_checkpoints": None}
# An optimizer block's parameters under Megatron-DeepSpeed: DeepSpeed builds the optimizer from them, but Megatron's
# schedule sets the rate and the weight decay of every group at each step, from the flags.
SCHEDULED_PARAMS = {"lr": "--lr (Megatron's schedule sets the rate at every step)",
                    "weight_decay": "--weight-decay (Megatron's schedule sets it at every step)",
                    "max_grad_norm": "gradient_clipping / --clip-grad (DeepSpeed's Adam ignores it)"}


def leaves(config: dict[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """(dotted key, value) of every key whose value is no object, and of every empty object."""
    found: list[tuple[str, Any]] = []
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            found += leaves(value, name + ".")
        else:
            found.append((name, value))
    return found


def audit_keys(args: argparse.Namespace, config: dict[str, Any], path: str, read: set[str],
               notes: list[str], refusals: list[str]) -> None:
    """Each key of `config` not in `read` (the keys surface_meanings read as flags): a note naming it and why it
    changes nothing, a flag set from it, or a refusal naming it."""
    for key, value in leaves(config):
        if key in read or key in READ_ELSEWHERE:
            continue
        section, _, leaf = key.partition(".")
        where = f"--deepspeed_config {path}: {key}"
        if key in WITHOUT_EFFECT or section in WITHOUT_EFFECT:
            notes.append(f"{where}: no effect here; {WITHOUT_EFFECT.get(key) or WITHOUT_EFFECT[section]}")
        elif section == "zero_optimization" and leaf.split(".")[0] in ZERO_TUNING_KEYS:
            notes.append(f"{where}: no effect here; DeepSpeed ZeRO's communication tuning, and ZeRO does not run "
                         "this layout (DDP or FSDP2 keep their own buckets: the same numbers)")
        elif section == "zero_optimization" and leaf.split(".")[0] in ("offload_optimizer", "offload_param",
                                                                        "cpu_offload"):
            _offload(key, value, where, notes, refusals)
        elif section == "activation_checkpointing":
            flag = ACTIVATION_KEYS.get(leaf)
            notes.append(f"{where}: no effect here; " + (f"it is {flag}: " if flag else "")
                         + "a DeepSpeed option of how activation checkpoints are kept; rapidtrain recomputes with "
                           "torch.utils.checkpoint (--checkpoint-activations, --recompute-granularity)")
        elif key == "gradient_accumulation_steps":
            _accumulation(args, int(value), where, notes, refusals)
        elif section == "optimizer":
            _optimizer(args, leaf, value, where, notes, refusals)
        elif section == "scheduler":
            refusals.append(f"{where}: DeepSpeed's learning-rate scheduler; rapidtrain's schedule is Megatron's, from "
                            "the flags (--lr, --min-lr, --lr-decay-style, --lr-warmup-iters, --lr-decay-iters): "
                            "remove the scheduler block and give those")
        elif section in ("curriculum_learning", "data_efficiency"):
            if section == "curriculum_learning" and leaf == "enabled" and not value:
                notes.append(f"{where}: false, nothing to do")
            elif not (config.get(section) or {}).get("enabled", section != "curriculum_learning"):
                notes.append(f"{where}: no effect here; {section} is disabled in the file")
            else:
                refusals.append(f"{where}: DeepSpeed's curriculum learning (sequence length growing with the "
                                "difficulty schedule) is not in rapidtrain; remove the block, or set enabled false")
        else:
            refusals.append(f"{where}: a DeepSpeed setting rapidtrain does not read; DeepSpeed does not run this "
                            "layout, so nothing would apply it: remove the key")


def _offload(key: str, value: Any, where: str, notes: list[str], refusals: list[str]) -> None:
    device = value if key.endswith(".device") else None
    if key.endswith(".device") and device in (None, "none"):
        notes.append(f"{where}: none, nothing offloaded")
    elif key.endswith(".device") or key.endswith("cpu_offload"):
        if value in (False, None):
            notes.append(f"{where}: off")
            return
        refusals.append(f"{where}: ZeRO-Offload runs inside DeepSpeed's ZeRO, which does not run this layout (tensor "
                        "or pipeline parallelism, or stage 0); offload needs --zero-2/3-memory-optimization with "
                        "tensor- and pipeline-parallel size 1 (then --cpu-offload), or remove it")
    else:
        notes.append(f"{where}: no effect here; a detail of ZeRO-Offload's buffers, which do not exist in this layout")


def _accumulation(args: argparse.Namespace, steps: int, where: str, notes: list[str], refusals: list[str]) -> None:
    """DeepSpeed's accumulation steps: the global batch is micro × steps × data parallel (DeepSpeed's check)."""
    import os

    world = int(os.environ.get("WORLD_SIZE") or args.nproc_per_node or 1)
    data_parallel = max(world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size), 1)
    wanted = args.micro_batch_size * steps * data_parallel
    if args.global_batch_size is None:
        args.global_batch_size = wanted
        notes.append(f"{where} {steps}: --global-batch-size {wanted} (micro {args.micro_batch_size} × {steps} × data "
                     f"parallel {data_parallel})")
    elif args.global_batch_size != wanted and "WORLD_SIZE" in os.environ:
        refusals.append(f"{where} {steps}: micro {args.micro_batch_size} × {steps} × data parallel {data_parallel} = "
                        f"{wanted}, but the global batch is {args.global_batch_size}; make them agree")
    else:
        notes.append(f"{where} {steps}: the accumulation steps follow from --global-batch-size "
                     f"{args.global_batch_size} / (micro × data parallel), as DeepSpeed checks")


def _optimizer(args: argparse.Namespace, leaf: str, value: Any, where: str, notes: list[str],
               refusals: list[str]) -> None:
    name = leaf.removeprefix("params.")
    if leaf == "type":
        kind = str(value).lower()
        if kind in ("adam", "adamw", "fusedadam", "cpuadam"):
            notes.append(f"{where} {value}: Adam with decoupled weight decay, as rapidtrain's --optimizer adam")
        else:
            refusals.append(f"{where} {value}: give it as --optimizer (rapidtrain's optimizers are its flags'); "
                            "remove the optimizer block")
    elif name in SCHEDULED_PARAMS:
        notes.append(f"{where} {value}: no effect here, as in Megatron-DeepSpeed; the value is "
                     f"{SCHEDULED_PARAMS[name]}")
    elif name == "eps":
        args.adam_eps = float(value)
        notes.append(f"{where} {value}: --adam-eps {value}")
    elif name == "betas" and isinstance(value, list) and len(value) == 2:
        args.adam_beta1, args.adam_beta2 = float(value[0]), float(value[1])
        notes.append(f"{where} {value}: --adam-beta1 {value[0]} --adam-beta2 {value[1]}")
    else:
        refusals.append(f"{where}: an optimizer parameter rapidtrain has no flag for; remove it")


def refuse_engine_data_features(config: dict[str, Any], path: str, refusals: list[str]) -> None:
    """Where DeepSpeed's engine runs the layout: its curriculum learning and data efficiency would change the
    sequence length of rapidtrain's batches (the engine passes `curriculum_seqlen` into the model's forward), which
    neither rapidtrain's data nor its model takes: refused by name."""
    for section in ("curriculum_learning", "data_efficiency"):
        block = config.get(section)
        if isinstance(block, dict) and block.get("enabled"):
            refusals.append(f"--deepspeed_config {path}: {section}.enabled: DeepSpeed's curriculum learning (sequence "
                            "length growing with the difficulty schedule) is not in rapidtrain's data or model; "
                            "remove the block, or set enabled false")
