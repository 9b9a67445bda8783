"""The optimizer-state partitioning switches (Rapidformer's --*-memory-optimization flags) in one table, read by
the flags, the rules and the plan (the rules refuse more than one); which engine serves ZeRO, and the DeepSpeed
config file that may choose the stage."""

from __future__ import annotations

import argparse
from typing import Any, Literal

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


def zero_by_fsdp2(args: argparse.Namespace) -> bool:
    """ZeRO-1/2 served by FSDP2 over the data-parallel dimension instead of DeepSpeed: DeepSpeed's engine can
    neither wrap tensor-parallel DTensors or pipeline stages, nor reduce expert slices that differ from one
    expert-parallel rank to the next over their own group."""
    return (args.tensor_model_parallel_size > 1 or args.pipeline_model_parallel_size > 1
            or args.expert_model_parallel_size > 1)


def read_user_config(path: str) -> dict[str, Any]:
    """The JSON object of --deepspeed_config FILE (plain data: nothing in it runs); ValueError names the file."""
    import json
    from pathlib import Path

    try:
        config = json.loads(Path(path).read_text())
    except OSError as error:
        raise ValueError(f"--deepspeed_config {path}: cannot read it ({error.strerror or error}). Give the path "
                         "of a DeepSpeed JSON config.") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"--deepspeed_config {path}: not valid JSON ({error}).") from None
    if not isinstance(config, dict):
        raise ValueError(f"--deepspeed_config {path}: a DeepSpeed config is a JSON object, not "
                         f"{type(config).__name__}.")
    return config
