"""8-bit AdamW under FSDP2 (DTensor parameters, served by torchao) in a real 2-rank torchrun trains as AdamW."""

from __future__ import annotations

import pytest

from tests.launch import TINY_GPT_PARITY, pretrain, read_losses, relative_difference

RUN = [*TINY_GPT_PARITY, "--micro-batch-size", "2", "--global-batch-size", "4", "--log-interval", "1", "--lr", "1e-3",
       "--lr-warmup-iters", "1", "--train-iters", "4", "--fsdp-memory-optimization"]


@pytest.mark.slow
def test_adamw_8bit_under_fsdp_follows_adamw_losses(tmp_path):
    eight_bit, full = tmp_path / "8bit.txt", tmp_path / "adamw.txt"
    result = pretrain(2, [*RUN, "--optimizer", "adamw_8bit", "--loss-log-file", str(eight_bit)], warm=True)
    assert "optimizer                      → torchao AdamW8bit" in result.stdout
    pretrain(2, [*RUN, "--optimizer", "adamw", "--loss-log-file", str(full)], warm=True)
    quantised, reference = read_losses(eight_bit), read_losses(full)
    assert quantised[1] == reference[1]  # the same weights before the first step
    # Later losses differ only by the moments' quantisation error.
    assert relative_difference(quantised, reference) < 1e-3
    assert quantised[4] < quantised[1]
