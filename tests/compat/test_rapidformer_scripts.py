"""PAI-Rapidformer's example scripts (EasyNLP's examples/rapidformer): the launch scripts changed only where a
2-core CPU forces it, the white-box scripts only in their import lines (and where they used EasyNLP's own
libraries, which are not rapidtrain's), run with bash as a user runs them (tests/compat/scripts/rapidformer/)."""

from __future__ import annotations

import random
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.compat.scripting import SCRIPTS, run_script
from tests.launch import REPO, child_env

RAPIDFORMER = SCRIPTS / "rapidformer"


def tensorboard_tags(folder: Path) -> set[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    tags = set()
    for events in folder.rglob("events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        tags |= set(accumulator.Tags()["scalars"])
    return tags


def log_lines(output: str) -> list[str]:
    return re.findall(r"\] iteration +\d+/ +\d+ \|[^\n]*", output)


@pytest.mark.slow
def test_gpt_moe_pretraining_then_fine_tuning_from_its_checkpoint(megatron_data, tmp_path):
    """run_pretrain_megatron_gpt.sh (PreTrainer white box: TP 2 with sequence parallelism, the distributed
    optimizer, 2 experts per layer with PR-MoE residual MLPs, fp16, Rapidformer's TensorBoard and --logging-path
    flags, --pretrained-model-name-or-path naming its own --save folder), then run_finetune_text_generation_gpt.sh
    (GPTFinetuner white box) starting from the checkpoint it wrote: model only, epochs over text lines."""
    out = tmp_path / "pretrain"
    env = {"DATA_DIR": str(megatron_data.folder), "OUTPUT_BASEPATH": str(out)}
    run = run_script(RAPIDFORMER / "run_pretrain_megatron_gpt.sh", tmp_path, env,
                     args=["dsw", "gpt2bpe", "tiny", "2", "0", "1", "2", "none", "do", "2"])
    checkpoint = next((out / "checkpoint").iterdir())
    assert (checkpoint / "latest_checkpointed_iteration.txt").read_text().strip() == "4"
    assert "holds no checkpoint yet, so training starts from scratch" in run.stdout
    assert "--use-distributed-optimizer: Megatron's optimizer-state sharding" in run.stdout
    assert "PR-MoE (--mlp-type residual)" in run.stdout and "sequence parallel norms/dropout" in run.stdout
    assert "moe loss value:" in run.stdout  # the script's own {"lm loss", "moe loss"} in evaluation
    logged = next((out / "log").iterdir()).read_text()
    assert len(log_lines(logged)) == 4 and "rapidtrain plan" in logged
    tags = tensorboard_tags(out / "tensorboard")
    assert {"timers/forward-backward", "timers/optimizer", "train/batch size", "validation/lm loss PPL"} <= tags

    out = tmp_path / "finetune"
    env = {"DATA_DIR": str(megatron_data.folder), "OUTPUT_BASEPATH": str(out)}
    run = run_script(RAPIDFORMER / "run_finetune_text_generation_gpt.sh", tmp_path, env, args=[
        "gen", str(megatron_data.train_text), str(megatron_data.valid_text), str(checkpoint), "tiny", "2", "0", "4",
        "2", "2", "none", "none", "64"])
    assert f"loaded checkpoint from {checkpoint} at iteration 0" in run.stdout
    lines = log_lines(run.stdout)
    assert len(lines) == 32  # 64 lines / micro 4 = 16 steps per epoch, 2 epochs
    trained = [line for line in lines if "lm loss:" in line]  # iterations fp16 did not skip
    assert trained and all("moe loss:" in line for line in trained)
    assert re.search(r"epoch 2 \| iteration 32 \| validation lm loss: \S+ \| lm loss PPL", run.stdout)
    assert "--DDP-impl local: data parallelism is torch DistributedDataParallel" in run.stdout


@pytest.mark.slow
def test_zeroclue_fine_tuning_with_its_own_flags_deepspeed_and_a_pyramid_of_experts(megatron_data, tmp_path):
    """run_finetune_gpt_moe.sh: the script's extra_args_provider declares --keep-last, --train-data, ... again
    (its definitions replace rapidtrain's), builds the model inside deepspeed.zero.Init(mpu=mpu, ...) with
    get_args().deepspeed_configuration, trains 2 and 4 experts on alternate layers with residual MLPs under
    DeepSpeed ZeRO-2 and --mixed-precision, from a checkpoint of the same shape."""
    data = megatron_data
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=1", "--standalone",
                    str(REPO / "rapidtrain" / "pretrain_gpt.py"), "--num-layers", "4", "--hidden-size", "64",
                    "--num-attention-heads", "4", "--seq-length", "64", "--num-experts", "2", "4", "--mlp-type",
                    "residual", "--micro-batch-size", "2", "--train-iters", "2", "--lr", "1e-3", "--data-path",
                    data.gpt_prefix, "--vocab-file", str(data.gpt_vocab), "--merge-file", str(data.gpt_merges),
                    "--save", str(tmp_path / "ckpts"), "--eval-iters", "0", "--num-workers", "0"],
                   check=True, capture_output=True, env=child_env(), cwd=REPO, timeout=600)
    rng = random.Random(0)
    words = "good bad fine poor great awful nice slow fast broken".split()
    for name, rows in (("train", 24), ("dev", 8)):
        (tmp_path / f"{name}.tsv").write_text("".join(
            f"{i}\t{' '.join(rng.choices(words, k=8))}\t{rng.choice(['Positive', 'Negative'])}\n"
            for i in range(rows)))
    env = {"DATA_DIR": str(data.folder), "PRETRAIN_CHECKPOINT_PATH": str(tmp_path / "ckpts"),
           "SAVE_CHECKPOINT_PATH": str(tmp_path / "out"), "TRAIN_DATA": str(tmp_path / "train.tsv"),
           "VALID_DATA": str(tmp_path / "dev.tsv")}
    run = run_script(RAPIDFORMER / "run_finetune_gpt_moe.sh", tmp_path, env)
    assert f"loaded checkpoint from {tmp_path / 'ckpts'} at iteration 0" in run.stdout
    assert "experts [0, 2, 0, 4]" in run.stdout and "DeepSpeed ZeRO stage 2" in run.stdout
    assert re.search(r"epoch 2 \| iteration 6 \| validation lm loss: \S+", run.stdout)  # 24 rows / (4 × 2) = 3
    assert all("moe loss:" in line for line in log_lines(run.stdout))
    assert (tmp_path / "out" / "latest_checkpointed_iteration.txt").read_text().strip() == "6"


