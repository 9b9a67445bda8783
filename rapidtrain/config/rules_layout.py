"""Rules of sizes, partitioning, the parallel layout, the model's shape, precision and experts (the first part of
the conflict table; rules.py joins the parts)."""

from __future__ import annotations

import argparse
import difflib

from rapidtrain.config import flag_status
from rapidtrain.config.arguments import TASKS
from rapidtrain.config.checks import (
    Rule,
    accumulation_steps,
    cp_size,
    deepspeed_zero,
    dp_size,
    experts_of,
    flag_name,
    interleaved,
    layout_divides,
    mla_problems,
    num_experts_length_ok,
    partitioning_flags,
    pipeline_schedule_problem,
    pipeline_split_problem,
    positive_sizes,
    pp_size,
    query_groups,
    sliding_window_of,
    three_d,
    tp_size,
    yarn_problems,
)
from rapidtrain.config.flag_surface import megatron_flags_given
from rapidtrain.config.resolve import uneven_split_flags, virtual_stages_of
from rapidtrain.models import hf_config

LAYOUT_RULES: tuple[Rule, ...] = (
    Rule(
        "positive-sizes", ("--micro-batch-size", "--tensor-model-parallel-size", "--num-layers",
                           "--make-vocab-size-divisible-by"),
        "Batch sizes, parallel sizes and model dimensions are positive integers.",
        lambda a, c: bool(positive_sizes(a)),
        lambda a, c: f"{', '.join(positive_sizes(a))} must be at least 1.",
    ),
    Rule(
        "unknown-task", ("--task",),
        f"--task is one of {', '.join(TASKS)} (causal_lm is accepted for casual_lm).",
        lambda a, c: a.task not in TASKS,
        lambda a, c: f"--task {a.task!r} is not a task rapidtrain knows"
        + (f"; did you mean {difflib.get_close_matches(a.task, TASKS, 1)[0]!r}?"
           if difflib.get_close_matches(a.task, TASKS, 1) else "")
        + f" Choose one of: {', '.join(TASKS)}.",
    ),
    Rule(
        "one-state-partitioning", ("--oss-memory-optimization", "--oss-sdp-memory-optimization",
                                   "--fsdp-memory-optimization", "--zero-1-memory-optimization",
                                   "--zero-2-memory-optimization", "--zero-3-memory-optimization"),
        "At most one model-state partitioning switch (OSS, SDP, FSDP, ZeRO-1/2/3).",
        lambda a, c: len(partitioning_flags(a)) > 1,
        lambda a, c: f"{' and '.join(flag_name(f) for f in partitioning_flags(a))} each choose how model state is "
        f"partitioned; they cannot be combined. Keep one (ZeRO-3 or FSDP shard the most, ZeRO-1 or OSS the least).",
    ),
    Rule(
        "3d-only-zero12", ("--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                           "--zero-3-memory-optimization", "--oss-memory-optimization",
                           "--oss-sdp-memory-optimization", "--fsdp-memory-optimization"),
        "With tensor or pipeline parallelism only ZeRO-1 or ZeRO-2 partitioning combines (served by FSDP2 over "
        "the data-parallel dimension).",
        lambda a, c: three_d(a) and any(f in partitioning_flags(a) for f in (
            "zero_3_memory_optimization", "oss_memory_optimization", "oss_sdp_memory_optimization",
            "fsdp_memory_optimization")),
        lambda a, c: f"--tensor-model-parallel-size {tp_size(a)} / --pipeline-model-parallel-size {pp_size(a)} "
                     f"cannot be "
        f"combined with {', '.join(flag_name(f) for f in partitioning_flags(a))}: with 3D parallelism parameters "
        f"are already split by layer or column, and only optimizer state and gradients are partitioned further. Use "
        "--zero-1-memory-optimization or --zero-2-memory-optimization instead, or drop tensor/pipeline parallelism.",
    ),
    Rule(
        "cpu-offload-needs-zero", ("--cpu-offload", "--zero-1-memory-optimization", "--zero-2-memory-optimization",
                                   "--zero-3-memory-optimization", "--fsdp-memory-optimization"),
        "--cpu-offload needs a DeepSpeed ZeRO switch and no tensor/pipeline/expert parallelism (DeepSpeedCPUAdam "
        "serves it); FSDP's own CPU offload is not used.",
        lambda a, c: a.cpu_offload and not deepspeed_zero(a),
        lambda a, c: f"{cpu_offload_as_typed(a)} moves the optimizer state and step to the CPU with DeepSpeed's "
        "DeepSpeedCPUAdam, which only DeepSpeed ZeRO without tensor/pipeline/expert parallelism provides. Add "
        "--zero-2-memory-optimization (or --zero-1/--zero-3), set --tensor-model-parallel-size, "
        f"--pipeline-model-parallel-size and --expert-model-parallel-size to 1, or drop {cpu_offload_as_typed(a)}."
        + (" With --fsdp-memory-optimization, FSDP2's CPUOffloadPolicy is not used: it would also move the sharded "
           "parameters and gradients to the CPU and step there (nothing to offload on a CPU-only run); for fully "
           "sharded states with the optimizer on the CPU use --zero-3-memory-optimization --cpu-offload instead."
           if a.fsdp_memory_optimization else ""),
    ),
    Rule(
        "world-divisible-by-tp-pp",
        ("--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--nproc-per-node"),
        "The world size is divisible by tensor × pipeline parallel size.",
        lambda a, c: tp_size(a) >= 1 and pp_size(a) >= 1 and c.world_size % (tp_size(a) * pp_size(a)) != 0,
        lambda a, c: f"world size {c.world_size} is not divisible by --tensor-model-parallel-size {tp_size(a)} × "
        f"--pipeline-model-parallel-size {pp_size(a)} = {tp_size(a) * pp_size(a)}. Launch a multiple of "
        f"{tp_size(a) * pp_size(a)} "
        "processes (--nproc-per-node × nodes) or change the parallel sizes.",
    ),
    Rule(
        "global-batch-divisible", ("--global-batch-size", "--micro-batch-size"),
        "The global batch is divisible by micro batch × data-parallel size (the quotient is the accumulation steps).",
        lambda a, c: layout_divides(a, c) and a.global_batch_size is not None and a.micro_batch_size >= 1
        and a.global_batch_size % (a.micro_batch_size * dp_size(a, c)) != 0,
        lambda a, c: f"--global-batch-size {a.global_batch_size} is not divisible by --micro-batch-size "
        f"{a.micro_batch_size} × data-parallel size {dp_size(a, c)} = {a.micro_batch_size * dp_size(a, c)}. Choose "
        f"a global "
        f"batch that is a multiple of {a.micro_batch_size * dp_size(a, c)} (accumulation steps = global / that).",
    ),
    Rule(
        "pipeline-split", ("--num-layers", "--pipeline-model-parallel-size", "--decoder-first-pipeline-num-layers",
                           "--decoder-last-pipeline-num-layers", "--account-for-embedding-in-pipeline-split",
                           "--account-for-loss-in-pipeline-split", "--pipeline-model-parallel-layout",
                           "--pp-partition-method"),
        "The layers split over the pipeline stages as the flags ask: evenly (Megatron's default), by Megatron-LM's "
        "first/last stage sizes or embedding/loss accounting, by Megatron-Core's layout string, or by DeepSpeed's "
        "partition method; every virtual stage of a rank alike.",
        lambda a, c: pipeline_split_problem(a) is not None,
        lambda a, c: str(pipeline_split_problem(a)),
    ),
    Rule(
        "virtual-stages", ("--num-layers-per-virtual-pipeline-stage", "--num-virtual-stages-per-pipeline-rank",
                           "--pipeline-model-parallel-size"),
        "Interleaved pipelining needs pipeline parallelism and a positive number of virtual stages.",
        lambda a, c: bool(a.num_layers_per_virtual_pipeline_stage or a.num_virtual_stages_per_pipeline_rank) and (
            pp_size(a) < 2 or (a.num_layers_per_virtual_pipeline_stage or 1) < 1
            or (a.num_virtual_stages_per_pipeline_rank or 1) < 1
            or (a.num_layers_per_virtual_pipeline_stage is not None and not uneven_split_flags(a)
                and (a.num_layers // max(pp_size(a), 1)) % a.num_layers_per_virtual_pipeline_stage != 0)),
        lambda a, c: f"--num-layers-per-virtual-pipeline-stage {a.num_layers_per_virtual_pipeline_stage} / "
        f"--num-virtual-stages-per-pipeline-rank {a.num_virtual_stages_per_pipeline_rank} need "
        "--pipeline-model-parallel-size ≥ 2 and a positive value; layers per virtual stage must divide the layers per "
        f"stage ({a.num_layers} / {pp_size(a)}). Adjust it or drop it for the plain 1F1B schedule.",
    ),
    Rule(
        "interleaved-micro-batches", ("--num-layers-per-virtual-pipeline-stage", "--global-batch-size",
                                      "--micro-batch-size"),
        "The interleaved schedule (torch's ScheduleInterleaved1F1B) runs the micro-batches per iteration (accumulation "
        "steps) in max(1, micro-batches // pipeline size) rounds of equal size: a multiple of the pipeline size, or "
        "fewer micro-batches than twice it (Megatron's --microbatch-group-size-per-virtual-pipeline-stage groups).",
        lambda a, c: pp_size(a) > 1 and interleaved(a)
        and (steps := accumulation_steps(a, c)) is not None and steps % max(1, steps // pp_size(a)) != 0,
        lambda a, c: f"{virtual_stages_of(a)} virtual stages per pipeline rank with {accumulation_steps(a, c)} "
        f"micro-batches per iteration (--global-batch-size / (--micro-batch-size × data-parallel size "
        f"{dp_size(a, c)})): the interleaved schedule runs them in "
        f"{max(1, (accumulation_steps(a, c) or 0) // pp_size(a))} rounds of equal size (one round per "
        f"--pipeline-model-parallel-size {pp_size(a)} micro-batches). Make "
        f"--global-batch-size a multiple of {pp_size(a) * a.micro_batch_size * dp_size(a, c)}, or drop the virtual "
        "stages.",
    ),
    Rule(
        "pipeline-schedule", ("--pipeline-schedule", "--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"),
        "The pipeline schedule fits the layout: ZBV and DualPipeV run two stages per rank (DualPipeV at least as "
        "many micro-batches as stages); the split-backward schedules (zero bubble, ZBV, DualPipeV) run without "
        "torch.compile, FSDP2, or tensor parallelism beside data parallelism.",
        lambda a, c: pipeline_schedule_problem(a, c) is not None,
        lambda a, c: str(pipeline_schedule_problem(a, c)),
    ),
    Rule(
        "pipeline-per-token-loss", ("--pipeline-model-parallel-size", "--bert-binary-head"),
        "Pipelining runs per-token losses: not the BERT binary head's sentence-order loss.",
        lambda a, c: pp_size(a) > 1 and a.bert_binary_head,
        lambda a, c: f"--pipeline-model-parallel-size {pp_size(a)} with --bert-binary-head: the sentence-order loss is "
        "not a per-token loss the last stage can sum. Drop one of them.",
    ),
    Rule(
        "heads-divisible-by-tp", ("--num-attention-heads", "--tensor-model-parallel-size"),
        "Attention heads are divisible by the tensor-parallel size.",
        lambda a, c: tp_size(a) >= 1 and a.num_attention_heads % tp_size(a) != 0,
        lambda a, c: f"--num-attention-heads {a.num_attention_heads} is not divisible by --tensor-model-parallel-size "
        f"{tp_size(a)}: heads are split across tensor-parallel ranks. Choose a head count that is a multiple of "
        f"{tp_size(a)}.",
    ),
    Rule(
        "query-groups-need-gqa", ("--num-query-groups", "--group-query-attention"),
        "--num-query-groups takes effect with --group-query-attention only.",
        lambda a, c: a.num_query_groups is not None and not a.group_query_attention,
        lambda a, c: f"--num-query-groups {a.num_query_groups} without --group-query-attention would be ignored: "
        "add --group-query-attention, or drop --num-query-groups for one key/value head per attention head.",
    ),
    Rule(
        "heads-divisible-by-query-groups", ("--num-attention-heads", "--num-query-groups"),
        "The attention heads are divisible by the query groups (each key/value head serves as many query heads).",
        lambda a, c: a.num_attention_heads >= 1 and query_groups(a) >= 1
        and a.num_attention_heads % query_groups(a) != 0,
        lambda a, c: f"--num-attention-heads {a.num_attention_heads} is not divisible by --num-query-groups "
        f"{query_groups(a)}: each key/value head serves an equal share of the query heads. Choose a group count "
        "that divides the heads.",
    ),
    Rule(
        "query-groups-divisible-by-tp", ("--num-query-groups", "--tensor-model-parallel-size"),
        "With grouped-query attention the query groups (key/value heads) are divisible by the tensor-parallel size.",
        lambda a, c: a.group_query_attention and tp_size(a) >= 1 and query_groups(a) >= 1
        and query_groups(a) % tp_size(a) != 0,
        lambda a, c: f"--num-query-groups {query_groups(a)} is not divisible by --tensor-model-parallel-size "
        f"{tp_size(a)}: tensor parallelism splits the key/value heads, each rank holding whole ones for its query "
        f"heads. Use a group count that is a multiple of {tp_size(a)}, or a smaller tensor-parallel size.",
    ),
    Rule(
        "qkv-bias-needs-no-bias-linear", ("--add-qkv-bias", "--disable-bias-linear"),
        "--add-qkv-bias adds q/k/v biases to a model without biases (--disable-bias-linear).",
        lambda a, c: a.add_qkv_bias and a.add_bias_linear,
        lambda a, c: "--add-qkv-bias without --disable-bias-linear changes nothing: every linear layer already has "
        "a bias. Add --disable-bias-linear (biases on q/k/v only, as Qwen2) or drop --add-qkv-bias.",
    ),
    Rule(
        "rotary-flags-need-rope", ("--rotary-base", "--rotary-percent", "--position-embedding-type"),
        "--rotary-base and --rotary-percent apply to rotary position embeddings.",
        lambda a, c: a.position_embedding_type != "rope" and not a.multi_latent_attention and (a.rotary_base is not None
                                                              or a.rotary_percent is not None),
        lambda a, c: "--rotary-base / --rotary-percent configure rotary embeddings, but --position-embedding-type is "
        f"{a.position_embedding_type}. Add --position-embedding-type rope or drop them.",
    ),
    Rule(
        "alibi-and-window-are-gpt", ("--position-embedding-type", "--sliding-window", "--model-type"),
        "ALiBi and sliding-window attention are causal features of the built-in GPT.",
        lambda a, c: a.model_type == "bert" and (a.position_embedding_type == "alibi" or a.sliding_window is not None),
        lambda a, c: ("--position-embedding-type alibi" if a.position_embedding_type == "alibi" else "--sliding-window")
        + " with --model-type bert: the built-in BERT attends both ways, and rapidtrain has ALiBi and sliding windows "
        "for the causal GPT only. Drop it, or use --model-type gpt.",
    ),
    Rule(
        "sliding-window-positive", ("--sliding-window",),
        "--sliding-window counts the keys a query sees, itself included: at least 1.",
        lambda a, c: a.sliding_window is not None and a.sliding_window < 1,
        lambda a, c: f"--sliding-window {a.sliding_window}: each query sees itself and the keys before it, at most "
        "this many; give 1 or more (leave it out for no window).",
    ),
    Rule(
        "alibi-needs-a-biased-kernel", ("--position-embedding-type", "--attention-backend"),
        "ALiBi adds a bias to the scores: on CUDA, PyTorch's flash and cuDNN kernels take none.",
        lambda a, c: a.position_embedding_type == "alibi" and c.device_type == "cuda"
        and a.attention_backend in ("flash", "flash_attention_2", "fused"),
        lambda a, c: f"--position-embedding-type alibi with --attention-backend {a.attention_backend}: that CUDA "
        "kernel takes no additive bias. Choose auto (memory-efficient attention takes ALiBi's bias), unfused, or "
        "flex_attention.",
    ),
    Rule(
        "rotary-percent-range", ("--rotary-percent",),
        "--rotary-percent lies in (0, 1].",
        lambda a, c: a.rotary_percent is not None and not 0 < a.rotary_percent <= 1,
        lambda a, c: f"--rotary-percent {a.rotary_percent} is the share of each head that rope rotates: give a "
        "value in (0, 1].",
    ),
    Rule(
        "rope-scaling-needs-rope", ("--use-rope-scaling", "--rotary-seq-len-interpolation-factor",
                                    "--position-embedding-type"),
        "Rope scaling and position interpolation apply to rotary position embeddings.",
        lambda a, c: a.position_embedding_type != "rope" and not a.multi_latent_attention
        and (a.use_rope_scaling or a.rotary_seq_len_interpolation_factor not in (None, 1)),
        lambda a, c: "--use-rope-scaling / --rotary-seq-len-interpolation-factor scale rotary embeddings, but "
        f"--position-embedding-type is {a.position_embedding_type}. Add --position-embedding-type rope or drop them.",
    ),
    Rule(
        "yarn-needs-rope", ("--rope-type", "--use-rope-scaling", "--position-embedding-type"),
        "YaRN scales rotary embeddings, and is one rope scaling (not with Llama 3.1's --use-rope-scaling).",
        lambda a, c: a.rope_type == "yarn" and ((a.position_embedding_type != "rope" and not a.multi_latent_attention)
                                                or a.use_rope_scaling),
        lambda a, c: "--rope-type yarn scales rotary embeddings: give --position-embedding-type rope"
        + (" and drop --use-rope-scaling (Llama 3.1's scaling; one rope scaling at a time)." if a.use_rope_scaling
           else f", not {a.position_embedding_type}."),
    ),
    Rule(
        "yarn-values", ("--rotary-scaling-factor", "--yarn-beta-fast", "--yarn-beta-slow",
                        "--yarn-original-max-position-embeddings"),
        "YaRN's factor, betas and original context are positive, beta-fast above beta-slow.",
        lambda a, c: bool(yarn_problems(a)),
        lambda a, c: "; ".join(yarn_problems(a)) + ".",
    ),
    Rule(
        "mla-needs-rope", ("--multi-latent-attention", "--position-embedding-type", "--group-query-attention"),
        "Multi-head latent attention rotates part of each head (rope) and makes every head's key and value from the "
        "latent (no grouped-query attention).",
        lambda a, c: a.multi_latent_attention and (a.position_embedding_type == "alibi" or a.group_query_attention),
        lambda a, c: "--multi-latent-attention "
        + ("makes each head's key and value from the shared latent: drop --group-query-attention."
           if a.position_embedding_type != "alibi" else
           "rotates a --qk-pos-emb-head-dim part of each head (rope): drop --position-embedding-type alibi."),
    ),
    Rule(
        "mla-sizes", ("--multi-latent-attention", "--q-lora-rank", "--kv-lora-rank", "--qk-head-dim",
                      "--qk-pos-emb-head-dim", "--v-head-dim"),
        "Multi-head latent attention's sizes are positive, the rotary part even.",
        lambda a, c: a.multi_latent_attention and bool(mla_problems(a)),
        lambda a, c: "; ".join(mla_problems(a)) + ".",
    ),
    Rule(
        "rope-scaling-factors-positive", ("--rope-scaling-factor", "--rotary-seq-len-interpolation-factor"),
        "Rope scaling factors are positive.",
        lambda a, c: a.rope_scaling_factor <= 0 or (a.rotary_seq_len_interpolation_factor is not None
                                                    and a.rotary_seq_len_interpolation_factor <= 0),
        lambda a, c: f"--rope-scaling-factor {a.rope_scaling_factor:g} / --rotary-seq-len-interpolation-factor "
        f"{a.rotary_seq_len_interpolation_factor}: each divides rope's frequencies; give a positive value.",
    ),
    Rule(
        "swiglu-ffn-size", ("--swiglu", "--ffn-hidden-size", "--hidden-size"),
        "With --swiglu and no --ffn-hidden-size the MLP is 2/3 of 4 × hidden rounded down to a multiple of 64 "
        "(Megatron); that must leave at least 64.",
        lambda a, c: a.swiglu and a.ffn_hidden_size is None and int(4 * a.hidden_size * 2 / 3 / 64) < 1,
        lambda a, c: f"--swiglu with --hidden-size {a.hidden_size} and no --ffn-hidden-size: 2/3 of 4 × hidden "
        "rounded down to a multiple of 64 leaves no MLP. Give --ffn-hidden-size.",
    ),
    Rule(
        "openai-gelu-needs-gelu", ("--openai-gelu", "--swiglu", "--quick-geglu"),
        "--openai-gelu changes the GELU of GELU MLPs; a GPT with --swiglu or --quick-geglu has none.",
        lambda a, c: a.openai_gelu and (a.swiglu or a.quick_geglu) and a.model_type == "gpt",
        lambda a, c: f"--openai-gelu with {'--swiglu' if a.swiglu else '--quick-geglu'}: the GPT's MLPs are gated "
        "units, no exact GELU is left to change. Drop one of them.",
    ),
    Rule(
        "one-gated-activation", ("--swiglu", "--quick-geglu"),
        "The gated MLP's gate activation is one: silu (--swiglu) or quick GELU (--quick-geglu), as Megatron asserts.",
        lambda a, c: a.swiglu and a.quick_geglu,
        lambda a, c: "--swiglu and --quick-geglu both choose the gated MLP's activation (silu or x·sigmoid(1.702x)). "
        "Give one.",
    ),
    Rule(
        "rotary-interleaved-needs-rope", ("--rotary-interleaved", "--position-embedding-type",
                                          "--multi-latent-attention"),
        "--rotary-interleaved chooses which dimensions rotary embeddings pair: it needs them "
        "(--position-embedding-type rope, or multi-head latent attention).",
        lambda a, c: a.rotary_interleaved and a.position_embedding_type != "rope" and not a.multi_latent_attention,
        lambda a, c: f"--rotary-interleaved with --position-embedding-type {a.position_embedding_type}: there are no "
        "rotary embeddings whose pairs it could choose. Add --position-embedding-type rope, or drop it.",
    ),
    Rule(
        "squared-relu-one-activation", ("--squared-relu", "--swiglu", "--quick-geglu", "--openai-gelu"),
        "--squared-relu is the activation of an MLP without a gate, in place of GELU: not beside --swiglu or "
        "--quick-geglu (as Megatron asserts) or --openai-gelu.",
        lambda a, c: a.squared_relu and (a.swiglu or a.quick_geglu or a.openai_gelu),
        lambda a, c: "--squared-relu with "
        + ("--swiglu" if a.swiglu else "--quick-geglu" if a.quick_geglu else "--openai-gelu")
        + ": both choose the MLP's activation. Drop one of them.",
    ),
    Rule(
        "glu-settings-need-a-gated-mlp", ("--glu-linear-offset", "--activation-func-clamp-value", "--swiglu",
                                          "--quick-geglu"),
        "--glu-linear-offset and --activation-func-clamp-value shape a gated MLP's product; without --swiglu or "
        "--quick-geglu there is none.",
        lambda a, c: (a.glu_linear_offset != 0 or a.activation_func_clamp_value is not None)
        and not (a.swiglu or a.quick_geglu),
        lambda a, c: ("--glu-linear-offset" if a.glu_linear_offset != 0 else "--activation-func-clamp-value")
        + " without a gated MLP: the GELU MLP has no gate or linear half to offset or clamp. Add --quick-geglu "
        "(gpt-oss) or --swiglu, or drop it.",
    ),
    Rule(
        "activation-clamp-positive", ("--activation-func-clamp-value",),
        "The gated MLP's clamp is a finite positive value (Megatron's check).",
        lambda a, c: a.activation_func_clamp_value is not None
        and not 0 < a.activation_func_clamp_value < float("inf"),
        lambda a, c: f"--activation-func-clamp-value {a.activation_func_clamp_value:g}: the gate is clamped above "
        "at it and the linear half to ± it; give a finite value above 0 (gpt-oss: 7).",
    ),
    Rule(
        "pretrained-folder-initialises-builtin", ("--pretrained-model-name-or-path", "--task"),
        "With --task pretraining, --pretrained-model-name-or-path is a Hugging Face folder (config.json) of a "
        "GPT-2, BLOOM, Llama, Mistral, Qwen2, Mixtral, gpt-oss or BERT model, which initialises the built-in model.",
        lambda a, c: hf_config.unsupported_reason(a) is not None,
        lambda a, c: f"{hf_config.unsupported_reason(a)}.",
    ),
    Rule(
        "pretrained-shape-flags", ("--pretrained-model-name-or-path", "--num-layers", "--hidden-size", "--swiglu"),
        "Shape flags given beside a Hugging Face folder that initialises the built-in model agree with its "
        "config.json (flags not given are taken from it).",
        lambda a, c: bool(hf_config.pretrained_conflicts(a)),
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path}: its config.json fixes the "
        "model's shape, and these flags contradict it: " + "; ".join(hf_config.pretrained_conflicts(a))
        + ". Drop them (flags not given are taken from config.json), or use another folder.",
    ),
    Rule(
        "finetuned-shape-flags", ("--pretrained-model-name-or-path", "--num-layers", "--hidden-size", "--seq-length"),
        "Shape flags given beside a Hugging Face folder that is fine-tuned as it is agree with its config.json, and "
        "--seq-length fits its position table.",
        lambda a, c: bool(hf_config.finetune_conflicts(a)),
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path}: its config.json describes "
        "the model, and these flags contradict it: " + "; ".join(hf_config.finetune_conflicts(a))
        + ". Drop them (the folder's config decides) or give its values.",
    ),
    Rule(
        "pretrained-needs-data", ("--pretrained-model-name-or-path", "--data-path"),
        "Continued pretraining from Hugging Face weights reads --data-path (the demo corpus has its own tokenizer).",
        lambda a, c: hf_config.initialises_builtin(a) and not a.data_path and not a.user_script,
        lambda a, c: f"--pretrained-model-name-or-path {a.pretrained_model_name_or_path} without --data-path would "
        "train on the demo corpus, whose token ids come from the demo's own tokenizer and mean nothing to this "
        "model. Preprocess text with the model's tokenizer (scripts/preprocess_data.py --tokenizer-type "
        f"HuggingFaceTokenizer --tokenizer-model {a.pretrained_model_name_or_path}) and give --data-path.",
    ),
    Rule(
        "pretrained-sliding-window", ("--pretrained-model-name-or-path", "--seq-length"),
        "A Hugging Face Qwen2 with sliding-window attention in some layers trains with --seq-length within the window "
        "(where the window changes nothing).",
        lambda a, c: sliding_window_of(a) is not None and a.seq_length > sliding_window_of(a),
        lambda a, c: f"--seq-length {a.seq_length} is longer than the sliding_window {sliding_window_of(a)} of "
        f"{a.pretrained_model_name_or_path}/config.json: the built-in attention sees the whole sequence. Use "
        f"--seq-length {sliding_window_of(a)} or less.",
    ),
    Rule(
        "hidden-divisible-by-heads", ("--hidden-size", "--num-attention-heads"),
        "The hidden size is divisible by the number of attention heads (unless --kv-channels gives the head size).",
        lambda a, c: a.num_attention_heads >= 1 and a.hidden_size % a.num_attention_heads != 0
        and not a.kv_channels,
        lambda a, c: f"--hidden-size {a.hidden_size} is not divisible by --num-attention-heads "
        f"{a.num_attention_heads}: each head gets hidden / heads dimensions. Change one of them, or give the head "
        "size with --kv-channels.",
    ),
    Rule(
        "fp16-xor-bf16", ("--fp16", "--bf16"),
        "--fp16 and --bf16 are exclusive.",
        lambda a, c: a.fp16 and a.bf16,
        lambda a, c: "--fp16 and --bf16 both choose the autocast type; keep one (bf16 needs no loss scaling).",
    ),
    Rule(
        "fp16-deepspeed-cpu", ("--fp16", "--mixed-precision", "--zero-1-memory-optimization"),
        "DeepSpeed refuses fp16 on the CPU: under ZeRO on CPU use --bf16 (--mixed-precision resolves to bf16 there).",
        lambda a, c: a.fp16 and c.device_type == "cpu" and deepspeed_zero(a),
        lambda a, c: "--fp16 with a --zero-*-memory-optimization switch on the CPU: DeepSpeed's CPU accelerator does "
        "not support fp16. Use --bf16 or --mixed-precision (bf16 on CPU) instead.",
    ),
    Rule(
        "seq-within-positions", ("--seq-length", "--max-position-embeddings"),
        "The sequence length is at most the position-embedding table (learned absolute positions).",
        lambda a, c: a.position_embedding_type == "learned_absolute" and a.max_position_embeddings is not None
        and a.seq_length > a.max_position_embeddings,
        lambda a, c: f"--seq-length {a.seq_length} exceeds --max-position-embeddings {a.max_position_embeddings}: "
        "positions past the table have no embedding. Raise --max-position-embeddings or shorten --seq-length.",
    ),
    Rule(
        "num-experts-length", ("--num-experts", "--num-layers"),
        "--num-experts is one number, one per layer, or one per evenly spaced MoE layer.",
        lambda a, c: not num_experts_length_ok(a),
        lambda a, c: f"--num-experts has {len(a.num_experts)} values but --num-layers is {a.num_layers}: give one "
        "number (MoE layers chosen by --moe-layer-freq), one per layer (0 for dense), or one per MoE layer with the "
        "MoE layers evenly spaced (a count that divides --num-layers, as DeepSpeed's pyramid MoE).",
    ),
    Rule(
        "experts-divisible-by-ep", ("--num-experts", "--expert-model-parallel-size"),
        "The number of experts of every MoE layer is divisible by the expert-parallel size.",
        lambda a, c: num_experts_length_ok(a) and a.expert_model_parallel_size >= 1
        and any(e % a.expert_model_parallel_size for e in experts_of(a)),
        lambda a, c: f"--num-experts {' '.join(map(str, a.num_experts or []))} is not divisible by "
        f"--expert-model-parallel-size {a.expert_model_parallel_size}: each expert-parallel rank holds an equal share "
        "of every MoE layer's experts. Use expert counts that are multiples of it.",
    ),
    Rule(
        "ep-divides-dp",
        ("--expert-model-parallel-size", "--tensor-model-parallel-size", "--pipeline-model-parallel-size"),
        "The expert-parallel size divides the data-parallel size (× the context-parallel size), and needs "
        "--num-experts.",
        lambda a, c: a.expert_model_parallel_size > 1 and layout_divides(a, c) and (
            not experts_of(a) or dp_size(a, c) * cp_size(a) % a.expert_model_parallel_size != 0),
        lambda a, c: f"--expert-model-parallel-size {a.expert_model_parallel_size} needs --num-experts and must divide "
        f"the data-parallel size {dp_size(a, c) * cp_size(a)} (world {c.world_size} / (TP {tp_size(a)} × PP "
        f"{pp_size(a)})"
        + (", context-parallel ranks counted with the data-parallel ones" if cp_size(a) > 1 else "") + "): "
        "experts are sharded over data-parallel ranks. Change the expert-parallel size or the number of processes.",
    ),
    Rule(
        "ep-with-zero3-or-fairscale", ("--expert-model-parallel-size", "--zero-3-memory-optimization",
                                       "--sharding-backend"),
        "Expert parallelism combines with OSS, SDP, FSDP and ZeRO-1/2 (torch engines), not with DeepSpeed ZeRO-3 or "
        "FairScale.",
        lambda a, c: a.expert_model_parallel_size > 1 and (
            a.zero_3_memory_optimization or (a.sharding_backend == "fairscale" and bool(partitioning_flags(a)))),
        lambda a, c: f"--expert-model-parallel-size {a.expert_model_parallel_size} with "
        + ("--zero-3-memory-optimization: DeepSpeed partitions every parameter over all data-parallel ranks, but "
           "each expert-parallel rank holds other experts, which must be reduced over their own group. Use "
           "--fsdp-memory-optimization (FSDP2 shards the expert slices over the ranks holding the same experts)"
           if a.zero_3_memory_optimization else
           "--sharding-backend fairscale: FairScale's OSS broadcasts every parameter over all data-parallel ranks, "
           "which would overwrite the expert slices that differ between expert-parallel ranks. Use the default "
           "torch backend")
        + ", or --expert-model-parallel-size 1.",
    ),
    Rule(
        "router-groups", ("--moe-router-num-groups", "--moe-router-group-topk", "--num-experts", "--moe-router-topk"),
        "Group-limited routing needs both group flags, groups that divide every MoE layer's experts, at most as many "
        "chosen groups as groups, and enough experts in the chosen groups for --moe-router-topk.",
        lambda a, c: router_group_problem(a) is not None,
        lambda a, c: f"{router_group_problem(a)}.",
    ),
    Rule(
        "shared-expert-size", ("--enable-shared-expert", "--num-shared-experts", "--shared-moe-ffn-hidden-size",
                               "--moe-shared-expert-gate", "--num-experts"),
        "Shared experts need a size and MoE layers.",
        lambda a, c: shared_expert_problem(a) is not None,
        lambda a, c: f"{shared_expert_problem(a)}.",
    ),
    Rule(
        "mtp-layout", ("--mtp-num-layers", "--pipeline-model-parallel-size", "--sequence-parallel", "--model-type"),
        "Multi-token prediction runs in the built-in GPT, with at least one depth, without sequence parallelism; "
        "under pipeline parallelism (its depths on the last stage, which embeds the tokens ahead with the tied head's "
        "copy of the word embeddings) with tied embeddings, no learned positions or --embed-layernorm, and no "
        "tensor parallelism.",
        lambda a, c: bool((a.mtp_num_layers is not None or a.use_multi_token_prediction) and (
            mtp_depths(a) < 1 or a.model_type != "gpt" or a.sequence_parallel or mtp_pipeline_problem(a))),
        lambda a, c: f"--mtp-num-layers {mtp_depths(a)}: "
        + ("give 1 or more depths (or leave the flag out)" if mtp_depths(a) < 1 else
           "multi-token prediction is a GPT feature here; drop it for BERT" if a.model_type != "gpt" else
           "with --sequence-parallel the depths' inputs would be sequence-sharded; drop --sequence-parallel"
           if a.sequence_parallel else str(mtp_pipeline_problem(a))) + ".",
    ),
    Rule(
        "router-values-positive", ("--moe-router-topk-scaling-factor", "--moe-router-bias-update-rate",
                                   "--moe-ffn-hidden-size", "--moe-shared-expert-intermediate-size"),
        "Router factors and expert sizes are positive.",
        lambda a, c: any(value is not None and value <= 0 for value in (
            a.moe_router_topk_scaling_factor, a.moe_ffn_hidden_size, a.moe_shared_expert_intermediate_size,
            a.num_shared_experts, a.shared_moe_ffn_hidden_size)) or a.moe_router_bias_update_rate < 0,
        lambda a, c: "--moe-router-topk-scaling-factor, --moe-ffn-hidden-size, the shared experts' sizes and "
        "--moe-router-bias-update-rate take positive values (the rate may be 0: the bias stays put); got "
        f"{a.moe_router_topk_scaling_factor}, {a.moe_ffn_hidden_size}, {a.moe_shared_expert_intermediate_size}, "
        f"{a.num_shared_experts}, {a.shared_moe_ffn_hidden_size}, {a.moe_router_bias_update_rate}.",
    ),
)


def router_group_problem(a: argparse.Namespace) -> str | None:
    """What is wrong with the group-limited routing flags, None when nothing (or they are not given)."""
    groups, chosen = a.moe_router_num_groups, a.moe_router_group_topk
    if groups is None and chosen is None:
        return None
    if groups is None or chosen is None:
        return ("group-limited routing needs --moe-router-num-groups and --moe-router-group-topk together (got "
                f"{groups} and {chosen}): give both, or neither")
    if not num_experts_length_ok(a) or not experts_of(a):
        return "--moe-router-num-groups / --moe-router-group-topk route MoE layers: give --num-experts"
    if groups < 1 or not 1 <= chosen <= groups:
        return (f"--moe-router-group-topk {chosen} of --moe-router-num-groups {groups}: choose between 1 and the "
                "number of groups")
    for experts in experts_of(a):
        if experts % groups:
            return (f"--moe-router-num-groups {groups} does not divide the {experts} experts of an MoE layer "
                    "(--num-experts): the groups are equal")
        if a.moe_router_topk > chosen * (experts // groups):
            return (f"--moe-router-topk {a.moe_router_topk} is more than the {chosen * (experts // groups)} experts "
                    f"of the {chosen} groups a token may use (--moe-router-group-topk)")
    return None


def mtp_depths(a: argparse.Namespace) -> int:
    from rapidtrain.config.resolve import mtp_depths as depths

    return depths(a)


def mtp_pipeline_problem(a: argparse.Namespace) -> str | None:
    """Why multi-token prediction cannot run under these pipeline flags (its last stage has no embedding module),
    or None."""
    if pp_size(a) == 1:
        return None
    needs = [what for wrong, what in (
        (a.untie_embeddings_and_output_weights, "drop --untie-embeddings-and-output-weights"),
        (a.position_embedding_type == "learned_absolute" and not a.multi_latent_attention,
         "use rotary positions (--position-embedding-type rope)"),
        (a.embed_layernorm, "drop --embed-layernorm"),
        (tp_size(a) > 1, "use --tensor-model-parallel-size 1"),
    ) if wrong]
    if not needs:
        return None
    return ("under --pipeline-model-parallel-size the depths sit on the last stage, which embeds the tokens ahead "
            "with the tied head's copy of the word embeddings (whole, plain): " + ", ".join(needs))


def shared_expert_problem(a: argparse.Namespace) -> str | None:
    """What is wrong with the shared-expert flags (a switch without a size, shared experts without MoE), or None."""
    from rapidtrain.config.resolve import shared_expert_size

    size = shared_expert_size(a)
    if (a.enable_shared_expert or a.num_shared_experts) and size is None:
        return ("--enable-shared-expert / --num-shared-experts give shared experts no size: add "
                "--shared-moe-ffn-hidden-size N, or --num-shared-experts with --moe-ffn-hidden-size (each shared "
                "expert has the routed experts' size), or --moe-shared-expert-intermediate-size N")
    if a.moe_shared_expert_gate and size is None:
        return "--moe-shared-expert-gate gates shared experts, but none are asked for: give their size too"
    if size is not None and not (num_experts_length_ok(a) and experts_of(a)):
        return "shared experts sit beside the routed experts of MoE layers: give --num-experts"
    return None


def cpu_offload_as_typed(a: argparse.Namespace) -> str:
    """--cpu-offload as the user spelled it (Megatron-Core's --optimizer-cpu-offload, Megatron-DeepSpeed's
    --cpu-optimizer, ...): a message names the flag in the script, not rapidtrain's name for it."""
    spellings = {flag for flag, renamed in flag_status.RENAMED.items() if renamed[0] == "cpu_offload"}
    typed = [flag for flag, _ in megatron_flags_given(a) if flag in spellings]
    return f"{typed[0]} (--cpu-offload)" if typed else "--cpu-offload"
