"""The step-time estimate's inputs for Narayanan et al. 2021's weak-scaling table ("Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM", Table 1: GPT 1.7B to 1T on 32 to 3,072 A100s), read from
published_runs.json: the same models as the paper's, and the FLOPs the estimate counts as run are the paper's
(recomputation included). How far each estimate lies from the run: tests/unit/test_published_runs.py."""

from __future__ import annotations

import pytest

from rapidtrain.config.estimate import estimate_step
from rapidtrain.config.published_runs import megatron_hardware_flops, published_runs
from rapidtrain.models.counting import count_parameters

TABLE_1 = [run for run in published_runs() if run.name.startswith("Narayanan 2021 Table 1")]


def test_the_table_has_its_ten_rows():
    assert len(TABLE_1) == 10


@pytest.mark.parametrize("run", TABLE_1, ids=lambda run: run.name.split(", ")[-1])
def test_the_estimate_counts_the_papers_models_and_flops(run):
    billions = float(run.name.split(", ")[-1].removesuffix("B"))
    # The same models (the paper rounds: its 1.7B is 1.65B by its own parameter formula).
    assert count_parameters(run.inputs.model)[0] / 1e9 == pytest.approx(billions, rel=0.03)
    estimate = estimate_step(run.inputs, run.device)
    paper = megatron_hardware_flops(run.inputs.model, run.inputs.global_batch_size)
    gpus = run.inputs.layout.world_size
    assert estimate.hardware_tflops_per_device == pytest.approx(
        paper / estimate.seconds_per_iteration / gpus / 1e12, rel=0.02)
