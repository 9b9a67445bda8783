"""Graph optimisation for --torch-compile and --onnx-runtime-training.

ONNX Runtime's ORTModule serves --onnx-runtime-training only when an installed onnxruntime-training imports
with this torch (its last release, 1.19.2, does not with torch 2.13); otherwise torch.compile serves it, with
the backend and mode of --torch-compile-backend / --torch-compile-mode, and the plan says which and why.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

if TYPE_CHECKING:
    from rapidtrain.plan import Switches


def apply_graph_optimization(model: nn.Module, switches: Switches) -> nn.Module:
    if switches.compile == "ortmodule":
        from onnxruntime.training.ortmodule import ORTModule

        return ORTModule(model)
    from rapidtrain.parallel.transforms import apply_compile

    apply_compile(model, backend=switches.compile_backend, mode=switches.compile_mode)
    return model
