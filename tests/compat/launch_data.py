"""The launch scripts of tests/compat/launch_scripts.json as a user would run them: placeholders filled with local
files, the world size their launcher asks for, `rapidtrain plan` in-process, and the same flags with sizes shrunk
for a run on two CPU processes."""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path

SCRIPTS: list[dict] = json.loads(Path(__file__).with_name("launch_scripts.json").read_text())
BY_ID = {script["id"]: script for script in SCRIPTS}
# Megatron's entry programs and what rapidtrain runs for them; other entries are user scripts of their own.
ENTRIES = {"pretrain_gpt.py": "pretrain_gpt", "pretrain_gpt2.py": "pretrain_gpt", "pretrain_llama.py": "pretrain_gpt",
           "pretrain_bert.py": "pretrain_bert", "main.py": "tasks_main"}


def entry_of(script: dict) -> str | None:
    return ENTRIES.get(Path(script["entry"]).name)


def _launcher_value(argv: list[str], *names: str) -> int | None:
    for index, token in enumerate(argv):
        for name in names:
            if token.startswith(name + "="):
                value = token.split("=", 1)[1]
            elif token == name and index + 1 < len(argv):
                value = argv[index + 1]
            else:
                continue
            return int(value) if value.isdigit() else None
    return None


# Processes per node when the launcher names none: python and torchrun start one, deepspeed one per GPU (a node
# of 8), Slurm's srun as many as its job (taken as one per model-parallel group).
DEFAULT_PER_NODE = {"python": 1, "torchrun": 1, "python -m torch.distributed.launch": 1,
                    "python -m torch.distributed.run": 1, "deepspeed": 8, "srun": 0}


def world_size(script: dict, argv: list[str]) -> int:
    """Processes the launcher starts, rounded up to a multiple of the model-parallel sizes the flags ask for and
    to a data-parallel size the expert-parallel size divides (scripts written for more nodes than one)."""
    launcher = script["launcher_argv"] or []
    per_node = _launcher_value(launcher, "--nproc_per_node", "--nproc-per-node", "--num_gpus")
    per_node = DEFAULT_PER_NODE.get(script["launcher"], 8) if per_node is None else per_node
    if _launcher_value(launcher, "--nproc_per_node", "--nproc-per-node", "--num_gpus") is None and any(
            "{" in token for token in launcher):
        per_node = 8  # the processes per node are a placeholder: a node of 8 GPUs
    nodes = _launcher_value(launcher, "--nnodes", "--num_nodes") or 1
    model_parallel = 1
    for names in (("--tensor-model-parallel-size", "--model-parallel-size"),
                  ("--pipeline-model-parallel-size", "--pipe-parallel-size")):
        model_parallel *= _launcher_value(argv, *names) or 1
    data_parallel = max(math.ceil(per_node * nodes / model_parallel), 1)
    experts = _launcher_value(argv, "--expert-model-parallel-size", "--moe-expert-parallel-size") or 1
    return model_parallel * math.lcm(data_parallel, experts)


@dataclass
class LocalFiles:
    """What the scripts' paths become here (the change a user makes before running one)."""

    folder: Path  # checkpoints, TensorBoard, DeepSpeed configs and any other path go under it
    gpt_prefix: str  # indexed data (documents) in the GPT-2 BPE tokenizer
    bert_prefix: str  # indexed data (sentences) in the BERT WordPiece tokenizer
    gpt_vocab: str
    gpt_merges: str
    bert_vocab: str
    sentencepiece: str  # a SentencePiece .model
    hf_tokenizer: str  # a Hugging Face tokenizer folder
    json_data: str  # JSON lines of {"text": ...}
    hf_bert: str  # a Hugging Face BERT folder (config, weights, tokenizer)


HF_TOKENIZER_TYPES = {"PretrainedFromHF", "HFTokenizer", "HuggingFaceTokenizer", "Llama3Tokenizer",
                      "MistralTokenizer"}
PATH_FLAGS = {"--vocab-file", "--merge-file", "--tokenizer-model", "--tokenizer-name-or-path", "--load", "--save",
              "--pretrained-checkpoint", "--tensorboard-dir", "--deepspeed_config", "--deepspeed-config",
              "--logging-path", "--data-cache-path", "--wandb-save-dir", "--train-data", "--valid-data",
              "--pretrained-model-name-or-path"}
DATA_FLAGS = {"--data-path", "--train-data-path", "--valid-data-path", "--test-data-path"}
WEIGHTED_FLAGS = {"--train-weighted-split-paths", "--valid-weighted-split-paths", "--test-weighted-split-paths"}


