"""Megatron-LM's example launch scripts of 2021-2025, each changed only where a 2-core CPU forces it (sizes,
world size, local data, gloo; the entry point rapidtrain/pretrain_gpt.py or pretrain_bert.py), run with bash as
a user runs them (tests/compat/scripts/megatron/)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.compat.scripting import SCRIPTS, copy_into, run_script

MEGATRON = SCRIPTS / "megatron"


def log_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if re.search(r"\] iteration +\d+/", line)]


def field(line: str, name: str) -> str | None:
    found = re.search(rf"\| {re.escape(name)}: +([^|]+?) \|", line)
    return found.group(1) if found else None


def latest(checkpoints: Path) -> int:
    return int((checkpoints / "latest_checkpointed_iteration.txt").read_text())


def test_pretrain_gpt_sh_trains_skips_fp16_overflows_as_megatron_and_resumes(megatron_data, tmp_path):
    """examples/pretrain_gpt.sh: one process, --fp16 with Megatron's dynamic loss scale (2^32 at first): an
    iteration that overflows is skipped, halves the scale and shows no loss (Megatron leaves it out, never
    0.0); saves every 3 iterations; run again with the same --load, it finds its work done."""
    copy_into(tmp_path, megatron_data.gpt_vocab, megatron_data.gpt_merges)
    env = {"DATA_PATH": megatron_data.gpt_prefix, "CHECKPOINT_PATH": str(tmp_path / "ck")}
    run = run_script(MEGATRON / "pretrain_gpt.sh", tmp_path, env)
    lines = log_lines(run.stdout)
    assert len(lines) == 6
    scales = [float(field(line, "loss scale")) for line in lines]
    for line, scale, after in zip(lines, scales, scales[1:] + [None], strict=True):
        if field(line, "number of skipped iterations").strip() == "1":
            assert field(line, "lm loss") is None and "lm loss: 0.000000E+00" not in line
            assert after is None or after == scale / 2
    assert "tokenizer GPT2BPETokenizer" in run.stdout  # Megatron's pretrain_gpt.py default for real data
    assert "--checkpoint-activations       → torch.utils.checkpoint" in run.stdout
    assert latest(tmp_path / "ck") == 6 and "validation loss at iteration 3" in run.stdout
    again = run_script(MEGATRON / "pretrain_gpt.sh", tmp_path, env)
    assert "loaded checkpoint" in again.stdout and "nothing to do" in again.stdout


def test_pretrain_bert_sh_trains_bert_with_its_binary_head(megatron_data, tmp_path):
    """examples/pretrain_bert.sh: Megatron's BERT (binary head on by default) on sentence-split data made by our
    preprocess_data.py --split-sentences; the log shows the masked-LM and sentence-order losses apart."""
    env = {"DATA_PATH": megatron_data.bert_prefix, "CHECKPOINT_PATH": str(tmp_path / "ck"),
           "VOCAB_FILE": str(megatron_data.bert_vocab)}
    run = run_script(MEGATRON / "pretrain_bert.sh", tmp_path, env)
    assert "tokenizer BertWordPieceLowerCase" in run.stdout
    assert re.search(r"lm loss value: \S+ \| lm loss PPL: \S+ \| sop loss value: \S+ \| sop loss PPL", run.stdout)
    assert latest(tmp_path / "ck") == 6


@pytest.mark.slow
@pytest.mark.parametrize("script, data", [("pretrain_gpt_distributed.sh", "gpt"),
                                          ("pretrain_bert_distributed.sh", "bert")])
def test_distributed_scripts_run_on_two_processes(megatron_data, tmp_path, script, data):
    """examples/pretrain_{gpt,bert}_distributed.sh through `python -m torch.distributed.launch` (its
    --local-rank argument included): 2 data-parallel ranks, 2 accumulation steps, global batch 8."""
    copy_into(tmp_path, megatron_data.gpt_vocab, megatron_data.gpt_merges, megatron_data.bert_vocab)
    env = {"DATA_PATH": megatron_data.gpt_prefix if data == "gpt" else megatron_data.bert_prefix,
           "CHECKPOINT_PATH": str(tmp_path / "ck"), "VOCAB_FILE": str(megatron_data.bert_vocab)}
    run = run_script(MEGATRON / script, tmp_path, env)
    assert "micro 2 × accumulation steps 2 × data parallel 2 = global 8" in run.stdout
    assert [field(line, "global batch size") for line in log_lines(run.stdout)] == ["8"] * 4
    assert latest(tmp_path / "ck") == 4


@pytest.mark.slow
def test_pretrain_gpt_distributed_with_mp_sh_pipelines_and_turns_sequence_parallel_off(megatron_data, tmp_path):
    """examples/pretrain_gpt_distributed_with_mp.sh (2023) on 2 ranks as pipeline 2: --sequence-parallel at
    tensor-parallel size 1 is turned off with a plan note, as Megatron warns, instead of refused."""
    env = {"DATA_PATH": megatron_data.gpt_prefix, "CHECKPOINT_PATH": str(tmp_path / "ck"),
           "VOCAB_FILE": str(megatron_data.gpt_vocab), "MERGE_FILE": str(megatron_data.gpt_merges)}
    run = run_script(MEGATRON / "pretrain_gpt_distributed_with_mp.sh", tmp_path, env)
    assert "note: --sequence-parallel is turned off" in run.stdout
    assert "torch.distributed.pipelining" in run.stdout
    assert latest(tmp_path / "ck") == 4


@pytest.mark.slow
def test_pretrain_gpt3_175b_sh_ramps_the_batch_over_a_blend_counted_in_samples(megatron_data, tmp_path):
    """examples/pretrain_gpt3_175B.sh: a blend of three datasets, --rampup-batch-size 2 2 24 to 8 and
    --train-samples 60 with the schedule in samples, tensor parallel 2, TensorBoard. Megatron's arithmetic:
    the batch grows 2 → 4 → 6 → 8 every 8 samples; ramp-up iterations while ≤ 24 samples are consumed, then
    whole batches of 8: 12 iterations."""
    parts = megatron_data.gpt_parts
    env = {"DATASET_1": parts[0], "DATASET_2": parts[1], "DATASET_3": parts[2],
           "CHECKPOINT_PATH": str(tmp_path / "ck"), "VOCAB_FILE": str(megatron_data.gpt_vocab),
           "MERGE_FILE": str(megatron_data.gpt_merges), "TENSORBOARD_DIR": str(tmp_path / "tb")}
    run = run_script(MEGATRON / "pretrain_gpt3_175B.sh", tmp_path, env)
    lines = log_lines(run.stdout)
    assert [int(field(line, "global batch size")) for line in lines] == [2, 2, 2, 2, 4, 4, 6, 6, 8, 8, 8, 8]
    assert int(field(lines[-1], "consumed samples")) == 60
    assert "60 samples (--train-samples) = 12 iterations" in run.stdout
    assert "cosine decay over 48 samples, warm-up 4 samples" in run.stdout
    assert "global batch ramps from 2 by 2 over the first 24 samples to 8" in run.stdout
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))
    assert latest(tmp_path / "ck") == 12


@pytest.mark.slow
def test_train_gpt3_175b_distributed_mcore_sh_runs_pipelined(megatron_data, tmp_path):
    """examples/gpt3/train_gpt3_175b_distributed.sh (2024, --use-mcore-models): positional arguments, pipeline
    2; --use-mcore-models has no effect here and the plan says so."""
    d = megatron_data
    run = run_script(MEGATRON / "train_gpt3_175b_distributed_mcore.sh", tmp_path, args=[
        str(tmp_path / "ck"), str(tmp_path / "tb"), str(d.gpt_vocab), str(d.gpt_merges), d.gpt_prefix])
    assert "note: --use-mcore-models: no effect" in run.stdout
    assert latest(tmp_path / "ck") == 4 and list((tmp_path / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_train_gpt3_175b_distributed_sh_ramps_within_train_iters(megatron_data, tmp_path):
    """examples/gpt3/train_gpt3_175b_distributed.sh (2025): --rampup-batch-size with --train-iters, which
    Megatron itself refuses; rapidtrain ramps the batch by samples consumed over the 8 iterations."""
    d = megatron_data
    run = run_script(MEGATRON / "train_gpt3_175b_distributed.sh", tmp_path, args=[
        str(tmp_path / "ck"), str(tmp_path / "tb"), str(d.gpt_vocab), str(d.gpt_merges), d.gpt_prefix])
    sizes = [int(field(line, "global batch size")) for line in log_lines(run.stdout)]
    assert sizes == [2, 2, 2, 2, 4, 4, 6, 6]
    assert "--attention-backend            → torch scaled_dot_product_attention" in run.stdout  # the script's auto
    assert latest(tmp_path / "ck") == 8


@pytest.mark.slow
@pytest.mark.parametrize("script", [
    "train_bert_340m_distributed_2024.sh",
    "train_bert_340m_distributed.sh",
])
def test_train_bert_340m_distributed_sh_runs_tensor_parallel(megatron_data, tmp_path, script):
    """examples/bert/train_bert_340m_distributed.sh: BERT with its binary head, tensor parallel 2."""
    d = megatron_data
    run = run_script(MEGATRON / script, tmp_path, args=[str(tmp_path / "ck"), str(tmp_path / "tb"),
                                                        str(d.bert_vocab), d.bert_prefix])
    assert "DTensor parallelize_module" in run.stdout and "sop loss value" in run.stdout
    if script == "train_bert_340m_distributed.sh":  # passes --attention-backend auto
        assert "because --attention-backend auto: Megatron's auto" in run.stdout
    assert latest(tmp_path / "ck") == 4
