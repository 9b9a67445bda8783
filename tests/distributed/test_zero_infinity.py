"""ZeRO-3 parameter offload (--cpu-offload-params) and ZeRO-Infinity (--nvme-offload-dir) in real 2-rank torchrun
runs: the same training as ZeRO-3 with the optimizer offloaded, with each rank's parameter shards moved out of device
memory (measured by `parameter_residency`), and DeepSpeedCPUAdam on the threads the plan chose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.launch import torchrun

WORKER = Path(__file__).with_name("zero_infinity_worker.py")


def run(configurations: list[list[str]]) -> list[dict]:
    """One 2-rank launch training each configuration (extra flags) in turn: one JSON report per configuration. The
    three trainings compared here shared no launch before, and each paid for the agent's imports (DeepSpeed's
    included) and the rendezvous; each still builds its own engine, model and DeepSpeed optimizer."""
    # OMP_NUM_THREADS=1 as torchrun leaves it by default
    # The three launches' time together (600 s each): DeepSpeed may build its async_io op on the first NVMe run.
    result = torchrun(2, WORKER, [json.dumps(configurations)], env={"OMP_NUM_THREADS": "1"}, warm=True,
                      timeout=1800)
    reports = [json.loads(line) for line in result.stdout.splitlines() if line.startswith('{"losses"')]
    assert len(reports) == len(configurations), result.stdout[-3000:]
    return reports


def async_io_builds() -> bool:
    from deepspeed.ops.op_builder import AsyncIOBuilder

    return AsyncIOBuilder().is_compatible(verbose=False)


@pytest.mark.slow
def test_parameter_offload_moves_shards_out_of_device_memory(tmp_path):
    nvme_runs = async_io_builds()
    # the optimizer on the CPU (DeepSpeedCPUAdam) in every run compared
    plain, offloaded, *nvme_report = run([["--cpu-offload"], ["--cpu-offload", "--cpu-offload-params"],
                                          *([["--nvme-offload-dir", str(tmp_path)]] if nvme_runs else [])])
    assert offloaded["offload_params"] == "cpu"
    assert offloaded["losses"] == pytest.approx(plain["losses"], rel=1e-6)  # offload moves memory, not arithmetic
    before, after = plain["residency"], offloaded["residency"]
    # The matrices are sharded and move to host memory; only the small persistent vectors stay gathered.
    assert before["shard on device"] > 0 and before["shard in host memory"] == 0
    assert after["shard on device"] == 0 and after["shard in host memory"] == before["shard on device"]
    assert after["gathered on device"] == before["gathered on device"] < before["shard on device"] / 10
    # DeepSpeedCPUAdam steps with the cores per rank the plan computed, not torchrun's single thread.
    assert offloaded["threads"] == offloaded["planned_threads"] >= 1
    if not nvme_runs:
        pytest.skip("DeepSpeed's async_io op cannot build here (libaio missing): NVMe offload not run")
    nvme = nvme_report[0]
    assert nvme["offload_params"] == "nvme"
    assert nvme["losses"] == pytest.approx(plain["losses"], rel=1e-6)
    swapped, held = nvme["residency"]["shard on nvme"], nvme["residency"]["shard in host memory"]
    # Shards of at least DeepSpeed's 1 MiB I/O block (the embedding's) are on disk, the small ones in host memory.
    assert swapped >= 2 * 2**20 and swapped + held == before["shard on device"]
    assert any(tmp_path.rglob("*.swp"))  # DeepSpeed's swap files
