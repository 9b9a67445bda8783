"""The plan's memory per rank (model states by the ZeRO paper's accounting and the engine's own buffers +
activations by Korthikanti et al. 2022, per pipeline stage, and what backward makes beside them) against the peak
each rank of a real CPU run reaches, for every layout: on 2 ranks DDP, DeepSpeed ZeRO-1/2/3, FSDP, SDP, OSS, TP,
TP + sequence parallelism, PP and EP, every recompute granularity, bf16 (autocast's fp32 residual stream), and
BERT; on 4, pipeline stages with ZeRO-1, tensor or plain data parallelism beside them, and data parallelism beside
tensor parallelism; context parallelism on 2 ranks (CP 1 and 2, each exchange and engine) and on 4 (CP 4, each
exchange: at one sequence the peak falls with CP as planned); and a seeded draw of configurations from the space
those come from; within ±15% per rank.
And whether the loss ran chunked where the plan says it does.

Measured (tests/distributed/memory_runs.py): the model states are the distinct tensor storages reachable from
the runner after the first optimizer step (parameters, gradients, optimizer state, DeepSpeed's partitions;
buffers left out), the activations the largest sum of live storages the second iteration's forward and backward
created (checked after every operator, backward's included; parameters and gradients left out; a DTensor's local
tensor). The layouts of each world size run in one torchrun launch (the drawn configurations in the 2-rank one).
"""

from __future__ import annotations

import json
import os
import random

import pytest

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.memory import loss_is_chunked
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.core.errors import UserError
from tests.launch import REPO, torchrun

SHAPE = ("--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 --micro-batch-size 2 "
         "--hidden-dropout 0 --attention-dropout 0 --num-workers 0 --eval-iters 0 --lr 1e-3 --train-iters 2 "
         "--log-interval 1").split()
# DeepSpeed's bucket buffers are sized by elements, not by the model (reduce buckets of 5·10⁸ elements by default:
# 2 GB per buffer in fp32, which the estimate counts): small buckets here, so that the model's states dominate.
SMALL_BUCKETS = ["--zero-reduce-bucket-size", "100000", "--zero-allgather-bucket-size", "100000"]
LAYERS_DOMINATE = ["--seq-length", "256", "--hidden-size", "128", "--pipeline-model-parallel-size", "2",
                   "--global-batch-size", "4"]
DEEPSEEK = ["--swiglu", "--normalization", "RMSNorm", "--position-embedding-type", "rope", "--disable-bias-linear",
            "--multi-latent-attention", "--qk-layernorm", "--q-lora-rank", "32", "--kv-lora-rank", "24",
            "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8", "--v-head-dim", "16", "--num-experts", "0", "8",
            "--moe-router-topk", "3", "--moe-ffn-hidden-size", "32", "--moe-shared-expert-intermediate-size", "64",
            "--moe-router-score-function", "sigmoid", "--moe-router-enable-expert-bias", "--disable-moe-token-dropping"]