def localize(script: dict, files: LocalFiles) -> list[str]:
    """The script's flags with every path (placeholder or the author's own) replaced by a local one of the same
    kind; nothing else changes."""
    argv = [re.sub(r"\{([A-Za-z_0-9]+)\}", lambda m: f"/{m.group(1)}", token) for token in script["argv"]]
    argv = [part for token in argv for part in (token.split("=", 1) if token.startswith("--") else [token])]
    flag, out, words = None, [], 0
    hf = any(t in HF_TOKENIZER_TYPES for t in argv) or "--patch-tokenizer-type" in argv
    for token in argv:
        if token.startswith("--"):
            flag, words = token, 0
            out.append(token)
            continue
        words += 1
        if flag in PATH_FLAGS and words > 1:
            continue  # the rest of a placeholder written as words ('PATH TO SAVE MODEL CHECKPOINT')
        out.append(_local_value(script, flag, token, files, hf))
    return out


def _local_value(script: dict, flag: str | None, value: str, files: LocalFiles, hf: bool) -> str:
    name = Path(value.strip("'\"")).name
    if flag in WEIGHTED_FLAGS:  # "NAME: W START:END PREFIX, ...": each prefix becomes the local GPT data
        return re.sub(r"(?<=\s)/[^\s,]+", lambda _: files.gpt_prefix, value)
    if flag and flag.removesuffix("-path") in WEIGHTED_FLAGS:  # the groups in a file of the user's: one local group
        split = flag.removeprefix("--").split("-")[0]
        groups = files.folder / f"{split}-splits.txt"
        span = "0:0.9" if split == "train" else "0.9:1"
        groups.write_text(f'"{split.upper()}_LOCAL: 1 {span} {files.gpt_prefix}"\n')
        return str(groups)
    if flag in DATA_FLAGS:
        if re.fullmatch(r"[\d.eE+-]+", value):
            return value  # a blend weight
        if value.endswith(".json"):
            return files.json_data
        return files.bert_prefix if "sentence" in value or entry_of(script) == "pretrain_bert" else files.gpt_prefix
    if flag not in PATH_FLAGS:
        return value
    if flag == "--vocab-file":
        bert = entry_of(script) == "pretrain_bert" or name.endswith(".txt") or "Bert" in " ".join(script["argv"])
        return files.sentencepiece if name.endswith(".model") else files.bert_vocab if bert else files.gpt_vocab
    if flag == "--merge-file":
        return files.gpt_merges
    if flag in ("--tokenizer-model", "--tokenizer-name-or-path"):
        return files.hf_tokenizer if hf or flag == "--tokenizer-name-or-path" else files.sentencepiece
    if flag in ("--deepspeed_config", "--deepspeed-config"):
        config = files.folder / f"{script['id']}-ds_config.json"
        config.write_text(json.dumps(script["deepspeed_config"] or {}))
        return str(config)
    if flag in ("--train-data", "--valid-data"):
        return files.json_data
    if flag == "--pretrained-model-name-or-path":
        saved = script["argv"][script["argv"].index("--save") + 1] if "--save" in script["argv"] else None
        return _local_value(script, "--save", value, files, hf) if value == saved else files.hf_bert
    if flag == "--load" and "--patch-tokenizer-type" in script["argv"]:
        return files.hf_tokenizer  # Pai-Megatron-Patch reads the tokenizer from the checkpoint folder
    return str(files.folder / script["id"] / re.sub(r"[^\w.-]", "_", value.strip("/")))  # same value, same folder


@dataclass
class Planned:
    status: int  # 0 planned, 2 a user error
    output: str


def plan(script: dict, argv: list[str]) -> Planned:
    """`rapidtrain plan` in this process, for the world size and device (CUDA) the script was written for."""
    from rapidtrain.cli import plan_command
    from rapidtrain.core.errors import UserError

    entry = entry_of(script)
    options = ["--world-size", str(world_size(script, argv)), "--device", "cuda", "--device-name", "NVIDIA H100"]
    if entry is not None:
        options += ["--entry", entry]
    out, err = io.StringIO(), io.StringIO()
    status = 0
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            plan_command([*options, *argv])
        except SystemExit as stop:
            status = int(stop.code or 0)
        except UserError as error:
            print(f"error: {error}", file=err)
            status = 2
    return Planned(status, out.getvalue() + err.getvalue())


