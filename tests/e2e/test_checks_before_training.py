"""What can be checked before training is checked before the model is built, on every path: the direct
`torchrun rapidtrain/pretrain.py` (no launcher checked anything for it) and the fine-tuning templates, whose
training length (and so the warm-up's limit) is known only once the data is counted.

"Before the model is built" is observed, not assumed: the templates here are the real ones with their model
provider counting its calls; a refused run must never have called it.
"""

from __future__ import annotations

import re

import pytest

from rapidtrain.core.errors import UserError
from rapidtrain.pretrain import ENTRY, MegatronPreTrainer
from rapidtrain.tasks import toy
from rapidtrain.train.engine import Engine
from tests.e2e.test_bad_inputs import captured
from tests.launch import TINY_GPT_SHAPE

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")
PRETRAIN = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "4", "--num-workers", "0",
            "--eval-iters", "0", "--lr", "1e-3", "--train-iters", "4", "--log-interval", "1"]


class CountingPreTrainer(MegatronPreTrainer):
    models_built = 0

    def model_optimizer_lr_scheduler_provider(self):
        CountingPreTrainer.models_built += 1
        return super().model_optimizer_lr_scheduler_provider()


def refused_before_the_model(trainer_class, argv: list[str], **engine_kwargs) -> str:
    """The message of the UserError the run stops with; its model provider was never called."""
    trainer_class.models_built = 0
    with pytest.raises(UserError) as refused:
        trainer_class(Engine(argv=argv, **engine_kwargs)).train()
    assert trainer_class.models_built == 0
    return str(refused.value)


@pytest.fixture
def null_data(tmp_path):
    import numpy as np

    from rapidtrain.data.indexed import IndexedDatasetBuilder

    prefix = tmp_path / "data" / "d_text_document"
    prefix.parent.mkdir()
    builder = IndexedDatasetBuilder(f"{prefix}.bin", np.uint16)
    rng = np.random.RandomState(0)
    for _ in range(100):
        builder.add_document([list(rng.randint(0, 100, size=80)) + [100]])
    builder.finalize(f"{prefix}.idx")
    return ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", str(prefix),
            "--data-cache-path", str(tmp_path / "cache")]


def test_direct_pretrain_refuses_missing_data_before_the_model(null_data, tmp_path):
    flags = list(null_data)
    flags[flags.index("--data-path") + 1] = str(tmp_path / "nowhere" / "d_text_document")
    message = refused_before_the_model(CountingPreTrainer, PRETRAIN + flags, entry=ENTRY)
    assert "nowhere/d_text_document" in message


def test_direct_pretrain_refuses_an_unusable_save_folder_before_the_model(null_data, tmp_path):
    (tmp_path / "a_file").write_text("not a folder")
    save = ["--save", str(tmp_path / "a_file" / "ck")]
    message = refused_before_the_model(CountingPreTrainer, PRETRAIN + null_data + save, entry=ENTRY)
    assert re.search(r"--save .*a_file/ck is not writable", message)


def test_direct_pretrain_refuses_a_missing_tokenizer_file_before_the_model(tmp_path):
    flags = ["--tokenizer-type", "GPT2BPETokenizer", "--vocab-file", str(tmp_path / "vocab.json"), "--merge-file",
             str(tmp_path / "merges.txt")]
    message = refused_before_the_model(CountingPreTrainer, PRETRAIN + flags, entry=ENTRY)
    assert "vocab.json" in message


# ---- fine-tuning: warm-up against a length known only once the data is counted ----


@pytest.fixture(scope="module")
def task(tmp_path_factory):
    return toy.make_task("sequence_classification", tmp_path_factory.mktemp("task"), train=48, dev=16)


def finetune_flags(task, *extra: str) -> list[str]:
    model, data = task
    return ["--task", "sequence_classification", "--pretrained-model-name-or-path", str(model), "--data-dir",
            str(data.parent), "--data-name", data.name, "--micro-batch-size", "4", "--global-batch-size", "8",
            "--seq-length", "32", "--lr", "1e-4", "--num-workers", "0", "--epochs", "2", *extra]


def counting_finetuner():
    from rapidtrain.finetune import TaskFinetuner

    class CountingFinetuner(TaskFinetuner):
        models_built = 0

        def model_optimizer_lr_scheduler_provider(self):
            CountingFinetuner.models_built += 1
            return super().model_optimizer_lr_scheduler_provider()

    return CountingFinetuner


def test_finetune_warmup_longer_than_the_epochs_is_shortened_with_a_warning(task):
    """48 samples in global batches of 8: 6 steps per epoch, 12 in 2 epochs; a 12-iteration warm-up would never
    reach --lr. Rapidformer's example scripts carry such warm-ups on short fine-tunes and Hugging Face's Trainer
    accepts them, so the run trains with the warm-up shortened to 11 iterations and says so."""
    from rapidtrain.finetune import main

    status, output = captured(lambda: main(finetune_flags(task, "--lr-warmup-iters", "12")))
    assert status == 0 and "Traceback" not in output, output[-3000:]
    assert "--lr-warmup-iters 12 is not shorter than this run's" in output
    assert "shortened to 11 iterations" in output


def test_finetune_warmup_within_the_epochs_trains(task):
    trainer_class = counting_finetuner()
    trainer_class(Engine(argv=finetune_flags(task, "--lr-warmup-iters", "11", "--epochs", "2"))).train()
    assert trainer_class.models_built == 1


def test_finetune_warmup_beyond_lr_decay_iters_is_refused_by_the_flags_rules(task):
    """With --lr-decay-iters the horizon is known from the flags: `rapidtrain plan` refuses it already."""
    from rapidtrain import cli

    status, output = captured(lambda: cli.main(["plan", *finetune_flags(task, "--lr-warmup-iters", "10",
                                                                        "--lr-decay-iters", "8")]))
    assert status == 2, output
    assert "--lr-warmup-iters 10 is not shorter than the decay horizon (--lr-decay-iters 8)" in output
