"""Rules of context parallelism (--context-parallel-size, --cp-comm-type) and DeepSpeed-Ulysses
(--ds-sequence-parallel-size): how the sequence divides, which attention splits by heads, and what composes with
the sequence split (parallel/context_parallel.py serves it)."""

from __future__ import annotations

import argparse

from rapidtrain.config.checks import Rule, cp_size, partitioning_flags, pp_size, query_groups, tp_size, uses_hf_model
from rapidtrain.config.resolve import mtp_depths, recompute_of


def cp_flag(a: argparse.Namespace) -> str:
    """The flag the user gave for the sequence split, with its value."""
    if (a.ds_sequence_parallel_size or 1) > 1:
        return f"--ds-sequence-parallel-size {a.ds_sequence_parallel_size}"
    return f"--context-parallel-size {a.context_parallel_size}"


def comm_types(a: argparse.Namespace) -> list[str]:
    value = a.cp_comm_type or ["p2p"]
    return [value] if isinstance(value, str) else list(value)


def comm_type(a: argparse.Namespace) -> str:
    return "a2a" if (a.ds_sequence_parallel_size or 1) > 1 else comm_types(a)[0]


def sequence_parts(a: argparse.Namespace) -> int:
    """How many equal parts the sequence is cut into: 2·CP chunks (p2p, allgather: load-balanced) or CP (a2a)."""
    return cp_size(a) if comm_type(a) == "a2a" else 2 * cp_size(a)


def split(a: argparse.Namespace) -> bool:
    return cp_size(a) > 1


def ulysses_heads_problem(a: argparse.Namespace) -> str | None:
    """a2a splits each tensor-parallel rank's heads (and key/value groups) over the CP ranks."""
    if not split(a) or comm_type(a) != "a2a" or tp_size(a) < 1:
        return None
    cp, tp = cp_size(a), tp_size(a)
    heads = a.num_attention_heads // tp
    groups = heads if a.multi_latent_attention else query_groups(a) // tp
    if heads % cp or groups % cp:
        return (f"{cp_flag(a)} (all-to-all, Ulysses) gives each rank heads/{cp} of the "
                f"{heads} attention heads and {groups} key/value groups per tensor-parallel rank "
                f"(--num-attention-heads {a.num_attention_heads}, --num-query-groups, --tensor-model-parallel-size "
                f"{tp}): they must divide by {cp}. Change the sizes, or use --cp-comm-type p2p or allgather")
    return None


