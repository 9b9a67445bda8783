"""Every flag rapidtrain defines is walked: changed from its default (with the flags it needs beside it), it changes
the resolved Plan, or it is refused with a message, or it is listed here with why the Plan cannot show it (it acts
on the launcher or the process, not on the run). A flag accepted and changing nothing would be a silent switch.
Plan resolution only, no training. The flags of the other parsers (config/flag_status.py) are each classified with
their note already (tests/compat/test_flag_surface.py)."""

from __future__ import annotations

import argparse

from rapidtrain.config import rules
from rapidtrain.config.arguments import build_parser, parse_args
from rapidtrain.config.flag_surface import own_flags_help
from rapidtrain.config.job_identity import plan_fields
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext

BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads",
        "4", "--seq-length", "64", "--micro-batch-size", "2", "--tokenizer-type", "NullTokenizer", "--vocab-size",
        "512"]
ROPE = ["--position-embedding-type", "rope"]
YARN = [*ROPE, "--rope-type", "yarn", "--rotary-scaling-factor", "4"]
MOE = ["--num-experts", "4"]
# A flag's change and what it needs beside it to act, where the walk's default change would not show it.
CHANGES: dict[str, list[str]] = {
    "--micro-batch-size": ["--micro-batch-size", "4"],
    "--global-batch-size": ["--global-batch-size", "8"],
    "--min-lr": ["--min-lr", "1e-5"],
    "--rope-type": [*ROPE, "--rope-type", "yarn"],
    "--rotary-scaling-factor": [*ROPE, "--rope-type", "yarn", "--rotary-scaling-factor", "4"],
    "--mscale": [*YARN, "--mscale", "0.5"],
    "--mscale-all-dim": [*YARN, "--mscale-all-dim", "0.5"],
    "--yarn-beta-slow": [*YARN, "--yarn-beta-slow", "2"],
    "--yarn-original-max-position-embeddings": [*YARN, "--yarn-original-max-position-embeddings", "32"],
    "--no-yarn-correction-range-round-to-int": [*YARN, "--no-yarn-correction-range-round-to-int"],
    "--glu-linear-offset": ["--swiglu", "--glu-linear-offset", "1"],
    "--lr-warmup-init": ["--lr-warmup-iters", "2", "--lr-warmup-init", "1e-5"],
    "--lora-dropout": ["--lora-rank", "4", "--lora-dropout", "0.2"],
    "--optimizer": ["--optimizer", "sgd"],
    "--moe-layer-freq": [*MOE, "--moe-layer-freq", "2"],
    "--moe-z-loss-coeff": [*MOE, "--moe-z-loss-coeff", "0.01"],
    "--moe-jitter-eps": [*MOE, "--moe-jitter-eps", "0.01"],
    "--num-mtp-predictor": ["--num-mtp-predictor", "1", "--use-multi-token-prediction"],
    "--decoupled-min-lr": ["--decoupled-lr", "1e-3", "--decoupled-min-lr", "1e-5"],
    "--dataloader-type": ["--dataloader-type", "cyclic"],
    "--bert-no-binary-head": ["--model-type", "bert", "--bert-no-binary-head"],
    "--cpu-offloading": ["--cpu-offloading", "--cpu-offloading-num-layers", "1"],
    "--cpu-offloading-num-layers": ["--cpu-offloading", "--cpu-offloading-num-layers", "1"],
    "--moe-layer-recompute": [*MOE, "--moe-layer-recompute"],
}
# Flags that act on the launcher or the process, which the Plan of the run does not describe.
NOT_THE_RUN = {
    "--nproc-per-node": "the launcher's number of processes (the plan's layout follows the world it starts)",
    "--local-rank": "set by torch.distributed.launch for each process",
    "--debug": "shows tracebacks of user errors",
    "--sequence-parallel": "needs --tensor-model-parallel-size > 1, which one process cannot plan",
    "--cp-comm-type": "needs --context-parallel-size > 1, which one process cannot plan "
                      "(tests/unit/test_context_parallel_plan.py and the rules' tests plan each)",
    "--pipeline-schedule": "needs --pipeline-model-parallel-size > 1, which one process cannot plan "
                           "(tests/unit/test_pipeline_split.py plans each schedule)",
    "--use-mcore-models": "Megatron's implementation choice: rapidtrain has one model (its flag status says so)",
    "--use-legacy-models": "Megatron's implementation choice: rapidtrain has one model (its flag status says so)",
    "--DDP-impl": "both of Megatron's choices are torch DDP (its flag status says so)",
    "--no-contiguous-buffers-in-local-ddp": "torch DDP always buckets (its flag status says so)",
    "--deepspeed": "Megatron-DeepSpeed's switch; the --zero-* switches choose DeepSpeed (its flag status says so)",
    "--ckpt-format": "torch_dist is the only format written (its flag status says so)",
    "--transformer-impl": "rapidtrain's own layers serve both (its flag status says so)",
    "--yarn-correction-range-round-to-int": "the default spelled out (--no-yarn-correction-range-round-to-int "
                                            "changes it, walked above)",
}


def resolved(argv: list[str]) -> dict[str, str] | None:
    """The Plan's fields (the saved flags aside, which record every flag by construction); None when refused."""
    try:
        args = parse_args(argv)
        if rules.violations(args, RunContext()):
            return None
        plan = from_args(args, RunContext())
    except (SystemExit, Exception):  # noqa: BLE001 - refused with its message (exit 2 or a UserError)
        return None
    fields = {name: value for name, value in plan_fields(plan).items() if not name.startswith("checkpoint.flags.")}
    # A flag that changes nothing here and says so: the plan's note naming it ("--recompute-method ...: no effect
    # here; ..."), which plan_fields leaves out as derived.
    fields["notes"] = " ".join(note for note in plan.notes if "no effect" in note)
    return fields


def changed_value(action: argparse.Action) -> list[str] | None:
    flag = action.option_strings[0]
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        return [flag]
    if action.choices:
        others = [choice for choice in action.choices if choice != action.default]
        return [flag, str(others[0])] if others else None
    if action.type is int or (isinstance(action.default, int) and not isinstance(action.default, bool)):
        return [flag, str((action.default if isinstance(action.default, int) else 1) + 3)]
    if action.type is float or isinstance(action.default, float):
        return [flag, str((action.default if isinstance(action.default, float) else 1.0) * 0.5 + 0.125)]
    return None  # strings and paths: their flags read files (their own tests give them real ones)


def test_every_flag_changes_the_plan_or_is_refused_or_says_why_not():
    parser = build_parser()
    own = own_flags_help(parser)
    base = resolved(BASE)
    assert base is not None
    silent = []
    for action in parser._actions:
        if not action.option_strings or action.option_strings[0] not in own or action.option_strings[0] in NOT_THE_RUN:
            continue
        flag = action.option_strings[0]
        change = CHANGES.get(flag) or changed_value(action)
        if change is None:
            continue
        after = resolved(BASE + change)
        if after == base or (after is not None and {**after, "notes": ""} == {**base, "notes": ""}
                             and flag not in after["notes"]):
            silent.append(" ".join(change))
    assert not silent, f"accepted, and the Plan does not change: {silent}"
