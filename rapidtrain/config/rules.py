"""The conflict table: one row per rule, each a predicate and a message naming flags, reason and fix.

`validate` reports every violated row at once. `docs/compatibility.md` is generated from this table
(`python -m rapidtrain.config.rules --write-docs`), and a test fails when the file is out of date."""

from __future__ import annotations

import sys

from rapidtrain.config.checks import Args, Rule
from rapidtrain.config.rules_context import CONTEXT_RULES
from rapidtrain.config.rules_layout import LAYOUT_RULES
from rapidtrain.config.rules_training import TRAINING_RULES
from rapidtrain.config.settings import RunContext


class FlagConflict(SystemExit):
    """Raised with every violated rule's message; exits with status 2 when uncaught."""

    def __init__(self, messages: list[str]):
        self.messages = messages
        super().__init__(2)

    def __str__(self) -> str:
        return format_conflicts(self.messages)


def format_conflicts(messages: list[str]) -> str:
    lines = [f"rapidtrain: {len(messages)} problem(s) with the flags:"]
    lines += [f"  - {m}" for m in messages]
    return "\n".join(lines)


# Rapidformer restrictions that reflected its implementation only; rapidtrain lifts them (docs list these).
LIFTED_RESTRICTIONS = (
    "ZeRO partitioning works in every template (Trainer, PreTrainer, Finetuner, Engine.compose), not only Trainer.",
    "3D parallelism works in the PreTrainer and Trainer templates for the built-in models, not only Trainer.",
    "Gradient accumulation also works in epoch-based fine-tuning: accumulation steps = global / (micro × "
    "data-parallel).",
    "The dynamic-shape iterator also serves fine-tuning, not only the PreTrainer.",
    "--mixed-precision works in the black-box command too (it resolves to bf16 where fp16 does not run).",
    "Megatron refuses --rampup-batch-size with --train-iters (its 2024 GPT-3 example passes both); rapidtrain runs "
    "it: the batch ramps by samples consumed, the schedule's horizon is --lr-decay-iters × the final batch.",
    "Megatron's leniencies instead of refusals: --sequence-parallel at --tensor-model-parallel-size 1 is turned "
    "off, --finetune without --load does nothing (each said in the plan).",
)


def violations(args: Args, ctx: RunContext) -> list[str]:
    return [rule.message(args, ctx) for rule in RULES if rule.violated(args, ctx)]


def validate(args: Args, ctx: RunContext) -> None:
    """Raise FlagConflict (exit status 2) listing every violated rule."""
    messages = violations(args, ctx)
    if messages:
        raise FlagConflict(messages)


def exit_on_conflicts(args: Args, ctx: RunContext) -> None:
    """For entry points: print every problem to stderr and exit 2, without a traceback."""
    messages = violations(args, ctx)
    if messages:
        print(format_conflicts(messages), file=sys.stderr)
        raise SystemExit(2)


def compatibility_markdown() -> str:
    """docs/compatibility.md: the switches × switches matrix and each rule in words, from RULES."""
    switches = ["--oss-memory-optimization", "--oss-sdp-memory-optimization", "--fsdp-memory-optimization",
                "--zero-1-memory-optimization", "--zero-2-memory-optimization", "--zero-3-memory-optimization",
                "--cpu-offload", "--tensor-model-parallel-size", "--pipeline-model-parallel-size",
                "--expert-model-parallel-size", "--data-iterator", "--pretrained-model-name-or-path",
                "--fp16", "--bf16"]
    short = {s: s.removeprefix("--").replace("-memory-optimization", "").replace("-model-parallel-size", "")
             for s in switches}
    lines = ["# Compatibility of rapidtrain's switches", "",
             "Generated from `rapidtrain/config/rules.py` by `python -m rapidtrain.config.rules --write-docs`; "
             "do not edit.", "",
             "A cell names the rules that involve both switches (each may hold only under some values, see below);",
             "an empty cell means no rule relates them.", "",
             "| | " + " | ".join(short[s] for s in switches) + " |",
             "|---|" + "---|" * len(switches)]
    for row in switches:
        cells = []
        for col in switches:
            names = [r.name for r in RULES if row != col and row in r.flags and col in r.flags]
            cells.append(", ".join(names))
        lines.append(f"| {short[row]} | " + " | ".join(cells) + " |")
    lines += ["", "## The rules", "", "| rule | flags | in words |", "|---|---|---|"]
    lines += [f"| `{r.name}` | {', '.join(f'`{f}`' for f in r.flags)} | {r.summary} |" for r in RULES]
    lines += ["", "## Rapidformer restrictions that rapidtrain lifts", ""]
    lines += [f"- {text}" for text in LIFTED_RESTRICTIONS]
    return "\n".join(lines) + "\n"


RULES: tuple[Rule, ...] = LAYOUT_RULES + CONTEXT_RULES + TRAINING_RULES


if __name__ == "__main__":
    from pathlib import Path

    target = Path(__file__).resolve().parents[2] / "docs" / "compatibility.md"
    if "--write-docs" in sys.argv:
        target.parent.mkdir(exist_ok=True)
        target.write_text(compatibility_markdown())
        print(f"wrote {target}")
    else:
        print(compatibility_markdown())
