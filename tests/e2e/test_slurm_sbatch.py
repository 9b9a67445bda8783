"""scripts/slurm/pretrain_gpt.sbatch run end to end as two "nodes" on this machine. Slurm cannot run here: srun
is a stand-in (tests/slurm_stand_in/srun starts the command once per node with the variables srun sets for a
one-task-per-node step); everything after it is real (the launcher, torchrun's rendezvous, gloo, training)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.launch import REPO, bindable, child_env


def free_port_in(low: int, high: int) -> int:
    port = next((port for port in range(low + os.getpid() % 1000, high) if bindable(port)), None)
    if port is None:
        raise RuntimeError("no free port")
    return port


@pytest.mark.slow
def test_sbatch_script_trains_on_two_nodes_through_the_launcher(tmp_path, demo_data):
    """The sbatch script as Slurm would run it, its srun a stand-in: two `rapidtrain` launchers, each told only
    its Slurm variables, rendezvous at the first host of "127.0.0.[1-2]" on the job's port and train one model."""
    port = free_port_in(20000, 30000)
    env = {"PATH": f"{REPO / 'tests' / 'slurm_stand_in'}{os.pathsep}{os.environ['PATH']}", "PYTHON": sys.executable,
           "SLURM_SUBMIT_DIR": str(REPO), "SLURM_JOB_ID": str(port - 20000), "SLURM_JOB_NUM_NODES": "2",
           "SLURM_JOB_NODELIST": "127.0.0.[1-2]", "GPUS_PER_NODE": "1", "LAYERS": "2", "HIDDEN": "64", "HEADS": "4",
           "SEQ": "64", "MICRO": "2", "GLOBAL": "8", "ITERS": "4", "SAVE": str(tmp_path / "ck")}
    env = child_env(env, nproc=2)
    for name in ("NNODES", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "LOCAL_RANK",
                 "TORCHELASTIC_RUN_ID"):
        env.pop(name, None)
    result = subprocess.run(["bash", str(REPO / "scripts" / "slurm" / "pretrain_gpt.sbatch"), "--num-workers", "0",
                             "--eval-iters", "0", "--log-interval", "2"],
                            capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert "layout: world 2 = data 2 × tensor 1 × pipeline 1" in result.stdout
    assert "iteration        4/       4" in result.stdout
    assert (tmp_path / "ck" / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