LAYOUTS = {
    "ddp": [],
    # 2 micro-batches per rank: DDP's gradients must stay views into its buckets across accumulation
    "ddp_accumulation": ["--global-batch-size", "8"],
    "zero1": ["--zero-1-memory-optimization", *SMALL_BUCKETS],
    "zero2": ["--zero-2-memory-optimization", *SMALL_BUCKETS],
    "zero3": ["--zero-3-memory-optimization", "--zero-reduce-bucket-size", "100000",
              "--zero-stage3-prefetch-bucket-size", "100000"],
    "fsdp": ["--fsdp-memory-optimization"],
    # 2 micro-batches per rank: FSDP2 keeps whole gradients from the first backward to the last, unsharded
    "fsdp_accumulation": ["--fsdp-memory-optimization", "--global-batch-size", "8"],
    "sdp": ["--oss-sdp-memory-optimization"],
    "oss": ["--oss-memory-optimization"],
    "tp2": ["--tensor-model-parallel-size", "2"],
    "tp2_sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "4"],  # 2 micro-batches in flight
    # one micro-batch and no data parallelism: the last stage's head-weight gradient becomes its .grad (fp32)
    "pp2_one_micro_batch": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "2"],
    "ep2": ["--num-experts", "2", "--expert-model-parallel-size", "2"],
    # bf16 (tiny, so that a CPU without native bf16 runs them too): autocast's 16-bit weight copies and the loss's
    # fp32 copies, under each way of holding the weights (fp32 + autocast, FSDP2's 16-bit blocks, DeepSpeed's
    # 16-bit weights) and both losses (chunked; vocab-parallel under TP)
    "ddp_bf16": ["--bf16"],
    "fsdp_bf16": ["--bf16", "--fsdp-memory-optimization"],
    "zero2_bf16": ["--bf16", "--zero-2-memory-optimization", *SMALL_BUCKETS],
    "tp2_bf16": ["--bf16", "--tensor-model-parallel-size", "2"],
    # experts outside FSDP2's 16-bit units (each rank holds its own: nothing to shard them over) stay fp32 and are
    # copied by autocast beside the 16-bit blocks
    "ep2_fsdp_bf16": ["--bf16", "--num-experts", "2", "--expert-model-parallel-size", "2",
                      "--fsdp-memory-optimization"],
    # Recompute, where the layers' activations are most of a rank's memory (the first of two pipeline stages, no
    # head; seq 256 × hidden 128): what each granularity keeps, and the one layer backward recomputes beside it
    "pp2_recompute_full": [*LAYERS_DOMINATE, "--recompute-granularity", "full"],
    "pp2_recompute_op": [*LAYERS_DOMINATE, "--recompute-granularity", "op"],
    # attention dropout keeps the s × s scores on the CPU (SDPA's math path): selective recompute drops them
    "pp2_selective_attention_dropout": [*LAYERS_DOMINATE, "--attention-dropout", "0.1", "--recompute-activations"],
    # BERT: the masked-LM head over every position (a dense + norm transform, then the tied decoder and the plain
    # loss), the sentence-order head, and its two pipeline stages (the sentence-order loss is refused under PP)
    "bert": ["--model-type", "bert"],
    "bert_pp2": ["--model-type", "bert", "--bert-no-binary-head", *LAYERS_DOMINATE],
    # bf16 under autocast where the layers dominate: the residual stream and the norms' inputs stay fp32; under
    # full recompute the first stage's peak is the word embedding's gradient, made after the layers are freed
    "pp2_bf16": [*LAYERS_DOMINATE, "--bf16"],
    "pp2_bf16_recompute_full": [*LAYERS_DOMINATE, "--bf16", "--recompute-granularity", "full"],
    # today's models: DeepSeek's MLA, fine-grained MoE (routed experts of their own size, a shared expert, dropless
    # sigmoid routing with expert bias) and a multi-token prediction depth after the layers; gpt-oss's sinks
    "deepseek_mtp": [*DEEPSEEK, "--mtp-num-layers", "1"],
    # in bf16 on a CPU the grouped experts pad each expert's rows to bucketed sizes (models/moe.py)
    "deepseek_bf16": [*DEEPSEEK, "--bf16"],
    "gpt_oss": ["--normalization", "RMSNorm", "--position-embedding-type", "rope", "--num-experts", "4",
                "--moe-router-topk", "2", "--disable-moe-token-dropping", "--softmax-type", "learnable",
                "--quick-geglu", "--glu-linear-offset", "1", "--activation-func-clamp-value", "7", "--window-size",
                "15,0",
                "--window-attn-skip-freq", "2"],
}


