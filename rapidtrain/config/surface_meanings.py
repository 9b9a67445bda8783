"""What the Megatron-family flags given on a command line do here, applied once after parsing: each one works (its
meaning applied, with a plan note where it is another origin's name or unit), is noted as having no effect, or is
refused with exit status 2 naming the flag, why, and what to use (all refusals at once)."""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from typing import Any

from rapidtrain.config.flag_status import HYBRID_LAYERS, NO_EFFECT, REFUSED
from rapidtrain.config.flag_surface import (
    VALUE_ALIASES,
    VALUE_REFUSALS,
    FlagRefused,
    classify,
    megatron_flags_given,
    record_of,
    refusal_applies,
)
from rapidtrain.config.settings import MEGATRON_TASKS

Args = argparse.Namespace


def apply_surface(args: Args, parser: argparse.ArgumentParser, given: set[str] | None = None) -> list[str]:
    """The plan notes of the Megatron-family flags given (`given`: the destinations typed, from which a flag this
    sets back to its default is removed); raises FlagRefused listing every refused one."""
    given = set() if given is None else given
    notes: list[str] = []
    refusals: list[str] = []
    _own_values(args, parser, notes, refusals)
    typed = sorted(megatron_flags_given(args), key=lambda item: HANDLER_ORDER.index(item[0])
                   if item[0] in HANDLER_ORDER else len(HANDLER_ORDER))
    for flag, value in typed:
        treatment = classify(flag)
        shown = _shown(flag, value)
        if treatment is None:
            continue
        if treatment.kind in ("renamed", "sets"):
            notes.append(f"{shown}: {treatment.note}")
        elif treatment.kind == "handled":
            HANDLERS[flag](args, value, notes, refusals)
        elif treatment.status == NO_EFFECT:
            notes.append(f"{shown}: no effect here; {treatment.note}")
        elif treatment.status == REFUSED and refusal_applies(flag, value):
            refusals.append(f"{shown}: {treatment.note}")
    defaults = {action.dest: action.default for action in parser._actions if action.default != argparse.SUPPRESS}
    _megatron_deepspeed_config(args, given, notes, refusals, defaults)
    _moe_layer_pattern(args, notes, refusals)
    _moe_topk(args, refusals)
    _sinkhorn(args, given, notes, refusals)
    _moe_dropping_by_origin(args, parser, given, notes)
    _moe_loss_coeff_default(args, given, notes)
    _weighted_splits(args, given, notes, refusals)
    if getattr(args, "raw_json_dataset", None) and "split" in given:
        notes.append(f"--split {args.split}: no effect here; each split reads its own JSON file")
    if refusals:
        raise FlagRefused("these flags ask for what rapidtrain does not do (docs/megatron-compat.md lists every "
                          "flag):\n" + "\n".join(f"  {line}" for line in refusals))
    return notes


def _shown(flag: str, value: object) -> str:
    if value is True or value is False:
        return flag
    if isinstance(value, list):
        return f"{flag} {' '.join(map(str, value))}"
    return f"{flag} {value}"


def _own_values(args: Args, parser: argparse.ArgumentParser, notes: list[str], refusals: list[str]) -> None:
    """rapidtrain's own flags given another origin's value: its spelling translated, or refused."""
    for action in parser._actions:  # argparse offers its actions only this way
        _one_value(args, action, notes, refusals)
        own = getattr(action, "rapidtrain_choices", None)
        value = getattr(args, action.dest, None)
        if own is None or value is None or value in own:
            continue
        flag = action.option_strings[0]
        alias = VALUE_ALIASES.get(action.dest, {}).get(value)
        if action.dest == "position_embedding_type" and value == "yarn":  # Megatron's YaRN rotary embedding
            if args.rope_type == "rope":
                refusals.append(f"{flag} yarn and --rope-type rope ask for different rotary embeddings: keep one")
            args.position_embedding_type, args.rope_type = "rope", "yarn"
            notes.append(f"{flag} yarn: rotary embeddings with YaRN scaling (--position-embedding-type rope "
                         "--rope-type yarn)")
        elif alias is not None:
            setattr(args, action.dest, alias)
            notes.append(f"{flag} {value}: {alias}, rapidtrain's spelling")
        elif value in VALUE_REFUSALS.get(action.dest, {}):
            refusals.append(f"{flag} {value}: {VALUE_REFUSALS[action.dest][value]}")
        else:
            refusals.append(f"{flag} {value}: not in rapidtrain; it has {', '.join(map(str, own))}")
    if isinstance(args.split, str):  # `--split '99,1,0'` from a script that quoted it inside a variable
        args.split = args.split.strip("'\"")
    if isinstance(args.step_batch_size_schedule, list):  # a list written as separate words
        args.step_batch_size_schedule = " ".join(args.step_batch_size_schedule)


# DeepSpeed config keys that say what rapidtrain's flags say: key → (destination, value from the key's value).
DEEPSPEED_KEYS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "train_micro_batch_size_per_gpu": ("micro_batch_size", int),
    "train_batch_size": ("global_batch_size", int),
    "gradient_clipping": ("clip_grad", float),
    "fp16.enabled": ("fp16", bool),
    "bf16.enabled": ("bf16", bool),
    "fp16.loss_scale": ("loss_scale", lambda v: float(v) or None),
    "fp16.initial_scale_power": ("initial_loss_scale", lambda v: 2.0 ** v),
    "fp16.loss_scale_window": ("loss_scale_window", int),
    "fp16.hysteresis": ("hysteresis", int),
    "fp16.min_loss_scale": ("min_loss_scale", float),
}


ZERO_TUNING = ("zero_overlap_comm", "zero_contiguous_gradients", "zero_reduce_bucket_size",
               "zero_allgather_bucket_size", "zero_stage3_prefetch_bucket_size",
               "zero_stage3_param_persistence_threshold", "zero_stage3_max_live_parameters")


