"""Optimizer state in bytes: what each implementation allocates per parameter tensor (for the plan's memory
estimate), and what a built optimizer really holds (for tests and benchmarks to check the estimate against)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:  # the plan sizes optimizer state without torch; measuring a built optimizer imports it
    import torch

StateKind = Literal[
    "adam", "sgd_momentum", "none", "adafactor", "bitsandbytes_8bit", "torchao_8bit", "torchao_4bit"
]
FP32 = 4
SCALAR = 4  # torch keeps `step` as a float32 scalar tensor per parameter
# Block-wise quantisation: tensors below this many elements keep fp32 moments (bitsandbytes' min_8bit_size,
# torchao's threshold), and each block of elements shares one fp32 scale.
LOW_BIT_MIN_ELEMENTS = 4096
BLOCK = {"bitsandbytes_8bit": 256, "torchao_8bit": 256, "torchao_4bit": 128}
CODE_BITS = {"bitsandbytes_8bit": 8, "torchao_8bit": 8, "torchao_4bit": 4}


def tensor_state_bytes(kind: StateKind, shape: tuple[int, ...]) -> int:
    """Bytes of optimizer state one fp32 parameter of `shape` gets after the first step."""
    n = math.prod(shape)
    if kind == "adam":  # exp_avg, exp_avg_sq, step (apex's and rapidtrain's LAMB keep the same)
        return 2 * FP32 * n + SCALAR
    if kind == "sgd_momentum":
        return FP32 * n
    if kind == "none":
        return 0
    if kind == "adafactor":
        # torch.optim.Adafactor factors the second moment of a matrix into row and column means (no first
        # moment): shape[:-1] + shape[:-2] + shape[-1:] elements; vectors keep a full variance.
        if len(shape) < 2:
            return FP32 * n + SCALAR
        rows = math.prod(shape[:-1])
        columns = math.prod(shape[:-2]) * shape[-1]
        return FP32 * (rows + columns) + SCALAR
    step = 0 if kind == "bitsandbytes_8bit" else SCALAR  # bitsandbytes counts steps in a Python int
    block = BLOCK[kind]
    quantised = n >= LOW_BIT_MIN_ELEMENTS and (kind == "bitsandbytes_8bit" or n % block == 0)
    if not quantised:
        return 2 * FP32 * n + step
    codes = math.ceil(n * CODE_BITS[kind] / 8)
    scales = FP32 * math.ceil(n / block)
    # torchao keeps a quantisation map per state tensor; bitsandbytes shares two per optimizer (below).
    own_map = FP32 * 2 ** CODE_BITS[kind] if kind != "bitsandbytes_8bit" else 0
    return 2 * (codes + scales + own_map) + step


def shared_state_bytes(kind: StateKind) -> int:
    """State an optimizer keeps once whatever the parameters: bitsandbytes' signed and unsigned 8-bit maps."""
    return 2 * FP32 * 256 if kind == "bitsandbytes_8bit" else 0


def optimizer_state_bytes(kind: StateKind, shapes: Iterable[tuple[int, ...]] | Mapping[tuple[int, ...], int]) -> int:
    """Total state bytes for parameters of these shapes (a shape → how many tensors have it, or a list)."""
    counts = shapes if isinstance(shapes, Mapping) else Counter(tuple(shape) for shape in shapes)
    per_tensor = sum(count * tensor_state_bytes(kind, shape) for shape, count in counts.items())
    return per_tensor + (shared_state_bytes(kind) if counts else 0)


def _storages(value: object) -> Iterable[torch.Tensor]:
    """The plain tensors behind a state value: DTensor shards and tensor subclasses (torchao's quantised
    state) are opened up to the tensors that own memory."""
    import torch

    if not isinstance(value, torch.Tensor):
        return
    local = getattr(value, "_local_tensor", None)  # DTensor
    if local is not None:
        yield from _storages(local)
        return
    if type(value) is not torch.Tensor and hasattr(value, "__tensor_flatten__"):
        names, _ = value.__tensor_flatten__()
        for name in names:
            yield from _storages(getattr(value, name))
        return
    yield value


def measured_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes the optimizer's state tensors really occupy on this rank, each storage counted once."""
    seen: dict[tuple[int, str], int] = {}
    for state in optimizer.state.values():
        for value in state.values():
            for tensor in _storages(value):
                storage = tensor.untyped_storage()
                seen[(storage.data_ptr(), str(tensor.device))] = storage.nbytes()
    return sum(seen.values())
