"""Which node a launch runs on: Rapidformer's variables (NNODES, NODE_RANK, MASTER_ADDR, MASTER_PORT), else
Slurm's, so that `srun rapidtrain FLAGS` (one task per node) starts torchrun with the right --nnodes,
--node-rank, --master-addr and --master-port on every node.

From Slurm: the node count of the step (SLURM_STEP_NUM_NODES, else the job's SLURM_JOB_NUM_NODES /
SLURM_NNODES), this node's index (SLURM_NODEID), the first host of the node list (SLURM_STEP_NODELIST, else
SLURM_JOB_NODELIST / SLURM_NODELIST, in Slurm's compressed form "node[01-03,07],gpu5") as the rendezvous host,
and a port derived from the job id (20000 + id mod 10000), the same on every node of a job and different for
jobs sharing a first node.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from rapidtrain.core.errors import UserError

DEFAULT_PORT = 29500


@dataclass(frozen=True)
class NodeLayout:
    nnodes: int = 1
    node_rank: int = 0
    master_addr: str | None = None  # None: one node and no address given: torchrun --standalone
    master_port: int = DEFAULT_PORT
    source: str = "default"  # "environment" (NNODES...), "slurm", or "default"


def split_hostlist(text: str) -> list[str]:
    """Top-level comma-separated parts of a host list; commas inside brackets belong to a range."""
    parts, depth, current = [], 0, ""
    for char in text:
        if char == "," and depth == 0:
            parts.append(current)
            current = ""
            continue
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth < 0:
            raise ValueError(f"unbalanced ']' in host list {text!r}")
        current += char
    if depth:
        raise ValueError(f"unclosed '[' in host list {text!r}")
    parts.append(current)
    return [p.strip() for p in parts if p.strip()]


def _expand_range(body: str, text: str) -> list[str]:
    """"01-03,07" → ["01", "02", "03", "07"]: a range keeps the width of its first number (zero padding)."""
    values = []
    for item in body.split(","):
        low, _, high = item.strip().partition("-")
        if not low.isdigit() or (high and not high.isdigit()):
            raise ValueError(f"{item!r} in host list {text!r} is not a number or a range of numbers")
        if not high:
            values.append(low)
            continue
        if int(high) < int(low):
            raise ValueError(f"range {item!r} in host list {text!r} goes backwards")
        values += [str(n).zfill(len(low)) for n in range(int(low), int(high) + 1)]
    return values


def expand_host(pattern: str, text: str = "") -> list[str]:
    """One part of a host list, each bracket group expanded in turn: "rack[1-2]-n[1,3]" → 4 hosts."""
    found = re.search(r"\[([^\]]*)\]", pattern)
    if found is None:
        return [pattern]
    head, tail = pattern[:found.start()], pattern[found.end():]
    return [head + value + rest for value in _expand_range(found.group(1), text or pattern)
            for rest in expand_host(tail, text or pattern)]


def expand_hostlist(text: str) -> list[str]:
    """Slurm's compressed host list expanded, in order: "node[01-03,07],gpu5" → node01 node02 node03 node07 gpu5."""
    return [host for part in split_hostlist(text) for host in expand_host(part, text)]


def _integer(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name, "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise UserError(f"{name}={value!r} is not a number; unset it or give the value Slurm (or you) meant.")
    return int(value)


def _first(env: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    return next(((name, env[name]) for name in names if env.get(name, "").strip()), None)


def slurm_tasks_per_node(env: Mapping[str, str]) -> int | None:
    """Tasks srun started on this node (SLURM_STEP_TASKS_PER_NODE / SLURM_TASKS_PER_NODE, e.g. "1(x2)")."""
    found = _first(env, "SLURM_STEP_TASKS_PER_NODE", "SLURM_TASKS_PER_NODE", "SLURM_NTASKS_PER_NODE")
    if found is None:
        return None
    counts = re.findall(r"(\d+)(?:\(x\d+\))?", found[1])
    return max(int(c) for c in counts) if counts else None


def node_layout(env: Mapping[str, str]) -> NodeLayout:
    """This launch's node layout: Rapidformer's variables first, then Slurm's, else one standalone node."""
    nnodes_given = _integer(env, "NNODES")
    if nnodes_given is not None or env.get("MASTER_ADDR") or "SLURM_JOB_ID" not in env:
        nnodes = nnodes_given or 1
        addr = env.get("MASTER_ADDR") or (None if nnodes == 1 else "127.0.0.1")
        return NodeLayout(nnodes, _integer(env, "NODE_RANK") or 0, addr,
                          _integer(env, "MASTER_PORT") or DEFAULT_PORT,
                          "environment" if nnodes_given is not None or env.get("MASTER_ADDR") else "default")
    nodes = _first(env, "SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES")
    nnodes = int(nodes[1]) if nodes and nodes[1].isdigit() else 1
    if nnodes == 1:
        return NodeLayout(source="slurm")
    assert nodes is not None  # nnodes > 1 was read from it
    tasks = slurm_tasks_per_node(env)
    if tasks is not None and tasks > 1:
        raise UserError(f"Slurm started {tasks} tasks on this node; rapidtrain starts torchrun, which starts "
                        "--nproc-per-node workers itself: launch one task per node (`srun --ntasks-per-node=1 "
                        "rapidtrain ...`, see scripts/slurm/).")
    hostlist = _first(env, "SLURM_STEP_NODELIST", "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if hostlist is None:
        raise UserError(f"Slurm says {nnodes} nodes ({nodes[0]}) but gives no node list (SLURM_JOB_NODELIST): set "
                        "MASTER_ADDR to the first node's address.")
    try:
        first_host = expand_hostlist(hostlist[1])[0]
    except (ValueError, IndexError) as error:
        raise UserError(f"{hostlist[0]}={hostlist[1]!r}: {error}; set MASTER_ADDR to the first node's address "
                        "instead.") from None
    node_rank = _integer(env, "NODE_RANK")
    if node_rank is None:
        node_rank = _integer(env, "SLURM_NODEID")
    if node_rank is None:
        node_rank = _integer(env, "SLURM_PROCID") or 0  # one task per node: the task's rank is the node's
    port = _integer(env, "MASTER_PORT") or 20000 + (_integer(env, "SLURM_JOB_ID") or 0) % 10000
    return NodeLayout(nnodes, node_rank, first_host, port, "slurm")
