"""The demo's closing lines (train/demo_end.py) and its loss curve (train/loss_curve.py): the baseline is the
corpus's unigram entropy, the verdict follows the target, and the curve is a PNG of what the loop logged."""

from __future__ import annotations

import math

import numpy as np
import pytest

from rapidtrain.data.demo import unigram_entropy
from rapidtrain.data.indexed import IndexedDataset
from rapidtrain.train.demo_end import baseline_line, reference_losses
from rapidtrain.train.loss_curve import LossCurve


def test_unigram_entropy_is_that_of_the_corpus_token_frequencies(demo_data):
    dataset = IndexedDataset(demo_data.data_prefix)
    counts = np.bincount(np.concatenate([dataset[i] for i in range(len(dataset))]).astype(np.int64))
    p = counts[counts > 0] / counts.sum()
    assert unigram_entropy(demo_data.data_prefix) == pytest.approx(float(-(p * np.log(p)).sum()), abs=1e-9)
    assert 5.0 < unigram_entropy(demo_data.data_prefix) < math.log(len(counts))


def test_the_baseline_line_says_how_far_under_and_whether_the_target_was_reached():
    reached = baseline_line(4.555002, 6.136452, 2000)  # the demo run's (docs/first-hour.md)
    assert "loss 4.56 nats at iteration 2000: 1.58 nats under the corpus's unigram entropy of 6.14" in reached
    assert reached.endswith("the demo's target of 1.5 under reached")
    short = baseline_line(4.641, 6.136, 1600)  # 1.495 under: shown as 1.49, never as the 1.50 it would round to
    assert "1.49 nats under" in short and "short of the demo's target of 1.5 under: train longer" in short
    assert "1.00 nats above" in baseline_line(7.1365, 6.1364, 20)


def test_the_loss_curve_keeps_the_logged_losses_and_draws_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    curve = LossCurve("lm loss")
    assert curve.draw(str(tmp_path / "none.png")) == "no loss was logged"
    for step, loss in [(50, 6.5), (100, 5.8), (150, 5.5)]:
        curve.add_scalars({"train/lm loss": loss, "train/learning rate": 1e-3}, step)
    curve.add_scalars({"validation/lm loss": 5.6}, 150)
    assert curve.train == [(50, 6.5), (100, 5.8), (150, 5.5)] and curve.validation == [(150, 5.6)]
    path = tmp_path / "logs" / "loss_curve.png"
    assert curve.draw(str(path), reference_losses(6.14)) == ""
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
