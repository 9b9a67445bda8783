"""Megatron's fine-tuning tasks (tasks/main.py --task MNLI / RACE) as rapidtrain/tasks_main.py runs them: the task
files read into BERT samples as Megatron builds them, and one real run of Megatron-LM's MNLI launch script (2020),
shrunk to one process, from a BERT checkpoint that rapidtrain's pretrain_bert.py saved."""

from __future__ import annotations

import json
import re

import pytest

from rapidtrain.data.tokenizer import BertWordPieceTokenizer
from rapidtrain.tasks.megatron_data import TaskDataError, file_name, pair_row, read_mnli, read_race
from tests.compat.launch_data import BY_ID, tiny
from tests.compat.test_launch_runs import ENTRY, python
from tests.launch import REPO

MNLI_HEADER = ("index\tpromptID\tpairID\tgenre\tsentence1_binary_parse\tsentence2_binary_parse\tsentence1_parse\t"
               "sentence2_parse\tsentence1\tsentence2\tlabel1\tgold_label\n")
WORDS = ["the", "cat", "sat", "on", "mat", "a", "dog", "ran", "is", "not", "here", "there", "what", "did", "do"]


def write_mnli(path, rows: int, offset: int = 0) -> None:
    """GLUE's MNLI layout: 12 columns, the pair in sentence1/sentence2, the gold label last."""
    labels = ("entailment", "neutral", "contradiction")
    lines = [f"{offset + i}\t0\t0\tfiction\t-\t-\t-\t-\tthe cat sat on the mat {i}\t"
             f"{'a dog ran' if i % 3 else 'the cat sat'} there\t-\t{labels[i % 3]}\n" for i in range(rows)]
    path.write_text(MNLI_HEADER + "".join(lines))


@pytest.fixture(scope="module")
def vocab(tmp_path_factory):
    path = tmp_path_factory.mktemp("vocab") / "vocab.txt"
    path.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", *WORDS, *map(str, range(10))]))
    return BertWordPieceTokenizer(str(path))


def test_mnli_rows_become_cls_a_sep_b_sep_with_megatrons_label_ids(tmp_path, vocab):
    write_mnli(tmp_path / "dev_matched.tsv", 3)
    samples = read_mnli(str(tmp_path / "dev_matched.tsv"), vocab, 16)
    first = samples[0]
    words = vocab.tokenize("the cat sat on the mat 0")
    second = vocab.tokenize("the cat sat there")
    expected = [vocab.cls, *words, vocab.sep, *second, vocab.sep]
    assert first["text"].tolist() == expected + [vocab.pad] * (16 - len(expected))
    assert first["types"].tolist() == [0] * (len(words) + 2) + [1] * (len(second) + 1) + [0] * (16 - len(expected))
    assert first["padding_mask"].sum() == len(expected)
    assert [s["label"] for s in samples] == [1, 2, 0]  # entailment 1, neutral 2, contradiction 0
    assert file_name("MNLI", str(tmp_path / "dev_matched.tsv")) == "dev-matched"


def test_long_pairs_are_cut_keeping_the_closing_sep(vocab):
    ids, types, mask = pair_row(list(range(6, 16)), list(range(16, 20)), 8, vocab)
    assert ids == [vocab.cls, *range(6, 12), vocab.sep] and sum(mask) == 8 and types[-1] == 1


def test_race_passages_give_four_rows_per_question_with_the_option_in_the_blank(tmp_path, vocab):
    folder = tmp_path / "RACE" / "dev" / "middle"
    folder.mkdir(parents=True)
    passage = {"article": "the cat sat on the mat .", "questions": ["the _ sat", "what did the cat do"],
               "options": [["cat", "dog", "mat", "a"], ["sat", "ran", "is", "not"]], "answers": ["A", "C"]}
    (folder / "1.txt").write_text(json.dumps(passage) + "\n")
    samples = read_race(str(folder), vocab, 24)
    assert [s["label"] for s in samples] == [0, 2] and samples[0]["text"].shape == (4, 24)
    dog = [vocab.cls, *vocab.tokenize("the dog sat"), vocab.sep]
    assert samples[0]["text"][1].tolist()[:len(dog)] == dog
    assert file_name("RACE", str(folder)) == "dev-middle"


def test_a_file_that_is_not_mnli_names_the_flag_and_line(tmp_path, vocab):
    (tmp_path / "train.tsv").write_text(MNLI_HEADER + "0\tonly\tthree\n")
    with pytest.raises(TaskDataError, match=r"--train-data .*train.tsv, line 2: 3 tab-separated columns"):
        read_mnli(str(tmp_path / "train.tsv"), vocab, 16)
    with pytest.raises(TaskDataError, match="--valid-data .*: no such folder"):
        read_race(str(tmp_path / "missing"), vocab, 16, flag="--valid-data")


