"""Every launch script of tests/compat/launch_scripts.json that plans (all but test_launch_scripts.py's REFUSED, save
JSON_AS_INDEXED; EasyNLP's user scripts run in test_launch_runs.py) run for real: its flags with sizes shrunk
(launch_data.tiny) and its layout folded onto one process (tensor, pipeline, expert and sequence-parallel sizes 1),
for 2 training iterations (a padded vocabulary set outright shrunk too: PADDED_VOCAB); precision, schedules, MoE,
tokenizers, data kinds and DeepSpeed config keys stay the script's but for the tables below. The runs share one
Python process (run_launch_scripts.py), one after another, each in a fresh single-rank process group."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.compat.launch_data import BY_ID, SCRIPTS, LocalFiles, entry_of, groups, pai_sft_idxmap, tiny
from tests.compat.run_launch_scripts import results
from tests.compat.test_launch_runs import log_lines
from tests.compat.test_launch_scripts import REFUSED
from tests.compat.test_megatron_tasks import write_mnli
from tests.launch import REPO, child_env

RUNNER = Path(__file__).with_name("run_launch_scripts.py")

# The layout's sizes, all 1 on one process; the rest of each script's flags stay.
FOLDED = {"--tensor-model-parallel-size": "1", "--model-parallel-size": "1", "--intra-layer-model-parallel-size": "1",
          "--pipeline-model-parallel-size": "1", "--pipe-parallel-size": "1", "--expert-model-parallel-size": "1",
          "--moe-expert-parallel-size": "1", "--ds-sequence-parallel-size": "1", "--context-parallel-size": "1"}
# Flags the one-process fold cannot keep, and why.
DROPPED = {
    # Virtual pipeline stages split a rank's pipeline stage further: with no pipeline there is no stage to split.
    "--num-layers-per-virtual-pipeline-stage": None, "--virtual-pipeline-model-parallel-size": None,
    "--num-virtual-stages-per-pipeline-rank": None,
    # ... nor stages to size unevenly or to schedule (the rules refuse them without pipeline stages)
    "--decoder-first-pipeline-num-layers": None, "--decoder-last-pipeline-num-layers": None,
    "--account-for-embedding-in-pipeline-split": None, "--account-for-loss-in-pipeline-split": None,
    "--pipeline-model-parallel-layout": None, "--enable-zbh1-pipeline": None, "--enable-zbh1-exact-semantics": None,
    "--pipeline-schedule": None,
    # Weights & Biases needs the user's account (no network here); tests/e2e/test_tracking.py runs it offline.
    "--wandb-project": None, "--wandb-exp-name": None, "--wandb-save-dir": None,
}
# DeepSpeed's CPU accelerator has no fp16: ZeRO runs of fp16 scripts train in bf16 here (their config's fp16 section
# switched to bf16; fp32 on a CPU without native bf16), as rapidtrain's own message for --fp16 with ZeRO on the CPU
# asks.
FP16_ZERO = {"bsw-tr10-13b-2022", "bsw-tr13f-6b3-mtf-2022", "mds-ds-example-2022",
             "mds-azure-175b-2022", "mds-rope-1.3b-2023", "mds-uc-fp16-2024",
             "mds-seqpar-32k-2024", "mds-ulysses-30b-32k-2023"}  # Ulysses' scripts: they plan since issue 42
# --data-path of alpaca JSON with no --dataset (the JSON reader of Pai's 2023 script, Megatron-DeepSpeed's
# finetune_llama.py): rapidtrain reads --data-path as a Megatron indexed prefix (its plan refuses a JSON file there,
# test_launch_scripts.py's REFUSED), so these runs get the local indexed data: a data kind the fold changes.
JSON_AS_INDEXED = {"pai-llama-pretrain-2023", "mds-finetune-llama-2024"}
# Pai's raw JSON kinds read instruction/output records: the local file is alpaca-style.
RAW_JSON_FLAGS = ("--data-path", "--train-data-path", "--valid-data-path", "--test-data-path")
# 2 iterations of the tiny global batch (4 samples of 64 tokens): in iterations, samples or tokens.
TWO_ITERATIONS = {"--train-iters": "2", "--train-samples": "8", "--train-tokens": "512"}
# EasyNLP's Rapidformer examples run as user scripts of their own in test_launch_runs.py.
USER_SCRIPT_ORIGINS = {"alibaba/EasyNLP"}
# The padded vocabulary a script sets outright (BLOOM's 250,880 rows, Qwen's 151,936): a size like the others
# launch_data.TINY shrinks, padded here to 1,024 rows over the local tokenizers' 600 ids, so the flag still pads the
# head (its rows beyond the tokenizer's ids) without a 250,880-row head, which cost 31 of the file's 90 CPU-s in one
# fp16 script (emulated on a CPU without fp16 arithmetic).
PADDED_VOCAB_FLAGS, PADDED_VOCAB = ("--pad-vocab-size-to", "--padded-vocab-size"), "1024"
# Megatron's tasks/main.py: rows in the training file that make 2 iterations of the script's global batch.
TASK_ROWS = {"mlm-mnli-ft-2020": 4, "mlm-race-ft-2021": 4, "mds-bert-mnli-2022": 8}
PRETRAINED_BERT = "mlm-bert-2020"  # the tasks fine-tune what this script saved (it runs first)


def runnable() -> list[str]:
    ids = [s["id"] for s in SCRIPTS if (s["id"] not in REFUSED or s["id"] in JSON_AS_INDEXED)
           and s["origin"] not in USER_SCRIPT_ORIGINS]
    return sorted(ids, key=lambda i: (entry_of(BY_ID[i]) == "tasks_main", i != PRETRAINED_BERT))


def folded_changes(script_id: str, local_files: LocalFiles) -> dict[str, object]:
    """What shrinks the script to one process and 2 iterations: only flags the script has change."""
    argv = tiny(BY_ID[script_id], local_files)
    present = {flag for flag, _ in groups(argv)}
    changes = {flag: value for flag, value in {**FOLDED, **DROPPED, **TWO_ITERATIONS}.items() if flag in present}
    values = {flag: value for flag, value in groups(argv)}
    if "--finetune" in present and values.get("--save") and values.get("--save") == values.get("--load"):
        # a fine-tune saving into the folder it loads would overwrite what it loaded: refused since issue 44,
        # naming a --save of its own as the fix, which the fold gives it
        changes["--save"] = values["--save"][0] + "_finetuned"
    if "--bf16" in present and not _native_bf16():
        changes["--bf16"] = None  # bf16 emulated in fp32 on this CPU is many times slower: fp32 instead
    if script_id in FP16_ZERO:
        changes.update({"--fp16": None, **({"--bf16": []} if _native_bf16() else {})})
    if script_id in JSON_AS_INDEXED:
        changes["--data-path"] = local_files.gpt_prefix
    if _value(BY_ID[script_id]["argv"], "--dataset") in ("LLama-Pretrain-Raw", "LLama-SFT"):
        changes.update({flag: alpaca_records(local_files) for flag in RAW_JSON_FLAGS if flag in present})
    if _value(BY_ID[script_id]["argv"], "--train-mode") == "finetune" and _value(
            BY_ID[script_id]["argv"], "--dataset") == "MMAP":  # Pai's SFT idxmap: tokens, then labels
        changes["--data-path"] = pai_sft_idxmap(local_files, int(values["--seq-length"][0]))
    original = BY_ID[script_id]["argv"]
    if _value(original, "--attention-backend") == "flash" and float(_value(original, "--attention-dropout") or 0.1):
        changes["--attention-backend"] = "auto"  # CUDA's flash kernel drops out; PyTorch's CPU one cannot
    if "--moe-layer-freq" in present:  # a per-layer pattern of the script's layer count: the tiny model's 4
        changes["--moe-layer-freq"] = "([1]*4)"
    changes.update({flag: PADDED_VOCAB for flag in PADDED_VOCAB_FLAGS if flag in present})
    return changes


def _value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def alpaca_records(local_files: LocalFiles) -> str:
    path = Path(local_files.folder) / "alpaca.json"
    lines = Path(local_files.json_data).read_text().splitlines()
    records = [{"instruction": json.loads(a)["text"], "input": "", "output": json.loads(b)["text"]}
               for a, b in zip(lines[::2], lines[1::2], strict=False)]
    path.write_text(json.dumps(records))
    return str(path)


def fold_deepspeed_config(script_id: str, argv: list[str]) -> None:
    """The script's DeepSpeed config on one process: 2 accumulation steps make the tiny global batch of 4 from
    micro batches of 2; an FP16_ZERO script's fp16 section off, bf16 on."""
    config = next((Path(v[0]) for f, v in groups(argv) if f in ("--deepspeed_config", "--deepspeed-config")), None)
    if config is None:
        return
    values = json.loads(config.read_text())
    if "gradient_accumulation_steps" in values:
        values["gradient_accumulation_steps"] = 2
    if script_id in FP16_ZERO:
        values.update(fp16={"enabled": False}, bf16={"enabled": True})  # turned off below without native bf16
    if not _native_bf16() and (values.get("bf16") or {}).get("enabled"):
        values["bf16"] = {"enabled": False}  # as --bf16 is dropped: fp32 on a CPU without native bf16
    config.write_text(json.dumps(values))