# On 4 ranks: pipeline stages with data parallelism over each. ZeRO-1/2 there is FSDP2 (DeepSpeed cannot wrap the
# pipelined model), which keeps whole gradients between the micro-batches; TP 2 × PP 2 splits the head by vocabulary
# (and the vocabulary-parallel embedding's backward makes only the rank's rows: whole, the first stage's peak
# would be 1.23× the plan's).
FOUR_RANK_LAYOUTS = {
    "pp2_zero1": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8", "--zero-1-memory-optimization"],
    "tp2_pp2": ["--pipeline-model-parallel-size", "2", "--tensor-model-parallel-size", "2", "--global-batch-size", "4"],
    # plain data parallelism: beside pipeline stages DDP around each stage (gradients accumulate in its buckets);
    # beside tensor parallelism composable replicate(), which keeps a copy of the parameters from forward to
    # backward and accumulates whole gradients apart from .grad (2 micro-batches each)
    "pp2_dp2": ["--pipeline-model-parallel-size", "2", "--global-batch-size", "8"],
    "tp2_dp2": ["--tensor-model-parallel-size", "2", "--global-batch-size", "8"],
}


# Context parallelism (issue 42) on 2 ranks: the sequence (256 tokens, so attention's exchange shows) split in two,
# each exchange's buffers (parallel/context_parallel.py; activations.context_parallel_bytes).
CP2 = ["--context-parallel-size", "2", "--seq-length", "256"]
CONTEXT_PARALLEL_LAYOUTS = {
    "cp2_p2p": [*CP2, "--cp-comm-type", "p2p"],
    "cp2_allgather": [*CP2, "--cp-comm-type", "allgather"],
    "cp2_a2a": [*CP2, "--cp-comm-type", "a2a"],
    # with attention dropout the ring keeps no more: backward draws each block pair's mask again from its seed
    "cp2_p2p_dropout": [*CP2, "--cp-comm-type", "p2p", "--attention-dropout", "0.1"],
    # model state partitioned over data × context ranks (2 here, with data parallel 1)
    "cp2_fsdp": [*CP2, "--fsdp-memory-optimization"],
    "cp2_zero2": [*CP2, "--zero-2-memory-optimization", *SMALL_BUCKETS],
    "cp2_oss": [*CP2, "--cp-comm-type", "a2a", "--oss-memory-optimization"],
    # CP 1 at the same sequence: data parallelism, for the fall with CP (a rank's peak at CP 2 × DP 2 on 4 ranks is
    # CP 2's here: the same tokens and the same replicated model states)
    "cp1_seq256": ["--seq-length", "256"],
}


# Context parallelism at CP 4 (issue 42), in the 4-rank launch above: the same 256-token sequence and micro batch
# of 2 as CP 1 and CP 2 on 2 ranks, each rank holding s/CP tokens of it, so the per-rank peak falls with CP as the
# plan says; each exchange.
CP4 = ["--context-parallel-size", "4", "--seq-length", "256"]
FOUR_RANK_CONTEXT_PARALLEL_LAYOUTS = {
    "cp4_p2p": [*CP4, "--cp-comm-type", "p2p"],
    "cp4_allgather": [*CP4, "--cp-comm-type", "allgather"],
    "cp4_a2a": [*CP4, "--cp-comm-type", "a2a"],
}


def measure(tmp_path_factory, world: int, layouts: dict[str, list[str]]) -> dict:
    out = tmp_path_factory.mktemp("memory")
    runs = {name: SHAPE + flags for name, flags in layouts.items()}
    (out / "runs.json").write_text(json.dumps(runs))
    torchrun(world, REPO / "tests" / "distributed" / "memory_runs.py",
             [str(out / "runs.json"), str(out / "out.json")], warm=True)
    return json.loads((out / "out.json").read_text())


@pytest.fixture(scope="module")
def measured(tmp_path_factory) -> dict:
    """Every 2-rank layout in one launch: the fixed ones, context parallelism's and the drawn configurations of
    every seed (named "seed S: ..."). A launch's start-up (the agent's imports, two ranks' rendezvous and process
    group, DeepSpeed's) was paid three times for the same world size; each run is measured on its own (its model
    states after its own first step, its second iteration's activations), so sharing the launch changes no number."""
    drawn = {f"seed {seed}: {name}": flags for seed in SEEDS for name, flags in drawn_configurations(seed).items()}
    return measure(tmp_path_factory, 2, {**LAYOUTS, **CONTEXT_PARALLEL_LAYOUTS, **drawn})


