#!/usr/bin/env python
"""Export a rapidtrain checkpoint (any layout, any world size: resharded by torch.distributed.checkpoint) as one
consolidated model, and the built-in GPT, Llama-family, MoE or BERT model as a Hugging Face save_pretrained folder.

    python scripts/convert_checkpoint.py --load checkpoints/gpt --output export/gpt [--hf] [--format torch]
    # export/gpt/model.safetensors (or model.pt): the model's state dict, every tensor whole, fp32
    # export/gpt/rapidtrain_config.json: the built-in model's shape (rapidtrain.models.ModelConfig)
    # export/gpt/hf/: config.json + safetensors for transformers' from_pretrained: GPT2LMHeadModel,
    #   LlamaForCausalLM, Qwen2ForCausalLM, MixtralForCausalLM, BertFor*/MegatronBertFor* by the model's shape
    #   (and the Hugging Face tokenizer the run used, when it used one)
    python scripts/convert_checkpoint.py --load checkpoints/gpt --output export/gpt --megatron \
        --target-tensor-parallel-size 2 --target-pipeline-parallel-size 2
    # export/gpt/megatron/: Megatron-LM's legacy checkpoint (latest_checkpointed_iteration.txt,
    #   iter_N/mp_rank_TT_PPP/model_optim_rng.pt) of the built-in GPT/Llama model, with its iteration, consumed
    #   samples and learning-rate schedule (no optimizer or random state, as Megatron's own converters write:
    #   Megatron-LM loads it with --finetune, or --no-load-optim --no-load-rng), which rapidtrain --load reads too
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    # Run as a file from a checkout: make the package beside scripts/ importable without installing.
    _root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    if os.path.isdir(os.path.join(_root, "rapidtrain")) and _root not in sys.path:
        sys.path.insert(0, _root)

import torch  # noqa: E402

from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state  # noqa: E402
from rapidtrain.config.saved_checkpoint import saved_args, saved_model_config  # noqa: E402
from rapidtrain.core.errors import UserError, user_errors  # noqa: E402
from rapidtrain.data.hf_tokenizer import special_token_ids  # noqa: E402
from rapidtrain.models.config import ModelConfig  # noqa: E402


class ExportError(UserError, ValueError):
    """The checkpoint cannot be exported in the form asked for (--hf of a model that is not GPT-2's)."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--load", required=True, help="A --save folder (its latest iteration) or one iter_* folder.")
    parser.add_argument("--iteration", type=int, default=None, help="Export this iteration instead of the latest.")
    parser.add_argument("--output", required=True, help="Folder to write the export into (created).")
    parser.add_argument("--format", choices=("safetensors", "torch"), default="safetensors",
                        help="File format of the consolidated state dict (default safetensors).")
    parser.add_argument("--hf", action="store_true",
                        help="Also write a Hugging Face save_pretrained folder (OUTPUT/hf); built-in models only.")
    parser.add_argument("--hf-max-shard-size", default="5GB",
                        help="Split the Hugging Face safetensors into files of at most this size (default 5GB).")
    parser.add_argument("--megatron", action="store_true",
                        help="Also write Megatron-LM's legacy checkpoint layout (OUTPUT/megatron) of the built-in "
                             "GPT/Llama/MoE model, cut for --target-tensor-parallel-size × "
                             "--target-pipeline-parallel-size (× --target-expert-parallel-size).")
    parser.add_argument("--target-tensor-parallel-size", type=int, default=1,
                        help="With --megatron: the tensor-parallel size to cut the model for (default 1).")
    parser.add_argument("--target-pipeline-parallel-size", type=int, default=1,
                        help="With --megatron: the pipeline-parallel size to cut the model for (default 1).")
    parser.add_argument("--target-expert-parallel-size", type=int, default=1,
                        help="With --megatron and a mixture-of-experts model: the expert-parallel size to divide the "
                             "routed experts over (folders mp_rank_TT[_PPP]_EEE, Megatron-Core's SequentialMLP names; "
                             "default 1).")
    return parser.parse_args(argv)


def write_state(state: dict[str, torch.Tensor], output: Path, file_format: str) -> Path:
    output.mkdir(parents=True, exist_ok=True)
    if file_format == "torch":
        path = output / "model.pt"
        torch.save(state, path)
        return path
    from safetensors.torch import save_file

    path = output / "model.safetensors"
    save_file({name: tensor.contiguous() for name, tensor in state.items()}, str(path), metadata={"format": "pt"})
    return path


def export_hf(state: dict[str, torch.Tensor], config: ModelConfig | None, directory: Path, output: Path,
              max_shard_size: str) -> Path:
    from rapidtrain.models.hf_weights import save_hf_folder

    if config is None:
        raise ExportError("--hf exports the built-in models; this checkpoint holds a Hugging Face model, which is "
                         "already in its own format: use its fine-tuning output instead.")
    found = run_tokenizer(directory)
    token_ids = special_token_ids(*found) if isinstance(found, tuple) else None
    kind = save_hf_folder(state, config, output, max_shard_size=max_shard_size, token_ids=token_ids)
    print(f"Hugging Face {kind} model in {output}")
    if isinstance(found, str):
        print(f"  no tokenizer written: {found}")
    else:
        settings, tokenizer = found
        tokenizer.save_pretrained(output)
        print(f"  with its tokenizer ({settings.tokenizer_type}, {len(tokenizer)} ids): "
              f"AutoTokenizer.from_pretrained('{output}') loads it; config.json names "
              + (", ".join(f"{name} {value}" for name, value in (token_ids or {}).items()) or "no special ids"))
    return output


def run_tokenizer(directory: Path) -> tuple[Any, Any] | str:
    """The run's tokenizer settings (the checkpoint's plan names them, the demo corpus's included) and its form that
    AutoTokenizer loads (rapidtrain/data/hf_tokenizer.py), so that the exported folder is usable alone; or why there
    is no text tokenizer to write."""
    from rapidtrain.checkpoint.checkpointer import read_common
    from rapidtrain.data.hf_tokenizer import hf_tokenizer
    from rapidtrain.data.tokenizer import TokenizerSettings

    saved = (read_common(directory).get("plan") or {}).get("tokenizer")
    if saved is None:
        return "the checkpoint names none"
    fields = {field.name for field in dataclasses.fields(TokenizerSettings)}
    settings = TokenizerSettings(**{name: value for name, value in saved.items() if name in fields})
    tokenizer = hf_tokenizer(settings)
    if tokenizer is None:
        return f"{settings.tokenizer_type} has ids only, no text"
    return settings, tokenizer


def export_megatron(state: dict[str, torch.Tensor], config: ModelConfig | None, directory: Path, output: Path,
                    tensor_parallel: int, pipeline_parallel: int, expert_parallel: int = 1) -> Path:
    """Megatron-LM's legacy layout; the vocabulary padded to its --make-vocab-size-divisible-by × the target TP; a
    mixture-of-experts model (MLA included) in Megatron-Core's names, its routed experts over `expert_parallel`."""
    from rapidtrain.checkpoint.checkpointer import read_common
    from rapidtrain.checkpoint.megatron_legacy import write_megatron_legacy

    if config is None or config.model_type != "gpt":
        raise ExportError("--megatron writes the built-in GPT/Llama/MoE model (not BERT)")
    if tensor_parallel < 1 or pipeline_parallel < 1 or expert_parallel < 1:
        raise ExportError("--target-tensor-parallel-size, --target-pipeline-parallel-size and "
                          "--target-expert-parallel-size must be at least 1")
    experts = {count for count in config.num_experts if count}
    if expert_parallel > 1 and (not experts or any(count % expert_parallel for count in experts)):
        raise ExportError(f"--target-expert-parallel-size {expert_parallel} must divide the model's experts per "
                          f"layer ({', '.join(map(str, sorted(experts))) or 'none: not a mixture-of-experts model'})")
    if output.exists() and any(output.iterdir()):
        raise ExportError(f"{output} is not empty: --megatron writes a new checkpoint folder; remove it or choose "
                          "another --output")
    common = read_common(directory)
    multiple = (getattr(saved_args(directory), "make_vocab_size_divisible_by", None) or 128) * tensor_parallel
    rows = -(-config.vocab_size // multiple) * multiple
    write_megatron_legacy(output, state, config, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
                          iteration=int(common.get("iteration", 0)), vocab_rows=rows,
                          consumed_samples=int(common.get("consumed_samples", 0)),
                          scheduler=common.get("lr_scheduler"),
                          extra_args={"make_vocab_size_divisible_by": multiple // tensor_parallel},
                          optimizer_and_rng=False, expert_parallel=expert_parallel)
    print(f"Megatron-LM legacy checkpoint (tensor parallel {tensor_parallel} × pipeline parallel "
          f"{pipeline_parallel}" + (f" × expert parallel {expert_parallel}" if expert_parallel > 1 else "")
          + f") in {output}")
    return output


def convert(args: argparse.Namespace) -> list[Path]:
    directory = checkpoint_directory(args.load, args.iteration)
    state = consolidated_model_state(directory)
    output = Path(args.output)
    config = saved_model_config(directory)
    written = [write_state(state, output, args.format)]
    if config is not None:
        (output / "rapidtrain_config.json").write_text(json.dumps(dataclasses.asdict(config), indent=2) + "\n")
        written.append(output / "rapidtrain_config.json")
    if args.hf:
        written.append(export_hf(state, config, directory, output / "hf", args.hf_max_shard_size))
    if args.megatron:
        written.append(export_megatron(state, config, directory, output / "megatron",
                                       args.target_tensor_parallel_size, args.target_pipeline_parallel_size,
                                       args.target_expert_parallel_size))
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
