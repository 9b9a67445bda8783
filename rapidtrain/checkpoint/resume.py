"""What resuming checks beyond the tensors: the learning-rate schedule of the saved run against this one's, with
the flags that changed named."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from rapidtrain.core.errors import UserError
from rapidtrain.optim.lr_schedule import LRScheduler


class ResumeError(UserError, ValueError):
    """The checkpoint cannot be continued with these flags."""


# The flags the learning-rate schedule is computed from (in samples: the batch and the run's length count too).
SCHEDULE_FLAGS = ("lr", "min_lr", "lr_decay_style", "lr_decay_iters", "lr_decay_samples", "lr_warmup_iters",
                  "lr_warmup_fraction", "lr_warmup_samples", "lr_warmup_init", "lr_wsd_decay_iters",
                  "lr_wsd_decay_samples", "lr_wsd_decay_style", "train_iters", "train_samples", "global_batch_size",
                  "rampup_batch_size", "step_batch_size_schedule")


def changed_schedule_flags(saved: dict[str, Any], current: dict[str, Any]) -> list[str]:
    """The schedule's flags whose values differ between the saved run and this one, as `--flag (checkpoint A,
    now B)`; flags a side did not record are not compared."""
    names: tuple[str, ...] = SCHEDULE_FLAGS
    if any(saved.get(name) and saved.get(name) == current.get(name) for name in ("lr_decay_iters", "lr_decay_samples")):
        names = tuple(n for n in names if n not in ("train_iters", "train_samples"))  # the decay horizon is set
    return [f"--{name.replace('_', '-')} (checkpoint {_shown(saved[name])}, now {_shown(current[name])})"
            for name in names if name in saved and name in current and saved[name] != current[name]]


def resolved_flags(common: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint's saved flags with the global batch it ran with: checkpoints before issue 44 recorded
    --global-batch-size as given, None when it was left to default (--micro-batch-size × data parallel)."""
    flags = dict(common.get("args") or {})
    batch = ((common.get("plan") or {}).get("batches") or {}).get("global_batch_size")
    if flags.get("global_batch_size") is None and batch is not None:
        flags["global_batch_size"] = batch
    return flags


def check_optimizer_groups(saved: dict[str, Any], current: dict[str, Any], directory: Path) -> None:
    """--decoupled-lr gives the embedding and output layer optimizer groups of their own: a saved optimizer state
    with the other grouping cannot load (torch names a missing group key, which reads as damage)."""
    before, now = saved.get("decoupled_lr"), current.get("decoupled_lr")
    if (before is None) == (now is None):
        return
    had = f"with --decoupled-lr {before}" if before is not None else "without --decoupled-lr"
    has = f"with --decoupled-lr {now}" if now is not None else "without it"
    raise ResumeError(f"--load {directory}: its optimizer state was saved {had}, and this run is {has}, which changes "
                      "the optimizer's parameter groups (the embedding and output layer have their own with it). Give "
                      "--no-load-optim (or --finetune) to start a fresh optimizer from the saved weights, or "
                      f"{'drop --decoupled-lr' if now is not None else 'give the saved --decoupled-lr'} to continue "
                      "the saved run.")


# The saved state of rapidtrain's LRScheduler: each entry's type (a damaged common.json is refused before use).
_SAVED_SCHEDULE_TYPES: dict[str, type | tuple[type, ...]] = {
    "num_steps": int, "max_lr": (int, float), "min_lr": (int, float), "lr_warmup_steps": (int, float),
    "lr_decay_steps": (int, float, type(None)), "lr_decay_style": str}  # warm-up/decay: fractions of a horizon


def _damaged_schedule(saved: Any) -> list[str]:
    if not isinstance(saved, dict):
        return ["lr_scheduler"]
    return [name for name, kinds in _SAVED_SCHEDULE_TYPES.items() if name in saved and (
        not isinstance(saved[name], kinds) or isinstance(saved[name], bool)
        or (isinstance(saved[name], int | float) and name.endswith("steps") and saved[name] < 0))
        ] + ([] if "num_steps" in saved else ["num_steps"])


def load_schedule(lr_scheduler: Any, saved: dict[str, Any], schedule_from: str, directory: Path,
                   changed: list[str]) -> None:
    if isinstance(lr_scheduler, LRScheduler) and _damaged_schedule(saved):
        raise ResumeError(f"--load {directory}: the learning-rate schedule in its common.json is damaged (missing or "
                          f"wrong: {', '.join(_damaged_schedule(saved))}); resume from another iteration or --load "
                          "folder.")
    try:
        if isinstance(lr_scheduler, LRScheduler):
            lr_scheduler.load_state_dict(saved, schedule_from=schedule_from)
        else:
            lr_scheduler.load_state_dict(saved)
    except ValueError as error:
        keep = ("--override-opt-param-scheduler to keep these flags' schedule (from the saved position), or "
                "--use-checkpoint-opt-param-scheduler to keep the saved one")
        if changed:
            raise ResumeError(f"--load {directory}: the learning-rate schedule would change, since "
                              f"{', '.join(changed)}: give the saved run's values to continue its schedule, or give "
                              f"{keep} (Megatron's flags; the consumed samples carry over either way).") from None
        raise ResumeError(f"--load {directory}: {error} (the flags --lr, --min-lr, --lr-decay-style, --lr-decay-iters "
                          f"and the warm-up must be the saved run's to continue it; or give {keep}).") from None


# ---- the data a resume continues on ----
# The saved plan's fields a resume compares, with the flags that set them. A difference in the data (paths, split,
# sequence length, data seed, or a data file's contents) continues as Megatron does: the consumed samples carry
# over into the new data's sample order, said in one line each. A tokenizer that maps ids to other text is refused:
# the embedding rows trained for one vocabulary would be read as another's (stricter than Megatron, which continues).
DATA_FIELDS = (("data", "data_path", "--data-path"), ("data", "split_paths", "--train-data-path/--valid-data-path"),
               ("data", "split", "--split"), ("data", "seq_length", "--seq-length"), ("data", "seed", "--seed"),
               ("data", "data_dir", "--data-dir"), ("data", "data_name", "--data-name"))
TOKENIZER_FIELDS = (("tokenizer_type", "--tokenizer-type"), ("vocab_file", "--vocab-file"),
                    ("merge_file", "--merge-file"), ("tokenizer_model", "--tokenizer-model"),
                    ("vocab_size", "--vocab-size"))


def _shown(value: Any) -> str:
    if value in (None, [], ()):
        return "not given"
    return " ".join(map(str, value)) if isinstance(value, list | tuple) else str(value)


def data_changes(saved: dict[str, Any], current_plan: dict[str, Any], current_files: dict[str, str],
                 directory: Path, iteration: int) -> list[str]:
    """What changed in the data since the checkpoint in `directory` was saved, one line each (printed as notes);
    ResumeError where continuing is wrong (another tokenizer), naming the flag that allows it."""
    saved_plan = saved.get("plan") or {}
    lines, consumed = [], saved.get("consumed_samples", 0)
    carry = f"the consumed samples ({consumed}) carry over into the new data's order, as Megatron's resume does"
    for section, name, flag in DATA_FIELDS:
        before, now = (saved_plan.get(section) or {}).get(name), (current_plan.get(section) or {}).get(name)
        if section in saved_plan and before != now and _shown(before) != _shown(now):
            lines.append(f"{flag} changed since the checkpoint (checkpoint {_shown(before)}, now {_shown(now)}): "
                         f"{carry}, so the samples from here are not those the saved run would have read next")
    saved_files = saved.get("data_files")
    if isinstance(saved_files, dict):
        for path, identity in saved_files.items():
            if path in current_files and current_files[path] != identity:
                lines.append(f"{path} changed since the checkpoint ({identity}, now {current_files[path]}): {carry}, "
                             "over the file's new contents")
    before_batch = (saved_plan.get("batches") or {}).get("global_batch_size")
    now_batch = (current_plan.get("batches") or {}).get("global_batch_size")
    if before_batch is not None and now_batch is not None and before_batch != now_batch:
        lines.append(f"--global-batch-size changed since the checkpoint (checkpoint {before_batch}, now {now_batch}): "
                     f"the run continues after iteration {iteration} at consumed sample {consumed}, each iteration "
                     f"from here taking {now_batch} samples (Megatron's resume)")
    _refuse_another_tokenizer(saved_plan.get("tokenizer"), current_plan.get("tokenizer"), saved_files,
                              current_files, directory)
    return lines


def _refuse_another_tokenizer(before: Any, now: Any, saved_files: Any, current_files: dict[str, str],
                              directory: Path) -> None:
    if not isinstance(before, dict) or not isinstance(now, dict):
        return
    changed = []
    for name, flag in TOKENIZER_FIELDS:
        if before.get(name) == now.get(name):
            continue
        moved = isinstance(saved_files, dict) and before.get(name) in saved_files and now.get(name) in current_files \
            and saved_files[before[name]].split(",")[0] == current_files[now[name]].split(",")[0]
        if not moved:  # the same file under another path (equal size) is the same tokenizer
            changed.append(f"{flag} (checkpoint {_shown(before.get(name))}, now {_shown(now.get(name))})")
    for name, flag in TOKENIZER_FIELDS[1:4]:
        path = now.get(name)
        if (path and path == before.get(name) and isinstance(saved_files, dict) and path in saved_files
                and path in current_files and saved_files[path].split(",")[0] != current_files[path].split(",")[0]):
            changed.append(f"{flag} {path}'s contents ({saved_files[path]}, now {current_files[path]})")
    if changed:
        raise ResumeError(f"--load {directory}: the tokenizer changed since the checkpoint: {'; '.join(changed)}. "
                          "Token ids would mean other text to the trained embeddings, so the run is not continued. "
                          "Give the saved run's tokenizer to continue it, or --finetune (with a --save of its own) to "
                          "start a new run from the saved weights.")