def test_easynlp_finetuner_reads_its_application_flags_and_shortens_a_long_warm_up(tmp_path):
    """run_finetune_easynlp_bert.sh: --app-name and --user-defined-parameters reach the script through get_args();
    the shape flags agree with the tiny BERT's config.json; --lr-warmup-iters 100 is longer than the 15
    iterations of 3 epochs, so it is shortened with a warning; the log line reports throughput."""
    from rapidtrain.tasks import toy

    model, data = toy.make_task("sequence_classification", tmp_path / "task", train=40, dev=16)
    env = {"PRETRAINED_CHECKPOINT": str(model), "DATA_DIR": str(data.parent), "DATA_NAME": data.name}
    run = run_script(RAPIDFORMER / "run_finetune_easynlp_bert.sh", tmp_path, env)
    assert "--lr-warmup-iters 100 is not shorter than this run's 15 iterations" in run.stdout
    assert "note: --app-name: for the user script" in run.stdout
    assert re.search(r"epoch 3 \| iteration 15 \| validation accuracy: [0-9.]+", run.stdout)
    lines = log_lines(run.stdout)
    assert len(lines) == 7 and all("throughput per GPU (TFLOP/s/GPU):" in line for line in lines)


def test_easynlp_finetuner_refuses_shape_flags_its_model_contradicts(tmp_path):
    """The same script with --num-layers 12 (the original's bert-base value) beside the tiny 2-layer BERT:
    refused before training, naming both values."""
    from rapidtrain.tasks import toy

    model, data = toy.make_task("sequence_classification", tmp_path / "task", train=8, dev=8)
    result = subprocess.run(
        [sys.executable, str(RAPIDFORMER / "rf_finetune_easynlp_bert.py"), "--task", "sequence_classification",
         "--pretrained-model-name-or-path", str(model), "--data-dir", str(data.parent), "--data-name", data.name,
         "--epochs", "1", "--lr", "1e-4", "--num-layers", "12", "--hidden-size", "32"],
        capture_output=True, text=True, env=child_env(), cwd=REPO, timeout=300)
    assert result.returncode == 2
    assert "--num-layers 12 (config.json num_hidden_layers: 2)" in result.stderr
    assert "Traceback" not in result.stderr