SHRUNK = {"--fp16": None, "--checkpoint-activations": None, "--save-interval": None}


@pytest.fixture(scope="module")
def pretrained_bert(local_files, tmp_path_factory):
    """A BERT checkpoint as a Megatron user makes one: Megatron-LM's BERT script (2020) run by pretrain_bert.py with
    its sizes shrunk, 2 iterations, --save."""
    folder = tmp_path_factory.mktemp("pretrained") / "bert"
    python(ENTRY["pretrain_bert"], tiny(BY_ID["mlm-bert-2020"], local_files,
                                        {**SHRUNK, "--train-iters": "2", "--save": str(folder), "--load": None}))
    return folder


def test_megatron_2020_mnli_script_fine_tunes_a_pretrained_bert_and_reports_accuracy(local_files, pretrained_bert,
                                                                                      tmp_path):
    """Megatron-LM's examples/finetune_mnli_distributed.sh (2020) shrunk to one process, from the checkpoint
    pretrain_bert.py saved: one epoch over 24 MNLI rows, then the accuracy on dev_matched and dev_mismatched, each
    file apart and overall, as Megatron prints it."""
    write_mnli(tmp_path / "train.tsv", 24)
    write_mnli(tmp_path / "dev_matched.tsv", 6, offset=100)
    write_mnli(tmp_path / "dev_mismatched.tsv", 3, offset=200)
    changes = {**SHRUNK, "--train-data": str(tmp_path / "train.tsv"), "--pretrained-checkpoint": str(pretrained_bert),
               "--valid-data": [str(tmp_path / "dev_matched.tsv"), str(tmp_path / "dev_mismatched.tsv")],
               "--epochs": "1", "--batch-size": "4", "--save": None, "--eval-interval": None}
    run = python(REPO / "rapidtrain" / "tasks_main.py", tiny(BY_ID["mlm-mnli-ft-2020"], local_files, changes))
    assert "started from the pretrained BERT: encoder and pooler" in run.stdout
    assert "head of 3 classes on the pooled [CLS], Megatron's MNLI task" in run.stdout
    assert len(re.findall(r"\] iteration +\d+/ +6 \|[^\n]*lm loss: [0-9.E+-]+", run.stdout)) == 6
    matched = re.search(r" > \|epoch: 0\| metrics for dev-matched: correct / total = (\d+) / 6 = ([0-9.]+) %",
                        run.stdout)
    assert matched and abs(float(matched.group(2)) - 100 * int(matched.group(1)) / 6) < 1e-3
    assert re.search(r" > \|epoch: 0\| metrics for dev-mismatched: correct / total = \d+ / 3 = ", run.stdout)
    assert re.search(r" >> \|epoch: 0\| overall: correct / total = \d+ / 9 = [0-9.]+ %", run.stdout)


def test_the_task_model_takes_the_encoder_and_refuses_a_checkpoint_of_another_shape(pretrained_bert):
    """The checkpoint's encoder and pooler land in the task model unchanged (its head is new); a model of another
    hidden size is refused naming the flag that differs. RACE's [b, 4, s] inputs give one score per option."""
    import torch

    from rapidtrain.checkpoint.checkpointer import CheckpointError, read_common
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state
    from rapidtrain.models.config import ModelConfig
    from rapidtrain.tasks.megatron_tasks import BertTaskModel

    directory = checkpoint_directory(str(pretrained_bert))
    config = ModelConfig(**read_common(directory)["plan"]["model"])
    model = BertTaskModel(config, outputs=1, seed=3)
    model.load_pretrained(str(pretrained_bert))
    saved = consolidated_model_state(directory)
    encoder = model.encoder.state_dict()
    assert len(encoder) > 20 and all(torch.equal(value, saved[name]) for name, value in encoder.items())
    assert torch.equal(model.pooler.dense.weight, saved["pooler.dense.weight"])
    model.eval()
    tokens = torch.randint(5, 100, (2, 4, 16))
    assert model(tokens, torch.ones_like(tokens), torch.zeros_like(tokens)).shape == (2, 4)
    other = BertTaskModel(ModelConfig(**{**config.__dict__, "hidden_size": 32}), outputs=3, seed=3)
    with pytest.raises(CheckpointError, match=r"holds a different model: --hidden-size \(checkpoint 64, now 32\)"):
        other.load_pretrained(str(pretrained_bert))