def _native_bf16() -> bool:
    import torch

    return torch.cpu._is_avx512_bf16_supported()


def task_files(script_id: str, folder: Path, pretrained: str) -> dict[str, object]:
    """Megatron's task files for 2 iterations, and the BERT checkpoint to start from."""
    rows = TASK_ROWS[script_id]
    folder.mkdir(parents=True, exist_ok=True)
    if BY_ID[script_id]["argv"][BY_ID[script_id]["argv"].index("--task") + 1] == "RACE":
        train, valid = [folder / "RACE" / "train" / "middle"], [folder / "RACE" / "dev" / n for n in ("middle", "high")]
        for path, count in ((train[0], rows), (valid[0], 2), (valid[1], 2)):
            path.mkdir(parents=True, exist_ok=True)
            questions = {"article": "the cat sat on the mat .", "questions": ["the _ sat"] * count,
                         "options": [["cat", "dog", "mat", "a"]] * count, "answers": ["A"] * count}
            (path / "1.txt").write_text(json.dumps(questions) + "\n")
    else:
        train, valid = [folder / "train.tsv"], [folder / "dev_matched.tsv", folder / "dev_mismatched.tsv"]
        write_mnli(train[0], rows)
        for offset, path in enumerate(valid):
            write_mnli(path, 3, offset=100 * (offset + 1))
    return {"--train-data": str(train[0]), "--valid-data": [str(p) for p in valid], "--epochs": "1",
            "--pretrained-checkpoint": pretrained}


