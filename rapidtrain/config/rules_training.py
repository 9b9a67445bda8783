"""Rules of which model each layout serves, training length and schedule, data, optimizers, LoRA and k-bit
bases, compile, ZeRO options, numeric ranges and profiling (the second part of the conflict table)."""

from __future__ import annotations

from rapidtrain.config.arguments import CATCHABLE_EXIT_SIGNALS
from rapidtrain.config.checks import (
    INDEX_BYTES_PER_SAMPLE,
    MAX_TRAIN_SAMPLES,
    NON_ELEMENTWISE_OPTIMIZERS,
    OFFLOADABLE_OPTIMIZERS,
    SEED_LIMIT,
    Rule,
    adafactor_on_dtensors,
    async_io_problem,
    attention_backend_problem,
    auto_micro_batch_problem,
    bad_lora_values,
    bad_muon_values,
    batch_schedule_misfits,
    batch_schedule_problem,
    compile_backends,
    compile_requested,
    compile_settings_given,
    cpu_offloading_problem,
    deepspeed_config_problem,
    deepspeed_zero,
    different_folders,
    dp_size,
    experts_of,
    flag_name,
    interleaved,
    k_bit_flag,
    k_bit_problem,
    lengths,
    lora_settings_given,
    low_bit_optimizer_refusal,
    megatron_task_problem,
    min_lr_above_lr,
    mixed_schedule_flags,
    muon_chosen,
    muon_options_without_muon,
    muon_under_fairscale,
    needs_iterations,
    non_finite_or_negative,
    not_positive_counts,
    optimizer_choice,
    options_without_switch,
    outside_range,
    pad_vocab_problem,
    padding_free_problem,
    partitioning_flags,
    per_split_problem,
    pp_size,
    profile_problem,
    recompute_problem,
    split_problem,
    three_d,
    train_samples_of,
    uses_hf_model,
    warmups,
    zero_settings_given,
)
from rapidtrain.config.partitioning import zero_stage
from rapidtrain.config.resolve import zero_by_fsdp2
from rapidtrain.models import hf_config
from rapidtrain.optim.optimizers import ADAFACTOR_ON_DTENSORS

EPOCH_SFT_KINDS = ("JSON-SFT", "LLama-SFT")  # Pai's SFT JSON: epochs count passes over its records


def builtin_lora_problem(args) -> str:
    """What the built-in model's LoRA adapters do not serve (empty: nothing)."""
    if args.load_in_4bit or args.load_in_8bit:
        return ("--load-in-4bit / --load-in-8bit with the built-in model: its base is not quantised here (QLoRA's "
                "bitsandbytes layers hold no tensor-parallel shards); QLoRA runs on a Hugging Face model "
                "(--pretrained-model-name-or-path DIR --task casual_lm), or drop the flag for LoRA on a full-precision "
                "base")
    if args.lora_dropout and args.tensor_model_parallel_size > 1:
        return ("--lora-dropout with --tensor-model-parallel-size > 1: the adapters' dropout would draw its masks "
                "on split inputs; give --lora-dropout 0 (the default) or tensor-parallel size 1")
    if deepspeed_zero(args):
        return ("--lora-rank with DeepSpeed ZeRO on the built-in model: give torch's engines (DDP, "
                "--fsdp-memory-optimization, --oss-memory-optimization) for its adapters")
    return ""

