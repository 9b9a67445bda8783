"""Every command line Pai-Megatron-Patch's 2025-26 Megatron-Core launch scripts produce (tests/compat/pai_sweep.json:
each script run by bash with a recording torchrun, for every model size of its case block, pretraining and SFT on
idxmap and raw JSON data, and each value of its precision, recompute, offload and parallel switches), changed only in
their paths: `rapidtrain plan` with the scripts' own sizes and world size either plans, saying what each of their
flags does, or stops with exit status 2 naming the flag and why. No traceback, nothing accepted and ignored."""

from __future__ import annotations

import re
import time
import traceback
from collections import Counter, defaultdict

import pytest

from rapidtrain.config.arguments import build_parser
from rapidtrain.config.flag_surface import classify, own_flags_help
from tests.compat.launch_data import Planned, localize, plan
from tests.compat.pai_sweep import family, scripts

SCRIPTS = scripts()


def _plan(script: dict, local_files) -> Planned:
    try:
        return plan(script, localize(script, local_files))
    except Exception:  # noqa: BLE001 - a crash is a finding: the test names it with its traceback
        return Planned(1, traceback.format_exc())


def reason(result: Planned) -> str:
    """What stopped a plan: the first flag its message names (or the message's start)."""
    if result.status == 1:
        return "crash: " + result.output.strip().splitlines()[-1][:120]
    lines = [line for line in result.output.splitlines() if line.strip()]
    start = next((i for i, line in enumerate(lines) if line.startswith(("error", "rapidtrain"))), 0)
    message = " ".join(lines[start:start + 3])
    flag = re.search(r"--[a-z0-9][a-z0-9_-]+(?: [\w.]+)?", message)
    return flag.group(0) if flag else message[:100]


@pytest.fixture(scope="module")
def planned(local_files):
    started = time.process_time()
    out = {script["id"]: _plan(script, local_files) for script in SCRIPTS}
    print(f"\n{len(out)} plans in {time.process_time() - started:.1f} CPU-s")
    return out


OWN = own_flags_help(build_parser())


def _unnoted(script: dict, result: Planned) -> list[str]:
    flags = {token for token in script["argv"] if token.startswith("--")}
    return sorted(flag for flag in flags if (t := classify(flag, OWN)) is not None and t.status == "no_effect"
                  and flag not in result.output)


def test_report(planned):
    by_reason: Counter = Counter()
    by_family: dict[str, Counter] = defaultdict(Counter)
    for script in SCRIPTS:
        result = planned[script["id"]]
        kind = ("plans" if result.status == 0 else "crash" if result.status == 1 else "refused")
        if result.status == 0 and _unnoted(script, result):
            kind = "ignored"
        by_family[family(script)][kind] += 1
        if result.status != 0:
            by_reason[reason(result)] += 1
        elif kind == "ignored":
            by_reason["ignored: " + " ".join(_unnoted(script, result))] += 1
    for name, counts in sorted(by_family.items()):
        print(f"{name:14} " + " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    for text, count in by_reason.most_common():
        print(f"{count:4}  {text}")


def test_examples(planned):
    shown = set()
    for script in SCRIPTS:
        result = planned[script["id"]]
        if result.status != 0 and reason(result) not in shown:
            shown.add(reason(result))
            print(f"\n===== {script['id']} [{script['args']}] {script['env']}\n{result.output[-1500:]}")


def test_all_lines(planned):
    lines: Counter = Counter()
    fams: dict = defaultdict(set)
    for script in SCRIPTS:
        result = planned[script["id"]]
        if result.status == 0:
            continue
        for line in result.output.splitlines():
            if line.startswith(("  -", "  --", "rapidtrain: error")):
                key = re.sub(r"\d+", "N", line.strip())[:150]
                lines[key] += 1
                fams[key].add(family(script))
    for text, count in lines.most_common():
        print(f"{count:4} {text}  {sorted(fams[text])}")
