"""Defaults chosen for the machine, each said in the plan with its reason: DataLoader workers and pinned memory by
device and data source, and a CPU run's threads per rank (cores ÷ local ranks unless OMP_NUM_THREADS is given)."""

from __future__ import annotations

import os

import pytest

from rapidtrain.config import arguments, plan, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.resolve import cpu_threads

CORES = len(os.sched_getaffinity(0))


def resolved(argv: list[str], device: str = "cpu", world: int = 1) -> settings.Plan:
    args = arguments.parse_args(["--train-iters", "10", "--lr", "1e-4", *argv], entry="pretrain")
    return plan.from_args(args, settings.RunContext(world, device))  # type: ignore[arg-type]


def test_a_cpu_run_on_indexed_data_makes_batches_in_process_and_says_why():
    data = resolved([]).data  # the demo corpus
    assert (data.num_workers, data.pin_memory) == (0, False)
    assert "memory-mapped" in data.loader_reason
    assert "no loader workers: a CPU run on memory-mapped tokens" in describe_plan(resolved([]))


def test_a_gpu_run_keeps_two_pinned_workers():
    data = resolved([], device="cuda").data
    assert (data.num_workers, data.pin_memory) == (2, True)
    assert "2 loader workers per rank: a GPU run" in describe_plan(resolved([], device="cuda"))


def test_num_workers_given_is_kept():
    data = resolved(["--num-workers", "3"]).data
    assert data.num_workers == 3 and data.loader_reason.startswith("--num-workers")


@pytest.mark.parametrize("env, local_ranks, expected", [
    ({}, 1, CORES),  # one rank: every core
    ({}, 2, max(CORES // 2, 1)),
    ({"OMP_NUM_THREADS": "1"}, 2, max(CORES // 2, 1)),  # torchrun's own 1 for several local ranks
    ({"OMP_NUM_THREADS": "1"}, 1, 0),  # one rank: the user's 1, kept (0: torch is left as it is)
    ({"OMP_NUM_THREADS": "3"}, 2, 0),  # the user's count, kept
])
def test_cpu_threads_per_rank_share_the_cores_unless_given(monkeypatch, env, local_ranks, expected):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_ranks))
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    threads, what, why = cpu_threads(settings.RunContext(local_ranks, "cpu"))
    assert threads == expected
    shown = expected or int(env["OMP_NUM_THREADS"])
    assert what == f"torch intra-op threads: {shown} per rank"
    assert ("as given" in why) == (expected == 0)
    assert cpu_threads(settings.RunContext(local_ranks, "cuda")) == (0, "", "")


def test_the_plan_says_the_threads_and_the_run_uses_them(monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    resolved_plan = resolved([])
    assert resolved_plan.switches.cpu_threads == CORES
    assert f"CPU threads                    → torch intra-op threads: {CORES} per rank" in describe_plan(resolved_plan)
