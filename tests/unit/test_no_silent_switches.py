"""No silent switches (issue 44 item 6): what --fp16 does on a CPU, what --lr means to --optimizer adafactor, which
--optimizer choices may be refused, and what ZeRO does in one process are said where users look (the plan's
warnings and engine lines, --help)."""

from __future__ import annotations

from rapidtrain.config import rules
from rapidtrain.config.arguments import build_parser, parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext

BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2"]


def plan_for(flags: list[str], ctx: RunContext | None = None):
    ctx = ctx or RunContext()
    args = parse_args(BASE + flags)
    rules.validate(args, ctx)
    return from_args(args, ctx)


def test_fp16_on_a_cpu_warns_of_its_speed_and_the_skipped_first_iterations():
    warnings = plan_for(["--fp16"]).warnings
    assert any("--fp16 on a CPU" in w and "2^32 (--initial-loss-scale)" in w and "skipped" in w for w in warnings)
    assert not any("--fp16 on a CPU" in w for w in plan_for([]).warnings)
    assert not any("--fp16 on a CPU" in w for w in plan_for(["--fp16"], RunContext(device_type="cuda")).warnings)


def test_adafactor_says_what_lr_means_in_the_plan_and_in_help():
    text = describe_plan(plan_for(["--optimizer", "adafactor"]))
    assert "--lr is relative to the weights' size" in text and "Hugging Face Trainer's Adafactor" in text
    help_text = " ".join(build_parser().format_help().split())
    assert "unlike Hugging Face Trainer's Adafactor, whose --lr is the step itself" in help_text
    assert "refused, naming why, where neither serves the layout and device" in help_text


def test_zero_in_one_data_parallel_rank_says_it_partitions_nothing():
    one = describe_plan(plan_for(["--zero-2-memory-optimization"]))
    assert "one data-parallel rank: nothing is partitioned" in one
    two = describe_plan(plan_for(["--zero-2-memory-optimization", "--global-batch-size", "4"],
                                 RunContext(world_size=2)))
    assert "nothing is partitioned" not in two
