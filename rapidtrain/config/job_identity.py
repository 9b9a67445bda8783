"""What makes two ranks' runs the same run, and a resume the same data: the Plan flattened into named fields, and
the identity of the files the data and tokenizer settings name.

Pure (it reads file sizes, as the flags' meanings read files; it starts nothing): the engine compares these fields
across the ranks of a job (train/agreement.py), and a checkpoint records the data part so that a resume can say what
changed under it (checkpoint/data_record.py).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from rapidtrain.config.settings import Plan

# Plan fields that follow from the others (estimates, the messages about them): compared, they would only repeat a
# difference already named, or add float noise.
DERIVED_FIELDS = frozenset({"memory", "estimate", "warnings", "notes"})
# What each node chooses for itself from its own hardware, which may differ in one job (nodes with different core
# counts): the CPU threads per rank (config/resolve.py's cpu_threads) and the plan's line that says why.
PER_NODE_FIELDS = frozenset({"switches.cpu_threads"})
PER_NODE_ENGINE_CHOICES = frozenset({"CPU threads"})


def flatten(value: Any, prefix: str, into: dict[str, str]) -> None:
    """`value`'s leaves as "a.b.c" → repr, dataclasses and mappings walked, sequences of leaves kept whole."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            flatten(getattr(value, field.name), f"{prefix}.{field.name}" if prefix else field.name, into)
    elif isinstance(value, dict):
        for key in sorted(value, key=str):
            flatten(value[key], f"{prefix}.{key}" if prefix else str(key), into)
    else:
        into[prefix] = repr(value)


def plan_fields(plan: Plan) -> dict[str, str]:
    """The Plan as named fields ("data.micro_batch_size" → "4"), derived estimates and each node's own hardware
    choices left out."""
    fields: dict[str, str] = {}
    for field in dataclasses.fields(plan):
        value = getattr(plan, field.name)
        if field.name == "engines":
            value = tuple(choice for choice in value if choice.switch not in PER_NODE_ENGINE_CHOICES)
        if field.name not in DERIVED_FIELDS:
            flatten(value, field.name, fields)
    return {name: text for name, text in fields.items() if name not in PER_NODE_FIELDS}


def _strings(value: Any) -> list[str]:
    """Every string held by a settings value (paths among them), in order."""
    if isinstance(value, str):
        return [value]
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return [s for field in dataclasses.fields(value) for s in _strings(getattr(value, field.name))]
    if isinstance(value, dict):
        return [s for item in value.values() for s in _strings(item)]
    if isinstance(value, list | tuple):
        return [s for item in value for s in _strings(item)]
    return []


def data_files(plan: Plan, with_mtime: bool = False) -> dict[str, str]:
    """The files the data and tokenizer settings name (a Megatron prefix's .bin and .idx, a vocabulary, a JSON
    file) → their size in bytes (and modification time when `with_mtime`: a copy on another node has its own, so
    ranks compare sizes only, while a resume on the same file system compares both)."""
    files: dict[str, str] = {}
    for text in _strings(plan.data) + _strings(plan.tokenizer):
        for path in (text, text + ".bin", text + ".idx"):
            if path in files or not os.path.isfile(path):
                continue
            stat = os.stat(path)
            files[path] = f"{stat.st_size} bytes" + (f", modified {int(stat.st_mtime)}" if with_mtime else "")
    return files


def job_fields(plan: Plan) -> dict[str, str]:
    """What every rank of a job must agree on: the plan's fields and the sizes of the data files it reads."""
    return plan_fields(plan) | {f"file {path}": identity for path, identity in data_files(plan).items()}
