"""tests/compat/pai_sweep.json read back: every command line Pai-Megatron-Patch's 2025-26 Megatron-Core launch scripts
hand to torchrun (tests/compat/pai_sweep_extract.py ran each script with a recording torchrun), as launch scripts of
launch_data's shape, so that launch_data.localize and plan take them as they take tests/compat/launch_scripts.json."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

_DATA = json.loads(Path(__file__).with_name("pai_sweep.json").read_text())
HEADER, RUNS = _DATA[0], _DATA[1:]


def expand() -> list[dict]:
    """Each run with its argv whole (the file keeps a script's later argvs as edits of its first)."""
    first: dict[str, list[str]] = {}
    out = []
    for run in RUNS:
        if "argv" in run:
            first[run["script"]] = run["argv"]
            out.append(run)
            continue
        argv = list(first[run["script"]])
        for start, end, tokens in reversed(run["edits"]):
            argv[start:end] = tokens
        out.append({**{k: v for k, v in run.items() if k != "edits"}, "argv": argv})
    return out


def _id(run: dict, seen: Counter) -> str:
    family = run["script"].split("/")[1]
    name = Path(run["script"]).stem.removeprefix("run_")
    words = run["args"].split()
    size = next((w for w in words[1:4] if re.fullmatch(r"[A\d][\w.]*B|\d+x\d+B", w)), "")
    mode = ("raw" if run["env"].get("MP_DATASET_TYPE") == "raw"
            else "sft" if "--train-mode" in run["argv"] and "finetune" in run["argv"] else "pt")
    base = "-".join(part for part in (family, name, size, mode) if part)
    seen[base] += 1
    return base if seen[base] == 1 else f"{base}-{seen[base]}"


def scripts() -> list[dict]:
    """The runs as launch_data's scripts: id, launcher, launcher_argv, entry, argv (placeholders as there)."""
    seen: Counter = Counter()
    out = []
    for run in expand():
        out.append({"id": _id(run, seen), "origin": HEADER["source"], "path": run["script"], "commit": HEADER["commit"],
                    "date": HEADER["dates"][run["script"]], "launcher": "torchrun",
                    "launcher_argv": run["launcher_argv"], "entry": run["entry"], "features": [],
                    "argv": run["argv"], "deepspeed_config": None, "args": run["args"], "env": run["env"]})
    return out


def family(script: dict) -> str:
    return script["path"].split("/")[1]
