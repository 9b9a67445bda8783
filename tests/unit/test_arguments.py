"""The flag set is deliberate (snapshot), and each documented default and value set holds."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rapidtrain.config import arguments

SNAPSHOT = Path(__file__).with_name("flags_snapshot.txt")


def current_table() -> str:
    return "\n".join("|".join(row) for row in arguments.flag_table()) + "\n"


def test_flag_set_matches_snapshot():
    assert current_table() == SNAPSHOT.read_text(), (
        "the flag set changed: if deliberate, run `python tests/unit/test_arguments.py` to update the snapshot"
    )


REFERENCE_FLAGS = [
    "--micro-batch-size",
    "--global-batch-size",
    "--tokenizer-type",
    "--split",
    "--data-impl",
    "--data-path",
    "--data-dir",
    "--data-name",
    "--pretrained-model-name-or-path",
    "--num-layers",
    "--hidden-size",
    "--num-attention-heads",
    "--max-position-embeddings",
    "--seq-length",
    "--task",
    "--save",
    "--lr",
    "--lr-decay-style",
    "--weight-decay",
    "--clip-grad",
    "--lr-warmup-fraction",
    "--train-iters",
    "--epochs",
    "--log-interval",
    "--lr-warmup-iters",
    "--min-lr",
    "--lr-decay-iters",
    "--seed",
    "--eval-interval",
    "--eval-iters",
    "--save-interval",
    "--load",
    "--finetune",
    "--no-load-optim",
    "--no-load-rng",
    "--vocab-file",
    "--merge-file",
    "--distributed-backend",
    "--adam-beta1",
    "--adam-beta2",
    "--init-method-std",
    "--num-workers",
    "--tensorboard-dir",
    "--eod-mask-loss",
    "--mask-prob",
    "--short-seq-prob",
    "--moe-loss-coeff",
    "--moe-min-capacity",
    "--disable-moe-token-dropping",
    "--user-script",
    "--dataset-name",
    "--num-experts",
    "--mixed-precision",
    "--oss-memory-optimization",
    "--oss-sdp-memory-optimization",
    "--fsdp-memory-optimization",
    "--zero-1-memory-optimization",
    "--zero-2-memory-optimization",
    "--zero-3-memory-optimization",
    "--tensor-model-parallel-size",
    "--pipeline-model-parallel-size",
    "--onnx-runtime-training",
    "--cpu-offload",
    "--checkpoint-activations",
    "--data-iterator",
    "--optimizers",
    # beyond Rapidformer
    "--fp16",
    "--bf16",
    "--torch-compile",
    "--sequence-parallel",
    "--expert-model-parallel-size",
    "--moe-router-topk",
    "--moe-capacity-factor",
    "--optimizer",
    "--sharding-backend",
    "--peak-tflops",
    "--nproc-per-node",
    "--exit-signal-handler",
]


def test_help_lists_every_reference_flag():
    result = subprocess.run(
        [sys.executable, "-m", "rapidtrain.cli", "--help"], capture_output=True, text=True
    )
    assert result.returncode == 0
    for flag in REFERENCE_FLAGS:
        assert flag in result.stdout, flag
    for group in (
        "data:",
        "transformer:",
        "training:",
        "acceleration: model-state partitioning:",
        "acceleration: 3D parallelism:",
        "acceleration: precision:",
        "logging:",
        "checkpointing:",
    ):
        assert group in result.stdout, group
    assert "DeepSpeed stage 2" in " ".join(result.stdout.split())  # help names the engine


def test_documented_defaults():
    a = arguments.parse_args([])
    assert (
        a.micro_batch_size == 1 and a.global_batch_size is None
    )  # None → micro × data-parallel size (1 on one device)
    assert a.split == "969, 30, 1" and a.data_impl == "mmap"
    assert (
        a.lr_decay_style == "linear"
        and a.weight_decay == 0.01
        and a.clip_grad == 1.0
        and a.log_interval == 100
    )
    assert a.tensor_model_parallel_size == 1 and a.pipeline_model_parallel_size == 1
    assert a.optimizers == "apex_adam" and a.optimizer is None
    for switch in (
        "mixed_precision",
        "oss_memory_optimization",
        "oss_sdp_memory_optimization",
        "fsdp_memory_optimization",
        "zero_1_memory_optimization",
        "zero_2_memory_optimization",
        "zero_3_memory_optimization",
        "onnx_runtime_training",
        "cpu_offload",
        "checkpoint_activations",
    ):
        assert getattr(a, switch) is False, switch


@pytest.mark.parametrize(
    "flag,values",
    [
        ("--data-impl", ["lazy", "cached", "mmap", "infer"]),
        ("--lr-decay-style", ["constant", "linear", "cosine"]),
        ("--optimizers", ["apex_adam", "apex_lamb"]),
        ("--optimizer", ["adamw", "adafactor", "sgd"]),
        ("--data-iterator", ["dynamic-shape"]),
        ("--tokenizer-type", ["BertWordPieceLowerCase", "BertWordPieceCase", "GPT2BPETokenizer"]),
        ("--sharding-backend", ["torch", "fairscale"]),
    ],
)
def test_value_sets(flag, values):
    dest = flag.lstrip("-").replace("-", "_")
    for value in values:
        assert getattr(arguments.parse_args([flag, value]), dest) == value
    with pytest.raises(SystemExit) as raised:
        arguments.parse_args([flag, "no-such-value"])
    assert raised.value.code == 2


def test_task_spelling_and_alias():
    assert arguments.parse_args(["--task", "casual_lm"]).task == "casual_lm"
    assert arguments.parse_args(["--task", "causal_lm"]).task == "casual_lm"
    assert set(arguments.TASKS) == {
        "sequence_classification",
        "token_classification",
        "question_answering",
        "masked_lm",
        "casual_lm",
        "seq2seq_lm",
        "pretraining",
        "MNLI",  # Megatron's tasks/main.py (rapidtrain/tasks_main.py)
        "RACE",
    }
    # The black-box fine-tuning tasks are the same names (and aliases), each named once by its class.
    from rapidtrain.tasks import TASK_CLASSES

    black_box = set(arguments.TASKS) - {"pretraining", *arguments.MEGATRON_TASKS}
    assert set(TASK_CLASSES) == black_box | set(arguments.TASK_ALIASES)


def test_split_with_spaces_and_num_experts_forms():
    assert arguments.parse_args(["--split", "969, 30, 1"]).split == "969, 30, 1"
    assert arguments.parse_args(["--num-experts", "8"]).num_experts == [8]
    assert arguments.parse_args(["--num-experts", "32", "32", "64"]).num_experts == [32, 32, 64]
    assert arguments.parse_args(["--moe-aux-loss-coeff", "0.1"]).moe_loss_coeff == 0.1


def test_extra_args_provider_adds_a_group():
    def provider(parser):
        group = parser.add_argument_group("my task")
        group.add_argument("--my-flag", type=int, default=3)
        return parser

    assert arguments.parse_args(["--my-flag", "5"], extra_args_provider=provider).my_flag == 5


def test_importing_rapidtrain_loads_no_heavy_dependencies():
    code = "import sys, rapidtrain, rapidtrain.cli; print('deepspeed' in sys.modules, 'transformers' in sys.modules)"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False False"


if __name__ == "__main__":
    SNAPSHOT.write_text(current_table())
    print(f"updated {SNAPSHOT}")


def test_misspelled_flag_is_reported_first_with_the_closest_flag(capsys):
    with pytest.raises(SystemExit) as raised:
        arguments.parse_args(["--train-iters", "5", "--lr-warmup-iter", "2", "--trian-iters", "3"])
    assert raised.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines == [
        "rapidtrain: error: unknown flag --lr-warmup-iter (did you mean --lr-warmup-iters?)",
        "rapidtrain: error: unknown flag --trian-iters (did you mean --train-iters?)",
        "rapidtrain: `rapidtrain --help` lists every flag.",
    ]  # no usage block: the error comes first and alone


def test_negative_numbers_in_exponent_form_are_values():
    args = arguments.parse_args(["--lr", "-1e-3", "--min-lr", "-.5", "--seed", "-2"])
    assert (args.lr, args.min_lr, args.seed) == (-1e-3, -0.5, -2)  # the rules then refuse them, naming each
