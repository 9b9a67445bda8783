"""Every row of the conflict table fires on a bad combination and stays quiet on a good one."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rapidtrain.config import arguments, rules
from rapidtrain.config.settings import RunContext

BASE = ["--train-iters", "10", "--lr", "1e-4"]

# rule name → (flags that violate it, flags that pass, world size, device)
CASES: dict[str, tuple[list[str], list[str], int, str]] = {
    "positive-sizes": (["--micro-batch-size", "0"], ["--micro-batch-size", "1"], 1, "cpu"),
    "min-lr-within-lr": (["--lr", "1e-4", "--min-lr", "1e-3"], ["--lr", "1e-4", "--min-lr", "1e-4"], 1, "cpu"),
    "unknown-task": (["--task", "sequence_clasification"], ["--task", "causal_lm"], 1, "cpu"),
    "pad-vocab-size-to-fits": (["--pad-vocab-size-to", "128"], ["--pad-vocab-size-to", "65536"], 1, "cpu"),
    "exit-signal-catchable": (["--exit-signal", "SIGKILL"], ["--exit-signal", "SIGUSR1"], 1, "cpu"),
    "cpu-offloading-settings": (["--cpu-offloading", "--recompute-activations"],
                                ["--cpu-offloading", "--cpu-offloading-num-layers", "1"], 1, "cpu"),
    "megatron-task": (  # Megatron's tasks/main.py: its files, the built-in BERT, data parallel
        ["--task", "MNLI", "--model-type", "bert", "--train-data", "t.tsv", "--valid-data", "d.tsv",
         "--tensor-model-parallel-size", "2"],
        ["--task", "MNLI", "--model-type", "bert", "--train-data", "t.tsv", "--valid-data", "d.tsv"],
        2,
        "cpu",
    ),
    "one-state-partitioning": (
        ["--zero-2-memory-optimization", "--fsdp-memory-optimization"],
        ["--zero-2-memory-optimization"],
        2,
        "cpu",
    ),
    "3d-only-zero12": (
        ["--zero-3-memory-optimization", "--pipeline-model-parallel-size", "2"],
        ["--zero-1-memory-optimization", "--pipeline-model-parallel-size", "2"],
        4,
        "cpu",
    ),
    "cpu-offload-needs-zero": (
        ["--cpu-offload", "--fsdp-memory-optimization"],
        ["--cpu-offload", "--zero-2-memory-optimization"],
        2,
        "cpu",
    ),
    "world-divisible-by-tp-pp": (
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "2"],
        ["--tensor-model-parallel-size", "3", "--pipeline-model-parallel-size", "2"],
        6,
        "cpu",
    ),
    "global-batch-divisible": (
        ["--micro-batch-size", "2", "--global-batch-size", "6"],
        ["--micro-batch-size", "2", "--global-batch-size", "8"],
        2,
        "cpu",
    ),
    "pipeline-split": (
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2"],
        ["--num-layers", "3", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "1"],
        2,
        "cpu",
    ),
    "pipeline-schedule": (
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
         "--micro-batch-size", "1", "--global-batch-size", "3"],
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "dualpipev",
         "--micro-batch-size", "1", "--global-batch-size", "4"],
        2,
        "cpu",
    ),
    "interleaved-micro-batches": (  # 5 micro-batches in 5 // 2 = 2 rounds: unequal
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--micro-batch-size", "1", "--global-batch-size", "5"],
        ["--num-layers", "4", "--pipeline-model-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "1",
         "--micro-batch-size", "1", "--global-batch-size", "4"],
        2,
        "cpu",
    ),
    "pipeline-per-token-loss": (
        ["--pipeline-model-parallel-size", "2", "--model-type", "bert"],  # Megatron's default: binary head on
        ["--pipeline-model-parallel-size", "2", "--model-type", "bert", "--bert-no-binary-head"],
        2,
        "cpu",
    ),
    "virtual-stages": (
        [
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "3",
        ],
        [
            "--num-layers",
            "8",
            "--pipeline-model-parallel-size",
            "2",
            "--num-layers-per-virtual-pipeline-stage",
            "2",
        ],
        2,
        "cpu",
    ),
    "heads-divisible-by-tp": (
        ["--num-attention-heads", "6", "--hidden-size", "96", "--tensor-model-parallel-size", "4"],
        ["--num-attention-heads", "8", "--hidden-size", "96", "--tensor-model-parallel-size", "4"],
        4,
        "cpu",
    ),
    "hidden-divisible-by-heads": (
        ["--hidden-size", "100", "--num-attention-heads", "8"],
        ["--hidden-size", "96", "--num-attention-heads", "8"],
        1,
        "cpu",
    ),
    "fp16-xor-bf16": (["--fp16", "--bf16"], ["--bf16"], 1, "cpu"),
    "fp16-deepspeed-cpu": (
        ["--fp16", "--zero-1-memory-optimization"],
        ["--bf16", "--zero-1-memory-optimization"],
        2,
        "cpu",
    ),
    "seq-within-positions": (
        ["--seq-length", "512", "--max-position-embeddings", "256"],
        ["--seq-length", "512", "--position-embedding-type", "rope", "--max-position-embeddings", "256"],
        1,
        "cpu",
    ),
    "num-experts-length": (
        ["--num-layers", "4", "--num-experts", "4", "4", "4"],
        ["--num-layers", "4", "--num-experts", "0", "4", "0", "4"],
        1,
        "cpu",
    ),
    "yarn-needs-rope": (
        ["--rope-type", "yarn", "--position-embedding-type", "learned_absolute"],
        ["--rope-type", "yarn", "--position-embedding-type", "rope"],
        1,
        "cpu",
    ),
    "yarn-values": (
        ["--position-embedding-type", "rope", "--rope-type", "yarn", "--yarn-beta-fast", "1", "--yarn-beta-slow", "32"],
        ["--position-embedding-type", "rope", "--rope-type", "yarn", "--yarn-beta-fast", "32", "--yarn-beta-slow", "1"],
        1,
        "cpu",
    ),
    "mla-needs-rope": (
        ["--multi-latent-attention", "--position-embedding-type", "rope", "--group-query-attention"],
        ["--multi-latent-attention", "--position-embedding-type", "rope"],
        1,
        "cpu",
    ),
    "mla-sizes": (
        ["--multi-latent-attention", "--position-embedding-type", "rope", "--qk-pos-emb-head-dim", "3"],
        ["--multi-latent-attention", "--position-embedding-type", "rope", "--qk-pos-emb-head-dim", "4"],
        1,
        "cpu",
    ),
    "mtp-layout": (
        ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "2"],
        ["--mtp-num-layers", "1", "--pipeline-model-parallel-size", "2", "--num-layers", "2",
         "--position-embedding-type", "rope"],
        2,
        "cpu",
    ),
    "router-groups": (
        ["--num-experts", "8", "--moe-router-topk", "4", "--moe-router-num-groups", "4",
         "--moe-router-group-topk", "1"],
        ["--num-experts", "8", "--moe-router-topk", "4", "--moe-router-num-groups", "4",
         "--moe-router-group-topk", "2"],
        1,
        "cpu",
    ),
    "shared-expert-size": (
        ["--num-experts", "4", "--enable-shared-expert"],
        ["--num-experts", "4", "--enable-shared-expert", "--shared-moe-ffn-hidden-size", "64"],
        1,
        "cpu",
    ),
    "router-values-positive": (
        ["--num-experts", "4", "--moe-router-topk-scaling-factor", "0"],
        ["--num-experts", "4", "--moe-router-topk-scaling-factor", "2.5"],
        1,
        "cpu",
    ),
    "experts-divisible-by-ep": (
        ["--num-experts", "3", "--expert-model-parallel-size", "2"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2"],
        2,
        "cpu",
    ),
    # Context parallelism (rules_context.py).
    "cp-one-size-flag": (["--context-parallel-size", "2", "--ds-sequence-parallel-size", "2"],
                         ["--ds-sequence-parallel-size", "2"], 2, "cpu"),
    "cp-comm-type-one": (["--context-parallel-size", "2", "--cp-comm-type", "a2a+p2p"],
                         ["--context-parallel-size", "2", "--cp-comm-type", "a2a", "a2a"], 2, "cpu"),
    "cp-sizes-positive": (["--context-parallel-size", "0"], ["--context-parallel-size", "1"], 1, "cpu"),
    "world-divisible-by-cp": (["--context-parallel-size", "2"], ["--context-parallel-size", "3"], 3, "cpu"),
    "cp-sequence-divides": (["--context-parallel-size", "2", "--seq-length", "30"],
                            ["--context-parallel-size", "2", "--seq-length", "30", "--cp-comm-type", "a2a"], 2, "cpu"),
    "cp-ulysses-heads": (["--ds-sequence-parallel-size", "4", "--num-attention-heads", "6", "--hidden-size", "96"],
                         ["--ds-sequence-parallel-size", "4", "--num-attention-heads", "8", "--hidden-size", "96"],
                         4, "cpu"),
    "cp-builtin-gpt": (["--context-parallel-size", "2", "--model-type", "bert"], ["--context-parallel-size", "2"], 2,
                       "cpu"),
    "cp-fixed-length": (["--context-parallel-size", "2", "--data-iterator", "dynamic-shape"],
                        ["--context-parallel-size", "2"], 2, "cpu"),
    "cp-without-mtp": (["--context-parallel-size", "2", "--mtp-num-layers", "1"], ["--context-parallel-size", "2"], 2,
                       "cpu"),
    "cp-documents-recompute-pipeline": (
        ["--context-parallel-size", "2", "--reset-attention-mask", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--recompute-granularity", "full"],
        ["--context-parallel-size", "2", "--reset-attention-mask", "--pipeline-model-parallel-size", "2",
         "--num-layers", "4", "--recompute-granularity", "selective"], 4, "cpu"),
    "cp-not-fairscale": (["--context-parallel-size", "2", "--sharding-backend", "fairscale",
                          "--oss-memory-optimization"], ["--context-parallel-size", "2", "--oss-memory-optimization"],
                         2, "cpu"),
    "ep-divides-dp": (
        ["--num-experts", "4", "--expert-model-parallel-size", "4"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2"],
        2,
        "cpu",
    ),
    "ep-with-zero3-or-fairscale": (
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--zero-3-memory-optimization"],
        ["--num-experts", "4", "--expert-model-parallel-size", "2", "--zero-2-memory-optimization"],
        2,
        "cpu",
    ),
    "3d-builtin-models-only": (
        [
            "--tensor-model-parallel-size",
            "2",
            "--pretrained-model-name-or-path",
            "m",
            "--task",
            "sequence_classification",
        ],
        [
            "--zero-3-memory-optimization",
            "--pretrained-model-name-or-path",
            "m",
            "--task",
            "sequence_classification",
        ],
        2,
        "cpu",
    ),
    "moe-builtin-models-only": (
        ["--num-experts", "4", "--pretrained-model-name-or-path", "m", "--task", "sequence_classification"],
        ["--num-experts", "4"],
        1,
        "cpu",
    ),
    "dynamic-shape-no-pp": (
        ["--data-iterator", "dynamic-shape", "--pipeline-model-parallel-size", "2"],
        ["--data-iterator", "dynamic-shape", "--tensor-model-parallel-size", "2"],
        2,
        "cpu",
    ),
    "one-warmup": (
        ["--lr-warmup-fraction", "0.1", "--lr-warmup-iters", "2"],
        ["--lr-warmup-fraction", "0.1"],
        1,
        "cpu",
    ),
    "warmup-within-decay": (["--lr-warmup-iters", "10"], ["--lr-warmup-iters", "9"], 1, "cpu"),
    "lr-required": ([], [], 1, "cpu"),  # handled specially below: BASE carries --lr
    "fairscale-backend-scope": (
        ["--sharding-backend", "fairscale", "--fsdp-memory-optimization"],
        ["--sharding-backend", "torch", "--fsdp-memory-optimization"],
        2,
        "cpu",
    ),
    "pretrained-checkpoint-or-load": (
        ["--pretrained-model-name-or-path", "CHECKPOINT_DIR", "--load", "elsewhere", "--data-path", "d"],
        ["--pretrained-model-name-or-path", "CHECKPOINT_DIR", "--load", "CHECKPOINT_DIR", "--data-path", "d"],
        1,
        "cpu",
    ),
    "universal-checkpoint-needs-load": (["--universal-checkpoint"], ["--universal-checkpoint", "--load", "x"], 1,
                                        "cpu"),
    "router-type-supported": (["--num-experts", "2", "--router-type", "1"], ["--num-experts", "2", "--router-type",
                                                                             "0"], 1, "cpu"),
    "remote-device-none": (["--remote-device", "cpu"], ["--remote-device", "none"], 1, "cpu"),
    "residual-moe-needs-experts": (["--mlp-type", "residual"], ["--mlp-type", "residual", "--num-experts", "2"], 1,
                                   "cpu"),
    "deepspeed-config-with-zero": (["--deepspeed_config", "DS_CONFIG"],
                                   ["--deepspeed_config", "DS_CONFIG", "--zero-2-memory-optimization"], 2, "cpu"),
    "per-split-data": (["--data-path", "d", "--train-data-path", "t"], ["--train-data-path", "t"], 1, "cpu"),
    "dynamic-shape-one-prefix": (["--data-iterator", "dynamic-shape", "--data-path", "0.5", "a", "0.5", "b"],
                                 ["--data-iterator", "dynamic-shape", "--data-path", "a"], 1, "cpu"),
    "batch-schedule-valid": (["--global-batch-size", "16", "--rampup-batch-size", "4", "5", "100"],
                             ["--global-batch-size", "16", "--rampup-batch-size", "4", "4", "100"], 1, "cpu"),
    "batch-schedule-divisible": (
        ["--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "2", "2", "100"],
        ["--micro-batch-size", "2", "--global-batch-size", "16", "--rampup-batch-size", "4", "4", "100"],
        2,
        "cpu",
    ),
    "binary-head-bert-only": (
        ["--bert-binary-head"],
        ["--bert-binary-head", "--model-type", "bert"],
        1,
        "cpu",
    ),
    "zero-elementwise-optimizer": (
        ["--zero-2-memory-optimization", "--optimizers", "apex_lamb"],
        ["--zero-2-memory-optimization", "--optimizer", "sgd"],
        2,
        "cpu",
    ),
    "cpu-offload-adam-only": (
        ["--zero-2-memory-optimization", "--cpu-offload", "--optimizer", "sgd"],
        ["--zero-2-memory-optimization", "--cpu-offload", "--optimizer", "adam"],
        2,
        "cpu",
    ),
    "builtin-lora-scope": (
        ["--lora-rank", "8", "--load-in-4bit"],
        ["--lora-rank", "8", "--tensor-model-parallel-size", "2", "--num-attention-heads", "4"],
        2,
        "cpu",
    ),
    "rates-finite": (["--lr", "-1e-3", "--min-lr", "-1"], ["--lr", "3e-4", "--min-lr", "0"], 1, "cpu"),
    "counts-positive": (["--log-interval", "0", "--num-workers", "-1"], ["--log-interval", "1", "--num-workers", "0"],
                        1, "cpu"),
    "probabilities-in-range": (["--hidden-dropout", "1"], ["--hidden-dropout", "0.99"], 1, "cpu"),
    "seed-range": (["--seed", "-1"], ["--seed", "0"], 1, "cpu"),
    "split-usable": (["--split", "0,0,1"], ["--split", "1,0,0"], 1, "cpu"),
    "train-samples-bound": (["--train-iters", "100000000000", "--global-batch-size", "1024"],
                            ["--train-iters", "1000000", "--global-batch-size", "1024"], 1, "cpu"),
    "nccl-needs-cuda": (["--distributed-backend", "nccl"], ["--distributed-backend", "nccl"], 1, "cuda"),
    "query-groups-need-gqa": (["--num-query-groups", "2"], ["--group-query-attention", "--num-query-groups", "2"],
                              1, "cpu"),
    "heads-divisible-by-query-groups": (
        ["--group-query-attention", "--num-query-groups", "3"],
        ["--group-query-attention", "--num-query-groups", "2"],
        1,
        "cpu",
    ),
    "query-groups-divisible-by-tp": (
        ["--group-query-attention", "--num-query-groups", "1", "--tensor-model-parallel-size", "2"],
        ["--group-query-attention", "--num-query-groups", "2", "--tensor-model-parallel-size", "2"],
        2,
        "cpu",
    ),
    "qkv-bias-needs-no-bias-linear": (["--add-qkv-bias"], ["--add-qkv-bias", "--disable-bias-linear"], 1, "cpu"),
    "alibi-and-window-are-gpt": (
        ["--model-type", "bert", "--sliding-window", "8"],
        ["--model-type", "gpt", "--sliding-window", "8", "--position-embedding-type", "alibi"],
        1,
        "cpu",
    ),
    "sliding-window-positive": (["--sliding-window", "0"], ["--sliding-window", "1"], 1, "cpu"),
    "alibi-needs-a-biased-kernel": (
        ["--position-embedding-type", "alibi", "--attention-backend", "flash", "--bf16"],
        ["--position-embedding-type", "alibi", "--attention-backend", "auto", "--bf16"],
        1,
        "cuda",
    ),
    "rotary-flags-need-rope": (
        ["--rotary-base", "500000"],
        ["--rotary-base", "500000", "--position-embedding-type", "rope"],
        1,
        "cpu",
    ),
    "rotary-percent-range": (
        ["--position-embedding-type", "rope", "--rotary-percent", "1.5"],
        ["--position-embedding-type", "rope", "--rotary-percent", "0.5"],
        1,
        "cpu",
    ),
    "rope-scaling-needs-rope": (
        ["--use-rope-scaling"],
        ["--use-rope-scaling", "--position-embedding-type", "rope"],
        1,
        "cpu",
    ),
    "rope-scaling-factors-positive": (
        ["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "0"],
        ["--position-embedding-type", "rope", "--rotary-seq-len-interpolation-factor", "4"],
        1,
        "cpu",
    ),
    "swiglu-ffn-size": (["--swiglu", "--hidden-size", "16"], ["--swiglu", "--hidden-size", "16", "--ffn-hidden-size",
                                                             "96"], 1, "cpu"),
    "openai-gelu-needs-gelu": (["--swiglu", "--openai-gelu"], ["--openai-gelu"], 1, "cpu"),
    "one-gated-activation": (["--swiglu", "--quick-geglu"], ["--quick-geglu"], 1, "cpu"),
    "squared-relu-one-activation": (["--squared-relu", "--swiglu"], ["--squared-relu"], 1, "cpu"),
    "rotary-interleaved-needs-rope": (["--rotary-interleaved"],
                                      ["--rotary-interleaved", "--position-embedding-type", "rope"], 1, "cpu"),
    "glu-settings-need-a-gated-mlp": (["--glu-linear-offset", "1"], ["--quick-geglu", "--glu-linear-offset", "1"], 1,
                                      "cpu"),
    "activation-clamp-positive": (["--swiglu", "--activation-func-clamp-value", "-1"],
                                  ["--swiglu", "--activation-func-clamp-value", "7"], 1, "cpu"),
    # HF_* and CHECKPOINT_DIR are replaced by folders the `folders` fixture writes.
    "pretrained-folder-initialises-builtin": (
        ["--pretrained-model-name-or-path", "NO_SUCH_FOLDER", "--data-path", "d"],
        ["--pretrained-model-name-or-path", "HF_LLAMA", "--data-path", "d"],
        1,
        "cpu",
    ),
    "pretrained-shape-flags": (
        ["--pretrained-model-name-or-path", "HF_LLAMA", "--data-path", "d", "--num-layers", "3"],
        ["--pretrained-model-name-or-path", "HF_LLAMA", "--data-path", "d", "--num-layers", "2"],
        1,
        "cpu",
    ),
    "finetuned-shape-flags": (
        ["--task", "sequence_classification", "--pretrained-model-name-or-path", "HF_LLAMA", "--num-layers", "3"],
        ["--task", "sequence_classification", "--pretrained-model-name-or-path", "HF_LLAMA", "--num-layers", "2"],
        1,
        "cpu",
    ),
    "pretrained-needs-data": (
        ["--pretrained-model-name-or-path", "HF_LLAMA"],
        ["--pretrained-model-name-or-path", "HF_LLAMA", "--data-path", "d"],
        1,
        "cpu",
    ),
    "pretrained-sliding-window": (
        ["--pretrained-model-name-or-path", "HF_QWEN2_WINDOW", "--data-path", "d", "--seq-length", "64"],
        ["--pretrained-model-name-or-path", "HF_QWEN2_WINDOW", "--data-path", "d", "--seq-length", "32"],
        1,
        "cpu",
    ),
    "lora-values": (["--lora-dropout", "1.0"], ["--lora-dropout", "0.1", "--lora-rank", "4"], 1, "cpu"),
    "lora-settings-need-rank": (["--lora-alpha", "16"], ["--lora-alpha", "16", "--lora-rank", "8"], 1, "cpu"),
    "k-bit-needs-lora": (
        ["--load-in-4bit", "--pretrained-model-name-or-path", "m"],
        ["--load-in-4bit", "--pretrained-model-name-or-path", "m", "--lora-rank", "4"],
        1,
        "cpu",
    ),
    "k-bit-plain-data-parallel": (
        ["--load-in-4bit", "--lora-rank", "4", "--fsdp-memory-optimization"],
        ["--load-in-4bit", "--lora-rank", "4", "--oss-memory-optimization"],
        2,
        "cpu",
    ),
    "k-bit-checkpoints": (
        ["--load-in-8bit", "--lora-rank", "4", "--save", "out"],
        ["--load-in-4bit", "--lora-rank", "4", "--save", "out"],
        1,
        "cpu",
    ),
    "compile-settings-need-compile": (["--torch-compile-mode", "max-autotune"],
                                      ["--torch-compile-mode", "max-autotune", "--torch-compile"], 1, "cpu"),
    "compile-backend-known": (["--torch-compile", "--torch-compile-backend", "inductr"],
                              ["--torch-compile", "--torch-compile-backend", "aot_eager"], 1, "cpu"),
    "compile-mode-inductor": (
        ["--torch-compile", "--torch-compile-backend", "eager", "--torch-compile-mode", "default"],
        ["--torch-compile", "--torch-compile-mode", "default"],
        1,
        "cpu",
    ),
    "zero-settings-need-deepspeed": (
        ["--no-zero-overlap-comm", "--fsdp-memory-optimization"],
        ["--no-zero-overlap-comm", "--zero-2-memory-optimization"],
        2,
        "cpu",
    ),
    "zero-stage3-settings": (
        ["--zero-stage3-prefetch-bucket-size", "1000", "--zero-2-memory-optimization"],
        ["--zero-stage3-prefetch-bucket-size", "1000", "--zero-3-memory-optimization"],
        2,
        "cpu",
    ),
    "param-offload-needs-zero3": (
        ["--cpu-offload-params", "--cpu-offload", "--zero-2-memory-optimization"],
        ["--cpu-offload-params", "--cpu-offload", "--zero-3-memory-optimization"],
        2,
        "cpu",
    ),
    "one-offload-target": (
        ["--nvme-offload-dir", "d", "--cpu-offload", "--zero-3-memory-optimization"],
        ["--nvme-offload-dir", "d", "--zero-3-memory-optimization"],
        2,
        "cpu",
    ),
    "low-bit-optimizer-available": (  # torchao's 4-bit AdamW fails on FSDP2's DTensors; its 8-bit one works
        ["--optimizer", "adamw_4bit", "--fsdp-memory-optimization"],
        ["--optimizer", "adamw_8bit", "--fsdp-memory-optimization"],
        2,
        "cpu",
    ),
    "muon-not-deepspeed": (
        ["--optimizer", "dist_muon", "--zero-1-memory-optimization"],
        ["--optimizer", "dist_muon", "--pipeline-model-parallel-size", "2"],
        2,
        "cpu",
    ),
    "muon-builtin-models": (
        ["--optimizer", "muon", "--pretrained-model-name-or-path", "m", "--task", "sequence_classification"],
        ["--optimizer", "muon"],
        1,
        "cpu",
    ),
    "muon-not-fairscale": (
        ["--optimizer", "muon", "--sharding-backend", "fairscale", "--oss-memory-optimization"],
        ["--optimizer", "muon", "--oss-memory-optimization"],
        2,
        "cpu",
    ),
    "muon-options-need-muon": (
        ["--optimizer", "adamw", "--muon-momentum", "0.95"],
        ["--optimizer", "muon", "--muon-momentum", "0.95", "--muon-nesterov", "--muon-scale-mode", "shape_scaling"],
        1,
        "cpu",
    ),
    "muon-values": (
        ["--optimizer", "muon", "--muon-num-ns-steps", "0"],
        ["--optimizer", "muon", "--muon-num-ns-steps", "3", "--muon-extra-scale-factor", "0.2"],
        1,
        "cpu",
    ),
    "adafactor-plain-tensors": (  # measured: torch's Adafactor raises on FSDP2's and TP's DTensors
        ["--optimizer", "adafactor", "--fsdp-memory-optimization"],
        ["--optimizer", "adafactor", "--oss-memory-optimization"],
        2,
        "cpu",
    ),
    "option-needs-its-switch": (
        ["--wandb-exp-name", "run1", "--mlflow-run-name", "r", "--profile-ranks", "1", "--async-save"],
        ["--wandb-project", "p", "--wandb-exp-name", "run1", "--mlflow-experiment", "e", "--mlflow-run-name", "r",
         "--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "1",
         "--async-save", "--save", "ck"],
        2,
        "cpu",
    ),
    "profile-steps": (["--profile", "--profile-step-start", "4", "--profile-step-end", "4"],
                      ["--profile", "--profile-step-start", "3", "--profile-step-end", "4"], 1, "cpu"),
    "attention-backend-runs-here": (["--attention-backend", "fused"],
                                    ["--attention-backend", "unfused"], 1, "cpu"),
    "auto-micro-batch-size": (["--auto-micro-batch-size"], ["--auto-micro-batch-size", "--memory-budget-gb", "8"],
                              1, "cpu"),
    "padding-free-packing": (["--padding-free"], ["--task", "causal_lm", "--padding-free",
                                                  "--pretrained-model-name-or-path", "HF_LLAMA"], 1, "cpu"),
    "recompute-settings": (["--recompute-activations", "--recompute-method", "block"],
                           ["--recompute-granularity", "full", "--recompute-method", "block"], 1, "cpu"),
}
# Rules about what the flags alone do not say: (context that violates, context that passes).
CONTEXT_CASES = {"world-size-positive": (RunContext(-3, "cpu"), RunContext(2, "cpu"))}
ITERS_CASES = {  # the rule about the training length needs argv without BASE's --train-iters
    "iters-xor-epochs": (
        ["--lr", "1e-4", "--train-iters", "5", "--train-samples", "100"],
        ["--lr", "1e-4", "--train-samples", "100"],
    ),
    "schedule-counts-as-training": (
        ["--lr", "1e-4", "--train-samples", "100", "--lr-decay-iters", "5"],
        ["--lr", "1e-4", "--train-samples", "100", "--lr-decay-samples", "80"],
    ),
    "samples-warmup-within-decay": (
        ["--lr", "1e-4", "--train-samples", "100", "--lr-warmup-samples", "100"],
        ["--lr", "1e-4", "--train-samples", "100", "--lr-warmup-samples", "99"],
    ),
    "pretraining-needs-iters": (
        ["--lr", "1e-4", "--epochs", "2"],
        ["--lr", "1e-4", "--epochs", "2", "--task", "sequence_classification"],
    ),
}


def fired(argv: list[str], world_size: int, device: str) -> set[str]:
    args = arguments.parse_args(argv)
    ctx = RunContext(world_size, device)  # type: ignore[arg-type]
    return {rule.name for rule in rules.RULES if rule.violated(args, ctx)}


# Rules about what is installed: flags alone cannot make them fire here (test_lora_settings.py removes bitsandbytes;
# test_nvme_offload_without_async_io_is_refused below takes libaio away).
ENVIRONMENT_RULES = {"k-bit-available", "nvme-offload-needs-async-io"}


def test_every_rule_has_cases():
    assert {r.name for r in rules.RULES} == set(CASES) | set(ITERS_CASES) | set(CONTEXT_CASES) | ENVIRONMENT_RULES


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict[str, str]:
    """config.json files of a tiny Llama and a Qwen2 with a 32-token window in its upper layers, and a rapidtrain
    checkpoint."""
    import json

    root = tmp_path_factory.mktemp("pretrained")
    llama = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "num_key_value_heads": 2, "intermediate_size": 128, "max_position_embeddings": 512, "vocab_size": 256,
             "rms_norm_eps": 1e-6, "tie_word_embeddings": False}
    configs = {"HF_LLAMA": llama, "HF_QWEN2_WINDOW": llama | {"model_type": "qwen2", "use_sliding_window": True,
                                                          "sliding_window": 32}}
    for name, config in configs.items():
        (root / name).mkdir()
        (root / name / "config.json").write_text(json.dumps(config))
    (root / "CHECKPOINT_DIR").mkdir()
    (root / "CHECKPOINT_DIR" / "latest_checkpointed_iteration.txt").write_text("5\n")
    (root / "DS_CONFIG").write_text(json.dumps({"steps_per_print": 10}))
    return {name: str(root / name) for name in [*configs, "CHECKPOINT_DIR", "DS_CONFIG"]}


@pytest.mark.parametrize("name", [n for n in CASES if n != "lr-required"])
def test_rule_fires_and_passes(name, folders):
    bad, good, world, device = CASES[name]
    bad, good = [folders.get(t, t) for t in bad], [folders.get(t, t) for t in good]
    if name == "nccl-needs-cuda":  # the same flags: the device decides
        assert name in fired(BASE + bad, world, "cpu")
    else:
        assert name in fired(BASE + bad, world, device)
    assert name not in fired(BASE + good, world, device)


@pytest.mark.parametrize("name", list(CONTEXT_CASES))
def test_context_rules(name):
    bad, good = CONTEXT_CASES[name]
    args = arguments.parse_args(BASE)
    assert name in {rule.name for rule in rules.RULES if rule.violated(args, bad)}
    assert name not in {rule.name for rule in rules.RULES if rule.violated(args, good)}


def test_probabilities_refuse_nan_and_the_split_names_its_problem(capsys):
    with pytest.raises(SystemExit) as stop:  # every float flag refuses nan in the parser, naming the flag
        arguments.parse_args(BASE + ["--attention-dropout", "nan"])
    refused = "argument --attention-dropout: 'nan' is not a finite number"
    assert stop.value.code == 2 and refused in capsys.readouterr().err
    args = arguments.parse_args(BASE + ["--split", "a,b"])
    messages = rules.violations(args, RunContext(1, "cpu"))
    assert any(m.startswith("--split 'a,b': expected one to three numbers") for m in messages)


def test_lr_required_fires_without_lr():
    assert "lr-required" in fired(["--train-iters", "10"], 1, "cpu")
    assert "lr-required" not in fired(BASE, 1, "cpu")


@pytest.mark.parametrize("name", list(ITERS_CASES))
def test_training_length_rules(name):
    bad, good = ITERS_CASES[name]
    assert name in fired(bad, 1, "cpu")
    assert name not in fired(good, 1, "cpu")


def test_training_length_needed():
    assert "iters-xor-epochs" in fired(["--lr", "1e-4"], 1, "cpu")  # neither given


def test_every_message_names_its_flags():
    for name, (bad, _, world, device) in CASES.items():
        argv = BASE + bad if name != "lr-required" else ["--train-iters", "1"]
        args = arguments.parse_args(argv)
        ctx = RunContext(world, device)  # type: ignore[arg-type]
        rule = next(r for r in rules.RULES if r.name == name)
        message = rule.message(args, ctx)
        assert any(flag in message for flag in rule.flags), (name, message)


def test_all_violations_reported_at_once():
    args = arguments.parse_args(
        BASE + ["--fp16", "--bf16", "--hidden-size", "100", "--num-attention-heads", "8"]
    )
    messages = rules.violations(args, RunContext(1, "cpu"))
    assert len(messages) == 2
    with pytest.raises(rules.FlagConflict) as raised:
        rules.validate(args, RunContext(1, "cpu"))
    assert (
        raised.value.code == 2 and "--fp16" in str(raised.value) and "--hidden-size 100" in str(raised.value)
    )


def test_compatibility_doc_is_up_to_date():
    from pathlib import Path

    doc = Path(rules.__file__).resolve().parents[2] / "docs" / "compatibility.md"
    assert doc.read_text() == rules.compatibility_markdown(), (
        "docs/compatibility.md is stale: run `python -m rapidtrain.config.rules --write-docs`"
    )


def test_plan_command_refuses_zero3_with_pipeline_naming_both_flags():
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "rapidtrain.cli",
            "plan",
            "--world-size",
            "4",
            "--zero-3-memory-optimization",
            "--pipeline-model-parallel-size",
            "2",
            *BASE,
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 2
    assert (
        "--zero-3-memory-optimization" in result.stderr and "--pipeline-model-parallel-size" in result.stderr
    )
    assert "--zero-1-memory-optimization or --zero-2-memory-optimization instead" in result.stderr
    assert "Traceback" not in result.stderr


def test_nvme_offload_without_async_io_is_refused(monkeypatch):
    from deepspeed.ops.op_builder import AsyncIOBuilder

    # Stand-in for a machine without libaio: DeepSpeed's own compatibility check answers no.
    monkeypatch.setattr(AsyncIOBuilder, "is_compatible", lambda self, verbose=False: False)
    argv = BASE + ["--zero-3-memory-optimization", "--nvme-offload-dir", "d"]
    assert "nvme-offload-needs-async-io" in fired(argv, 2, "cpu")
    message = rules.violations(arguments.parse_args(argv), RunContext(2, "cpu"))[0]
    assert "apt-get install libaio-dev" in message and "--cpu-offload --cpu-offload-params" in message


@pytest.mark.parametrize("flags, named", [
    (["--profile"], "--profile-step-end 12 is past --train-iters 10"),  # Megatron's default window
    (["--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "0", "2"],
     "rank(s) [2] do not exist in a world of 2"),
    (["--wandb-save-dir", "w", "--mlflow-tracking-uri", "file:m"],
     "--wandb-save-dir needs --wandb-project; --mlflow-tracking-uri needs --mlflow-experiment"),
])
def test_profiler_and_tracker_refusals_name_the_flags(flags, named):
    args = arguments.parse_args(BASE + flags)
    messages = rules.violations(args, RunContext(2, "cpu"))
    assert any(named in m for m in messages), messages


def test_a_zero_vocabulary_multiple_is_refused_naming_the_flag():
    """--make-vocab-size-divisible-by 0 reached the vocabulary padding and ended in a ValueError's traceback (found by
    tests/unit/test_flag_search.py's random flag sets): it is refused with the other sizes that must be positive."""
    messages = rules.violations(arguments.parse_args(["--make-vocab-size-divisible-by", "0"]), RunContext(1, "cpu"))
    assert any("--make-vocab-size-divisible-by must be at least 1" in message for message in messages)
