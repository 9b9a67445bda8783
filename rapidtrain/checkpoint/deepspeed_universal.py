"""A DeepSpeed universal checkpoint (what `python -m deepspeed.checkpoint.ds_to_universal` writes), read for --load.

ds_to_universal turns `ROOT/global_stepN` (ZeRO stage 1/2 partitions, any tensor/pipeline/data-parallel layout) into
`ROOT/global_stepN_universal` and names it in `ROOT/latest_universal`, which Megatron-DeepSpeed's
--universal-checkpoint reads instead of `latest`. In it, `zero/<parameter name>/` holds one parameter whole: its
fp32 master weight (`fp32.pt`), Adam's moments (`exp_avg.pt`, `exp_avg_sq.pt`), each a dict with the tensor under
`param` (and how its tensor-parallel slices were joined: `cat_dim`, `vocab_tensor`, ...), and `step.pt`, the step
count. The tensor-parallel slices are already joined as the model holds them at TP 1 (row-parallel weights along
dim 1, SwiGLU's halves gate-then-up), and the vocabulary's padding rows are cut off (to the tokenizer's size, its
`universal_checkpoint_info`'s `original_vocab_size`): DeepSpeed pads them back with zeros on load, and so does this
reader. The copied `mp_rank_TT[_PPP]_model_states.pt` keep the client state (args, iteration, schedule), read as for
the non-universal folder. Parameter names are Megatron-DeepSpeed's: the GPT model's (`language_model.encoder.
layers.N.…`) or, under its pipeline engine, GPTModelPipe's (`tied_modules.embed.word_embeddings.weight`, `K.
input_layernorm.weight` numbered by position in the layer list, `K.weight` for the final norm, `K.lm_head.weight`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch

from rapidtrain.checkpoint.compatibility import CheckpointError
from rapidtrain.checkpoint.deepspeed_folder import _layer_shard
from rapidtrain.checkpoint.foreign_formats import ForeignCheckpoint
from rapidtrain.checkpoint.foreign_pickle import load_foreign_pickle, plain_args
from rapidtrain.checkpoint.megatron_layout import Shard, core_names
from rapidtrain.checkpoint.megatron_legacy import ForeignState, _count

_MODEL_FILE = re.compile(r"^mp_rank_\d{2}(?:_\d{3})?_model_states\.pt$")
_PIPE_NAME = re.compile(r"^(\d+)\.(.+)$")
_STATES = ("fp32", "exp_avg", "exp_avg_sq")


def _tensor(path: Path) -> torch.Tensor | None:
    """The whole tensor of one `zero/<name>/<state>.pt` (a dict with `param`); None when the file is absent."""
    if not path.is_file():
        return None
    saved = load_foreign_pickle(path)
    value = saved.get("param") if isinstance(saved, dict) else None
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"{path}: holds no `param` tensor: not a universal checkpoint's parameter file")
    return value.detach().float()  # saved from DeepSpeed's fp32 partition, a Parameter: requires_grad comes along


def _step(path: Path) -> int | None:
    if not path.is_file():
        return None
    value = load_foreign_pickle(path)
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return int(value.item())
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return int(value)
    raise CheckpointError(f"{path}: holds {type(value).__name__}, not a step count")


def _pipe_names(tensors: dict[str, torch.Tensor]) -> Shard:
    """GPTModelPipe's names (layer position first, tied embedding under tied_modules) → the legacy model's."""
    renamed: Shard = {}
    by_position: dict[int, dict[str, torch.Tensor]] = {}
    for name, value in tensors.items():
        if name.startswith("tied_modules.embed."):
            renamed[f"language_model.embedding.{name.removeprefix('tied_modules.embed.')}"] = value
        elif (match := _PIPE_NAME.match(name)) is not None:
            by_position.setdefault(int(match.group(1)), {})[match.group(2)] = value
        else:
            renamed[name] = value
    layer = 0
    for position in sorted(by_position):
        part = by_position[position]
        if "lm_head.weight" in part:
            renamed["language_model.output_layer.weight"] = part["lm_head.weight"]
            continue
        kind, tensors = _layer_shard(position, part, layer)  # as the pipeline engine's layer files are read
        layer += kind == "layer"
        renamed.update(tensors)
    return renamed


def _model_names(tensors: dict[str, torch.Tensor]) -> Shard:
    pipeline = any(_PIPE_NAME.match(name) or name.startswith("tied_modules.") for name in tensors)
    return core_names(_pipe_names(tensors) if pipeline else tensors)


def read_deepspeed_universal(checkpoint: ForeignCheckpoint) -> ForeignState:
    directory = checkpoint.directory
    zero = directory / "zero"
    model_files = sorted(path for path in directory.iterdir() if _MODEL_FILE.match(path.name))
    if not zero.is_dir() or not model_files:
        raise CheckpointError(f"{directory}: no zero/ folder or no mp_rank_*_model_states.pt: the universal "
                              "checkpoint is incomplete (run ds_to_universal again, or load the global_stepN folder "
                              "it was made from)")
    first = load_foreign_pickle(model_files[0])
    if not isinstance(first, dict):
        raise CheckpointError(f"{model_files[0]}: a {type(first).__name__}, not a DeepSpeed checkpoint's dict")
    states: dict[str, dict[str, torch.Tensor]] = {key: {} for key in _STATES}
    steps: set[int] = set()
    for folder in sorted(p for p in zero.iterdir() if p.is_dir()):
        for key in _STATES:
            value = _tensor(folder / f"{key}.pt")
            if value is not None:
                states[key][folder.name] = value
        step = _step(folder / "step.pt")
        if step is not None:
            steps.add(step)
    if not states["fp32"]:
        raise CheckpointError(f"{zero}: no <parameter>/fp32.pt in it: the universal checkpoint holds no weights")
    saved_args = plain_args(first.get("args"))
    info = first.get("universal_checkpoint_info")
    original_vocab = info.get("original_vocab_size") if isinstance(info, dict) else None
    iteration = _count(first.get("iteration", first.get("global_steps", 0)))
    consumed = _count(saved_args.get("consumed_train_samples", first.get("global_samples", 0)))
    scheduler = first.get("lr_scheduler")
    notes = [f"{checkpoint.describe()}: {len(states['fp32'])} parameters whole, their fp32 master weights"
             + (f"; its vocabulary's padding (rows past {original_vocab}) was dropped by ds_to_universal and is "
                "zeros here, as DeepSpeed loads it" if isinstance(original_vocab, int) else "")]
    state = ForeignState(str(directory), [[_model_names(states["fp32"])]], saved_args, iteration, consumed,
                         scheduler if isinstance(scheduler, dict) else None, False, notes)
    _read_moments(state, states, steps, notes)
    return state


def _read_moments(state: ForeignState, states: dict[str, dict[str, torch.Tensor]], steps: set[int],
                  notes: list[str]) -> None:
    """Adam's moments and step, when every parameter has them and all took the same number of steps."""
    lacking = sorted(set(states["fp32"]) - set(states["exp_avg"]) | set(states["fp32"]) - set(states["exp_avg_sq"]))
    if lacking:
        notes.append(f"no Adam moments for {', '.join(lacking[:3])}{' ...' if len(lacking) > 3 else ''} (never "
                     "stepped, or another optimizer): the optimizer starts fresh")
        return
    if len(steps) != 1:
        notes.append(f"its parameters have taken different numbers of steps ({sorted(steps) or 'none saved'}): "
                     "the optimizer starts fresh")
        return
    state.moments = {key: [[_model_names(states[key])]] for key in ("exp_avg", "exp_avg_sq")}
    state.optimizer_step = steps.pop()