@pytest.fixture(scope="module")
def measured_on_four_ranks(tmp_path_factory) -> dict:
    return measure(tmp_path_factory, 4, {**FOUR_RANK_LAYOUTS, **FOUR_RANK_CONTEXT_PARALLEL_LAYOUTS})


def planned_memory(flags: list[str], world: int):
    ctx = RunContext(world_size=world)
    args = parse_args(SHAPE + flags)
    rules.validate(args, ctx)
    return from_args(args, ctx)


def check_every_rank(flags: list[str], world: int, name: str, measured: list[dict]) -> None:
    plan = planned_memory(flags, world)
    memory = plan.memory
    stages = len(memory.stage_state_bytes)
    chunked = loss_is_chunked(plan.model, plan.layout, plan.switches)
    for rank, got in enumerate(measured):
        stage = rank * stages // world  # ranks are ordered tensor, data, then pipeline (Megatron's order)
        if stage == stages - 1:  # a rank that computes the loss: the plan knows how
            assert got["chunked_loss"] == chunked, (name, rank, got)
        estimate = memory.stage_state_bytes[stage] + memory.stage_activation_bytes[stage]
        if memory.optimizer_bytes_by_rank:  # OSS: this rank's own share of the optimizer state
            estimate += memory.optimizer_bytes_by_rank[rank] - memory.optimizer_bytes
        real = got["state_bytes"] + got["activation_bytes"]
        detail = (name, rank, got, memory.stage_state_bytes[stage], memory.stage_activation_bytes[stage])
        print(f"{name} rank {rank}: measured / planned {real / estimate:.3f}")  # shown with -s
        assert real == pytest.approx(estimate, rel=0.15), detail


@pytest.fixture(scope="module")
def measured_context_parallel(measured) -> dict:
    return measured  # the 2-rank launch's context-parallel runs


@pytest.mark.parametrize("layout", list(CONTEXT_PARALLEL_LAYOUTS))
def test_context_parallel_peak_memory_per_rank_is_estimated_within_15_percent(measured_context_parallel, layout):
    check_every_rank(CONTEXT_PARALLEL_LAYOUTS[layout], 2, layout, measured_context_parallel[layout])


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_peak_memory_per_rank_is_estimated_within_15_percent(measured, layout):
    check_every_rank(LAYOUTS[layout], 2, layout, measured[layout])


@pytest.mark.parametrize("layout", list(FOUR_RANK_LAYOUTS))
def test_peak_memory_per_rank_on_four_ranks_is_estimated_within_15_percent(measured_on_four_ranks, layout):
    check_every_rank(FOUR_RANK_LAYOUTS[layout], 4, layout, measured_on_four_ranks[layout])


@pytest.mark.parametrize("layout", list(FOUR_RANK_CONTEXT_PARALLEL_LAYOUTS))
def test_context_parallel_peak_memory_on_four_ranks_is_estimated_within_15_percent(measured_on_four_ranks, layout):
    check_every_rank(FOUR_RANK_CONTEXT_PARALLEL_LAYOUTS[layout], 4, layout, measured_on_four_ranks[layout])


@pytest.mark.parametrize("exchange", ["p2p", "allgather", "a2a"])
def test_peak_memory_falls_with_the_context_parallel_size_as_planned(measured_context_parallel,
                                                                     measured_on_four_ranks, exchange):
    """The largest rank's peak at CP 1, 2 and 4 (each exchange; the same sequence and micro batch per rank): measured
    and planned fall together, each step's measured ratio within 15% of the plan's."""
    runs = [(measured_context_parallel, CONTEXT_PARALLEL_LAYOUTS, 2, "cp1_seq256"),
            (measured_context_parallel, CONTEXT_PARALLEL_LAYOUTS, 2, f"cp2_{exchange}"),
            (measured_on_four_ranks, FOUR_RANK_CONTEXT_PARALLEL_LAYOUTS, 4, f"cp4_{exchange}")]
    real = [max(r["state_bytes"] + r["activation_bytes"] for r in measured[name]) for measured, _, _, name in runs]
    planned = [planned_memory(layouts[name], world).memory.peak_bytes_per_rank for _, layouts, world, name in runs]
    print(f"CP 1, 2, 4 ({exchange}) peak per rank (MiB), measured:", [round(x / 2**20, 2) for x in real],
          "planned:", [round(x / 2**20, 2) for x in planned])
    assert real[0] > real[1] > real[2] and planned[0] > planned[1] > planned[2]
    for before, after, plan_before, plan_after in zip(real, real[1:], planned, planned[1:], strict=False):
        assert after / before == pytest.approx(plan_after / plan_before, rel=0.15)


