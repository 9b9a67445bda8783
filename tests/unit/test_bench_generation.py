"""bench/generation.py runs end to end at tiny sizes: every setting gets numbers for both sides, and rapidtrain's
greedy tokens equal transformers' generate on the model the project's exporter wrote."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.launch import REPO, child_env


def test_generation_bench_smoke(tmp_path):
    rows_file = tmp_path / "rows.json"
    result = subprocess.run(
        [sys.executable, str(REPO / "bench" / "generation.py"), "--hidden-size", "32", "--num-layers", "2",
         "--num-attention-heads", "4", "--vocab-size", "128", "--prompt-length", "4", "--new-tokens", "3",
         "--repeats", "1", "--no-compile", "--json", str(rows_file)],
        capture_output=True, text=True, env=child_env(), timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    rows = json.loads(rows_file.read_text())
    assert {"batch 1, fp32, sdpa", "batch 4, fp32, sdpa", "batch 1, fp32, eager"} <= {row["setting"] for row in rows}
    for row in rows:
        assert row["same_tokens"] or "bf16" in row["setting"]
        for side in ("rapidtrain", "hf"):
            assert row[side]["tokens_per_s"] > 0 and row[side]["first_token_ms"] > 0
    assert "| setting | rapidtrain tok/s | HF tok/s | ratio |" in result.stdout and "CPU:" in result.stdout
