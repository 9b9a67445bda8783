"""One configuration per job: every rank's resolved Plan and data files compared in one collective at start.

A launch script copied to each node and edited on one (another --micro-batch-size, --seq-length, data path) would
otherwise train to the end, each rank doing its own arithmetic, with exit 0. Each rank all-gathers a digest of its
fields (config/job_identity.py) with its host name; equal digests cost that one collective. On a difference every
rank gathers the fields themselves (all of them take this second step, since all saw the difference) and stops with
the same message: the field, each value and the ranks and hosts that hold it.
"""

from __future__ import annotations

import hashlib
import json
import socket

import torch.distributed as dist

from rapidtrain.config.job_identity import job_fields
from rapidtrain.config.settings import Plan
from rapidtrain.core.errors import UserError

SHOWN_FIELDS = 10  # a difference in one flag shows in several derived fields; the first few name it
# The flags as given, saved for checkpoints: they repeat what the resolved fields say, so they are listed after them.
FLAGS_PREFIX = "checkpoint.flags."


class ConfigurationMismatch(UserError):
    """The ranks of one job resolved different configurations."""


def digest_of(fields: dict[str, str]) -> str:
    return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()


def ranks_in_words(ranks: list[int], hosts: list[str]) -> str:
    """'ranks 0, 2 (host a)' or 'rank 1 (hosts b)': which processes and where."""
    where = sorted({hosts[rank] for rank in ranks})
    return (f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
            f"(host{'s' if len(where) > 1 else ''} {', '.join(where)})")


def mismatch_message(fields_by_rank: list[dict[str, str]], hosts: list[str]) -> str:
    """The fields on which the ranks differ, each with its values and the ranks and hosts holding each."""
    names = sorted({name for fields in fields_by_rank for name in fields},
                   key=lambda name: (name.startswith(FLAGS_PREFIX), name))
    lines = []
    for name in names:
        holders: dict[str, list[int]] = {}
        for rank, fields in enumerate(fields_by_rank):
            holders.setdefault(fields.get(name, "(absent)"), []).append(rank)
        if len(holders) > 1:
            values = "; ".join(f"{value} on {ranks_in_words(ranks, hosts)}" for value, ranks in holders.items())
            lines.append(f"  {name}: {values}")
    more = f"\n  ... and {len(lines) - SHOWN_FIELDS} more" if len(lines) > SHOWN_FIELDS else ""
    return ("the ranks of this job resolved different configurations, so each would train its own run (their "
            "flags, or the data files they read, differ); every rank stops before the first step:\n"
            + "\n".join(lines[:SHOWN_FIELDS]) + more
            + "\nGive every node and rank the same flags and the same data (a launch script edited on one node is "
              "the usual cause).")


def agree_on_configuration(plan: Plan) -> None:
    """Raise ConfigurationMismatch, on every rank, unless all ranks of the default group hold the same plan and
    data files. Call it after the process group starts and before any other collective."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    fields = job_fields(plan)
    mine = (digest_of(fields), socket.gethostname())
    gathered: list[tuple[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    if len({entry[0] for entry in gathered if entry is not None}) == 1:
        return
    fields_by_rank: list[dict[str, str] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(fields_by_rank, fields)
    hosts = [entry[1] if entry is not None else "?" for entry in gathered]
    raise ConfigurationMismatch(mismatch_message([f or {} for f in fields_by_rank], hosts))
