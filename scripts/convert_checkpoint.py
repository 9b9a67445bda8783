#!/usr/bin/env python
"""Export a rapidtrain checkpoint (any mode, any world size) as one consolidated model, and the built-in GPT
as a Hugging Face GPT2LMHeadModel folder.

    python scripts/convert_checkpoint.py --load checkpoints/gpt --output export/gpt [--hf] [--format torch]
    # export/gpt/model.safetensors (or model.pt): the model's state dict, every tensor whole, fp32
    # export/gpt/rapidtrain_config.json: the built-in model's shape (rapidtrain.models.ModelConfig)
    # export/gpt/hf/: config.json + model.safetensors for transformers' GPT2LMHeadModel.from_pretrained
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a file from a checkout: make the package beside scripts/ importable without installing.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(_root, "rapidtrain")) and _root not in sys.path:
        sys.path.insert(0, _root)

import torch  # noqa: E402

from rapidtrain.checkpoint import (  # noqa: E402
    CheckpointError,
    check_complete,
    iteration_dir,
    latest_iteration,
    read_common,
    read_metadata_file,
    safe_dcp_load,
    verify_checkpoint,
)
from rapidtrain.errors import UserError, user_errors  # noqa: E402
from rapidtrain.models.config import ModelConfig  # noqa: E402


class ExportError(UserError, ValueError):
    """The checkpoint cannot be exported in the form asked for (--hf of a model that is not GPT-2's)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--load", required=True, help="A --save folder (its latest iteration) or one iter_* folder."
    )
    parser.add_argument(
        "--iteration", type=int, default=None, help="Export this iteration instead of the latest."
    )
    parser.add_argument("--output", required=True, help="Folder to write the export into (created).")
    parser.add_argument(
        "--format",
        choices=("safetensors", "torch"),
        default="safetensors",
        help="File format of the consolidated state dict (default safetensors).",
    )
    parser.add_argument(
        "--hf",
        action="store_true",
        help="Also write a Hugging Face GPT2LMHeadModel folder (OUTPUT/hf); built-in GPT only.",
    )
    return parser.parse_args(argv)


def checkpoint_directory(load: str | Path, iteration: int | None) -> Path:
    """The iter_* folder to export, refused with a clear error when missing or not completely written."""
    load = Path(load)
    if (load / ".metadata").exists():
        directory = load
    else:
        iteration = iteration if iteration is not None else latest_iteration(load)
        if iteration is None:
            raise CheckpointError(
                f"--load {load}: no latest_checkpointed_iteration.txt and no .metadata there; "
                "point it at a --save folder or one of its iter_* folders."
            )
        directory = iteration_dir(load, iteration)
    if not directory.is_dir():
        raise CheckpointError(
            f"checkpoint {directory} does not exist: choose a complete iteration with --iteration."
        )
    check_complete(directory)
    return directory


def consolidated_model_state(directory: Path) -> dict[str, torch.Tensor]:
    """Every model tensor of a DCP checkpoint, whole, read in this one process (no process group needed):
    shards written by FSDP/TP ranks are stitched by torch.distributed.checkpoint from its metadata."""
    metadata = read_metadata_file(directory / ".metadata")  # runs nothing stored in the file
    model: dict[str, torch.Tensor] = {}
    for key, path in metadata.planner_data.items():
        stored = metadata.state_dict_metadata[key]
        if path[0] == "model" and len(path) == 2 and hasattr(stored, "size"):
            model[path[1]] = torch.empty(stored.size, dtype=stored.properties.dtype)
    if not model:
        raise CheckpointError(
            f"checkpoint {directory} holds no model tensors (was it written by rapidtrain?)"
        )
    safe_dcp_load({"model": model}, directory, no_dist=True)
    return model


def saved_model_config(directory: Path) -> ModelConfig | None:
    """The built-in model's shape from the flags saved with the checkpoint; None for other models."""
    from rapidtrain.plan import model_config_from_args

    saved = read_common(directory)["args"]
    if saved.get("pretrained_model_name_or_path") or not saved.get("padded_vocab_size"):
        return None
    return model_config_from_args(argparse.Namespace(**saved), saved["padded_vocab_size"])


def write_state(state: dict[str, torch.Tensor], output: Path, file_format: str) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    if file_format == "torch":
        path = output / "model.pt"
        torch.save(state, path)
        return path
    from safetensors.torch import save_file

    path = output / "model.safetensors"
    save_file(
        {name: tensor.contiguous() for name, tensor in state.items()}, str(path), metadata={"format": "pt"}
    )
    return path


# ---- Hugging Face GPT-2 ----
# The built-in GPT is GPT-2's architecture: learned absolute positions, pre-LN blocks, GELU MLP, final norm,
# output tied to the word embeddings. GPT-2 fuses q/k/v into c_attn and stores Conv1D weights as [in, out].