# Drawn: the fixed layouts above are the corners; here a seeded draw of 8 configurations from the space they come
# from (engine × recompute granularity × precision × micro-batches per step × MLP kind × shape × attention dropout),
# run in the fixed layouts' 2-rank launch. CI draws seed 1; MEMORY_SEARCH_SEED=S MEMORY_SEARCH_BATCHES=N searches N
# batches from S (a failure names its configuration). A seeded draw, not Hypothesis: its first examples are its
# simplest, and each example here is a run.
ENGINES = {  # flags (the fixed layout's of that name), data-parallel size on 2 ranks
    **{name: (LAYOUTS[name], 2) for name in ("ddp", "zero1", "zero2", "zero3", "fsdp", "sdp", "oss", "ep2")},
    "tp2": (LAYOUTS["tp2"], 1), "tp2_sp": (LAYOUTS["tp2_sp"], 1),
    "pp2": (["--pipeline-model-parallel-size", "2"], 1),  # the draw sets the global batch
}
RECOMPUTE = {"none": [], "selective": ["--recompute-activations"], "full": ["--recompute-granularity", "full"],
             "op": ["--recompute-granularity", "op"]}
FIRST_SEED = int(os.environ.get("MEMORY_SEARCH_SEED", "1"))
SEEDS = range(FIRST_SEED, FIRST_SEED + int(os.environ.get("MEMORY_SEARCH_BATCHES", "1")))




def drawn_configuration(rng: random.Random) -> tuple[str, list[str]]:
    engine, recompute = rng.choice(sorted(ENGINES)), rng.choice(sorted(RECOMPUTE))
    bf16, micro_batches, swiglu = rng.random() < 0.5, rng.choice([1, 2]), rng.random() < 0.5
    layers_dominate, attention_dropout = rng.random() < 0.5, rng.random() < 0.3
    flags, dp = ENGINES[engine]
    name = " ".join([engine, f"recompute={recompute}", "bf16" if bf16 else "fp32", f"micro-batches={micro_batches}",
                     *(["swiglu"] if swiglu else []), *(["seq256-h128"] if layers_dominate else []),
                     *(["attention-dropout"] if attention_dropout else [])])
    return name, [*flags, *RECOMPUTE[recompute], "--global-batch-size", str(2 * dp * micro_batches),
                  *(["--bf16"] if bf16 else []), *(["--swiglu"] if swiglu else []),
                  *(["--seq-length", "256", "--hidden-size", "128"] if layers_dominate else []),
                  *(["--attention-dropout", "0.1"] if attention_dropout else [])]


def drawn_configurations(seed: int) -> dict[str, list[str]]:
    """The 8 configurations seed `seed` draws (name → flags), skipping combinations the rules refuse."""
    rng, layouts = random.Random(seed), {}
    while len(layouts) < 8:
        name, flags = drawn_configuration(rng)
        try:
            rules.validate(parse_args(SHAPE + flags), RunContext(world_size=2))
        except UserError:  # a combination the rules refuse has no plan to check
            continue
        layouts[name] = flags
    return layouts


@pytest.mark.slow
@pytest.mark.parametrize("seed", SEEDS)
def test_drawn_configurations_are_estimated_within_15_percent(seed, measured):
    layouts = drawn_configurations(seed)
    assert len(layouts) == 8
    for name, flags in layouts.items():
        check_every_rank(flags, 2, f"seed {seed}: {name}", measured[f"seed {seed}: {name}"])
