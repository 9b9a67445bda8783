"""The black-box fine-tuning command on tiny local models and data: every task, the Finetuner's loop
(accumulation, resume, dynamic shape, activation checkpointing, LoRA), exported models, the metrics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from rapidtrain.data.loaders import EvalBatchSampler, gather_across_ranks
from rapidtrain.finetune import main as finetune
from rapidtrain.tasks import metrics, toy
from rapidtrain.train.own_loop import AccumulationTracker
from tests.compat.run_launch_scripts import results
from tests.launch import REPO, child_env, read_losses, relative_difference, torchrun

RUNNER = REPO / "tests" / "compat" / "run_launch_scripts.py"  # several runs on one launch's ranks

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning"),
              pytest.mark.usefixtures("one_thread")]



def flags(model: Path, data: Path, *extra: str) -> list[str]:
    task = data.name
    return [
        "--task",
        task,
        "--pretrained-model-name-or-path",
        str(model),
        "--data-dir",
        str(data.parent),
        "--data-name",
        task,
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "16",
        "--seq-length",
        "32",
        "--lr",
        "3e-3",
        "--num-workers",
        "0",
        "--log-interval",
        "100",
        *extra,
    ]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def epoch_means(losses: dict[int, float], per_epoch: int) -> list[float]:
    values = [losses[i] for i in sorted(losses)]
    return [sum(values[i : i + per_epoch]) / per_epoch for i in range(0, len(values), per_epoch)]


# ---- metrics, sampling, gathering (no training) ----


def test_entities_follow_conll_rules():
    tags = ["B-PER", "I-PER", "O", "B-LOC", "B-LOC", "I-ORG", "E-ORG", "S-MISC", "I-PER"]
    assert metrics.entities(tags) == {
        ("PER", 0, 1),
        ("LOC", 3, 3),
        ("LOC", 4, 4),
        ("ORG", 5, 6),
        ("MISC", 7, 7),
        ("PER", 8, 8),
    }
    # a wrong type or a wrong boundary is a miss and a false alarm
    assert metrics.entity_counts(["B-PER", "I-PER", "O", "B-LOC"], ["B-PER", "I-PER", "O", "B-ORG"]) == (
        1,
        2,
        2,
    )
    assert metrics.entity_counts(["B-PER", "O"], ["B-PER", "I-PER"]) == (0, 1, 1)
    assert metrics.precision_recall_f1(3, 4, 6) == {"precision": 0.75, "recall": 0.5, "f1": 0.6}


def test_squad_scores_and_overlap():
    assert metrics.squad_scores("The Blue!", ["blue"]) == (1.0, 1.0)
    exact, f1 = metrics.squad_scores("dark blue sky", ["blue sky", "red"])
    assert exact == 0.0 and f1 == pytest.approx(0.8)
    assert metrics.overlap_f1([1, 2, 2, 3], [2, 2, 4]) == pytest.approx(
        2 * (2 / 4) * (2 / 3) / (2 / 4 + 2 / 3)
    )
    assert metrics.f1_score(torch.tensor([1, 1, 0, 0]), torch.tensor([1, 0, 0, -100]), 2) == pytest.approx(
        2 / 3
    )


@pytest.mark.parametrize("total, micro, ranks", [(13, 2, 3), (1, 2, 2), (8, 4, 2)])
def test_eval_batches_cover_every_sample_once_in_dataset_order(total, micro, ranks):
    samplers = [EvalBatchSampler(total, micro, rank, ranks) for rank in range(ranks)]
    assert len({len(s) for s in samplers}) == 1  # every rank runs the same number of batches
    order = []
    for step, batches in enumerate(zip(*samplers, strict=True)):
        for sampler, batch in zip(samplers, batches, strict=True):
            order += batch[: sampler.real_rows(step)]
            assert len(batch) >= 1  # never an empty batch, even with fewer samples than ranks
    assert order == list(range(total))


def test_gather_keeps_only_real_rows():
    padded = torch.tensor([[7, 7], [7, 7]])
    assert gather_across_ranks(padded, None, real_rows=0).shape == (0, 2)
    assert gather_across_ranks(torch.tensor(3.0), None).tolist() == [3.0]


def test_accumulation_groups_end_with_the_epoch():
    tracker = AccumulationTracker(accumulation_steps=2)
    places = []
    for step in range(5):
        tracker.place(step, steps_in_epoch=5)
        places.append((tracker.group_size, tracker.is_last))
    assert places == [(2, False), (2, True), (2, False), (2, True), (1, True)]
    assert float(tracker.scale(torch.tensor(3.0))) == 3.0


# ---- every task on a tiny model ----


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    made: dict[str, tuple[Path, Path]] = {}

    def make(task: str, train: int = 128, dev: int = 32, dropout: float = 0.1) -> tuple[Path, Path]:
        key = f"{task}-{train}-{dev}-{dropout}"
        if key not in made:
            made[key] = toy.make_task(
                task, tmp_path_factory.mktemp(task), train=train, dev=dev, dropout=dropout
            )
        return made[key]

    return make


def test_sequence_classification_learns_and_its_export_predicts_the_same(tiny, tmp_path):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    model, data = tiny("sequence_classification", train=256, dev=64)
    results = finetune(flags(model, data, "--epochs", "3", "--save", str(tmp_path)))
    assert results["accuracy"] > 0.85  # chance is 0.5
    best = json.loads((tmp_path / "best" / "eval_results.json").read_text())
    assert best["validation"]["accuracy"] == max(h["accuracy"] for h in results_history(tmp_path))
    loaded = AutoModelForSequenceClassification.from_pretrained(
        tmp_path / "best", local_files_only=True
    ).eval()
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "best", local_files_only=True)
    dev = [json.loads(line) for line in (data / "dev.jsonl").read_text().splitlines()]
    batch = tokenizer(
        [r["sentence"] for r in dev], truncation=True, max_length=32, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        predicted = [loaded.config.id2label[int(i)] for i in loaded(**batch).logits.argmax(-1)]
    saved = [row["prediction"] for row in read_jsonl(tmp_path / "best" / "eval_predictions.jsonl")]
    assert predicted == saved
    accuracy = sum(int(p) == r["label"] for p, r in zip(predicted, dev, strict=True)) / len(dev)
    assert accuracy == best["validation"]["accuracy"]


def results_history(save: Path) -> list[dict]:
    return json.loads((save / "last" / "eval_results.json").read_text())["history"]


def test_token_classification_entity_f1_matches_its_predictions(tiny, tmp_path):
    model, data = tiny("token_classification")
    results = finetune(flags(model, data, "--epochs", "3", "--save", str(tmp_path)))
    assert results["f1"] > 0.5
    predictions = [row["prediction"] for row in read_jsonl(tmp_path / "last" / "eval_predictions.jsonl")]
    gold = [row["ner_tags"] for row in read_jsonl(data / "dev.jsonl")]
    counts = [
        sum(c)
        for c in zip(
            *(metrics.entity_counts(p, g) for p, g in zip(predictions, gold, strict=True)), strict=True
        )
    ]
    assert metrics.precision_recall_f1(*counts)["f1"] == pytest.approx(results["f1"])


def test_question_answering_scores_match_its_answers(tiny, tmp_path):
    model, data = tiny("question_answering")
    log = tmp_path / "losses.txt"
    results = finetune(
        flags(
            model,
            data,
            "--epochs",
            "3",
            "--seq-length",
            "48",
            "--save",
            str(tmp_path),
            "--loss-log-file",
            str(log),
        )
    )
    answers = [row["prediction"] for row in read_jsonl(tmp_path / "last" / "eval_predictions.jsonl")]
    gold = [row["answers"]["text"] for row in read_jsonl(data / "dev.jsonl")]
    scores = [metrics.squad_scores(a, g) for a, g in zip(answers, gold, strict=True)]
    assert results["exact_match"] == pytest.approx(sum(s[0] for s in scores) / len(scores))
    assert results["f1"] == pytest.approx(sum(s[1] for s in scores) / len(scores))
    first, *_, last = epoch_means(read_losses(log), per_epoch=8)
    assert last < first


@pytest.mark.parametrize("task", ["masked_lm", "casual_lm", "causal_lm"])
def test_language_models_lower_their_perplexity(tiny, tmp_path, task):
    model, data = tiny("casual_lm" if task == "causal_lm" else task)
    args = flags(model, data, "--epochs", "2", "--save", str(tmp_path))
    args[1] = task  # causal_lm is accepted for Rapidformer's casual_lm
    results = finetune(args)
    history = results_history(tmp_path)
    assert history[-1]["perplexity"] < history[0]["perplexity"]
    assert results["perplexity"] == pytest.approx(torch.tensor(results["loss"]).exp().item(), rel=1e-6)


def test_seq2seq_reports_loss_and_token_overlap(tiny, tmp_path):
    model, data = tiny("seq2seq_lm")
    results = finetune(flags(model, data, "--epochs", "2", "--save", str(tmp_path)))
    history = results_history(tmp_path)
    assert history[-1]["loss"] < history[0]["loss"]
    assert 0.0 <= results["token_overlap_f1"] <= 1.0
    assert len(read_jsonl(tmp_path / "last" / "eval_predictions.jsonl")) == 32


# ---- the loop's switches ----


def test_evaluations_reuse_one_loader_whose_workers_persist(tiny, tmp_path, monkeypatch):
    """Three evaluations (two epochs with --eval-interval between them) with two loader workers: one evaluation
    loader for the run, its workers kept (forked once, not per evaluation while other threads run), and stopped
    when the run ends."""
    from rapidtrain.data import loaders
    from rapidtrain.train import trainer

    made = []

    def counting_eval_loader(*args, **kwargs):
        made.append(loaders.eval_loader(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(trainer, "eval_loader", counting_eval_loader)
    model, data = tiny("sequence_classification", train=64, dev=16)
    finetune(flags(model, data, "--epochs", "2", "--num-workers", "2", "--eval-interval", "3",
                   "--save", str(tmp_path)))
    assert len(results_history(tmp_path)) >= 3 and len(made) == 1
    assert made[0].loader.persistent_workers
    assert made[0].loader._iterator is None or not made[0].loader._iterator._workers_status[0]  # stopped at the end




def test_gradient_accumulation_gives_the_losses_of_one_large_micro_batch(tiny, tmp_path):
    model, data = tiny("sequence_classification", train=64, dev=16, dropout=0.0)
    one, four = tmp_path / "one.txt", tmp_path / "four.txt"
    finetune(flags(model, data, "--epochs", "2", "--micro-batch-size", "16", "--loss-log-file", str(one)))
    finetune(flags(model, data, "--epochs", "2", "--micro-batch-size", "4", "--loss-log-file", str(four)))
    assert len(read_losses(one)) == 8
    assert relative_difference(read_losses(four), read_losses(one)) < 1e-5


def test_resume_mid_epoch_continues_with_identical_losses(tiny, tmp_path):
    """Dropout on: position, optimizer, schedule and RNG all come back from the checkpoint."""
    model, data = tiny("sequence_classification", train=48, dev=16)
    straight, resumed, save = tmp_path / "straight.txt", tmp_path / "resumed.txt", tmp_path / "save"
    common = flags(model, data, "--epochs", "2")
    finetune(common + ["--loss-log-file", str(straight)])
    finetune(common + ["--save", str(save), "--exit-interval", "2", "--loss-log-file", str(resumed)])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "2"  # mid epoch 1 (3 steps)
    finetune(common + ["--save", str(save), "--load", str(save), "--loss-log-file", str(resumed)])
    assert read_losses(resumed) == read_losses(straight)


def test_dynamic_shape_pads_to_the_batch_longest_multiple_of_8(tiny):
    from rapidtrain.tasks import build_task
    from rapidtrain.tasks.base import load_tokenizer

    model, data = tiny("sequence_classification")
    tokenizer = load_tokenizer(str(model))
    fixed, dynamic = (build_task("sequence_classification", tokenizer, 64, d) for d in (False, True))
    records = [json.loads(line) for line in (data / "dev.jsonl").read_text().splitlines()[:4]]
    features = fixed.prepare({"train": records})["train"].features
    longest = max(len(f["input_ids"]) for f in features)
    assert fixed.collate(features)["input_ids"].shape == (4, 64)
    assert dynamic.collate(features)["input_ids"].shape == (4, -(-longest // 8) * 8)


def test_activation_checkpointing_keeps_the_losses(tiny, tmp_path):
    model, data = tiny("sequence_classification", train=32, dev=16, dropout=0.0)
    plain, recomputed = tmp_path / "plain.txt", tmp_path / "recomputed.txt"
    finetune(flags(model, data, "--epochs", "1", "--loss-log-file", str(plain)))
    finetune(
        flags(model, data, "--epochs", "1", "--checkpoint-activations", "--loss-log-file", str(recomputed))
    )
    assert relative_difference(read_losses(recomputed), read_losses(plain)) < 1e-5


def test_lora_trains_adapters_only_and_exports_a_merged_model(tiny, tmp_path):
    from safetensors.torch import load_file

    model, data = tiny("sequence_classification")
    finetune(flags(model, data, "--epochs", "1", "--lora-rank", "4", "--save", str(tmp_path)))
    before, after = load_file(model / "model.safetensors"), load_file(tmp_path / "last" / "model.safetensors")
    frozen = "bert.embeddings.word_embeddings.weight"
    adapted = "bert.encoder.layer.0.attention.self.query.weight"  # peft's default LoRA target for BERT
    assert torch.equal(after[frozen], before[frozen])
    assert not torch.allclose(after[adapted], before[adapted])
    assert (tmp_path / "last" / "adapter" / "adapter_config.json").is_file()


def test_a_missing_model_folder_names_the_flag(tmp_path, capsys):
    with pytest.raises(SystemExit) as stopped:
        finetune(
            [
                "--task",
                "sequence_classification",
                "--pretrained-model-name-or-path",
                "bert-base-cased",
                "--data-dir",
                str(tmp_path),
                "--epochs",
                "1",
                "--lr",
                "1e-4",
            ]
        )
    assert stopped.value.code == 2 and isinstance(stopped.value.__cause__, FileNotFoundError)
    assert "--pretrained-model-name-or-path bert-base-cased" in capsys.readouterr().err
    assert "never downloads" in str(stopped.value.__cause__)


# ---- the headline: 2 gloo ranks, ZeRO-2, mixed precision, through the `rapidtrain` command ----


@pytest.fixture(scope="module")
def glue_bert(tmp_path_factory) -> Path:
    """GLUE SST-2 style files (384 train, 128 dev) and a randomly initialised tiny BERT, all local."""
    root = tmp_path_factory.mktemp("glue-bert")
    toy.write_glue_folder(root / "glue", "sst2", train=384, dev=128)
    texts = toy.texts_of(toy.sentiment_records(384, 0))
    toy.save_tiny_model("bert", root / "tiny-bert", toy.train_tokenizer(texts, root / "tok"))
    return root


def black_box_flags(root: Path, save: Path, *switches: str, epochs: int = 2) -> list[str]:
    """The black-box command's flags (after `rapidtrain`) for the tiny BERT on 2 ranks."""
    return [
        "--nproc-per-node",
        "2",
        "--task",
        "sequence_classification",
        "--pretrained-model-name-or-path",
        str(root / "tiny-bert"),
        "--data-dir",
        str(root / "glue"),
        "--data-name",
        "sst2",
        "--epochs",
        str(epochs),
        "--micro-batch-size",
        "16",
        "--global-batch-size",
        "32",
        "--lr",
        "3e-3",
        "--lr-warmup-fraction",
        "0.1",
        "--seq-length",
        "32",
        "--num-workers",
        "0",
        "--save",
        str(save),
        *switches,
    ]