def runs(local_files: LocalFiles, folder: Path) -> list[dict]:
    """The runner's list: each runnable script's folded flags, a task's files, a fine-tune's checkpoint run first."""
    out = []
    pretrained = ""
    for script_id in runnable():
        changes = folded_changes(script_id, local_files)
        entry = entry_of(BY_ID[script_id]) or "pretrain_gpt"
        if entry == "tasks_main":
            changes.update(task_files(script_id, folder / script_id, pretrained))
        argv = tiny(BY_ID[script_id], local_files, changes)
        fold_deepspeed_config(script_id, argv)
        if "--finetune" in argv and "--load" in argv:  # it fine-tunes its --load: the same script saves one first
            out.append(checkpoint_first(script_id, entry, argv))
        if script_id == PRETRAINED_BERT:
            pretrained = next(values[0] for flag, values in groups(argv) if flag == "--save")
        out.append({"id": script_id, "entry": entry, "argv": argv})
    return out


def checkpoint_first(script_id: str, entry: str, argv: list[str]) -> dict:
    load = next(values[0] for flag, values in groups(argv) if flag == "--load")
    flags = [(f, v) for f, v in groups(argv) if f not in ("--finetune", "--save", "--load", "--save-interval")]
    return {"id": f"{script_id}:checkpoint", "entry": entry,
            "argv": [t for f, v in flags for t in (f, *v)] + ["--save", load, "--save-interval", "2"]}


@pytest.mark.slow
def test_every_script_that_plans_trains_two_iterations_on_one_process(local_files, tmp_path):
    planned = runnable()
    own = dataclasses.replace(local_files, folder=tmp_path)  # checkpoints apart from test_launch_runs.py's runs
    (tmp_path / "runs.json").write_text(json.dumps(runs(own, tmp_path)))
    run = subprocess.run([sys.executable, str(RUNNER), str(tmp_path / "runs.json")], stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, env=child_env(), cwd=REPO, timeout=900)
    done = results(run.stdout)
    cpu = {i: float(s) for i, s in re.findall(r"^@@ end (\S+) status=-?\d+ seconds=[0-9.]+ cpu=([0-9.]+)", run.stdout,
                                             re.M)}
    costliest = ", ".join(f"{i} {cpu[i]:.1f}" for i in sorted(cpu, key=cpu.get, reverse=True))
    print(f"{len(done)} runs in one process, {sum(cpu.values()):.0f} CPU-s inside main(); by CPU-s: {costliest}")
    trained = [i for i in planned if i in done and done[i][0] == 0 and len(log_lines(done[i][1])) == 2]
    for origin, count in sorted(Counter(BY_ID[i]["origin"] for i in trained).items()):
        print(f"{origin}: {count} scripts trained 2 iterations on one process")
    failed = {i: (done[i][0], done[i][1][-3000:]) if i in done else None for i in planned if i not in trained}
    assert not failed, "\n".join(f"== {i}: {failed[i]}" for i in failed)
    assert len(planned) >= 45  # all that plan but EasyNLP's 3 (test_launch_runs.py) and none left out
