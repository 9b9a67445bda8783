"""The run's loss curve: recorded from the scalars the loop already logs (a writer beside TensorBoard's) and drawn as
a PNG beside the run's logs, so a newcomer sees at a glance that the loss fell and by how much."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any


class LossCurve:
    """A ScalarWriter (train/tracking.py) that keeps the training loss of each log line and each validation loss."""

    def __init__(self, loss_name: str) -> None:
        self.loss_name = loss_name
        self.train: list[tuple[int, float]] = []
        self.validation: list[tuple[int, float]] = []

    def add_config(self, config: Mapping[str, Any]) -> None:
        pass

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        if (loss := values.get(f"train/{self.loss_name}")) is not None:
            self.train.append((step, float(loss)))
        if (loss := values.get(f"validation/{self.loss_name}")) is not None:
            self.validation.append((step, float(loss)))

    def flush(self) -> None:
        pass

    def close(self, failed: bool = False) -> None:
        pass

    def draw(self, path: str, references: Sequence[tuple[float, str]] = ()) -> str:
        """Write the curve to `path` (PNG), with horizontal reference lines (loss, label); "" when written, else why
        not (said to the user, nothing raised)."""
        if not self.train and not self.validation:
            return "no loss was logged"
        try:  # a declared dependency (setup.py); an environment installed before it was gets the reason instead
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError:
            return "matplotlib is not installed (pip install matplotlib)"
        figure = Figure(figsize=(7, 4.2), dpi=110)
        FigureCanvasAgg(figure)  # the PNG renderer, without pyplot's global state
        axes = figure.add_subplot()
        if self.train:
            axes.plot(*zip(*self.train, strict=True), label=f"training {self.loss_name}", color="tab:blue")
        if self.validation:
            axes.plot(*zip(*self.validation, strict=True), "o-", label=f"validation {self.loss_name}",
                      color="tab:orange")
        for (loss, label), style in zip(references, ["--", ":", "-."], strict=False):
            axes.axhline(loss, linestyle=style, color="gray", label=label)
        axes.set_xlabel("iteration")
        axes.set_ylabel("loss (nats per token)")
        axes.grid(alpha=0.3)
        axes.legend()
        figure.tight_layout()
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        figure.savefig(path)
        return ""
