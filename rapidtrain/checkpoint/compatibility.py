"""What a checkpoint folder must be to load: its file names and format version, complete, and of the same built-in
model as this run (the flags that fix the parameters' shapes). Plain checks on JSON values, no torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidtrain.core.errors import UserError

LATEST_FILE = "latest_checkpointed_iteration.txt"
COMMON_FILE = "common.json"
LEGACY_COMMON_FILE = "common.pt"  # rapidtrain before checkpoint format 2
MANIFEST_FILE = "manifest.json"
METADATA_FILE = ".metadata"
FORMAT_VERSION = 2
# The built-in model's settings that fix its parameters' shapes, with the flag that sets each: a checkpoint
# saved with other values cannot load.
MODEL_SHAPE_FIELDS = {"model_type": "--model-type", "num_layers": "--num-layers", "hidden_size": "--hidden-size",
                      "num_attention_heads": "--num-attention-heads", "ffn_hidden_size": "--ffn-hidden-size",
                      "vocab_size": "--tokenizer-type/--make-vocab-size-divisible-by (padded vocabulary)",
                      "position_embedding_type": "--position-embedding-type",
                      "max_position_embeddings": "--max-position-embeddings",
                      "tie_embeddings": "--untie-embeddings-and-output-weights",
                      "bert_binary_head": "--bert-binary-head", "num_experts": "--num-experts/--moe-layer-freq",
                      "normalization": "--normalization", "swiglu": "--swiglu",
                      "num_query_groups": "--group-query-attention/--num-query-groups",
                      "add_bias_linear": "--disable-bias-linear", "add_qkv_bias": "--add-qkv-bias",
                      "post_layernorm": "--post-layernorm"}


class CheckpointError(UserError, RuntimeError):
    """A checkpoint that cannot be loaded: missing, incomplete, damaged, unsafe, or of another model."""


def check_format_version(version: Any, path: Path) -> None:
    """Older formats load (each reader keeps their layout); a newer one is refused: this rapidtrain cannot know
    what it changed."""
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"{path} was written in checkpoint format {version!r}, newer than the format "
                              f"{FORMAT_VERSION} this rapidtrain reads: load it with the rapidtrain that wrote it "
                              "(or a newer one).")


def check_complete(directory: Path) -> None:
    missing = [name for name in (METADATA_FILE,) if not (directory / name).exists()]
    if not (directory / COMMON_FILE).exists() and not (directory / LEGACY_COMMON_FILE).exists():
        missing.append(COMMON_FILE)
    if missing:
        raise CheckpointError(f"checkpoint {directory} is incomplete (missing {', '.join(missing)}): it was not "
                              "fully written. Point --load at a folder whose latest iteration is complete.")


def check_same_model(saved: dict[str, Any] | None, current: dict[str, Any] | None, directory: Path) -> None:
    """Refuse a checkpoint of another built-in model (`saved`/`current`: the plans' model settings)."""
    if not saved or not current:
        return
    differing = []
    for name, flag in MODEL_SHAPE_FIELDS.items():
        before, now = _comparable(saved.get(name)), _comparable(current.get(name))
        if name in saved and before != now:
            differing.append(f"{flag} (checkpoint {before!r}, now {now!r})")
    if differing:
        raise CheckpointError(f"checkpoint {directory} holds a different model: " + "; ".join(differing)
                              + ". Use the flags the checkpoint was saved with, or another --load folder.")


def _comparable(value: Any) -> Any:
    return list(value) if isinstance(value, tuple) else value  # JSON brings tuples back as lists
