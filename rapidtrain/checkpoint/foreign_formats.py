"""Which tool wrote a --load folder, from its file names alone (no torch: `rapidtrain plan` says it too).

rapidtrain's own: `latest_checkpointed_iteration.txt` → `iter_N/` with `.metadata` and `common.json`.
Megatron-LM legacy: the same tracker (a number or `release`) → `iter_N/mp_rank_TT[_PPP[_EEE]]/model_optim_rng.pt`.
Megatron-LM torch_dist: the tracker → `iter_N/` with `metadata.json` (its `sharded_backend`), `common.pt`, `*.distcp`.
DeepSpeed / Megatron-DeepSpeed: `latest` (a tag) → `TAG/mp_rank_TT_model_states.pt` (and, under its pipeline
engine, `layer_LL[-model_TT]-model_states.pt`), `*_optim_states.pt`.
DeepSpeed universal (ds_to_universal's output): `latest_universal` (a tag) → `TAG/zero/<parameter>/fp32.pt` and the
copied `mp_rank_*_model_states.pt`. Megatron-DeepSpeed's --universal-checkpoint reads it instead of `latest`; here a
folder holding only `latest_universal` is read as universal without the flag too (DeepSpeed would start from
scratch, silently).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from rapidtrain.checkpoint.compatibility import LATEST_FILE, CheckpointError

MEGATRON_RANK_DIR = re.compile(r"^mp_rank_(\d{2})(?:_(\d{3}))?(?:_(\d{3}))?$")
DEEPSPEED_MODEL_FILE = re.compile(r"^mp_rank_(\d{2})_model_states\.pt$")
# `-model_TT` names the tensor rank when the pipeline's topology has a model axis (none without tensor parallelism).
DEEPSPEED_LAYER_FILE = re.compile(r"^layer_(\d{2,})(?:-model_(\d{2}))?-model_states\.pt$")
MEGATRON_FILE = "model_optim_rng.pt"
UNIVERSAL_TRACKER = "latest_universal"  # what ds_to_universal writes beside its output folder


@dataclass(frozen=True)
class ForeignCheckpoint:
    """A checkpoint folder another tool wrote: `kind`, the folder of the iteration to read, and its name."""

    kind: str  # "megatron-legacy", "megatron-torch-dist", "deepspeed" or "deepspeed-universal"
    root: Path
    directory: Path
    tag: str  # iter_0000010, release, global_step10

    def describe(self) -> str:
        names = {"megatron-legacy": "Megatron-LM checkpoint (legacy format)",
                 "megatron-torch-dist": "Megatron-LM checkpoint (torch_dist format)",
                 "deepspeed": "DeepSpeed / Megatron-DeepSpeed checkpoint",
                 "deepspeed-universal": "DeepSpeed universal checkpoint (ds_to_universal)"}
        return f"{names[self.kind]}, {self.tag}"


def _tracker(root: Path) -> str | None:
    path = root / LATEST_FILE
    try:
        return path.read_text(encoding="utf-8").strip() if path.is_file() else None
    except (OSError, UnicodeDecodeError):
        return None  # the resume path reads it again and names the damage


def detect_foreign(root: str | Path, universal: bool = False) -> ForeignCheckpoint | None:
    """The foreign checkpoint in `root`; None for rapidtrain's own, an empty or missing folder (a first run).
    `universal` (--universal-checkpoint): the DeepSpeed universal checkpoint `latest_universal` names, which must
    be there."""
    root = Path(root)
    if universal:
        found = _deepspeed_tag(root, UNIVERSAL_TRACKER, "deepspeed-universal")
        if found is None:
            raise CheckpointError(f"--universal-checkpoint: no {UNIVERSAL_TRACKER} in --load {root}. It is written "
                                  "by `python -m deepspeed.checkpoint.ds_to_universal --input_folder ROOT/global_stepN "
                                  "--output_folder ROOT/global_stepN_universal`; point --load at that ROOT, or drop "
                                  "--universal-checkpoint to load a DeepSpeed checkpoint named by `latest`.")
        return found
    text = _tracker(root)
    if text is not None:
        if text == "release":
            directory, tag = root / "release", "release"
        elif re.fullmatch(r"[0-9]{1,12}", text):
            tag = f"iter_{int(text):07d}"
            directory = root / tag
        else:
            return None
        if any(MEGATRON_RANK_DIR.match(p.name) for p in _entries(directory)):
            return ForeignCheckpoint("megatron-legacy", root, directory, tag)
        if (directory / "metadata.json").is_file() and _sharded_backend(directory) is not None:
            return ForeignCheckpoint("megatron-torch-dist", root, directory, tag)
        return None
    return _deepspeed_tag(root, "latest", "deepspeed") or _deepspeed_tag(root, UNIVERSAL_TRACKER,
                                                                         "deepspeed-universal")


def _deepspeed_tag(root: Path, tracker: str, kind: str) -> ForeignCheckpoint | None:
    """The DeepSpeed checkpoint the tag file `tracker` (`latest`, `latest_universal`) names; None without one."""
    latest = root / tracker
    if not latest.is_file():
        return None
    try:
        tag = latest.read_text(encoding="utf-8").strip()
    except (OSError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{latest}: cannot be read ({error}); it should name a DeepSpeed checkpoint's "
                              "folder (global_stepN).") from None
    if not tag or Path(tag).name != tag or not (root / tag).is_dir():
        raise CheckpointError(f"{latest} names {tag[:60]!r}, which is no folder in {root}: the DeepSpeed "
                              "checkpoint is incomplete. Write the name of a complete global_step* folder into it.")
    return ForeignCheckpoint(kind, root, root / tag, tag)


def _entries(directory: Path) -> list[Path]:
    try:
        return sorted(directory.iterdir()) if directory.is_dir() else []
    except OSError:
        return []


def _sharded_backend(directory: Path) -> str | None:
    try:
        value = json.loads((directory / "metadata.json").read_text()).get("sharded_backend")
    except (OSError, ValueError, AttributeError):
        return None
    return value if isinstance(value, str) else None


# What marks a folder as holding some model or checkpoint, when it is none of the formats read here.
_MODEL_SUFFIXES = (".pt", ".pth", ".bin", ".safetensors", ".distcp", ".ckpt", ".h5", ".msgpack", ".gguf")
_CHECKPOINT_DIRS = re.compile(r"^(iter_\d+|global_step\d+(_universal)?|release|checkpoint-\d+)$")


def refuse_unknown_folder(root: str | Path) -> None:
    """A --load folder with no checkpoint rapidtrain reads, but with model files or checkpoint folders in it, is
    refused naming what is there (starting from scratch would silently drop the weights the user meant)."""
    root = Path(root)
    found = []
    for entry in _entries(root):
        rapidtrains = entry.is_dir() and any((entry / name).exists() for name in ("common.json", "manifest.json"))
        if entry.name == "config.json" or entry.suffix in _MODEL_SUFFIXES or (
                entry.is_dir() and _CHECKPOINT_DIRS.match(entry.name) and not rapidtrains):
            found.append(entry.name + ("/" if entry.is_dir() else ""))
    if not found:
        return
    hint = ("a Hugging Face model: give it as --pretrained-model-name-or-path" if "config.json" in found else
            "rapidtrain reads its own checkpoints, Megatron-LM's (latest_checkpointed_iteration.txt → "
            "iter_N/mp_rank_*/model_optim_rng.pt, or torch_dist) and DeepSpeed's (latest → global_stepN/, or "
            "latest_universal → global_stepN_universal/)")
    raise CheckpointError(f"--load {root}: no checkpoint of a known kind there, but it holds {', '.join(found[:6])}"
                          f"{' ...' if len(found) > 6 else ''}: {hint}. Point --load at such a folder, or at an empty "
                          "one to start from scratch.")
