"""Read the pickled files of other tools' checkpoints (Megatron-LM's `model_optim_rng.pt`, DeepSpeed's
`*_model_states.pt`) as data only, never running what they store.

They hold more than tensors: Megatron's `args` (an argparse.Namespace, with a dtype and, in newer releases,
Megatron's own enums), RNG states (numpy arrays), DeepSpeed's config. torch's weights_only unpickler reads them
with argparse.Namespace and numpy's array classes allowed; any other class the file names becomes an inert
`Stored` record of its name and arguments: nothing is imported from the module it names and none of its code runs.
Names that only a crafted file holds (os.system, builtins.eval, ...) are refused outright.
"""

from __future__ import annotations

import argparse
import pickle
import re
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rapidtrain.checkpoint.compatibility import CheckpointError

# Modules whose names an honest checkpoint never holds: refused, not recorded.
_DANGEROUS_MODULES = ("os", "posix", "nt", "sys", "subprocess", "builtins", "__builtin__", "importlib", "runpy",
                      "shutil", "socket", "pickle", "_pickle", "marshal", "code", "codeop", "ctypes", "pty",
                      "multiprocessing", "webbrowser", "types", "functools", "operator", "io", "pathlib", "inspect")
_UNSUPPORTED = re.compile(r"Unsupported global: GLOBAL ([\w.]+)")
_BLOCKED = re.compile(r"unsupported GLOBAL ([\w.]+) whose module [\w.]+ is blocked")
_MAX_FOREIGN_CLASSES = 64  # one read per class found: a file naming more is not a checkpoint


class Stored:
    """What a class or function outside the allow-list would have built: its name and arguments, as data."""

    qualified_name = "?"

    def __init__(self, *arguments: Any, **kwargs: Any) -> None:
        self.arguments, self.kwargs = arguments, kwargs

    def __setstate__(self, state: Any) -> None:
        self.state = state

    def __repr__(self) -> str:
        return f"<stored {self.qualified_name}{getattr(self, 'arguments', ())!r}>"


def _stand_in(qualified_name: str) -> type:
    module, _, name = qualified_name.rpartition(".")
    cls = type(name, (Stored,), {"qualified_name": qualified_name, "__module__": f"rapidtrain.stored.{module}"})
    return cls


def _numpy_classes() -> list[Any]:
    core = getattr(np, "_core", None) or np.core  # numpy 2 renamed numpy.core
    return [np.ndarray, np.dtype, type(np.dtype(np.uint32)), core.multiarray._reconstruct]


def load_foreign_pickle(path: Path) -> Any:
    """The object a foreign checkpoint file holds, built from data only (see the module's docstring)."""
    allowed: list[Any] = [argparse.Namespace, *_numpy_classes()]
    for _ in range(_MAX_FOREIGN_CLASSES):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as error:
            blocked = _BLOCKED.search(str(error))
            if blocked is not None:  # torch's own deny-list (os, subprocess, ...)
                raise CheckpointError(f"{path}: refused: it asks to call {blocked.group(1)}, which no checkpoint "
                                      "holds (a crafted file). Nothing from it was run; use a checkpoint from a "
                                      "source you trust.") from None
            found = _UNSUPPORTED.search(str(error))
            if found is None:
                raise CheckpointError(f"{path}: refused: it holds objects other than data ({_first_line(error)}). "
                                      "Nothing from it was run.") from None
            name = found.group(1)
            if name.split(".")[0] in _DANGEROUS_MODULES:
                raise CheckpointError(f"{path}: refused: it asks to call {name}, which no checkpoint holds (a "
                                      "crafted file). Nothing from it was run; use a checkpoint from a source you "
                                      "trust.") from None
            allowed.append((_stand_in(name), name))
        except (RuntimeError, EOFError, OSError, ValueError) as error:
            raise CheckpointError(f"{path}: cannot be read ({_first_line(error)}): the file is damaged or "
                                  "truncated.") from None
    raise CheckpointError(f"{path}: refused: it names more than {_MAX_FOREIGN_CLASSES} classes of other programs; "
                          "not a checkpoint this reader knows.")


def _first_line(error: BaseException) -> str:
    lines = [line for line in str(error).splitlines() if "nsupported" in line or "error" in line.lower()]
    text = (lines or str(error).strip().splitlines() or [type(error).__name__])[-1]
    return text.strip()[:300]


def plain_args(saved_args: Any) -> dict[str, Any]:
    """A stored `args` (argparse.Namespace, or a dict) as a dict of its values; {} when there is none."""
    if isinstance(saved_args, argparse.Namespace):
        return dict(vars(saved_args))
    if isinstance(saved_args, dict):
        return dict(saved_args)
    return {}