def check_gpt2_compatible(config: ModelConfig | None) -> ModelConfig:
    if config is None:
        raise ExportError(
            "--hf exports the built-in GPT; this checkpoint holds another model (a Hugging Face "
            "model is already in its own format: use its fine-tuning output instead)."
        )
    problems = []
    if config.model_type != "gpt":
        problems.append(f"--model-type {config.model_type} (GPT-2 is a GPT)")
    if config.position_embedding_type != "learned_absolute":
        problems.append(
            f"--position-embedding-type {config.position_embedding_type} (GPT-2 learns absolute ones)"
        )
    if not config.tie_embeddings:
        problems.append("--untie-embeddings-and-output-weights (GPT-2 ties them)")
    if any(config.num_experts):
        problems.append("--num-experts (GPT-2 has dense MLPs)")
    if problems:
        raise ExportError(
            "--hf: the checkpoint's model is not GPT-2's architecture: "
            + "; ".join(problems)
            + ". Export without --hf (consolidated state dict only)."
        )
    return config


def gpt2_config(config: ModelConfig):
    from transformers import GPT2Config

    return GPT2Config(
        vocab_size=config.vocab_size,
        n_positions=config.max_position_embeddings,
        n_embd=config.hidden_size,
        n_layer=config.num_layers,
        n_head=config.num_attention_heads,
        n_inner=config.ffn_size,
        activation_function="gelu",
        resid_pdrop=config.hidden_dropout,
        embd_pdrop=config.hidden_dropout,
        attn_pdrop=config.attention_dropout,
        layer_norm_epsilon=config.layernorm_epsilon,
        initializer_range=config.init_method_std,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=None,
    )


def gpt2_state_dict(state: dict[str, torch.Tensor], config: ModelConfig) -> dict[str, torch.Tensor]:
    """rapidtrain GPT names and layouts → GPT2LMHeadModel's."""
    hf = {
        "transformer.wte.weight": state["embedding.word_embeddings.weight"],
        "transformer.wpe.weight": state["embedding.position_embeddings.weight"],
        "transformer.ln_f.weight": state["final_norm.weight"],
        "transformer.ln_f.bias": state["final_norm.bias"],
    }
    for i in range(config.num_layers):
        ours, theirs = f"layers.{i}.", f"transformer.h.{i}."
        attention = [state[f"{ours}attention.{p}_proj.weight"] for p in "qkv"]
        hf[f"{theirs}attn.c_attn.weight"] = torch.cat(attention, dim=0).t()
        hf[f"{theirs}attn.c_attn.bias"] = torch.cat([state[f"{ours}attention.{p}_proj.bias"] for p in "qkv"])
        pairs = {
            "ln_1": "ln1",
            "ln_2": "ln2",
            "attn.c_proj": "attention.o_proj",
            "mlp.c_fc": "mlp.fc1",
            "mlp.c_proj": "mlp.fc2",
        }
        for hf_name, our_name in pairs.items():
            weight = state[f"{ours}{our_name}.weight"]  # Conv1D keeps [in, out]: matrices are transposed
            hf[f"{theirs}{hf_name}.weight"] = weight.t() if weight.ndim == 2 else weight
            hf[f"{theirs}{hf_name}.bias"] = state[f"{ours}{our_name}.bias"]
    return {name: tensor.contiguous() for name, tensor in hf.items()}


def export_gpt2(state: dict[str, torch.Tensor], config: ModelConfig, output: Path) -> Path:
    from transformers import GPT2LMHeadModel

    model = GPT2LMHeadModel(gpt2_config(config))
    missing, unexpected = model.load_state_dict(gpt2_state_dict(state, config), strict=False)
    # Only the tied head (and non-persistent buffers) may be left to transformers.
    if unexpected or any(name != "lm_head.weight" for name in missing):
        raise RuntimeError(f"GPT-2 name mapping incomplete: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.save_pretrained(output)
    return output


def convert(args: argparse.Namespace) -> list[Path]:
    directory = checkpoint_directory(args.load, args.iteration)
    if not verify_checkpoint(directory):
        print(f"note: {directory} has no manifest.json (an older checkpoint): its files were not checked for damage")
    state = consolidated_model_state(directory)
    output = Path(args.output)
    config = saved_model_config(directory)
    written = [write_state(state, output, args.format)]
    if config is not None:
        (output / "rapidtrain_config.json").write_text(
            json.dumps(dataclasses.asdict(config), indent=2) + "\n"
        )
        written.append(output / "rapidtrain_config.json")
    if args.hf:
        written.append(export_gpt2(state, check_gpt2_compatible(config), output / "hf"))
    return written


@user_errors("convert_checkpoint")
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    written = convert(args)
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