def _megatron_deepspeed_config(args: Args, given: set[str], notes: list[str], refusals: list[str],
                               parser_defaults: dict) -> None:
    """Megatron-DeepSpeed's `--deepspeed --deepspeed_config FILE`: the file's ZeRO stage selects rapidtrain's ZeRO
    switch; where DeepSpeed does not run the layout (stage 0, or tensor/pipeline parallelism, served by DDP or
    FSDP2), the keys that are flags are read as flags and the file is not merged (the plan lists the rest)."""
    from rapidtrain.config.partitioning import read_user_config, zero_by_fsdp2, zero_stage

    if not (args.deepspeed and args.deepspeed_config):
        return
    path = args.deepspeed_config
    try:
        config = read_user_config(path)
    except ValueError as error:
        refusals.append(str(error))
        return
    try:
        zero = config.get("zero_optimization") or {}
        stage = int(zero) if isinstance(zero, bool) else int(zero.get("stage", 0) or 0)  # DeepSpeed 0.1's `true`: 1
        if stage not in (0, 1, 2, 3):
            raise ValueError(f"stage {stage}")
    except (ValueError, TypeError, AttributeError) as error:
        refusals.append(f"--deepspeed_config {path}: zero_optimization is not DeepSpeed's ({error}): give an "
                        'object with "stage": 0 to 3')
        return
    chosen = next((n for n in (1, 2, 3) if getattr(args, f"zero_{n}_memory_optimization")), 0)
    if chosen and stage and chosen != stage:
        refusals.append(f"--deepspeed_config {path}: ZeRO stage {stage}, the flags {chosen} (--zero-stage); make "
                        "them agree")
    elif stage and not chosen:
        setattr(args, f"zero_{stage}_memory_optimization", True)
        notes.append(f"--deepspeed_config {path}: ZeRO stage {stage} → --zero-{stage}-memory-optimization")
    try:
        read = _deepspeed_keys_as_flags(args, config, given, path, notes)
    except (ValueError, TypeError) as error:
        refusals.append(f"--deepspeed_config {path}: a value has the wrong type ({error}); fix the file")
        return
    if zero_stage(args) and not zero_by_fsdp2(args):
        from rapidtrain.config.deepspeed_keys import refuse_engine_data_features

        # DeepSpeed runs it: the file is merged with the generated config (a key both set must agree), but the
        # engine's data features would reach into rapidtrain's data and model
        refuse_engine_data_features(config, path, refusals)
        return
    args.deepspeed_config = None
    tuning = [dest for dest in ZERO_TUNING if dest in given]
    for dest in tuning:  # DeepSpeed's own knobs, for an engine this layout does not start
        setattr(args, dest, parser_defaults[dest])
        given.discard(dest)  # back at its default: no longer a flag the rules hold the user to
    if tuning:
        notes.append(f"{', '.join('--' + d.replace('_', '-') for d in tuning)}: no effect here; they tune DeepSpeed "
                     "ZeRO, which does not run this layout")
    notes.append(f"--deepspeed_config {path}: DeepSpeed does not run this layout (ZeRO stage {stage} with tensor-"
                 f"parallel {args.tensor_model_parallel_size}, pipeline {args.pipeline_model_parallel_size}: DDP, or "
                 f"FSDP2 for ZeRO-1/2); read as flags: {', '.join(read) or 'none'}; each other key follows")
    from rapidtrain.config.deepspeed_keys import audit_keys

    try:
        audit_keys(args, config, path, {key for key in DEEPSPEED_KEYS if _has_key(config, key)}, notes, refusals)
    except (ValueError, TypeError) as error:
        refusals.append(f"--deepspeed_config {path}: a value has the wrong type ({error}); fix the file")


def _has_key(config: dict, key: str) -> bool:
    section, _, name = key.rpartition(".")
    holder = config.get(section) if section else config
    return isinstance(holder, dict) and name in holder


def _deepspeed_keys_as_flags(args: Args, config: dict, given: set[str], path: str,
                             notes: list[str]) -> list[str]:
    """The config's keys that rapidtrain has flags for, read as those flags. The file wins over a flag that says
    otherwise, as in Megatron-DeepSpeed, where DeepSpeed's engine takes batch sizes and loss scaling from it."""
    read = []
    for key, (dest, convert) in DEEPSPEED_KEYS.items():
        section, _, name = key.rpartition(".")
        holder = config.get(section) if section else config
        if not isinstance(holder, dict) or name not in holder or holder[name] == "auto":
            continue
        value = convert(holder[name])
        if dest in given and getattr(args, dest) != value:
            notes.append(f"--{dest.replace('_', '-')} {getattr(args, dest)!r}: --deepspeed_config {path} sets "
                         f"{key} {holder[name]!r}, which DeepSpeed runs with in Megatron-DeepSpeed; so does this run")
        setattr(args, dest, value)
        read.append(f"{key} → --{dest.replace('_', '-')}")
    return read


def _one_value(args: Args, action: argparse.Action, notes: list[str], refusals: list[str]) -> None:
    value = getattr(args, action.dest, None)
    if not getattr(action, "rapidtrain_scalar", False) or not isinstance(value, list):
        return
    if len(value) == 1:
        setattr(args, action.dest, value[0])
    else:
        refusals.append(f"{action.option_strings[0]} {' '.join(map(str, value))}: rapidtrain takes one value here")


