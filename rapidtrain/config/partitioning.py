"""The optimizer-state partitioning switches (Rapidformer's --*-memory-optimization flags) in one table, read by
the flags, the rules and the plan; the rules refuse more than one."""

from __future__ import annotations

import argparse
from typing import Literal

# Flag destination → the plan's name for it (Switches.partitioning), in the order the first one set is chosen.
PARTITIONING_SWITCHES: dict[str, Literal["oss", "sdp", "fsdp", "zero-1", "zero-2", "zero-3"]] = {
    "oss_memory_optimization": "oss",
    "oss_sdp_memory_optimization": "sdp",
    "fsdp_memory_optimization": "fsdp",
    "zero_1_memory_optimization": "zero-1",
    "zero_2_memory_optimization": "zero-2",
    "zero_3_memory_optimization": "zero-3",
}


def chosen_partitioning(args: argparse.Namespace) -> list[str]:
    """The destinations of the partitioning switches set, in table order."""
    return [dest for dest in PARTITIONING_SWITCHES if getattr(args, dest)]


def zero_stage(args: argparse.Namespace) -> int:
    """The ZeRO stage of --zero-N-memory-optimization (the highest set), 0 for none."""
    for stage in (3, 2, 1):
        if getattr(args, f"zero_{stage}_memory_optimization"):
            return stage
    return 0