CONTEXT_RULES: tuple[Rule, ...] = (
    Rule(
        "cp-one-size-flag", ("--context-parallel-size", "--ds-sequence-parallel-size"),
        "Context parallelism is given once: --context-parallel-size (with --cp-comm-type) or Megatron-DeepSpeed's "
        "--ds-sequence-parallel-size (Ulysses, a2a).",
        lambda a, c: (a.ds_sequence_parallel_size or 1) > 1 and (a.context_parallel_size or 1) > 1,
        lambda a, c: f"--context-parallel-size {a.context_parallel_size} and --ds-sequence-parallel-size "
        f"{a.ds_sequence_parallel_size} both split the sequence: give one (--ds-sequence-parallel-size N is "
        "--context-parallel-size N --cp-comm-type a2a).",
    ),
    Rule(
        "cp-comm-type-one", ("--cp-comm-type",),
        "--cp-comm-type is one of p2p, allgather, a2a for every layer; a2a+p2p (hierarchical) is not served.",
        lambda a, c: len(set(comm_types(a))) > 1 or "a2a+p2p" in comm_types(a),
        lambda a, c: f"--cp-comm-type {' '.join(comm_types(a))}: "
        + ("hierarchical a2a+p2p (all-to-all inside groups, a ring across them, with "
           "--hierarchical-context-parallel-sizes) is not in rapidtrain" if "a2a+p2p" in comm_types(a)
           else "one exchange serves every layer here, a per-layer list must repeat one value")
        + ": choose p2p, allgather or a2a.",
    ),
    Rule(
        "cp-sizes-positive", ("--context-parallel-size", "--ds-sequence-parallel-size"),
        "Context-parallel sizes are at least 1.",
        lambda a, c: (a.context_parallel_size or 0) < 1 or (a.ds_sequence_parallel_size or 0) < 1,
        lambda a, c: f"--context-parallel-size {a.context_parallel_size} / --ds-sequence-parallel-size "
        f"{a.ds_sequence_parallel_size}: give 1 or more.",
    ),
    Rule(
        "world-divisible-by-cp", ("--context-parallel-size", "--tensor-model-parallel-size",
                                  "--pipeline-model-parallel-size", "--nproc-per-node"),
        "The world size is divisible by tensor × pipeline × context parallel size.",
        lambda a, c: split(a) and tp_size(a) >= 1 and pp_size(a) >= 1
        and c.world_size % (tp_size(a) * pp_size(a) * cp_size(a)) != 0,
        lambda a, c: f"world size {c.world_size} is not divisible by --tensor-model-parallel-size {tp_size(a)} × "
        f"--pipeline-model-parallel-size {pp_size(a)} × {cp_flag(a)} = {tp_size(a) * pp_size(a) * cp_size(a)}. "
        "Launch a multiple of that many processes or change the parallel sizes.",
    ),
    Rule(
        "cp-sequence-divides", ("--context-parallel-size", "--cp-comm-type", "--seq-length"),
        "The sequence length divides by 2·CP (p2p, allgather: Megatron-Core's load-balanced chunks) or CP (a2a).",
        lambda a, c: split(a) and a.seq_length is not None and a.seq_length % sequence_parts(a) != 0,
        lambda a, c: f"--seq-length {a.seq_length} with {cp_flag(a)} --cp-comm-type {comm_type(a)}: the sequence "
        f"is cut into {sequence_parts(a)} equal "
        + ("parts (one per rank)" if comm_type(a) == "a2a" else "chunks (rank r keeps chunks r and 2·CP-1-r)")
        + f"; give a --seq-length divisible by {sequence_parts(a)}.",
    ),
    Rule(
        "cp-ulysses-heads", ("--context-parallel-size", "--cp-comm-type", "--ds-sequence-parallel-size",
                             "--num-attention-heads", "--num-query-groups"),
        "a2a (Ulysses) splits heads and key/value groups (per tensor-parallel rank) over the context-parallel ranks.",
        lambda a, c: ulysses_heads_problem(a) is not None,
        lambda a, c: f"{ulysses_heads_problem(a)}.",
    ),
    Rule(
        "cp-builtin-gpt", ("--context-parallel-size", "--ds-sequence-parallel-size", "--model-type", "--task"),
        "Context parallelism serves the built-in GPT's causal attention (pretraining); not BERT's bidirectional "
        "attention or Hugging Face models.",
        lambda a, c: split(a) and (a.model_type != "gpt" or uses_hf_model(a)),
        lambda a, c: f"{cp_flag(a)}: context parallelism replaces the causal attention core of the built-in GPT; "
        + ("BERT attends in both directions" if a.model_type != "gpt" else "a Hugging Face model's attention is "
           "its own") + ". Drop the flag.",
    ),
    Rule(
        "cp-fixed-length", ("--context-parallel-size", "--data-iterator"),
        "Context parallelism splits fixed --seq-length sequences; --data-iterator dynamic-shape pads each batch to "
        "its own length.",
        lambda a, c: split(a) and a.data_iterator == "dynamic-shape",
        lambda a, c: f"{cp_flag(a)} with --data-iterator dynamic-shape: the split needs every batch at --seq-length "
        "(divisible into the ranks' chunks). Drop one of them.",
    ),
    Rule(
        "cp-without-mtp", ("--context-parallel-size", "--mtp-num-layers"),
        "Multi-token prediction reads the tokens ahead along the whole sequence: not under context parallelism.",
        lambda a, c: split(a) and mtp_depths(a) > 0,
        lambda a, c: f"{cp_flag(a)} with --mtp-num-layers: multi-token prediction shifts each sequence by its "
        "depth, which crosses the ranks' parts. Drop one of them.",
    ),
    Rule(
        "cp-documents-recompute-pipeline", ("--context-parallel-size", "--reset-attention-mask",
                                            "--pipeline-model-parallel-size", "--recompute-granularity"),
        "Under context parallelism a micro-batch's document ids are gathered once per forward; a pipeline schedule "
        "runs later micro-batches' forwards before a layer recomputed whole (full or op-level) in backward, which "
        "would read theirs.",
        lambda a, c: split(a) and a.reset_attention_mask and pp_size(a) > 1
        and recompute_of(a).granularity in ("full", "op"),
        lambda a, c: f"{cp_flag(a)} with --reset-attention-mask, --pipeline-model-parallel-size {pp_size(a)} and "
        f"--recompute-granularity {recompute_of(a).granularity}: recomputing a whole layer in a pipeline's backward "
        "would mask it with another micro-batch's documents. Use --recompute-granularity selective (the attention "
        "core keeps its mask), or drop one of the others.",
    ),
    Rule(
        "cp-not-fairscale", ("--context-parallel-size", "--sharding-backend"),
        "Context parallelism reduces gradients over data × context ranks with torch's and DeepSpeed's engines; "
        "FairScale's are not given that group.",
        lambda a, c: split(a) and a.sharding_backend == "fairscale" and bool(partitioning_flags(a)),
        lambda a, c: f"{cp_flag(a)} with --sharding-backend fairscale: use --sharding-backend torch.",
    ),
)
