"""Graph optimisation for --torch-compile and --onnx-runtime-training.

ONNX Runtime's ORTModule serves --onnx-runtime-training only when an installed onnxruntime-training imports
with this torch (its last release, 1.19.2, does not with torch 2.13); otherwise torch.compile (inductor)
serves it, and the plan says which and why.
"""

from __future__ import annotations

from typing import Literal

from torch import nn


def apply_graph_optimization(model: nn.Module, how: Literal["inductor", "ortmodule"]) -> nn.Module:
    if how == "ortmodule":
        from onnxruntime.training.ortmodule import ORTModule

        return ORTModule(model)
    from rapidtrain.parallel.transforms import apply_compile

    apply_compile(model)
    return model
