"""Pipeline splits and schedules in the plan (config/pipeline_split.py): every layer placed once, in order, as many
on each stage as the flags ask (Megatron-LM's uneven first/last stages and embedding/loss accounting, Megatron-Core's
layout string, DeepSpeed's partition methods with DeepSpeed's own functions as the oracle), impossible splits
refused naming flags and numbers, BLOOM-176B's 70 layers over 12 stages planned, and each schedule's bubble."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.pipeline_split import (
    SplitError,
    balanced_boundaries,
    bubble_fraction,
    deepspeed_split,
    deepspeed_units,
    layout_split,
    megatron_split,
    parse_layout,
    rank_of_stage,
    stages_of_rank,
    uniform_boundaries,
)
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import DeviceCapability, Layout, RunContext
from rapidtrain.parallel.pipeline import stage_layers

SMALL = ["--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "32", "--max-position-embeddings", "32",
         "--micro-batch-size", "1", "--train-iters", "2", "--lr", "1e-3"]


def plan_of(flags: list[str], world_size: int):
    ctx = RunContext(world_size=world_size)
    args = parse_args(SMALL + flags)
    rules.validate(args, ctx)
    return from_args(args, ctx)


def refusal(flags: list[str], world_size: int) -> str:
    with pytest.raises(rules.FlagConflict) as stopped:
        rules.validate(parse_args(SMALL + flags), RunContext(world_size=world_size))
    assert stopped.value.code == 2
    return str(stopped.value)


def placed_once_in_order(split: tuple[int, ...], num_layers: int) -> None:
    names = [name for stage in stage_layers(split) for name in stage]
    assert names == [str(i) for i in range(num_layers)]


# ---- Megatron-LM ----


@settings(max_examples=300, deadline=None)
@given(pipeline=st.integers(2, 16), virtual=st.integers(1, 4), middle=st.integers(0, 6), first=st.integers(0, 12),
       last=st.integers(0, 12), which=st.sampled_from(["first", "last", "both"]))
def test_first_and_last_stage_sizes_place_every_layer_once(pipeline, virtual, middle, first, last, which):
    """Megatron's uneven split: the first (last) rank holds the given layers over its virtual stages equally, every
    middle rank the same share of the rest; stages in model order are chunk-major (stage = chunk·P + rank)."""
    first, last = first * virtual, last * virtual
    given_first, given_last = (first if which != "last" else None), (last if which != "first" else None)
    middles = pipeline - (given_first is not None) - (given_last is not None)
    num_layers = (given_first or 0) + (given_last or 0) + middles * middle * virtual
    split = megatron_split(num_layers, pipeline, virtual, first=given_first, last=given_last)
    assert len(split) == pipeline * virtual and sum(split) == num_layers
    placed_once_in_order(split, num_layers)
    per_rank = [sum(split[c * pipeline + r] for c in range(virtual)) for r in range(pipeline)]
    assert per_rank[0] == (given_first if given_first is not None else middle * virtual)
    assert per_rank[-1] == (given_last if given_last is not None else middle * virtual)
    assert set(per_rank[1:-1]) <= {middle * virtual}
    for rank in range(pipeline):  # each virtual stage of a rank alike
        assert len({split[c * pipeline + rank] for c in range(virtual)}) == 1


def test_first_last_and_accounting_as_megatron():
    assert megatron_split(61, 8, first=5) == (5, 8, 8, 8, 8, 8, 8, 8)  # DeepSeek-V3's
    assert megatron_split(10, 4, first=1, last=3) == (1, 3, 3, 3)
    assert megatron_split(8, 2, 2, first=2) == (1, 3, 1, 3)  # first rank: 2 layers over 2 chunks
    # embedding and loss as layers: 6 + 2 over 4 ranks × 2 chunks, one fewer on the first and the last stage
    assert megatron_split(6, 4, 2, embedding=True, loss=True) == (0, 1, 1, 1, 1, 1, 1, 0)
    assert megatron_split(31, 4, embedding=True) == (7, 8, 8, 8)
    assert megatron_split(31, 4, loss=True) == (8, 8, 8, 7)


@pytest.mark.parametrize(("call", "words"), [
    (lambda: megatron_split(62, 8, first=5), "--decoder-first-pipeline-num-layers 5 leave 57 of --num-layers 62 "
                                             "for the other 7 pipeline ranks"),
    (lambda: megatron_split(70, 12), "--num-layers 70 is not divisible by --pipeline-model-parallel-size 12"),
    (lambda: megatron_split(31, 4, embedding=True, loss=True), "--num-layers 31 + 1 (embedding) + 1 (loss) = 33"),
    (lambda: megatron_split(12, 4, 2, first=3), "pipeline rank 0 holds 3 layers, not divisible by its 2 virtual"),
    (lambda: megatron_split(12, 4, first=3, embedding=True), "cannot be combined"),
])
def test_impossible_megatron_splits_name_flags_and_numbers(call, words):
    with pytest.raises(SplitError) as refused:
        call()
    assert words in str(refused.value)


# ---- Megatron-Core's layout string ----


def test_layout_string_grammar():
    assert parse_layout("Et*3|(tt|)*2,m|L") == ["Ettt", "tt", "tt", "m", "L"]
    assert parse_layout("E(t|)*2tL") == ["Et", "t", "tL"]
    assert layout_split("Et*2|(tt|)*5t|tmL", 4, 14, 1) == (2, 2, 2, 2, 2, 2, 1, 1)  # Megatron's DeepSeek proxy
    assert layout_split("E|t*4|t*4|L", 2, 8) == (0, 4, 4, 0)  # embedding and loss stages of their own


@pytest.mark.parametrize(("layout", "pipeline", "layers", "words"), [
    ("Ett|ttL", 2, 5, "places 4 transformer layers (t), but --num-layers is 5"),
    ("Ett|tt|tL", 2, 5, "has 3 stages, not a multiple of --pipeline-model-parallel-size 2"),
    ("tEt|tL", 2, 3, "the embedding E must appear once, first"),
    ("Ett|Lt", 2, 3, "the loss L must appear once, last"),
    ("Ett||tL", 3, 3, "stage(s) 1 hold nothing"),
    ("Etx|tL", 2, 2, "unknown part(s) 'x'"),
    ("Etm|tL", 2, 2, "places 1 MTP depths (m), but --mtp-num-layers is 0"),
])
def test_impossible_layouts_are_refused(layout, pipeline, layers, words):
    with pytest.raises(SplitError) as refused:
        layout_split(layout, pipeline, layers)
    assert words in str(refused.value) and "--pipeline-model-parallel-layout" in str(refused.value)


def test_mtp_depths_must_sit_on_the_last_stage():
    assert layout_split("Ett|ttmL", 2, 4, 1) == (2, 2)
    with pytest.raises(SplitError, match="MTP depths"):
        layout_split("Ettm|ttL", 2, 4, 1)


# ---- DeepSpeed's PipelineModule partitioning, DeepSpeed's own functions the oracle ----


@settings(max_examples=400, deadline=None)
@given(weights=st.lists(st.integers(0, 9), min_size=1, max_size=40), parts=st.integers(1, 12))
def test_balanced_partition_is_deepspeeds(weights, parts):
    from deepspeed.runtime.utils import partition_balanced, partition_uniform

    assert balanced_boundaries(weights, parts) == [int(b) for b in partition_balanced(weights, parts)]
    assert uniform_boundaries(len(weights), parts) == list(partition_uniform(len(weights), parts))


@settings(max_examples=200, deadline=None)
@given(num_layers=st.integers(1, 90), pipeline=st.integers(2, 12), tied=st.booleans(),
       method=st.sampled_from(["uniform", "type:transformer", "type:transformer|embedding", "parameters"]))
def test_deepspeed_methods_place_every_layer_once(num_layers, pipeline, tied, method):
    units = deepspeed_units(num_layers, tied=tied, rmsnorm=False, sixteen_bit=True, embedding_parameters=4096,
                            layer_parameters=[1000] * num_layers, norm_parameters=64, head_parameters=4096)
    try:
        split = deepspeed_split(method, units, pipeline)
    except SplitError as refused:  # too few layers for the stages, or the embedding off the first stage
        assert "--pp-partition-method" in str(refused)
        return
    assert len(split) == pipeline and sum(split) == num_layers
    placed_once_in_order(split, num_layers)


def test_bloom_counts_its_embeddings_as_layers():
    """BigScience's --pp-partition-method 'type:transformer|embedding': 70 layers + 2 embeddings (the tied head
    is an EmbeddingPipe) = 12 × 6, so the first and the last stage hold 5 transformer layers."""
    units = deepspeed_units(70, tied=True, rmsnorm=False, sixteen_bit=True)
    assert deepspeed_split("type:transformer|embedding", units, 12) == (5,) + (6,) * 10 + (5,)
    assert deepspeed_split("type:transformer", units, 12) == (6,) * 10 + (5, 5)
    with pytest.raises(SplitError, match="matches none of the model's layers"):
        deepspeed_split("type:mamba", units, 12)
    with pytest.raises(SplitError, match="DeepSpeed's methods are uniform"):
        deepspeed_split("profile", units, 12)


def test_bloom_176b_plans_with_its_sizes():
    """70 layers, hidden 14336, 112 heads, TP 4 × PP 12 on 384 GPUs: the plan prints each rank's layers."""
    flags = ["--num-layers", "70", "--hidden-size", "14336", "--num-attention-heads", "112", "--seq-length", "2048",
             "--max-position-embeddings", "2048", "--tensor-model-parallel-size", "4",
             "--pipeline-model-parallel-size", "12", "--pp-partition-method", "type:transformer|embedding",
             "--global-batch-size", "2048", "--micro-batch-size", "2", "--bf16", "--train-iters", "2", "--lr", "1e-4"]
    ctx = RunContext(world_size=384)
    args = parse_args(flags)
    rules.validate(args, ctx)
    planned = from_args(args, ctx)
    assert planned.layout.stage_layers == (5,) + (6,) * 10 + (5,)
    text = describe_plan(planned)
    assert "rank 0: stage 0 embedding + layers 0–4 (5)" in text
    assert "rank 11: stage 11 layers 65–69 + head (5)" in text
    assert "1F1B, 128 micro-batches over 12 ranks" in text
    # the uneven split's memory: the first and last ranks hold one layer fewer beside the embedding / head
    states = planned.memory.stage_state_bytes
    assert states[1] == states[5] and states[0] != states[1]


