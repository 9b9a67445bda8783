"""Fit the step-time model's GEMM constants (config/estimate.py: GEMM_EFFICIENCY, GEMM_HALF_WIDTH) to the
published runs marked fitted in rapidtrain/config/published_runs.json, and print every run's error.

The fit minimizes the largest |log(estimate / measured)| over the fitted runs on a grid (the root mean square
breaks ties); COLLECTIVE_EFFICIENCY stays as estimate.py sets it (see its docstring for why it is not fitted).
Run after changing the model or the runs; copy the constants it prints into estimate.py.

    python scripts/calibrate_step_model.py [--table-only]
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rapidtrain.config import estimate  # noqa: E402
from rapidtrain.config.published_runs import PublishedRun, published_runs  # noqa: E402

EFFICIENCIES = [x / 100 for x in range(60, 91)]
HALF_WIDTHS = [float(x) for x in range(0, 801, 50)]


def log_errors(runs: list[PublishedRun]) -> list[float]:
    return [math.log(run.estimated_seconds() / run.measured_seconds) for run in runs]


def fit(runs: list[PublishedRun]) -> tuple[float, float, float]:
    """(GEMM_EFFICIENCY, GEMM_HALF_WIDTH, largest |log error|) of the grid's best point."""
    best: tuple[float, float, float, float] | None = None
    for efficiency in EFFICIENCIES:
        for half_width in HALF_WIDTHS:
            estimate.GEMM_EFFICIENCY, estimate.GEMM_HALF_WIDTH = efficiency, half_width
            errors = log_errors(runs)
            score = (max(abs(e) for e in errors), math.sqrt(sum(e * e for e in errors) / len(errors)))
            if best is None or score < best[2:]:
                best = (efficiency, half_width, *score)
    assert best is not None
    estimate.GEMM_EFFICIENCY, estimate.GEMM_HALF_WIDTH = best[0], best[1]
    return best[0], best[1], best[2]


def print_table(runs: list[PublishedRun]) -> None:
    print(f"{'run':44} {'measured s':>11} {'estimate s':>11} {'error':>7}  role")
    for run in runs:
        print(f"{run.name:44} {run.measured_seconds:11.3f} {run.estimated_seconds():11.3f} {run.error():+7.1%}  "
              f"{'fitted' if run.fitted else 'held out'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--table-only", action="store_true", help="print the errors under estimate.py's constants")
    args = parser.parse_args()
    runs = published_runs()
    if not args.table_only:
        efficiency, half_width, worst = fit([run for run in runs if run.fitted])
        print(f"GEMM_EFFICIENCY = {efficiency:g}, GEMM_HALF_WIDTH = {half_width:g} "
              f"(largest error over the fitted runs: {math.exp(worst) - 1:.1%})")
    print_table(runs)


if __name__ == "__main__":
    main()