TRAINING_RULES: tuple[Rule, ...] = (
    Rule(
        "exit-signal-catchable", ("--exit-signal",),
        "--exit-signal names a signal a run can catch and stop on (SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1/2, "
        "SIGALRM, SIGXCPU, SIGPWR).",
        lambda a, c: a.exit_signal not in CATCHABLE_EXIT_SIGNALS,
        lambda a, c: f"--exit-signal {a.exit_signal}: "
        + ("it cannot be caught, so no run can save on it" if a.exit_signal in ("SIGKILL", "SIGSTOP") else
           "it comes with normal operation or a fault, not as a request to stop")
        + f". Give one of {', '.join(CATCHABLE_EXIT_SIGNALS)} (a scheduler's warning signal is usually SIGUSR1 "
        "or SIGTERM).",
    ),
    Rule(
        "3d-builtin-models-only", ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                                   "--pretrained-model-name-or-path"),
        "Tensor and pipeline parallelism apply to the built-in Megatron-style models, not Hugging Face models.",
        lambda a, c: three_d(a) and uses_hf_model(a),
        lambda a, c: "--tensor-model-parallel-size / --pipeline-model-parallel-size apply to the built-in "
        "Megatron-style models; --pretrained-model-name-or-path loads a Hugging Face model, which they cannot split. "
        "For a model that does not fit, use --zero-3-memory-optimization or --fsdp-memory-optimization instead.",
    ),
    Rule(
        "moe-builtin-models-only", ("--num-experts", "--pretrained-model-name-or-path"),
        "Mixture of experts replaces MLPs of the built-in models only.",
        lambda a, c: bool(experts_of(a)) and uses_hf_model(a),
        lambda a, c: "--num-experts turns the built-in models' MLPs into MoE layers; it cannot change a Hugging Face "
        "model loaded with --pretrained-model-name-or-path. Drop one of them.",
    ),
    Rule(
        "dynamic-shape-no-pp", ("--data-iterator", "--pipeline-model-parallel-size"),
        "The dynamic-shape iterator does not combine with pipeline parallelism (stages exchange fixed shapes).",
        lambda a, c: a.data_iterator == "dynamic-shape" and pp_size(a) > 1,
        lambda a, c: "--data-iterator dynamic-shape with --pipeline-model-parallel-size "
        f"{pp_size(a)}: pipeline stages exchange activations of one fixed shape. Drop dynamic shapes or pipelining.",
    ),
    Rule(
        "iters-xor-epochs", ("--train-iters", "--train-samples", "--epochs"),
        "Exactly one of --train-iters / --train-samples / --epochs: pretraining counts iterations (or samples, "
        "Megatron's sample-based training), fine-tuning epochs (or iterations).",
        lambda a, c: len(lengths(a)) != 1,
        lambda a, c: (f"{' and '.join(lengths(a))} all set the training length; give one." if lengths(a)
                      else "--train-iters, --train-samples or --epochs is needed: "
                      + ("pretraining is iteration-based (--train-iters N, or --train-samples N)."
                         if needs_iterations(a, c) else "fine-tuning runs --epochs N (or --train-iters N).")),
    ),
    Rule(
        "pretraining-needs-iters", ("--epochs", "--task"),
        "Pretraining (--task pretraining, without --user-script) is iteration-based.",
        lambda a, c: needs_iterations(a, c) and a.epochs is not None and a.train_iters is None
        and a.train_samples is None and getattr(a, "raw_json_dataset", None) not in EPOCH_SFT_KINDS,
        lambda a, c: "--epochs with --task pretraining: Megatron-style pretraining counts iterations over a "
        "sample stream (Pai's SFT JSON, --dataset JSON-SFT or LLama-SFT, trains by epochs). Use --train-iters N "
        "(or --train-samples N).",
    ),
    Rule(
        "schedule-counts-as-training", ("--train-samples", "--lr-decay-samples", "--lr-decay-iters"),
        "The schedule is counted as the training length is (Megatron): with --train-samples the -samples forms "
        "(--lr-decay-samples, --lr-warmup-samples, --lr-wsd-decay-samples), otherwise the -iters forms.",
        lambda a, c: bool(mixed_schedule_flags(a)),
        lambda a, c: f"{', '.join(mixed_schedule_flags(a))} with "
        + ("--train-samples: sample-based training counts its schedule in samples. Use "
           + ", ".join(f.replace("-iters", "-samples") for f in mixed_schedule_flags(a))
           if a.train_samples is not None else
           "iteration-based training (--train-iters / --epochs): its schedule is counted in iterations. Use "
           + ", ".join(f.replace("-samples", "-iters") for f in mixed_schedule_flags(a)) + " or --train-samples")
        + " (Megatron refuses the mix too).",
    ),
    Rule(
        "one-warmup", ("--lr-warmup-fraction", "--lr-warmup-iters", "--lr-warmup-samples"),
        "Warm-up by fraction, by iterations or by samples: one of them.",
        lambda a, c: len(warmups(a)) > 1,
        lambda a, c: f"{' and '.join(warmups(a))} all set the warm-up; keep one.",
    ),
    Rule(
        "samples-warmup-within-decay", ("--lr-warmup-samples", "--train-samples", "--lr-decay-samples"),
        "With sample-based training the warm-up ends before the decay horizon.",
        lambda a, c: a.train_samples is not None and a.lr_warmup_samples > 0
        and a.lr_warmup_samples >= (a.lr_decay_samples or a.train_samples),
        lambda a, c: f"--lr-warmup-samples {a.lr_warmup_samples} is not below the decay horizon ("
        f"{'--lr-decay-samples' if a.lr_decay_samples else '--train-samples'} "
        f"{a.lr_decay_samples or a.train_samples}). Lower it or train longer.",
    ),
    Rule(
        "batch-schedule-valid", ("--rampup-batch-size", "--step-batch-size-schedule", "--global-batch-size"),
        "--rampup-batch-size START INCREMENT SAMPLES ramps from START (> 0) to --global-batch-size in whole "
        "INCREMENTs; --step-batch-size-schedule is 'THRESHOLD:BATCH ...' from threshold 0; not both.",
        lambda a, c: batch_schedule_problem(a) is not None,
        lambda a, c: str(batch_schedule_problem(a)),
    ),
    Rule(
        "batch-schedule-divisible", ("--rampup-batch-size", "--step-batch-size-schedule", "--micro-batch-size"),
        "Every global batch of a ramp-up or step schedule is divisible by micro batch × data-parallel size (and, "
        "with interleaved pipelining, gives a multiple of the pipeline size of micro-batches).",
        lambda a, c: bool(batch_schedule_misfits(a, c)),
        lambda a, c: f"global batch sizes {', '.join(map(str, batch_schedule_misfits(a, c)))} of the batch schedule "
        f"are not divisible by --micro-batch-size {a.micro_batch_size} × data-parallel size {dp_size(a, c)}"
        + (f" × --pipeline-model-parallel-size {pp_size(a)} (interleaved schedule)"
           if interleaved(a) else "")
        + ": each iteration runs whole micro-batches on every rank. Choose a start, increment and final batch (or "
        "schedule sizes) that are multiples of it.",
    ),
    Rule(
        "warmup-within-decay", ("--lr-warmup-iters", "--train-iters", "--lr-decay-iters"),
        "Warm-up ends before the decay horizon.",
        lambda a, c: (a.lr_decay_iters or a.train_iters) is not None and a.lr_warmup_iters > 0
        and a.lr_warmup_iters >= (a.lr_decay_iters or a.train_iters),
        lambda a, c: f"--lr-warmup-iters {a.lr_warmup_iters} is not shorter than the decay horizon "
        f"({'--lr-decay-iters' if a.lr_decay_iters else '--train-iters'} {a.lr_decay_iters or a.train_iters}). "
        "Lower --lr-warmup-iters (or use --lr-warmup-fraction) or train longer.",
    ),
    Rule(
        "lr-required", ("--lr",),
        "--lr is required.",
        lambda a, c: a.lr is None,
        lambda a, c: "--lr is missing: give the peak learning rate, e.g. --lr 1e-4.",
    ),
    Rule(
        "fairscale-backend-scope", ("--sharding-backend", "--fsdp-memory-optimization", "--oss-memory-optimization"),
        "--sharding-backend fairscale serves OSS and SDP only (FairScale's FSDP fails on current PyTorch).",
        lambda a, c: a.sharding_backend == "fairscale" and not (
            a.oss_memory_optimization or a.oss_sdp_memory_optimization),
        lambda a, c: "--sharding-backend fairscale applies to --oss-memory-optimization and "
        "--oss-sdp-memory-optimization only"
        + (" (FairScale's FSDP does not run with current PyTorch; use the default torch backend for "
           "--fsdp-memory-optimization)" if a.fsdp_memory_optimization else "")
        + ". Drop --sharding-backend or add one of those switches.",
    ),
    Rule(
        "binary-head-bert-only", ("--bert-binary-head", "--model-type"),
        "The binary (next-sentence) head belongs to BERT.",
        lambda a, c: bool(a.bert_binary_head) and a.model_type != "bert",
        lambda a, c: "--bert-binary-head needs --model-type bert.",
    ),
    Rule(
        "pretrained-checkpoint-or-load", ("--pretrained-model-name-or-path", "--load"),
        "A Megatron-format checkpoint named by --pretrained-model-name-or-path is loaded as --load is: give one "
        "folder to load from.",
        lambda a, c: hf_config.is_megatron_checkpoint(a) and a.load is not None and different_folders(
            a.load, a.pretrained_model_name_or_path),
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path} is a Megatron-format "
        f"checkpoint folder, which the run loads as --load, but --load names {a.load}. Give one of them.",
    ),
    Rule(
        "universal-checkpoint-needs-load", ("--universal-checkpoint", "--load"),
        "--universal-checkpoint chooses which checkpoint --load reads (DeepSpeed's latest_universal): without --load "
        "it would do nothing.",
        lambda a, c: bool(a.universal_checkpoint) and not a.load,
        lambda a, c: "--universal-checkpoint without --load does nothing: give --load ROOT, the folder whose "
        "latest_universal names ds_to_universal's output, or drop --universal-checkpoint.",
    ),
    Rule(
        "router-type-supported", ("--router-type", "--num-experts"),
        "Rapidformer's --router-type 0 (top-k gating with the load-balancing loss) is the built-in router; other "
        "router types are not implemented.",
        lambda a, c: a.router_type != 0,
        lambda a, c: f"--router-type {a.router_type}: the built-in MoE implements Rapidformer's router type 0 only "
        "(top-k gating by a linear layer, trained with the load-balancing loss, --moe-loss-coeff); a router "
        "without that loss is not implemented here. Use --router-type 0 (or leave it out).",
    ),
    Rule(
        "remote-device-none", ("--remote-device", "--zero-3-memory-optimization"),
        "--remote-device (Megatron-DeepSpeed's ZeRO-3 parameter placement) is served for 'none' only.",
        lambda a, c: a.remote_device != "none",
        lambda a, c: f"--remote-device {a.remote_device}: rapidtrain's ZeRO-3 keeps the parameter partitions on the "
        "device; DeepSpeed's parameter offload is not wired up. Use --remote-device none, and --cpu-offload (with "
        "ZeRO) to move the optimizer state and step to the CPU.",
    ),
    Rule(
        "residual-moe-needs-experts", ("--mlp-type", "--use-expert-residual-network", "--num-experts"),
        "PR-MoE (--mlp-type residual / --use-expert-residual-network) adds a dense MLP beside MoE layers: it needs "
        "--num-experts.",
        lambda a, c: a.mlp_type == "residual" and not experts_of(a),
        lambda a, c: "--mlp-type residual (--use-expert-residual-network) mixes a dense MLP into each MoE layer, but "
        "no layer has experts: add --num-experts N, or drop it.",
    ),
    Rule(
        "deepspeed-config-with-zero", ("--deepspeed_config", "--zero-2-memory-optimization"),
        "--deepspeed_config FILE is merged into the config of a DeepSpeed ZeRO run (a --zero-*-memory-optimization "
        "switch without tensor/pipeline parallelism); the file is JSON.",
        lambda a, c: deepspeed_config_problem(a) is not None,
        lambda a, c: str(deepspeed_config_problem(a)),
    ),
    Rule(
        "per-split-data", ("--train-data-path", "--data-path", "--data-iterator"),
        "Megatron's per-split data (--train-data-path ...) replaces --data-path and --split; pretraining needs its "
        "training split, and the dynamic-shape iterator reads one --data-path prefix.",
        lambda a, c: per_split_problem(a, c) is not None,
        lambda a, c: str(per_split_problem(a, c)),
    ),
    Rule(
        "dynamic-shape-one-prefix", ("--data-iterator", "--data-path"),
        "The dynamic-shape iterator in pretraining reads the documents of one --data-path prefix (not a blend).",
        lambda a, c: needs_iterations(a, c) and a.data_iterator == "dynamic-shape" and a.data_path is not None
        and len(a.data_path) > 1,
        lambda a, c: "--data-iterator dynamic-shape with a weighted blend in --data-path: unpacked documents come from "
        "one indexed dataset. Give a single prefix, or drop --data-iterator dynamic-shape.",
    ),
    Rule(
        "builtin-lora-scope", ("--lora-rank", "--load-in-4bit", "--load-in-8bit", "--lora-dropout"),
        "The built-in model's adapters: a full-precision base (bitsandbytes' 4/8-bit layers hold no tensor-parallel "
        "shards), no adapter dropout beside tensor parallelism, torch's engines (not DeepSpeed ZeRO).",
        lambda a, c: a.lora_rank > 0 and not uses_hf_model(a) and bool(builtin_lora_problem(a)),
        lambda a, c: builtin_lora_problem(a),
    ),
    Rule(
        "zero-elementwise-optimizer", ("--zero-1-memory-optimization", "--zero-2-memory-optimization",
                                       "--zero-3-memory-optimization", "--optimizers", "--optimizer"),
        "DeepSpeed ZeRO steps flat partitions of each parameter group: it takes elementwise optimizers (Adam, "
        "AdamW, SGD), not LAMB or Adafactor.",
        lambda a, c: deepspeed_zero(a) and optimizer_choice(a)[0] in NON_ELEMENTWISE_OPTIMIZERS,
        lambda a, c: f"{optimizer_choice(a)[1]} {optimizer_choice(a)[0]} with --zero-{zero_stage(a)}-memory-"
        "optimization: DeepSpeed ZeRO flattens each parameter group into one tensor and partitions it, so LAMB's "
        "per-layer trust ratio or Adafactor's row/column statistics would be computed over slices of many "
        "parameters, a different optimizer. Use --optimizers apex_adam (or --optimizer adamw, adam or sgd) with "
        "ZeRO, or --oss-memory-optimization, which keeps each parameter whole on one rank.",
    ),
    Rule(
        "cpu-offload-adam-only", ("--cpu-offload", "--optimizers", "--optimizer"),
        "--cpu-offload steps the optimizer with DeepSpeedCPUAdam: the optimizer must be Adam or AdamW.",
        lambda a, c: bool(a.cpu_offload or a.nvme_offload_dir)
        and optimizer_choice(a)[0] not in OFFLOADABLE_OPTIMIZERS
        and not (deepspeed_zero(a) and optimizer_choice(a)[0] in NON_ELEMENTWISE_OPTIMIZERS),
        lambda a, c: f"{'--cpu-offload' if a.cpu_offload else '--nvme-offload-dir'} with {optimizer_choice(a)[1]} "
        f"{optimizer_choice(a)[0]}: the offloaded "
        "optimizer step is DeepSpeedCPUAdam, which implements Adam and AdamW only. Use --optimizers apex_adam "
        "(AdamW) or --optimizer adamw/adam, or drop --cpu-offload.",
    ),
    Rule(
        "world-size-positive", ("--nproc-per-node",),
        "The world size (processes per node × nodes; `rapidtrain plan --world-size`) is at least 1.",
        lambda a, c: c.world_size < 1,
        lambda a, c: f"world size {c.world_size}: the number of processes must be at least 1 (rapidtrain plan "
        "--world-size N, or --nproc-per-node × NNODES for a run).",
    ),
    Rule(
        "rates-finite", ("--lr", "--min-lr", "--weight-decay", "--clip-grad"),
        "Learning rates, weight decay and the clipping norm are finite and not negative.",
        lambda a, c: bool(non_finite_or_negative(a)),
        lambda a, c: f"{', '.join(non_finite_or_negative(a))}: must be a finite number ≥ 0 (a negative rate "
        "climbs the loss, NaN poisons every weight at the first step). Give e.g. --lr 1e-4.",
    ),
    Rule(
        "min-lr-within-lr", ("--min-lr", "--lr"),
        "--min-lr is the floor the schedule decays to from --lr, so it is at most --lr (the run's schedule refuses it "
        "too).",
        # Only between valid rates: a negative or non-finite one is the rule above's to name.
        lambda a, c: min_lr_above_lr(a) and not non_finite_or_negative(a),
        lambda a, c: f"--min-lr {a.min_lr:g} is above --lr {a.lr:g}: the schedule decays from --lr down to "
        "--min-lr, so the learning rate would rise instead. Give --min-lr at most --lr (Megatron's runs use about "
        "a tenth of it).",
    ),
    Rule(
        "counts-positive", ("--train-iters", "--log-interval", "--eval-interval", "--num-workers"),
        "Iteration counts and intervals are at least 1; --eval-iters and --num-workers are not negative.",
        lambda a, c: bool(not_positive_counts(a)),
        lambda a, c: f"{', '.join(not_positive_counts(a))}: iteration counts and intervals must be at least 1, "
        "--eval-iters and --num-workers at least 0 (leave an interval out to use its default).",
    ),
    Rule(
        "probabilities-in-range", ("--hidden-dropout", "--attention-dropout", "--mask-prob"),
        "Dropout rates and betas lie in [0, 1); masking probabilities in [0, 1].",
        lambda a, c: bool(outside_range(a)),
        lambda a, c: f"{', '.join(outside_range(a))}: these are probabilities. Give a value in the range shown "
        "(dropout 0.1 is Megatron's default).",
    ),
    Rule(
        "seed-range", ("--seed",),
        "--seed lies in [0, 2**32) (numpy's RandomState orders the data with it).",
        lambda a, c: a.seed is not None and not 0 <= a.seed < SEED_LIMIT,
        lambda a, c: f"--seed {a.seed}: must lie in [0, {SEED_LIMIT}) because numpy's RandomState, which shuffles "
        "the data, takes no other seeds. Give e.g. --seed 1234.",
    ),
    Rule(
        "split-usable", ("--split",),
        "--split is one to three non-negative weights with a positive sum; pretraining needs a positive train weight.",
        lambda a, c: split_problem(a, c) is not None,
        lambda a, c: str(split_problem(a, c)),
    ),
    Rule(
        "train-samples-bound", ("--train-iters", "--global-batch-size"),
        f"--train-iters × global batch stays below 2**36 samples: the data indices take ~{INDEX_BYTES_PER_SAMPLE} "
        "bytes per sample.",
        lambda a, c: (train_samples_of(a, c) or 0) > MAX_TRAIN_SAMPLES,
        lambda a, c: f"--train-iters {a.train_iters} × global batch "
        f"{(train_samples_of(a, c) or 0) // max(a.train_iters or 1, 1)} = {train_samples_of(a, c):,} samples: the "
        f"sample and shuffle indices of that stream would need about "
        f"{(train_samples_of(a, c) or 0) * INDEX_BYTES_PER_SAMPLE / 2**40:,.0f} TiB ({INDEX_BYTES_PER_SAMPLE} bytes "
        f"per sample), and {MAX_TRAIN_SAMPLES:,} samples (2**36) is far beyond any real run. Check --train-iters.",
    ),
    Rule(
        "nccl-needs-cuda", ("--distributed-backend",),
        "--distributed-backend nccl needs CUDA devices.",
        lambda a, c: a.distributed_backend == "nccl" and c.device_type != "cuda",
        lambda a, c: "--distributed-backend nccl: NCCL runs collectives between CUDA devices, and this run has none "
        "(device cpu). Use --distributed-backend gloo, or leave the flag out (gloo on CPU, nccl on CUDA).",
    ),
    Rule(
        "low-bit-optimizer-available", ("--optimizer", "--tensor-model-parallel-size", "--fsdp-memory-optimization"),
        "--optimizer adamw_8bit needs bitsandbytes (plain-tensor layouts) or torchao (any layout); "
        "paged_adamw_8bit needs bitsandbytes on CUDA with plain tensors; adamw_4bit needs torchao and plain tensors.",
        lambda a, c: low_bit_optimizer_refusal(a, c) is not None,
        lambda a, c: f"{optimizer_choice(a)[1]} {optimizer_choice(a)[0]}: {low_bit_optimizer_refusal(a, c)}. "
        "Install the library, choose --optimizer adamw_8bit (bitsandbytes or torchao, every layout), or use "
        "--optimizer adamw.",
    ),
    Rule(
        "adafactor-plain-tensors", ("--optimizer", "--tensor-model-parallel-size", "--fsdp-memory-optimization",
                                    "--oss-sdp-memory-optimization"),
        "--optimizer adafactor runs where parameters are plain tensors (one process, DDP, OSS, pipeline or expert "
        "parallelism alone): torch's Adafactor fails on the DTensors of tensor parallelism and FSDP2.",
        adafactor_on_dtensors,
        lambda a, c: f"{optimizer_choice(a)[1]} adafactor: {ADAFACTOR_ON_DTENSORS}.",
    ),
    Rule(
        "muon-not-deepspeed", ("--optimizer", "--zero-1-memory-optimization", "--zero-2-memory-optimization",
                               "--zero-3-memory-optimization"),
        "DeepSpeed ZeRO steps flat partitions of parameter groups, and rapidtrain does not run DeepSpeed's own Muon.",
        lambda a, c: muon_chosen(a) and deepspeed_zero(a),
        lambda a, c: f"{optimizer_choice(a)[1]} {optimizer_choice(a)[0]} with --zero-{zero_stage(a)}-memory-"
        "optimization: DeepSpeed ZeRO hands the optimizer flat slices of many parameters, which torch.optim.Muon "
        "cannot orthogonalize. DeepSpeed 0.19's own Muon (MuonWithAuxAdam, parameters tagged use_muon) runs on a CPU "
        "but is another algorithm: a Gram Newton–Schulz by default, Nesterov always on, 5 steps, Keller Jordan's "
        "aspect-ratio scale only (so --muon-nesterov, --muon-num-ns-steps, --muon-scale-mode and "
        "--muon-extra-scale-factor could not be honoured), and with matched settings (Nesterov, standard "
        "Newton–Schulz, momentum 0.9, weight decay 0.1, lr 0.05) its weights after 3 ZeRO-2 steps were 6e-2 away from "
        "torch.optim.Muon's (measured, 2 Linear layers, 1 and 2 ranks): the other layouts' numbers would not be "
        "matched, so rapidtrain's DeepSpeed engine does not drive it. Use "
        "--fsdp-memory-optimization or --oss-memory-optimization (state sharded by torch) with Muon, or "
        "--optimizer adamw with ZeRO.",
    ),
    Rule(
        "muon-builtin-models", ("--optimizer", "--pretrained-model-name-or-path"),
        "--optimizer muon picks its matrices by the built-in models' parameter names (`layers.N....`).",
        lambda a, c: muon_chosen(a) and uses_hf_model(a),
        lambda a, c: f"{optimizer_choice(a)[1]} {optimizer_choice(a)[0]} with a Hugging Face model "
        "(--pretrained-model-name-or-path): Muon takes the built-in models' transformer-layer matrices, found by "
        "their names, and a Hugging Face model's fused or differently named ones (GPT-2's c_attn) are not told "
        "apart from its embeddings and head. Use --optimizer adamw to fine-tune it, or pretrain the built-in model "
        "(--task pretraining) from its weights.",
    ),
    Rule(
        "muon-not-fairscale", ("--optimizer", "--sharding-backend"),
        "--optimizer muon is not run under FairScale's OSS.",
        muon_under_fairscale,
        lambda a, c: f"{optimizer_choice(a)[1]} {optimizer_choice(a)[0]} with --sharding-backend fairscale: "
        "FairScale's OSS rebuilds the optimizer's groups itself, without the tags that say which parameters Muon "
        "steps. Use --sharding-backend torch (--oss-memory-optimization is torch's ZeroRedundancyOptimizer, which "
        "runs Muon).",
    ),
    Rule(
        "muon-options-need-muon", ("--optimizer", *("--muon-momentum", "--muon-nesterov", "--muon-num-ns-steps",
                                                    "--muon-scale-mode", "--muon-extra-scale-factor")),
        "The --muon-* options set Muon; with another optimizer they would change nothing.",
        lambda a, c: bool(muon_options_without_muon(a)),
        lambda a, c: f"{', '.join(muon_options_without_muon(a))} with {optimizer_choice(a)[1]} "
        f"{optimizer_choice(a)[0]}: these set Muon, which this run does not use. Add --optimizer muon, or drop them.",
    ),
    Rule(
        "muon-values", ("--muon-momentum", "--muon-num-ns-steps", "--muon-extra-scale-factor"),
        "Muon's momentum lies in [0, 1), its Newton–Schulz steps in 1..99, its extra scale factor above 0.",
        lambda a, c: bool(bad_muon_values(a)),
        lambda a, c: "; ".join(bad_muon_values(a)) + ".",
    ),
    Rule(
        "lora-values", ("--lora-rank", "--lora-alpha", "--lora-dropout"),
        "LoRA's rank is >= 0, its alpha > 0 and its dropout in [0, 1).",
        lambda a, c: bool(bad_lora_values(a)),
        lambda a, c: "; ".join(bad_lora_values(a)) + ".",
    ),
    Rule(
        "lora-settings-need-rank", ("--lora-alpha", "--lora-dropout", "--lora-target-modules", "--lora-rank"),
        "--lora-alpha, --lora-dropout and --lora-target-modules shape LoRA adapters: they need --lora-rank > 0.",
        lambda a, c: bool(lora_settings_given(a)) and a.lora_rank <= 0,
        lambda a, c: f"{', '.join(lora_settings_given(a))} set LoRA adapters, but --lora-rank is {a.lora_rank} "
        "(no adapters), so they would do nothing. Add --lora-rank R (e.g. 8), or drop them.",
    ),
    Rule(
        "k-bit-needs-lora", ("--load-in-4bit", "--load-in-8bit", "--lora-rank"),
        "A 4/8-bit base is frozen: it trains through LoRA adapters (--lora-rank > 0), one width at a time.",
        lambda a, c: (a.load_in_4bit or a.load_in_8bit) and (a.lora_rank <= 0 or (a.load_in_4bit and a.load_in_8bit)),
        lambda a, c: "--load-in-4bit and --load-in-8bit both choose the base's width; keep one."
        if a.load_in_4bit and a.load_in_8bit else
        f"{k_bit_flag(a)} loads the base model quantised, and quantised weights cannot be trained: add "
        "--lora-rank R (QLoRA trains adapters on the frozen quantised base), or drop it for full fine-tuning.",
    ),
    Rule(
        "k-bit-plain-data-parallel", ("--load-in-4bit", "--load-in-8bit", "--zero-3-memory-optimization",
                                      "--fsdp-memory-optimization", "--oss-sdp-memory-optimization"),
        "A 4/8-bit base trains under one process, DDP or OSS; ZeRO, FSDP and SDP would flatten or shard its packed "
        "quantised weights.",
        lambda a, c: (a.load_in_4bit or a.load_in_8bit) and (zero_stage(a) > 0 or a.fsdp_memory_optimization
                                                              or a.oss_sdp_memory_optimization),
        lambda a, c: f"{k_bit_flag(a)} with {', '.join(flag_name(f) for f in partitioning_flags(a))}: the partitioning "
        "engine would flatten or shard bitsandbytes' packed weights and their quantisation state. The frozen "
        "quantised base is already small and only the adapters train: drop the partitioning switch (plain data "
        "parallel), or use --oss-memory-optimization.",
    ),
    Rule(
        "k-bit-available", ("--load-in-4bit", "--load-in-8bit"),
        "--load-in-4bit / --load-in-8bit need bitsandbytes with 4/8-bit kernels for the device (≥ 0.50 on CPU).",
        lambda a, c: k_bit_problem(a, c) is not None,
        lambda a, c: f"{k_bit_flag(a)}: {k_bit_problem(a, c)}. Install bitsandbytes>=0.50 (pip install "
        "'rapidtrain[lowbit]'), or drop the flag to fine-tune the fp32 base with LoRA.",
    ),
    Rule(
        "k-bit-checkpoints", ("--load-in-4bit", "--load-in-8bit", "--save", "--load"),
        "Checkpoints of a 4/8-bit base: torch.distributed.checkpoint cannot save bitsandbytes' 8-bit layers, nor "
        "load into 4-bit ones; a 4-bit run's exported model (SAVE/best, SAVE/last) is written dequantised.",
        lambda a, c: (a.load_in_8bit and bool(a.save or a.load)) or (a.load_in_4bit and bool(a.load)),
        lambda a, c: ("--load-in-8bit with --save/--load: torch.distributed.checkpoint cannot save bitsandbytes' "
                      "Linear8bitLt layers (their state dict carries SCB/weight_format entries that are not module "
                      "attributes). Use --load-in-4bit (QLoRA), or run without --save/--load."
                      if a.load_in_8bit else
                      "--load-in-4bit with --load: resuming into bitsandbytes' packed 4-bit layers is not supported "
                      "(the checkpoint's packed weights do not load into freshly quantised ones). Start a new run "
                      "without --load; the exported SAVE/best and SAVE/last models (dequantised, adapters merged) "
                      "load with from_pretrained."),
    ),
    Rule(
        "compile-settings-need-compile", ("--torch-compile-backend", "--torch-compile-mode", "--torch-compile"),
        "--torch-compile-backend and --torch-compile-mode configure torch.compile: they need --torch-compile (or "
        "--onnx-runtime-training where torch.compile serves it).",
        lambda a, c: bool(compile_settings_given(a)) and not compile_requested(a),
        lambda a, c: f"{', '.join(compile_settings_given(a))} configure torch.compile, which this run does not use, "
        "so they would do nothing. Add --torch-compile, or drop them.",
    ),
    Rule(
        "compile-backend-known", ("--torch-compile-backend",),
        "--torch-compile-backend names a backend registered with torch._dynamo.",
        # inductor (the default) is always registered: asking torch._dynamo costs ~1.5 s of `rapidtrain plan`.
        lambda a, c: a.torch_compile_backend != "inductor" and a.torch_compile_backend not in compile_backends(),
        lambda a, c: f"--torch-compile-backend {a.torch_compile_backend!r} is not a torch.compile backend here; "
        f"choose one of {', '.join(compile_backends())} (inductor is the default).",
    ),
    Rule(
        "compile-mode-inductor", ("--torch-compile-mode", "--torch-compile-backend"),
        "--torch-compile-mode chooses how inductor compiles: it needs the inductor backend.",
        lambda a, c: a.torch_compile_mode is not None and a.torch_compile_backend != "inductor",
        lambda a, c: f"--torch-compile-mode {a.torch_compile_mode} with --torch-compile-backend "
        f"{a.torch_compile_backend}: modes are options of the inductor backend. Drop the mode, or use "
        "--torch-compile-backend inductor.",
    ),
    Rule(
        "zero-settings-need-deepspeed", ("--zero-overlap-comm", "--no-zero-overlap-comm", "--zero-reduce-bucket-size",
                                         "--zero-allgather-bucket-size", "--zero-1-memory-optimization"),
        "The --zero-* communication settings configure DeepSpeed ZeRO: they need a ZeRO switch without tensor/pipeline "
        "parallelism (with TP/PP/EP, FSDP2 serves ZeRO-1/2).",
        lambda a, c: bool(zero_settings_given(a)) and not deepspeed_zero(a),
        lambda a, c: f"{', '.join(zero_settings_given(a))} configure DeepSpeed ZeRO, which does not serve this run "
        f"({'FSDP2 serves ZeRO-1/2 with tensor/pipeline/expert parallelism' if zero_by_fsdp2(a) else 'no ZeRO switch'})"
        ", so they would do nothing. Add --zero-1/2/3-memory-optimization without tensor/pipeline/expert parallelism, "
        "or drop them.",
    ),
    Rule(
        "zero-stage3-settings", ("--zero-stage3-prefetch-bucket-size", "--zero-stage3-param-persistence-threshold",
                                 "--zero-3-memory-optimization"),
        "The --zero-stage3-* settings apply to ZeRO-3 only.",
        lambda a, c: bool(zero_settings_given(a, stage3_only=True)) and deepspeed_zero(a) and zero_stage(a) != 3,
        lambda a, c: f"{', '.join(zero_settings_given(a, stage3_only=True))} tune how ZeRO-3 gathers partitioned "
        f"parameters; --zero-{zero_stage(a)}-memory-optimization does not partition parameters. Use "
        "--zero-3-memory-optimization, or drop them.",
    ),
    Rule(
        "param-offload-needs-zero3", ("--cpu-offload-params", "--nvme-offload-dir", "--zero-3-memory-optimization"),
        "--cpu-offload-params and --nvme-offload-dir offload parameter partitions: they need DeepSpeed ZeRO-3.",
        lambda a, c: bool(a.cpu_offload_params or a.nvme_offload_dir)
        and not (deepspeed_zero(a) and zero_stage(a) == 3),
        lambda a, c: f"{'--cpu-offload-params' if a.cpu_offload_params else '--nvme-offload-dir'} offloads each "
        "rank's parameter partition, which only DeepSpeed ZeRO-3 keeps (ZeRO-Infinity). Add "
        "--zero-3-memory-optimization (without tensor/pipeline parallelism), or use --cpu-offload with ZeRO-1/2 to "
        "offload the optimizer only.",
    ),
    Rule(
        "one-offload-target", ("--nvme-offload-dir", "--cpu-offload", "--cpu-offload-params"),
        "--nvme-offload-dir puts optimizer state and parameters on NVMe: not with --cpu-offload or "
        "--cpu-offload-params.",
        lambda a, c: bool(a.nvme_offload_dir) and (a.cpu_offload or a.cpu_offload_params),
        lambda a, c: "--nvme-offload-dir offloads optimizer state and parameters to NVMe, and "
        f"{'--cpu-offload' if a.cpu_offload else '--cpu-offload-params'} sends them to host memory instead: choose "
        "one target (NVMe for models whose states exceed host memory).",
    ),
    Rule(
        "nvme-offload-needs-async-io", ("--nvme-offload-dir",),
        "--nvme-offload-dir needs DeepSpeed's async_io op, which builds against libaio.",
        lambda a, c: bool(a.nvme_offload_dir) and async_io_problem() is not None,
        lambda a, c: f"--nvme-offload-dir {a.nvme_offload_dir}: {async_io_problem()}. Install it, or offload to "
        "host memory with --cpu-offload --cpu-offload-params.",
    ),
    Rule(
        "option-needs-its-switch", ("--wandb-exp-name", "--wandb-project", "--mlflow-tracking-uri",
                                    "--mlflow-experiment", "--profile-step-start", "--profile", "--async-save",
                                    "--save"),
        "A tracker's, the profiler's or the async save's options need their switch (--wandb-project, "
        "--mlflow-experiment, --profile, --save); alone they would do nothing.",
        lambda a, c: bool(options_without_switch(a)),
        lambda a, c: f"{'; '.join(options_without_switch(a))}: without its switch an option does nothing. Add the "
        "switch, or drop the option.",
    ),
    Rule(
        "profile-steps", ("--profile", "--profile-step-start", "--profile-step-end", "--profile-ranks"),
        "--profile traces steps [start, end) with 0 ≤ start < end ≤ --train-iters, on ranks that exist.",
        lambda a, c: profile_problem(a, c) is not None,
        lambda a, c: str(profile_problem(a, c)),
    ),
    Rule(
        "attention-backend-runs-here", ("--attention-backend", "--attention-dropout", "--bf16", "--fp16",
                                        "--pretrained-model-name-or-path"),
        "--attention-backend names a kernel the device runs: fused (cuDNN) only on CUDA; flash and fused on CUDA "
        "with --bf16/--fp16; flash on CPU and flex_attention without attention dropout; flex_attention trains on "
        "CUDA only (no backward on CPU); a Hugging Face model takes no fused, and flash_attention_2 needs CUDA and "
        "the flash_attn package.",
        lambda a, c: attention_backend_problem(a, c) is not None,
        lambda a, c: str(attention_backend_problem(a, c)),
    ),
    Rule(
        "padding-free-packing", ("--padding-free", "--task", "--pretrained-model-name-or-path"),
        "--padding-free packs the casual_lm fine-tuning task's sequences into one row per micro-batch, for a "
        "Hugging Face model whose modeling code builds its mask with transformers' create_causal_mask (which keeps "
        "packed sequences apart by their position ids, for eager, sdpa, flex_attention and flash_attention_2).",
        lambda a, c: padding_free_problem(a, c) is not None,
        lambda a, c: str(padding_free_problem(a, c)),
    ),
    Rule(
        "recompute-settings", ("--recompute-granularity", "--recompute-method", "--recompute-num-layers",
                               "--recompute-activations", "--checkpoint-activations",
                               "--activations-checkpoint-method", "--pipeline-model-parallel-size"),
        "Recompute flags agree on one granularity; --recompute-method / --recompute-num-layers need full or op "
        "granularity (not selective, as in Megatron); uniform recomputes in units of one layer; block recomputes "
        "at most the layers of a pipeline stage; op granularity is for the built-in models.",
        lambda a, c: recompute_problem(a) is not None,
        lambda a, c: str(recompute_problem(a)),
    ),
    Rule(
        "cpu-offloading-settings", ("--cpu-offloading", "--cpu-offloading-num-layers", "--recompute-granularity",
                                    "--recompute-activations", "--checkpoint-activations"),
        "Activation offloading keeps 0 to the layers - 1 layers' activations on the host, and not beside "
        "recomputation (Megatron-Core refuses both too).",
        lambda a, c: cpu_offloading_problem(a) is not None,
        lambda a, c: str(cpu_offloading_problem(a)),
    ),
    Rule(
        "pad-vocab-size-to-fits", ("--pad-vocab-size-to", "--tokenizer-type"),
        "BigScience's --pad-vocab-size-to N gives the embedding exactly N rows: at least the tokenizer's ids.",
        lambda a, c: pad_vocab_problem(a) is not None,
        lambda a, c: str(pad_vocab_problem(a)),
    ),
    Rule(
        "megatron-task", ("--task", "--train-data", "--valid-data", "--epochs", "--model-type",
                          "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--data-iterator"),
        "Megatron's tasks (--task MNLI / RACE) read --train-data and --valid-data files, train for --epochs, fine-tune "
        "the built-in BERT data-parallel (ZeRO and FSDP allowed) on samples padded to --seq-length.",
        lambda a, c: megatron_task_problem(a, c) is not None,
        lambda a, c: str(megatron_task_problem(a, c)),
    ),
    Rule(
        "auto-micro-batch-size", ("--auto-micro-batch-size", "--memory-budget-gb", "--global-batch-size",
                                  "--rampup-batch-size", "--pretrained-model-name-or-path"),
        "--auto-micro-batch-size needs --memory-budget-gb (and the budget needs it), the built-in model and one "
        "global batch (no batch schedule); refused when even micro batch 1 does not fit, as the global batch "
        "could not be kept.",
        lambda a, c: auto_micro_batch_problem(a, c) is not None,
        lambda a, c: str(auto_micro_batch_problem(a, c)),
    ),
)

