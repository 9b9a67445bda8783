"""The launcher under Slurm: Slurm's compressed host lists expanded, SLURM_* mapped to torchrun's node flags
(Rapidformer's variables first), one task per node enforced; the sbatch scripts parse. Slurm cannot run here: its
environment is a stand-in (the variables srun sets for a one-task-per-node step)."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import pytest

from rapidtrain import cli
from rapidtrain.config.settings import RunContext
from rapidtrain.core.errors import UserError
from rapidtrain.core.slurm import NodeLayout, expand_hostlist, node_layout
from tests.launch import REPO

SLURM_JOB = {"SLURM_JOB_ID": "123456", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4", "SLURM_NODEID": "2",
             "SLURM_PROCID": "2", "SLURM_JOB_NODELIST": "node[01-03,07],gpu5", "SLURM_STEP_TASKS_PER_NODE": "1(x4)"}


@pytest.mark.parametrize("text, hosts", [
    ("node[01-03,07],gpu5", ["node01", "node02", "node03", "node07", "gpu5"]),
    ("gpu5", ["gpu5"]),
    ("a[8-10]", ["a8", "a9", "a10"]),
    ("rack[1-2]-n[1,3]", ["rack1-n1", "rack1-n3", "rack2-n1", "rack2-n3"]),
    ("x[098-100],y[1],10.0.0.[4-5]", ["x098", "x099", "x100", "y1", "10.0.0.4", "10.0.0.5"]),
])
def test_hostlists_expand_as_slurm_writes_them(text, hosts):
    assert expand_hostlist(text) == hosts


@pytest.mark.parametrize("text", ["node[01-03", "node]1[", "node[3-1]", "node[a-b]"])
def test_malformed_hostlists_are_refused(text):
    with pytest.raises(ValueError):
        expand_hostlist(text)


def test_slurm_step_becomes_torchruns_node_flags():
    assert node_layout(SLURM_JOB) == NodeLayout(4, 2, "node01", 20000 + 123456 % 10000, "slurm")
    command = cli.torchrun_command(argparse.Namespace(nproc_per_node=8, user_script=None), Path("pretrain.py"),
                                   ["--train-iters", "5"], "cuda", env=SLURM_JOB)
    assert command[4:] == ["--nproc-per-node=8", "--nnodes=4", "--node-rank=2", "--master-addr=node01",
                           "--master-port=23456", "pretrain.py", "--train-iters", "5"]


def test_a_steps_own_nodes_win_over_the_jobs():
    step = SLURM_JOB | {"SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NODELIST": "node[03,07]", "SLURM_NODEID": "1"}
    assert node_layout(step) == NodeLayout(2, 1, "node03", 23456, "slurm")


def test_rapidformers_variables_win_over_slurms():
    layout = node_layout(SLURM_JOB | {"NNODES": "2", "NODE_RANK": "1", "MASTER_ADDR": "10.0.0.1",
                                      "MASTER_PORT": "6000"})
    assert layout == NodeLayout(2, 1, "10.0.0.1", 6000, "environment")
    assert node_layout(SLURM_JOB | {"MASTER_PORT": "6001"}).master_port == 6001


def test_one_node_jobs_and_no_slurm_run_standalone():
    args = argparse.Namespace(nproc_per_node=2, user_script=None)
    for env in ({"SLURM_JOB_ID": "7", "SLURM_JOB_NUM_NODES": "1", "SLURM_JOB_NODELIST": "gpu5"}, {}):
        command = cli.torchrun_command(args, Path("p.py"), [], "cpu", env=env)
        assert command[4:7] == ["--nproc-per-node=2", "--nnodes=1", "--standalone"]


def test_several_tasks_per_node_are_refused():
    with pytest.raises(UserError, match="one task per node"):
        node_layout(SLURM_JOB | {"SLURM_STEP_TASKS_PER_NODE": "8(x4)"})


def test_plan_world_size_counts_slurms_nodes(monkeypatch):
    for name, value in SLURM_JOB.items():
        monkeypatch.setenv(name, value)
    for name in ("WORLD_SIZE", "NNODES", "MASTER_ADDR"):
        monkeypatch.delenv(name, raising=False)
    assert RunContext.detect(argparse.Namespace(nproc_per_node=2, user_script=None)).world_size == 8


@pytest.mark.parametrize("script", sorted((REPO / "scripts" / "slurm").glob("*.sbatch")), ids=lambda p: p.name)
def test_sbatch_scripts_parse_and_start_one_task_per_node(script):
    subprocess.run(["bash", "-n", str(script)], check=True)
    text = script.read_text()
    assert "#SBATCH --ntasks-per-node=1" in text and "srun --ntasks-per-node=1" in text