def black_box(root: Path, save: Path, *switches: str, epochs: int = 2) -> subprocess.CompletedProcess:
    run = subprocess.run(
        [sys.executable, "-m", "rapidtrain.cli", *black_box_flags(root, save, *switches, epochs=epochs)],
        capture_output=True,
        text=True,
        env=child_env({"OMP_NUM_THREADS": "1"}),
        cwd=REPO,
        timeout=900,
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    return run


def exported_predictions(model_dir: Path, dev: list[dict]) -> list[str]:
    """The labels a saved model folder predicts, loaded with `from_pretrained` (fp32)."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    loaded = AutoModelForSequenceClassification.from_pretrained(model_dir, local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
    batch = tokenizer(
        [r["sentence"] for r in dev], truncation=True, max_length=32, padding=True, return_tensors="pt"
    )
    with torch.no_grad():
        return [loaded.config.id2label[int(i)] for i in loaded(**batch).logits.argmax(-1)]


def trained_weights(save: Path, folder: str) -> dict[str, torch.Tensor]:
    """The model of the checkpoint written at the iteration an exported folder was evaluated (restitched from
    the ranks' shards by the reader), LoRA adapters merged by peft as a user of the adapter folder would."""
    from rapidtrain.checkpoint.reader import checkpoint_directory, consolidated_model_state

    iteration = json.loads((save / folder / "eval_results.json").read_text())["iteration"]
    trained = consolidated_model_state(checkpoint_directory(save, iteration))
    if not (save / folder / "adapter").is_dir():
        return trained
    from peft import LoraConfig, get_peft_model
    from transformers import AutoConfig, AutoModelForSequenceClassification

    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(AutoConfig.from_pretrained(save / folder))
    model = get_peft_model(model, LoraConfig.from_pretrained(save / folder / "adapter"))
    model.load_state_dict(trained, assign=True, strict=True)
    return model.merge_and_unload().state_dict()


def assert_exported_weights_are_the_trained_ones(save: Path, folder: str) -> None:
    """Every tensor of an exported folder equals, bit for bit, the trained one (gathered by the export from the
    sharding engine; read back from the checkpoint's shards here)."""
    from safetensors.torch import load_file

    trained = trained_weights(save, folder)
    exported = load_file(save / folder / "model.safetensors")
    assert sorted(exported) == sorted(trained)
    different = [name for name, value in exported.items() if not torch.equal(value, trained[name])]
    assert not different, f"exported tensors differ from the trained ones: {different}"


@pytest.mark.slow
def test_black_box_command_fine_tunes_bert_with_zero2_and_mixed_precision(glue_bert, tmp_path):
    from rapidtrain.data.finetune import read_split_file

    # 4 epochs: after 2 the tiny BERT sits on its learning transition (0.91 alone, 0.68 in a full-suite run), after 4
    # it is clear of it
    run = black_box(glue_bert, tmp_path, "--zero-2-memory-optimization", "--mixed-precision", epochs=4)
    from rapidtrain.config.settings import detect_capability

    assert "DeepSpeed ZeRO stage 2" in run.stdout
    # --mixed-precision is bf16 where the CPU computes it natively, fp32 (said in the plan) where it would be emulated.
    assert ("DeepSpeed bf16 engine" in run.stdout) == detect_capability("cpu").native_bf16
    reported = json.loads((tmp_path / "best" / "eval_results.json").read_text())["validation"]["accuracy"]
    assert reported >= 0.8  # chance is 0.5
    # bf16 evaluation: the exported model is checked on its weights, not by re-evaluating it in fp32
    # (a borderline example flips between the two precisions, differently on each CPU)
    assert_exported_weights_are_the_trained_ones(tmp_path, "best")
    dev = read_split_file(glue_bert / "glue" / "sst2" / "dev.tsv")
    predicted = [row["prediction"] for row in read_jsonl(tmp_path / "best" / "eval_predictions.jsonl")]
    assert sum(int(p) == r["label"] for p, r in zip(predicted, dev, strict=True)) / len(dev) == reported
    print(f"headline: validation accuracy {reported:.4f} with ZeRO-2 + bf16 on 2 gloo ranks")


PARTITIONINGS = {
    "fsdp-recompute": ["--fsdp-memory-optimization", "--checkpoint-activations"],
    "zero3": ["--zero-3-memory-optimization"],
    "sdp-bf16": ["--oss-sdp-memory-optimization", "--bf16"],
    "zero1-lora": ["--zero-1-memory-optimization", "--lora-rank", "4"],
}


@pytest.fixture(scope="module")
def partitioned_runs(glue_bert, tmp_path_factory) -> dict[str, Path]:
    """The black-box command's program (rapidtrain/finetune.py) with each of PARTITIONINGS' switches, one after
    another on one warm torchrun launch of 2 ranks (tests/compat/run_launch_scripts.py, tests/launch.py): what is
    checked is what each sharding engine exports, not how the command starts its processes (the headline test
    above starts it as users do). Each run's --save folder, by id."""
    root = tmp_path_factory.mktemp("partitionings")
    runs = [{"id": name, "entry": "finetune", "argv": black_box_flags(glue_bert, root / name, *switches)}
            for name, switches in PARTITIONINGS.items()]
    (root / "runs.json").write_text(json.dumps(runs))
    launch = torchrun(2, RUNNER, [str(root / "runs.json")], warm=True, env={"OMP_NUM_THREADS": "1"})
    done = results(launch.stdout)
    assert sorted(done) == sorted(PARTITIONINGS), launch.stdout[-3000:] + launch.stderr[-3000:]
    return {name: root / name for name in PARTITIONINGS}


@pytest.mark.slow
@pytest.mark.parametrize("switches", list(PARTITIONINGS.values()), ids=list(PARTITIONINGS))
def test_every_partitioning_exports_the_model_it_evaluated(glue_bert, partitioned_runs, switches):
    """The full weights gathered from each sharding engine are the trained ones, and (where the run evaluated in
    fp32, the precision `from_pretrained` loads) they make the reported predictions."""
    from rapidtrain.data.finetune import read_split_file

    tmp_path = partitioned_runs[next(name for name, value in PARTITIONINGS.items() if value == switches)]
    assert_exported_weights_are_the_trained_ones(tmp_path, "last")
    if "--bf16" in switches:  # bf16 evaluation vs an fp32 re-evaluation: borderline examples flip by CPU
        return
    dev = read_split_file(glue_bert / "glue" / "sst2" / "dev.tsv")
    saved = [row["prediction"] for row in read_jsonl(tmp_path / "last" / "eval_predictions.jsonl")]
    assert exported_predictions(tmp_path / "last", dev) == saved