def _moe_layer_pattern(args: Args, notes: list[str], refusals: list[str]) -> None:
    """A per-layer 0/1 --moe-layer-freq becomes rapidtrain's per-layer --num-experts list (0 = dense), and so does
    Megatron-DeepSpeed's --expert-interval N, which means otherwise than Megatron-Core's --moe-layer-freq N: its
    layers are numbered from 1 and those divisible by N are MoE (0-based N-1, 2N-1, ...), where Megatron-Core's
    are 0, N, 2N, ... (a checkpoint or script of either origin keeps its own layers)."""
    pattern = args.moe_layer_freq
    interval = dict(megatron_flags_given(args)).get("--expert-interval")
    experts = args.num_experts or []
    if isinstance(interval, int) and interval > 1 and len(experts) == 1 and not isinstance(pattern, list):
        args.num_experts = [experts[0] if (i + 1) % interval == 0 else 0 for i in range(args.num_layers)]
        args.moe_layer_freq = 1
        notes.append(f"--expert-interval {interval} (Megatron-DeepSpeed: layers {interval}, {2 * interval}, ... "
                     f"counted from 1): --num-experts {' '.join(map(str, args.num_experts))} (0 = dense layer)")
        return
    if not isinstance(pattern, list):
        return
    if len(experts) != 1 or len(pattern) != args.num_layers:
        refusals.append(f"--moe-layer-freq with a {len(pattern)}-layer pattern needs one --num-experts value and "
                        f"--num-layers {len(pattern)}")
        return
    args.num_experts = [experts[0] * bit for bit in pattern]
    args.moe_layer_freq = 1
    notes.append(f"--moe-layer-freq pattern: --num-experts {' '.join(map(str, args.num_experts))} (0 = dense layer)")


def _moe_topk(args: Args, refusals: list[str]) -> None:
    experts = max(args.num_experts or [0])
    if args.moe_router_topk < 1 or (experts > 1 and args.moe_router_topk > experts):
        refusals.append(f"--moe-router-topk {args.moe_router_topk}: each token goes to 1 to --num-experts ({experts}) "
                        "experts")


def _samples(tokens: int, args: Args) -> int:
    return math.ceil(tokens / args.seq_length)


def _iterations(samples: int, args: Args) -> int | None:
    return math.ceil(samples / args.global_batch_size) if args.global_batch_size else None