# A launch script's flags for a run on 2 CPU processes: only sizes, counts and the backend change. A value None
# drops the flag (with its values); a callable maps the old value(s).
TINY: dict[str, object] = {
    "--num-layers": "4", "--hidden-size": "64", "--num-attention-heads": "4", "--ffn-hidden-size": "128",
    "--seq-length": "64", "--max-position-embeddings": "64", "--encoder-seq-length": "64",
    "--max-padding-length": "64", "--micro-batch-size": "2", "--batch-size": "2", "--global-batch-size": "4",
    "--train-iters": "4", "--lr-decay-iters": "4", "--lr-warmup-iters": "1", "--train-samples": "16",
    "--lr-decay-samples": "16", "--lr-warmup-samples": "2", "--train-tokens": "1024", "--lr-decay-tokens": "1024",
    "--lr-warmup-tokens": "128", "--eval-iters": "1", "--eval-interval": "2", "--save-interval": "2",
    "--log-interval": "1", "--num-workers": "0", "--distributed-backend": "gloo", "--num-query-groups": "2",
    "--num-key-value-heads": "2", "--kv-channels": "16", "--moe-ffn-hidden-size": "128", "--gas": "1",
    "--num-experts": lambda values: ["2" if v != "0" else "0" for v in values],
    "--tensor-model-parallel-size": lambda values: [str(min(int(values[0]), 2))],
    "--model-parallel-size": lambda values: [str(min(int(values[0]), 2))],
    "--pipeline-model-parallel-size": lambda values: [str(min(int(values[0]), 2))],
    "--pipe-parallel-size": lambda values: [str(min(int(values[0]), 2))],
    "--expert-model-parallel-size": "1", "--moe-expert-parallel-size": "1", "--rampup-batch-size": None,
    "--exit-duration-in-mins": None, "--exit-interval": None, "--moe-router-topk": lambda values: ["1"],
    # today's MoE and attention: shared experts, group-limited routing over the two experts left, MLA's ranks
    "--moe-shared-expert-intermediate-size": "64", "--shared-moe-ffn-hidden-size": "64",
    "--moe-router-num-groups": "2", "--moe-router-group-topk": "1", "--q-lora-rank": "32", "--kv-lora-rank": "16",
    "--qk-head-dim": "16", "--qk-nope-head-dim": "16", "--qk-pos-emb-head-dim": "8", "--qk-rope-head-dim": "8",
    "--v-head-dim": "16",
}
TINY_DEEPSPEED = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2}


def groups(argv: list[str]) -> list[tuple[str, list[str]]]:
    """(flag, its values) in order."""
    out: list[tuple[str, list[str]]] = []
    for token in argv:
        if token.startswith("--"):
            out.append((token, []))
        elif out:
            out[-1][1].append(token)
    return out


def tiny(script: dict, files: LocalFiles, changes: dict[str, object] | None = None) -> list[str]:
    """The localized flags with sizes shrunk (TINY, then `changes`, whose flags the script lacks are added), for
    two CPU processes."""
    table = {**TINY, **(changes or {})}
    changes = {"--num-workers": "0", **(changes or {})}  # data read in-process: two cores, no loader workers
    argv: list[str] = []
    present = groups(localize(script, files))
    added = [(flag, []) for flag, rule in (changes or {}).items() if rule is not None
             and flag not in {name for name, _ in present}]
    for flag, values in present + added:
        rule = table.get(flag, values)
        if flag in table and rule is None:
            continue
        new = rule(values) if callable(rule) else ([rule] if isinstance(rule, str) else rule)
        argv += [flag, *new]
        if flag in ("--deepspeed_config", "--deepspeed-config"):
            config = {**json.loads(Path(new[0]).read_text()), **TINY_DEEPSPEED}
            Path(new[0]).write_text(json.dumps(config))
    return argv


def pai_sft_row(conversations: list[tuple[list[int], list[int]]], seq_length: int, pad: int = 0) -> list[int]:
    """One document as Pai's toolkits/sft_data_preprocessing writes it: conversations (prompt ids, answer ids) packed,
    each one's last token stored as -id - 1, padded to `seq_length`; then the labels, the answer ids one position
    ahead, -100 elsewhere (2 x seq_length ids in all)."""
    tokens: list[int] = []
    labels: list[int] = []
    for prompt, answer in conversations:
        ids = prompt + answer
        tokens += ids[:-1] + [-ids[-1] - 1]
        labels += [-100] * (len(prompt) - 1) + answer + [-100]
    tokens += [pad] * (seq_length - len(tokens))
    labels += [-100] * (seq_length - len(labels))
    return tokens + labels


def pai_sft_idxmap(files: LocalFiles, seq_length: int, rows: int = 16) -> str:
    """Pai's SFT idxmap data of `rows` documents for --seq-length `seq_length`, its conversations cut from the local
    GPT data's documents (a prompt of 6 ids, an answer of 8; three to a row); the prefix."""
    import numpy as np

    from rapidtrain.data.indexed import IndexedDataset, IndexedDatasetBuilder

    prefix = str(files.folder / f"pai-sft-{seq_length}_text_document")
    if Path(prefix + ".idx").exists():
        return prefix
    source = IndexedDataset(files.gpt_prefix)
    documents = [np.asarray(source[i]).tolist() for i in range(len(source)) if len(source[i]) >= 14]
    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for row in range(rows):
        picked = [documents[(3 * row + k) % len(documents)] for k in range(3)]
        builder.add_item(pai_sft_row([(d[:6], d[6:14]) for d in picked], seq_length))
        builder.end_document()
    builder.finalize(prefix + ".idx")
    return prefix