# ---- the plan and the rules ----


def test_plan_prints_each_stage_with_virtual_stages_and_accounting():
    planned = plan_of(["--num-layers", "6", "--pipeline-model-parallel-size", "4",
                       "--num-virtual-stages-per-pipeline-rank", "2", "--account-for-embedding-in-pipeline-split",
                       "--account-for-loss-in-pipeline-split", "--global-batch-size", "4"], 4)
    assert planned.layout.stage_layers == (0, 1, 1, 1, 1, 1, 1, 0)
    text = describe_plan(planned)
    assert "rank 0: stage 0 embedding (0), stage 4 layer 3 (1)" in text
    assert "rank 3: stage 3 layer 2 (1), stage 7 head (0)" in text
    assert "interleaved 1F1B, 2 model chunks per rank" in text


def test_v_schedules_put_stages_r_and_2p_minus_1_minus_r_on_rank_r():
    assert stages_of_rank(0, 4, 2, "zbv") == [0, 7] and stages_of_rank(3, 4, 2, "dualpipev") == [3, 4]
    assert [rank_of_stage(s, 4, "zbv") for s in range(8)] == [0, 1, 2, 3, 3, 2, 1, 0]
    assert stages_of_rank(1, 4, 2, "1f1b") == [1, 5] and rank_of_stage(5, 4, "1f1b") == 1
    planned = plan_of(["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
                       "--global-batch-size", "4"], 2)
    assert planned.layout.virtual_pipeline_stages == 2 and planned.layout.layers_per_rank(8) == [4, 4]
    text = describe_plan(planned)
    assert "rank 0: stage 0 embedding + layers 0–1 (2), stage 3 layers 6–7 + head (2)" in text
    assert "zero bubble V (ZBV), 2 stages per rank in a V" in text
    # memory: rank 0 holds the embedding and the head (sharing the tied weight), rank 1 layers alone
    assert planned.layout.head_rank() == 0
    states = planned.memory.stage_state_bytes
    one_f_one_b = plan_of(["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "4"], 2)
    assert states[1] < states[0] and states[1] < min(one_f_one_b.memory.stage_state_bytes)


@pytest.mark.parametrize(("flags", "title"), [
    (["--enable-zbh1-pipeline", "--enable-zbh1-exact-semantics"], "zero bubble ZB-H1"),
    (["--pipeline-schedule", "zero-bubble", "--num-layers-per-virtual-pipeline-stage", "2"],
     "interleaved zero bubble (ZB1P), 2 model chunks per rank"),
    (["--pipeline-schedule", "dualpipev"], "DualPipeV"),
    (["--pipeline-schedule", "gpipe"], "GPipe"),
])
def test_each_schedule_is_named_in_the_plan_with_its_bubble(flags, title):
    planned = plan_of(["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--global-batch-size", "8",
                       *flags], 2)
    engine = next(e.engine for e in planned.engines if e.switch == "--pipeline-model-parallel-size")
    assert title in engine and "bubble" in engine


def test_bubble_fractions():
    assert bubble_fraction("1f1b", 4, 8) == pytest.approx(3 / 8)
    assert bubble_fraction("1f1b", 4, 8, 2) == pytest.approx(3 / 16)
    assert bubble_fraction("zero-bubble", 4, 8) == pytest.approx(3 / 24)  # ZB-H1: a third of 1F1B's
    assert bubble_fraction("zbv", 4, 8, 2) == pytest.approx(3 / 48)
    assert bubble_fraction("dualpipev", 4, 4, 2) == pytest.approx(3 / 8)  # too few micro-batches to fill it
    assert bubble_fraction("1f1b", 1, 8) == 0.0


def test_step_time_uses_the_schedules_bubble():
    """config/estimate.py's step time on an H100 counts the schedule's bubble: zero bubble's is a third of 1F1B's."""
    flags = ["--num-layers", "8", "--pipeline-model-parallel-size", "4", "--global-batch-size", "16"]
    ctx = RunContext(4, "cuda", None, DeviceCapability(name="H100 SXM"))
    bubbles = {}
    for schedule in ("1f1b", "zero-bubble"):
        estimate = from_args(parse_args(SMALL + flags + ["--pipeline-schedule", schedule]), ctx).estimate
        assert estimate is not None and not estimate.reason
        bubbles[schedule] = next(seconds for name, seconds in estimate.parts if name.startswith("pipeline bubble"))
    assert bubbles["zero-bubble"] == pytest.approx(bubbles["1f1b"] / 3)


@pytest.mark.parametrize(("flags", "words"), [
    (["--num-layers", "7", "--pipeline-model-parallel-size", "2", "--decoder-first-pipeline-num-layers", "2",
      "--decoder-last-pipeline-num-layers", "3"], "--decoder-first-pipeline-num-layers 2 + "
                                                  "--decoder-last-pipeline-num-layers 3 ≠ --num-layers 7"),
    (["--num-layers", "8", "--decoder-first-pipeline-num-layers", "2"], "need --pipeline-model-parallel-size ≥ 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-model-parallel-layout", "Et*4|t*4L",
      "--pp-partition-method", "uniform"], "give one of them"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--decoder-first-pipeline-num-layers", "2"], "give --pipeline-model-parallel-layout instead"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zero-bubble",
      "--tensor-model-parallel-size", "2"], "--pipeline-schedule zero-bubble with --tensor-model-parallel-size 2 "
                                            "and data-parallel size 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--enable-zbh1-pipeline", "--torch-compile"],
     "drop --torch-compile"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--position-embedding-type", "rope", "--mtp-num-layers", "1"], "choose --pipeline-schedule 1f1b"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--enable-zbh1-exact-semantics"],
     "--enable-zbh1-exact-semantics tunes the zero-bubble schedule"),
    (["--num-layers", "8", "--pipeline-schedule", "zbv"], "needs --pipeline-model-parallel-size ≥ 2"),
    (["--num-layers", "8", "--pipeline-model-parallel-size", "2", "--pipeline-schedule", "zbv",
      "--num-virtual-stages-per-pipeline-rank", "4"], "runs exactly two stages per pipeline rank"),
])
def test_the_rules_refuse_what_cannot_run(flags, words):
    world = 8 if "--tensor-model-parallel-size" in flags else 2
    assert words in refusal(flags + ["--global-batch-size", "8"], world)


def test_layout_records_the_split_only_where_it_is_possible():
    assert Layout(2, 1, 1, 2).layers_of_stage(1, 8) == range(4, 8)  # the even split before any was recorded
    assert Layout(2, 1, 1, 2, 1, 2, False, (1, 3, 3, 1)).layers_per_rank(8) == [4, 4]
    assert Layout(2, 1, 1, 2, 1, 2, False, (1, 3, 3, 1), "zbv").layers_per_rank(8) == [2, 6]
