"""The plan's memory model where the CPU memory test's 2-rank layouts cannot reach: which loss a model runs, which
weights a 16-bit run copies, and where FSDP2's gathered parameters sit along a pipeline."""

from __future__ import annotations

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.memory import activation_context
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext

SMALL = ["--num-layers", "8", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32",
         "--max-position-embeddings", "32", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3"]


def plan_of(flags: list[str], world_size: int, entry: str | None = None):
    ctx = RunContext(world_size=world_size)
    args = parse_args(SMALL + flags, entry=entry) if entry else parse_args(SMALL + flags)
    rules.validate(args, ctx)
    plan = from_args(args, ctx)
    return plan, activation_context(plan.model, plan.precision, plan.layout, plan.switches, "cpu")


def test_bert_runs_the_plain_loss_and_gpt_the_chunked_one():
    assert not plan_of([], 1, entry="pretrain_bert")[1].chunked_loss
    assert plan_of([], 1)[1].chunked_loss


def test_fsdp2_over_one_data_parallel_rank_leaves_fp32_weights_to_autocast():
    """FSDP2 applies only over more than one data-parallel rank: with one, every matrix is copied to 16 bits."""
    assert plan_of(["--bf16", "--fsdp-memory-optimization"], 1)[1].weight_copies == "all"
    assert plan_of(["--bf16", "--fsdp-memory-optimization"], 2)[1].weight_copies == "head_and_experts"
    assert plan_of(["--bf16", "--zero-2-memory-optimization"], 2)[1].weight_copies == "none"  # DeepSpeed: 16-bit
    assert plan_of(["--fsdp-memory-optimization"], 2)[1].weight_copies == "none"  # fp32


def test_fsdp2_gathered_root_sits_on_the_first_and_last_pipeline_stages():
    """ZeRO-1 beside 4 pipeline stages is FSDP2 over the data-parallel ranks: the embedding's gathered copy is on
    stage 0, the head's on stage 3, the middle stages hold only their blocks."""
    plan, _ = plan_of(["--zero-1-memory-optimization", "--pipeline-model-parallel-size", "4",
                       "--global-batch-size", "8"], 8)
    first, second, third, last = plan.memory.engine_bytes_by_stage
    assert second == third < min(first, last)
    vocab, h = plan.model.vocab_size, plan.model.hidden_size
    assert first - second >= 4 * vocab * h and last - second >= 4 * vocab * h


def test_with_fewer_micro_batches_than_stages_every_stage_keeps_them_all():
    """GPipe (fewer micro-batches than stages) runs every forward before any backward: the last stage keeps both
    micro-batches, where 1F1B's last stage keeps one."""
    from rapidtrain.config.activations import chunks_in_flight

    flags = ["--pipeline-model-parallel-size", "4", "--hidden-dropout", "0", "--attention-dropout", "0"]
    gpipe, _ = plan_of([*flags, "--global-batch-size", "4"], 4)  # 2 micro-batches over 4 stages
    assert "GPipe" in " ".join(engine.engine for engine in gpipe.engines)
    assert [chunks_in_flight(stage, gpipe.layout, 2) for stage in range(4)] == [2, 2, 2, 2]
    assert [chunks_in_flight(stage, gpipe.layout, 4) for stage in range(4)] == [4, 3, 2, 1]  # 1F1B
