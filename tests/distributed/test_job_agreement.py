"""One configuration per job: ranks whose flags resolve to different plans stop before the first step, every one
of them, naming the field, the values and the ranks and hosts holding each (train/agreement.py)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

from tests.launch import TINY_GPT_PARITY, pretrain

DISAGREEING = Path(__file__).resolve().parent / "disagreeing_ranks.py"
TINY = [*TINY_GPT_PARITY, "--global-batch-size", "8", "--train-iters", "2", "--lr", "1e-3", "--log-interval", "1"]


def test_a_rank_with_another_micro_batch_and_seq_length_stops_the_job_before_training(tmp_path, demo_data):
    """Rank 1 alone is given --micro-batch-size 4 and --seq-length 32: both ranks exit 2 before iteration 1, with
    one message naming both fields, each value and which rank on which host holds it; nothing is saved."""
    save = tmp_path / "ck"
    extra = {"1": ["--micro-batch-size", "4", "--seq-length", "32"]}
    result = pretrain(2, [*TINY, "--micro-batch-size", "2", "--save", str(save), "--save-interval", "1"],
                      script=DISAGREEING, env={"RANK_EXTRA_ARGS": json.dumps(extra)}, check=False, timeout=300)
    output = result.stdout + result.stderr
    assert result.returncode != 0, output
    assert "iteration        1/" not in output and " iteration " not in result.stdout, output
    host = socket.gethostname()
    assert f"data.micro_batch_size: 2 on rank 0 (host {host}); 4 on rank 1 (host {host})" in output, output
    assert f"data.seq_length: 64 on rank 0 (host {host}); 32 on rank 1 (host {host})" in output, output
    told = [line for line in output.splitlines() if line.startswith("rapidtrain: error: the ranks of this job")]
    assert len(told) == 1, output  # told once by the ranks (torchrun's summary quotes each rank's error file)
    assert "agreement.py" not in output and "engine.py" not in output, output  # no rank's traceback (torchrun's own is)
    assert not save.exists() or not any(save.iterdir())


def test_ranks_with_the_same_flags_train(tmp_path, demo_data):
    """The check costs one collective and stops nothing when the ranks agree (here, equal extra flags)."""
    extra = {"0": ["--seed", "7"], "1": ["--seed", "7"]}
    result = pretrain(2, [*TINY, "--micro-batch-size", "2"], script=DISAGREEING,
                      env={"RANK_EXTRA_ARGS": json.dumps(extra)}, timeout=300)
    assert "resolved different configurations" not in result.stdout + result.stderr
