"""The step-time model against published training runs (rapidtrain/config/published_runs.json): every run's
estimate and its error, printed as a table (pytest -s shows it), each within its bound, and the fitted constants
at the fit's optimum.

Bounds: 15% for the runs the constants are fitted to. Two of them cannot both come closer than about 5%: the
same 530B shapes, one pipeline of 35 stages with 280 micro-batches, ran in 54.1 s per pipeline in Narayanan et al.
(2021) and in 49.05 s in Korthikanti et al. (2022, full recomputation), a year's software apart; the fit's largest
error is 11.2%, the bound leaves 3.8 points for float and model drift. 25% for the held-out runs, other software
on other networks (MT-NLG's DeepSpeed pipeline engine is estimated 20-23% under what it took)."""

from __future__ import annotations

import math

import pytest

from rapidtrain.config import estimate
from rapidtrain.config.published_runs import PublishedRun, published_runs

FITTED_BOUND, HELD_OUT_BOUND = 0.15, 0.25
RUNS = published_runs()


def table(runs: list[PublishedRun]) -> str:
    rows = [f"{'run':44} {'measured s':>11} {'estimate s':>11} {'error':>7}  role"]
    rows += [f"{run.name:44} {run.measured_seconds:11.3f} {run.estimated_seconds():11.3f} {run.error():+7.1%}  "
             f"{'fitted' if run.fitted else 'held out'}" for run in runs]
    return "\n".join(rows)


def test_every_published_run_lies_within_its_bound():
    print("\n" + table(RUNS))
    outside = [(run.name, f"{run.error():+.1%}") for run in RUNS
               if abs(run.error()) > (FITTED_BOUND if run.fitted else HELD_OUT_BOUND)]
    assert not outside, outside
    # Several sources, on both GPUs the table's constants are shared by, each way of the fit.
    assert {run.device.name for run in RUNS if run.fitted} == {"A100 SXM 80GB", "H100 SXM"}
    assert sum(run.fitted for run in RUNS) >= 15 and sum(not run.fitted for run in RUNS) >= 3


def test_the_runs_are_the_sources_own_numbers():
    """Each published figure read back: Korthikanti et al.'s 175B at 51.4% MFU (their model FLOPs), BLOOM's 150
    TFLOP/s (Megatron's count) over 384 GPUs, Llama 3's 430 TFLOP/s over 8,192."""
    by_name = {run.name: run for run in RUNS}
    korthikanti = by_name["Korthikanti 2022, 175B, selective + SP"]
    model = korthikanti.inputs.model
    s, h, layers, vocab, batch = model.seq_length, model.hidden_size, model.num_layers, model.vocab_size, 64
    paper_flops = 72 * batch * s * layers * h**2 * (1 + s / (6 * h) + vocab / (12 * h * layers))
    assert paper_flops / korthikanti.measured_seconds / 64 / 312e12 == pytest.approx(0.514, abs=0.001)
    assert by_name["BLOOM 176B, 384 GPUs"].measured_seconds == pytest.approx(104.5, abs=0.1)
    assert by_name["BLOOM 176B, 384 GPUs"].device.inter_node_gb_per_s == 6.25  # its Omni-Path, not the table's
    llama = by_name["Llama 3 405B, 16384 GPUs, 128k, CP16"].inputs.layout
    assert (llama.context_parallel_size, llama.data_parallel_size, llama.cp_comm_type) == (16, 8, "allgather")


def test_the_constants_sit_at_the_fits_optimum(monkeypatch):
    """A step of the calibration grid away from GEMM_EFFICIENCY or GEMM_HALF_WIDTH makes the largest error over the
    fitted runs no smaller: the constants are the fit's, not hand-set."""
    fitted = [run for run in RUNS if run.fitted]

    def worst() -> float:
        return max(abs(math.log(run.estimated_seconds() / run.measured_seconds)) for run in fitted)

    at_fit = worst()
    for efficiency, half_width in ((0.01, 0), (-0.01, 0), (0, 50), (0, -50)):
        monkeypatch.setattr(estimate, "GEMM_EFFICIENCY", estimate.GEMM_EFFICIENCY + efficiency)
        monkeypatch.setattr(estimate, "GEMM_HALF_WIDTH", estimate.GEMM_HALF_WIDTH + half_width)
        assert worst() >= at_fit, (efficiency, half_width)
        monkeypatch.undo()


def test_the_plan_names_the_references_it_was_fitted_to():
    run = RUNS[0]
    said = " ".join(estimate.estimate_step(run.inputs, run.device).assumptions)
    for reference in ("Narayanan et al. 2021", "Korthikanti et al. 2022", "Llama 3", "published_runs.json"):
        assert reference in said