def _train_tokens(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    samples = _samples(value, args)
    iterations = _iterations(samples, args)
    if args.train_iters is not None and iterations is not None:
        args.train_iters = min(args.train_iters, iterations)
        notes.append(f"--train-tokens {value}: training stops after {args.train_iters} iterations (whichever of "
                     f"--train-iters and {value} tokens / (--seq-length {args.seq_length} × global batch "
                     f"{args.global_batch_size}) comes first, as Megatron-DeepSpeed)")
    elif args.train_iters is None:
        args.train_samples = min(samples, args.train_samples or samples)
        notes.append(f"--train-tokens {value}: --train-samples {args.train_samples} (whichever of --train-samples and "
                     f"tokens / --seq-length {args.seq_length} is smaller)")
    else:
        notes.append(f"--train-tokens {value}: --train-iters {args.train_iters} ends the run (the global batch is not "
                     "given, so the tokens' iteration count is not known before start)")


def _schedule_tokens(kind: str):
    def handle(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
        samples = _samples(value, args)
        if args.train_iters is None:
            setattr(args, f"lr_{kind}_samples", samples)
            notes.append(f"--lr-{kind}-tokens {value}: --lr-{kind}-samples {samples} (tokens / --seq-length)")
            return
        iterations = _iterations(samples, args) or math.ceil(samples / args.micro_batch_size)
        setattr(args, f"lr_{kind}_iters", iterations)
        if kind == "warmup":
            args.lr_warmup_fraction = None
        notes.append(f"--lr-{kind}-tokens {value}: --lr-{kind}-iters {iterations} (tokens / --seq-length / global "
                     "batch)")
    return handle


def _key_value_heads(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    args.num_query_groups = value
    args.group_query_attention = value != args.num_attention_heads
    notes.append(f"--num-key-value-heads {value}: --num-query-groups {value}"
                 + (" --group-query-attention" if args.group_query_attention else " (one per head: plain attention)"))


def _zero_stage(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    if value not in (0, 1, 2, 3):
        refusals.append(f"--zero-stage {value}: DeepSpeed's stages are 0 to 3")
        return
    if value:
        setattr(args, f"zero_{value}_memory_optimization", True)
    notes.append(f"--zero-stage {value}: " + (f"--zero-{value}-memory-optimization" if value else
                                              "no ZeRO sharding (plain data parallelism)"))


def _gas(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    if args.global_batch_size is not None:
        notes.append(f"--gas {value}: --global-batch-size {args.global_batch_size} decides the accumulation steps")
        return
    world = int(os.environ.get("WORLD_SIZE") or args.nproc_per_node or 1)
    data_parallel = max(world // (args.tensor_model_parallel_size * args.pipeline_model_parallel_size), 1)
    args.global_batch_size = args.micro_batch_size * value * data_parallel
    notes.append(f"--gas {value}: --global-batch-size {args.global_batch_size} (micro {args.micro_batch_size} × "
                 f"{value} × data parallel {data_parallel})")


def _note(text: str):
    def handle(args: Args, value: object, notes: list[str], refusals: list[str]) -> None:
        notes.append(f"{_shown(text, value)}: " + note_of(text))
    return handle


def note_of(flag: str) -> str:
    """The table's note of a flag this module applies (each one is classified: test_flag_surface)."""
    treatment = classify(flag)
    assert treatment is not None, flag
    return treatment.note


def _mock_data(args: Args, value: bool, notes: list[str], refusals: list[str]) -> None:
    args.data_path = None
    notes.append("--mock-data: " + note_of("--mock-data"))


def _ckpt_format(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    if value != "torch_dist":
        notes.append(f"--ckpt-format {value}: checkpoints are written as torch_dist (torch.distributed.checkpoint), "
                     "rapidtrain's one format")


def _no_position_embedding(args: Args, value: bool, notes: list[str], refusals: list[str]) -> None:
    if args.position_embedding_type not in ("rope", "alibi"):
        refusals.append("--no-position-embedding: rapidtrain's models need a position encoding; add "
                        "--position-embedding-type rope (or --use-rotary-position-embeddings) or alibi")


def _pretrained_checkpoint(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    if args.task in MEGATRON_TASKS:  # Megatron's tasks/main.py: the starting BERT; --load resumes the task run
        notes.append(f"--pretrained-checkpoint {value}: the {args.task} model starts from this BERT checkpoint's "
                     "encoder and pooler (its head is new)")
    elif args.load is None:
        args.load, args.finetune = value, True
        notes.append(f"--pretrained-checkpoint {value}: --load {value} --finetune")


def _patch_tokenizer(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    if value == "JiebaBPETokenizer":  # Pai's Chinese BPE from a tokenizer.json, not a Hugging Face folder
        args.tokenizer_type = value
        notes.append(f"--patch-tokenizer-type {value}: --tokenizer-type {value} (jieba's words through the BPE of "
                     f"--vocab-file {args.vocab_file})")
        return
    folder = args.tokenizer_model or args.load or getattr(args, "pretrained_checkpoint", None)
    args.tokenizer_type, args.tokenizer_model = "HuggingFaceTokenizer", folder
    notes.append(f"--patch-tokenizer-type {value}: --tokenizer-type HuggingFaceTokenizer --tokenizer-model {folder} "
                 "(a local Hugging Face tokenizer folder)")


def _pai_dataset(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    from rapidtrain.data.chat_sft import CHAT_SFT_KINDS
    from rapidtrain.data.raw_json import RAW_JSON_KINDS

    if "idxmap" in value.lower() or value.upper() == "MMAP":
        notes.append(f"--dataset {value}: Megatron indexed data (--data-path)")
        if "idxmap" in value.lower() and args.data_path:
            _idxmap_reads_data_path(args, value, notes)
    elif value in RAW_JSON_KINDS + CHAT_SFT_KINDS:
        _raw_json(args, value, notes, refusals)
    else:
        kinds = ", ".join(RAW_JSON_KINDS + CHAT_SFT_KINDS)
        refusals.append(f"--dataset {value}: not read by rapidtrain (it reads {kinds} JSON and Megatron indexed "
                        "data); make indexed data with scripts/preprocess_data.py and pass --dataset ...-Idxmap")


def _optimizer_offload_fraction(args: Args, value: object, notes: list[str], refusals: list[str]) -> None:
    """Megatron-Core offloads a share of the optimizer state; DeepSpeed's CPU Adam behind --cpu-offload the whole."""
    if not args.cpu_offload:
        notes.append(f"--optimizer-offload-fraction {value}: no effect here; without --optimizer-cpu-offload the "
                     "optimizer state stays on the device")
    elif float(str(value)) == 1.0:
        notes.append(f"--optimizer-offload-fraction {value}: the whole optimizer state on the CPU (--cpu-offload)")
    else:
        refusals.append(f"--optimizer-offload-fraction {value}: rapidtrain's --cpu-offload (DeepSpeed's CPU Adam) "
                        "keeps the whole optimizer state on the CPU, not a share; give 1.0, or drop "
                        "--optimizer-cpu-offload to keep it on the device")


def _optimizer_offload_policy(args: Args, value: object, notes: list[str], refusals: list[str]) -> None:
    if value == "static":
        notes.append(f"--optimizer-offload-policy {value}: " + note_of("--optimizer-offload-policy"))
    else:
        refusals.append(f"--optimizer-offload-policy {value}: Pai's policy that moves optimizer state by the free "
                        "device memory at run time is not in rapidtrain; use --cpu-offload (the whole state)")


def _idxmap_reads_data_path(args: Args, value: str, notes: list[str]) -> None:
    """Pai's 2024 *-Idxmap kinds build their datasets from --data-path and --split alone: the per-split paths its
    scripts pass beside it (the same prefix, for the raw kinds) are not read, so they do not stop the run here."""
    for dest in ("train_data_path", "valid_data_path", "test_data_path"):
        if getattr(args, dest, None):
            notes.append(f"--{dest.replace('_', '-')} {' '.join(getattr(args, dest))}: no effect here; --dataset "
                         f"{value} reads --data-path with --split (as Pai's Idxmap datasets)")
            setattr(args, dest, None)


def _raw_json(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    """Pai's raw JSON kinds: records from --train-data-path, tokenized at start, padded."""
    chat = value == "JSON-SFT"
    length = args.max_padding_length or args.seq_length
    if not args.train_data_path:
        refusals.append(f"--dataset {value}: give the JSON file of records with --train-data-path")
    elif length > args.seq_length:
        refusals.append(f"--max-padding-length {length}: samples longer than --seq-length {args.seq_length}; give "
                        "at most --seq-length")
    elif chat and getattr(args, "train_mode", "pretrain") != "finetune":
        refusals.append(f"--dataset {value}: Pai's chat-template fine-tuning data; add --train-mode finetune (Pai "
                        "refuses it in its default pretrain mode too)")
    else:
        args.raw_json_dataset, args.max_padding_length = value, length
        source = "the training file (as Pai)" if not args.valid_data_path else "--valid-data-path"
        if chat:
            packed = args.reset_position_ids or args.reset_attention_mask
            notes.append(f"--dataset {value}: Pai's chat-template SFT: each record (messages, conversations, or "
                         "instruction/input/output) rendered by the tokenizer's chat template, only the assistant "
                         "turns (after their header, their end token included) carrying loss, each "
                         "conversation's loss its answer tokens' mean and the batch's the "
                         f"conversations' mean (Pai's per-sequence average); {length} tokens a sample (a prompt "
                         "longer than that drops its record, a longer answer is cut)"
                         + ("; conversations packed to a row" if packed else "")
                         + f"; validation reads {source}")
        else:
            notes.append(f"--dataset {value}: Pai's raw JSON records tokenized at start (prompt = instruction + "
                         "input, masked out of the loss; answer = output + end of document), "
                         f"{length} tokens a sample (padded, longer records dropped); validation reads {source}")
        if args.data_path:
            notes.append(f"--data-path {' '.join(args.data_path)}: no effect here; --dataset {value} reads "
                         "--train-data-path")
            args.data_path = None
        _sft_packing_flags(args, value, chat, notes)


def _sft_packing_flags(args: Args, value: str, chat: bool, notes: list[str]) -> None:
    """JSON-SFT packs with the resets (each conversation its own positions and attention); --eod-mask-loss, and the
    resets of the instruction/output kinds, change nothing there: the loss mask is the answers' already."""
    dests = ("eod_mask_loss",) if chat else ("eod_mask_loss", "reset_position_ids", "reset_attention_mask")
    for dest in dests:
        if getattr(args, dest):
            reason = ("the loss already covers the assistant turns only, their end token included, as Pai's SFT "
                      "batches (its mask comes from the labels)" if chat else
                      "a raw JSON sample is one record, whose answer and end-of-document token carry the loss "
                      "(Pai's raw datasets mask the prompt only)")
            notes.append(f"--{dest.replace('_', '-')}: no effect here; {reason}")
            setattr(args, dest, False)
    if chat and (args.reset_position_ids or args.reset_attention_mask):
        kept = " and ".join(f"--{d.replace('_', '-')}" for d in ("reset_position_ids", "reset_attention_mask")
                            if getattr(args, d))
        notes.append(f"{kept}: --dataset {value} packs whole conversations into each row; "
                     + ("positions restart at each conversation" if args.reset_position_ids else
                        "positions run on across the row")
                     + ("; attention stays within each conversation" if args.reset_attention_mask else
                        "; attention reaches earlier conversations of the row"))


def _max_padding_length(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    from rapidtrain.data.chat_sft import CHAT_SFT_KINDS
    from rapidtrain.data.raw_json import RAW_JSON_KINDS

    if getattr(args, "dataset", None) not in RAW_JSON_KINDS + CHAT_SFT_KINDS:
        notes.append(f"--max-padding-length {value}: no effect here; " + note_of("--max-padding-length"))


def _train_mode(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    dataset = getattr(args, "dataset", None)
    if value == "pretrain":
        return
    if value != "finetune":
        refusals.append(f"--train-mode {value}: Pai's modes are pretrain and finetune")
    elif dataset in ("JSON-SFT", "LLama-SFT"):
        notes.append(f"--train-mode finetune: supervised fine-tuning on --dataset {dataset}")
    elif dataset is not None and dataset.upper() == "MMAP" and args.data_path:
        _idxmap_sft(args, notes)
    else:
        refusals.append(f"--train-mode finetune with --dataset {dataset}: Pai fine-tunes on --dataset MMAP "
                        "--data-path PREFIX (its SFT idxmap: toolkits/sft_data_preprocessing), JSON-SFT or LLama-SFT; "
                        "give one of those")


def _idxmap_sft(args: Args, notes: list[str]) -> None:
    """Pai's SFT idxmap: the loss mask comes from the labels, and packing (--reset-position-ids, Pai's
    MP_SFT_PACKING) keeps each conversation's attention to itself as Pai's packed sequences do."""
    args.idxmap_sft = True
    packed = args.reset_position_ids or args.reset_attention_mask
    notes.append("--train-mode finetune with --dataset MMAP: Pai's SFT idxmap (toolkits/sft_data_preprocessing): "
                 f"each document {2 * args.seq_length} ids, {args.seq_length} tokens then their labels (-100: no "
                 "loss); the loss is the mean over " + ("conversations (packed: positions restart and attention "
                                                        "stays within each)" if packed else "rows")
                 + ", Pai's per-sequence average")
    if args.eod_mask_loss:
        notes.append("--eod-mask-loss: no effect here; the SFT idxmap's labels say which positions carry loss")
        args.eod_mask_loss = False
    if packed and not (args.reset_position_ids and args.reset_attention_mask):
        notes.append("--reset-position-ids / --reset-attention-mask: with SFT idxmap packing both apply (Pai's "
                     "packed sequences restart positions and attention at each conversation)")
        args.reset_position_ids = args.reset_attention_mask = True


CORE_ORIGINS = {"Megatron-LM", "Megatron-LM-extras"}
DEEPSPEED_MOE_ORIGINS = {"microsoft/Megatron-DeepSpeed", "bigscience/Megatron-DeepSpeed", "DeepSpeedExamples",
                         "rapidformer"}


def moe_flag_origins(args: Args, parser: argparse.ArgumentParser, given: set[str]) -> tuple[list[str], list[str]]:
    """(MoE flags typed that only Megatron-Core has, those only DeepSpeed-MoE's parsers have: Megatron-DeepSpeed,
    Rapidformer). A flag rapidtrain parses under several spellings counts only when every spelling says the same."""
    spelled = {flag for flag, _ in megatron_flags_given(args)}  # other origins' flags, as typed
    spelled |= {" ".join(action.option_strings) for action in parser._actions  # rapidtrain's own, by destination
                if action.dest in given and action.option_strings and classify(action.option_strings[0]) is None}
    core, deepspeed = [], []
    for spelling in sorted(spelled):
        flags = spelling.split()
        if not any("moe" in flag or flag in ("--topk", "--expert-interval") for flag in flags):
            continue
        origins = [set((record_of(flag) or {}).get("origins") or ()) for flag in flags]
        if origins and all(o and o <= CORE_ORIGINS for o in origins):
            core.append(flags[0])
        elif origins and all(o and not o & CORE_ORIGINS and o & DEEPSPEED_MOE_ORIGINS for o in origins):
            deepspeed.append(flags[0])
    return core, deepspeed


def _moe_dropping_by_origin(args: Args, parser: argparse.ArgumentParser, given: set[str], notes: list[str]) -> None:
    """Token dropping as the MoE flags' origin means it. Megatron-Core is dropless unless a capacity factor is
    given (--moe-expert-capacity-factor); DeepSpeed-MoE (Megatron-DeepSpeed) and Rapidformer drop at capacity
    factor 1 unless --disable-moe-token-dropping. Flags only one of them has tell which the command line is written
    for; with none, rapidtrain keeps DeepSpeed-MoE's and Rapidformer's capacity 1 (the command line it takes)."""
    if not args.num_experts or max(args.num_experts) <= 1 or args.disable_moe_token_dropping:
        return
    typed = {flag for flag, _ in megatron_flags_given(args)}
    if "--moe-expert-capacity-factor" in typed or "--moe-train-capacity-factor" in typed \
            or "moe_capacity_factor" in given:
        notes.append(f"MoE token dropping: capacity factor {args.moe_capacity_factor:g} as given (every origin drops "
                     "tokens over capacity when a capacity factor is given)")
        return
    core, deepspeed = moe_flag_origins(args, parser, given)
    if core and not deepspeed:
        args.disable_moe_token_dropping = True
        notes.append(f"MoE token dropping: Megatron-Core's meaning (its flags {', '.join(sorted(core))}): dropless, "
                     "every token reaches its experts, since no --moe-expert-capacity-factor is given")
    else:
        why = (f"its flags {', '.join(sorted(deepspeed))}" if deepspeed else
               "no flag only Megatron-Core has; give --disable-moe-token-dropping for Megatron-Core's dropless")
        notes.append(f"MoE token dropping: DeepSpeed-MoE's and Rapidformer's meaning ({why}): capacity factor "
                     f"{args.moe_capacity_factor:g}, tokens over an expert's capacity dropped")


def _moe_loss_coeff_default(args: Args, given: set[str], notes: list[str]) -> None:
    """The balancing loss's weight where no flag gives it: the origins' defaults differ (Megatron-Core's
    --moe-aux-loss-coeff 0, no balancing loss; Megatron-DeepSpeed's --moe-loss-coeff 0.1; Pai-Megatron-Patch's
    0.01). rapidtrain keeps its own 0.01 (Pai's) whatever flags are typed — its own MoE flags are Megatron-Core's
    spellings, so they cannot tell a Megatron-Core command line from one written for rapidtrain, and a run that
    silently lost its balancing loss would collapse onto a few experts — and the plan says so, with the flag to type."""
    if not args.num_experts or max(args.num_experts) <= 1 or "moe_loss_coeff" in given or not args.moe_loss_coeff:
        return
    notes.append(f"MoE load-balancing loss weight {args.moe_loss_coeff:g} (rapidtrain's and Pai-Megatron-Patch's "
                 "default; Megatron-Core's is 0, no balancing loss, Megatron-DeepSpeed's 0.1): give "
                 "--moe-aux-loss-coeff to choose")


# What Megatron-LM's --enable-gpt-oss sets (its model builder): gpt-oss's YaRN, as flag destinations.
GPT_OSS_YARN = {"rope_type": "yarn", "rotary_scaling_factor": 32.0, "yarn_original_max_position_embeddings": 131072,
                "yarn_beta_fast": 32.0, "yarn_beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.0,
                "yarn_correction_range_round_to_int": False}


def _enable_gpt_oss(args: Args, value: bool, notes: list[str], refusals: list[str]) -> None:
    if not value:
        return
    for dest, setting in GPT_OSS_YARN.items():
        setattr(args, dest, setting)
    notes.append("--enable-gpt-oss: gpt-oss's YaRN rope, as Megatron sets it (--rope-type yarn, factor 32, original "
                 "positions 131072, beta fast 32 / slow 1, mscale 1, mscale-all-dim 0, correction range not rounded)")


def _load_balancing(args: Args, value, notes: list[str], refusals: list[str]) -> None:
    kinds = set(value if isinstance(value, list) else [value])
    if kinds <= {"aux_loss"}:
        notes.append(f"{_shown('--moe-router-load-balancing-type', value)}: the built-in router's load-balancing loss")
    elif kinds == {"seq_aux_loss"}:
        args.moe_aux_loss_type = "seq_aux_loss"
        notes.append(f"{_shown('--moe-router-load-balancing-type', value)}: the load-balancing loss per sequence, "
                     "averaged over the sequences (DeepSeek-V3), weighted by --moe-aux-loss-coeff")
    elif kinds == {"none"}:
        args.moe_loss_coeff = 0.0
        notes.append("--moe-router-load-balancing-type none: --moe-aux-loss-coeff 0")
    elif kinds == {"sinkhorn"}:
        args.moe_aux_loss_type = "sinkhorn"  # its coefficient and the router flags it ignores: _sinkhorn below
    else:
        refusals.append(f"{_shown('--moe-router-load-balancing-type', value)}: rapidtrain's router balances with "
                        "one of aux_loss, seq_aux_loss, sinkhorn (or none); global_aux_loss, quantile_balancing and "
                        "combinations of types are not in it")


# Router settings Sinkhorn routing does not read (Megatron-Core ignores them): flag → the namespace value that asks
# for nothing.
SINKHORN_IGNORES = {"--moe-router-score-function": ("moe_router_score_function", "softmax"),
                    "--moe-router-pre-softmax": ("moe_router_pre_softmax", False),
                    "--moe-router-topk-scaling-factor": ("moe_router_topk_scaling_factor", None),
                    "--moe-router-num-groups": ("moe_router_num_groups", None),
                    "--moe-router-enable-expert-bias": ("moe_router_enable_expert_bias", False)}


def _sinkhorn(args: Args, given: set[str], notes: list[str], refusals: list[str]) -> None:
    """Sinkhorn routing balances by its choice, with no balancing loss: Megatron asserts --moe-aux-loss-coeff 0 (its
    default); rapidtrain's default coefficient becomes 0 here, one given stops the run, as do the router flags that
    Sinkhorn routing would ignore."""
    if getattr(args, "moe_aux_loss_type", None) != "sinkhorn":
        return
    ignored = [flag for flag, (dest, neutral) in SINKHORN_IGNORES.items() if getattr(args, dest) != neutral]
    if "moe_loss_coeff" in given and args.moe_loss_coeff:
        ignored.append(f"--moe-aux-loss-coeff {args.moe_loss_coeff:g}")
    if ignored:
        refusals.append(f"--moe-router-load-balancing-type sinkhorn chooses by the Sinkhorn-balanced logits and "
                        "combines with sigmoid (top-1) or softmax scores, with no balancing loss: "
                        f"{', '.join(ignored)} would do nothing under it (Megatron-Core asserts a zero "
                        "--moe-aux-loss-coeff). Drop them.")
        return
    args.moe_loss_coeff = 0.0
    notes.append("--moe-router-load-balancing-type sinkhorn: Sinkhorn routing, the experts chosen by the logits "
                 "balanced over the micro-batch's tokens (Sinkhorn-Knopp), no balancing loss (--moe-aux-loss-coeff 0)")


def _exact_vocab_rows(flag: str, args: Args, value: int, notes: list[str], refusals: list[str]) -> bool:
    """Pai's --padded-vocab-size and BigScience's --pad-vocab-size-to: N embedding rows, as padding to a multiple of
    N/TP × TP = N gives for any tokenizer of at most N ids. False (and a refusal) when N does not split over TP."""
    tp = args.tensor_model_parallel_size
    if value < 1 or value % tp:
        refusals.append(f"{flag} {value}: the embedding's rows are split over --tensor-model-parallel-size {tp} "
                        f"ranks, so give a positive multiple of {tp}")
        return False
    args.make_vocab_size_divisible_by = value // tp
    notes.append(f"{flag} {value}: the embedding has exactly {value} rows (--make-vocab-size-divisible-by "
                 f"{value // tp} × tensor-parallel {tp})")
    return True


def _padded_vocab_size(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    if _exact_vocab_rows("--padded-vocab-size", args, value, notes, refusals):
        notes[-1] += "; a tokenizer of more ids would pad to the next multiple"


def _pad_vocab_size_to(args: Args, value: int, notes: list[str], refusals: list[str]) -> None:
    """BigScience's exact row count; the tokenizer's size is checked against it by the rules (which read it)."""
    _exact_vocab_rows("--pad-vocab-size-to", args, value, notes, refusals)


def _dataloader_type(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    if value == "external":
        refusals.append("--dataloader-type external: a user-supplied iterator is served by a --user-script instead")
    else:
        notes.append(f"--dataloader-type {value}: " + note_of("--dataloader-type"))


def _window_size(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    """Megatron-Core's --window-size 'LEFT,RIGHT' (also '(LEFT, RIGHT)' or 'LEFT RIGHT'): keys from LEFT positions back
    (-1: all of them) to RIGHT ahead; the built-in GPT is causal, so RIGHT can only be 0 (or -1, which causality
    makes 0)."""
    parts = str(value).strip("()[] ").replace(",", " ").split()
    if len(parts) != 2 or not all(part.lstrip("-").isdigit() for part in parts):
        refusals.append(f"--window-size {value}: give two integers LEFT,RIGHT, e.g. 4096,0 (-1: no limit)")
        return
    left, right = int(parts[0]), int(parts[1])
    if left < -1 or right not in (0, -1):
        refusals.append(f"--window-size {value}: the built-in GPT is causal, so the window is LEFT,0 with LEFT >= 0 "
                        "keys back (or -1, no limit)")
        return
    window = None if left == -1 else left + 1
    if args.sliding_window is not None and args.sliding_window != window:
        refusals.append(f"--window-size {value} and --sliding-window {args.sliding_window} ask for different windows: "
                        "keep one")
        return
    args.sliding_window = window
    notes.append(f"--window-size {value}: " + (f"--sliding-window {window} (each query and the {left} keys before it)"
                                               if window else "no sliding window (-1: every earlier key)"))


def _window_skip_freq(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
    text = str(value).strip()
    if not text.isdigit() or int(text) < 1:
        refusals.append(f"--window-attn-skip-freq {value}: rapidtrain takes one integer N >= 1 (every Nth layer "
                        "attends to the whole sequence), not a per-layer pattern")
        return
    args.window_attn_skip_freq = int(text)
    if args.sliding_window is None:
        notes.append(f"--window-attn-skip-freq {text}: no effect here; there is no sliding window (--window-size or "
                     "--sliding-window) to skip")
    else:
        notes.append(f"--window-attn-skip-freq {text}: " + note_of("--window-attn-skip-freq"))
def _decoupled_lr(args: Args, value: float, notes: list[str], refusals: list[str]) -> None:
    floor = args.decoupled_min_lr if args.decoupled_min_lr is not None else args.min_lr
    named = "--decoupled-min-lr" if args.decoupled_min_lr is not None else "--min-lr"
    bad = [f"{flag} {rate}" for flag, rate in (("--decoupled-lr", value), (named, floor))
           if not (math.isfinite(rate) and rate >= 0)]
    if bad:
        refusals.append(f"{', '.join(bad)}: learning rates are finite numbers ≥ 0")
    elif floor > value:
        refusals.append(f"--decoupled-lr {value:g} is below {named} {floor:g}, the floor its groups decay to; give "
                        "--decoupled-min-lr at most --decoupled-lr")
    else:
        notes.append(f"--decoupled-lr {value:g}: the word embedding and output layer follow the schedule from "
                     f"{value:g} down to {floor:g} ({named}); the other parameters from --lr")


def _decoupled_min_lr(args: Args, value: float, notes: list[str], refusals: list[str]) -> None:
    if args.decoupled_lr is None:
        notes.append(f"--decoupled-min-lr {value:g}: no effect here; it is the floor of --decoupled-lr, not given "
                     "(as in Megatron-Core)")


def _spec(args: Args, value: list[str], notes: list[str], refusals: list[str]) -> None:
    """Megatron's --spec: `local` chooses Megatron's own layers over Transformer Engine's (Megatron-LM's BERT tests
    pass it), which changes nothing here; MODULE FUNCTION imports Megatron-Core code, which rapidtrain does not run."""
    if value == ["local"]:
        notes.append("--spec local: Megatron's layers without Transformer Engine; rapidtrain's layers are its own "
                     "torch modules either way")
    else:
        refusals.append(f"{_shown('--spec', value)}: a Megatron-Core layer spec by module path is not in rapidtrain; "
                        f"{HYBRID_LAYERS}")


def _per_token_loss(args: Args, value: bool, notes: list[str], refusals: list[str]) -> None:
    if args.model_type == "bert" and args.bert_binary_head:
        refusals.append("--calculate-per-token-loss: BERT's sentence-order loss is one value per sample, not per "
                        "token; add --bert-no-binary-head or drop the flag")
    else:
        notes.append("--calculate-per-token-loss: " + note_of("--calculate-per-token-loss"))


SPLITS = ("train", "valid", "test")


def _weighted_paths_file(split: str):
    """`--SPLIT-weighted-split-paths-path FILE`: the file's groups, as if given as --SPLIT-weighted-split-paths."""
    def handle(args: Args, value: str, notes: list[str], refusals: list[str]) -> None:
        from rapidtrain.data.weighted_splits import DataPathError, read_groups_file

        flag = f"--{split}-weighted-split-paths"
        if getattr(args, f"{split}_weighted_split_paths"):
            refusals.append(f"{flag} and {flag}-path: give the groups one way")
            return
        try:
            setattr(args, f"{split}_weighted_split_paths", read_groups_file(value, f"{flag}-path"))
        except DataPathError as error:
            refusals.append(str(error))
    return handle


def _weighted_splits(args: Args, given: set[str], notes: list[str], refusals: list[str]) -> None:
    """BigScience's weighted split paths, parsed into `args.weighted_split_groups` (train, valid, test groups):
    each group a blend of document ranges; exclusive with --data-path and the per-split --*-data-path."""
    from rapidtrain.data.weighted_splits import DataPathError, parse_group

    texts = [getattr(args, f"{split}_weighted_split_paths", None) or [] for split in SPLITS]
    if not any(texts):
        return
    try:
        groups = tuple(tuple(parse_group(text, f"--{split}-weighted-split-paths") for text in split_texts)
                       for split, split_texts in zip(SPLITS, texts, strict=True))
    except DataPathError as error:
        refusals.append(str(error))
        return
    problem = _weighted_splits_problem(args, groups)
    if problem:
        refusals.append(problem)
        return
    args.weighted_split_groups = groups
    for split, split_groups in zip(SPLITS, groups, strict=True):
        if split_groups:
            evaluated = "" if split == "train" else " (each group evaluated and logged on its own)"
            notes.append(f"--{split}-weighted-split-paths: {'; '.join(g.describe() for g in split_groups)}{evaluated}")
    if "split" in given:
        notes.append(f"--split {args.split}: no effect here; the weighted split paths give each split's documents")


def _weighted_splits_problem(args: Args, groups: tuple) -> str | None:
    train, valid, test = groups
    if args.data_path or any(getattr(args, f"{split}_data_path", None) for split in SPLITS):
        return ("--*-weighted-split-paths with --data-path or --*-data-path: BigScience's two ways of naming the "
                "data exclude each other; give one")
    if len(train) != 1:
        return (f"--train-weighted-split-paths: {len(train)} groups; training reads one blend (as BigScience): "
                "give one group, its components separated by commas")
    if args.model_type == "bert" or args.data_iterator == "dynamic-shape":
        return ("--*-weighted-split-paths: the weighted splits feed the GPT's packed samples; drop "
                "--data-iterator dynamic-shape (or use --data-path for BERT)")
    return None


HANDLERS = {
    "--train-tokens": _train_tokens,
    "--lr-decay-tokens": _schedule_tokens("decay"),
    "--lr-warmup-tokens": _schedule_tokens("warmup"),
    "--zero-stage": _zero_stage,
    "--num-key-value-heads": _key_value_heads,
    "--n-head-kv": _key_value_heads,
    "--gas": _gas,
    "--mock-data": _mock_data,
    "--ckpt-format": _ckpt_format,
    "--apply-layernorm-1p": _note("--apply-layernorm-1p"),
    "--no-position-embedding": _no_position_embedding,
    "--pretrained-checkpoint": _pretrained_checkpoint,
    "--patch-tokenizer-type": _patch_tokenizer,
    "--dataset": _pai_dataset,
    "--optimizer-offload-fraction": _optimizer_offload_fraction,
    "--optimizer-offload-policy": _optimizer_offload_policy,
    "--train-mode": _train_mode,
    "--transformer-impl": _note("--transformer-impl"),
    "--no-pipeline-parallel": _note("--no-pipeline-parallel"),
    "--moe-router-load-balancing-type": _load_balancing,
    "--enable-gpt-oss": _enable_gpt_oss,
    "--padded-vocab-size": _padded_vocab_size,
    "--pad-vocab-size-to": _pad_vocab_size_to,
    "--dataloader-type": _dataloader_type,
    "--use-flash-attn": _note("--use-flash-attn"),
    "--use-flash-attn-v1": _note("--use-flash-attn-v1"),
    "--use-flash-attn-triton": _note("--use-flash-attn-triton"),
    "--window-size": _window_size,
    "--window-attn-skip-freq": _window_skip_freq,
    "--decoupled-lr": _decoupled_lr,
    "--decoupled-min-lr": _decoupled_min_lr,
    "--calculate-per-token-loss": _per_token_loss,
    "--spec": _spec,
    "--max-padding-length": _max_padding_length,
    **{f"--{split}-weighted-split-paths": (lambda args, value, notes, refusals: None) for split in SPLITS},
    **{f"--{split}-weighted-split-paths-path": _weighted_paths_file(split) for split in SPLITS},
}
# Sizes and iteration counts first, so the schedule in tokens converts with the final global batch.
# The window before the layers that skip it.
HANDLER_ORDER = ["--gas", "--train-tokens", "--lr-decay-tokens", "--lr-warmup-tokens", "--window-size",
                 "--window-attn-skip-freq"]
