"""White-box scripts: Rapidformer-shaped Finetuners and own loops run through `--user-script`, templates
without a main are run, scripts with nothing to train are refused."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rapidtrain.tasks import toy
from rapidtrain.user_script import UserScriptError, run_user_script
from tests.compat.run_launch_scripts import results
from tests.launch import REPO, child_env, read_losses, torchrun

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning", "ignore::FutureWarning")

# Rapidformer's published Finetuner example with `from rapidformer import` → `from rapidtrain import`. Only
# what needs the network differs: the data files are local and the GLUE metric is a small local object.
RAPIDFORMER_SCRIPT = """
import os
import torch
from datasets import load_dataset
from transformers import AutoModelForSequenceClassification, AutoTokenizer
from rapidtrain import RapidformerEngine, get_args, Finetuner


class LocalAccuracy:
    def __init__(self):
        self.correct = self.total = 0

    def add_batch(self, predictions, references):
        self.correct += int((predictions == references).sum())
        self.total += len(references)

    def compute(self):
        return {"accuracy": self.correct / self.total, "samples": self.total}


class MyFintuner(Finetuner):
    def __init__(self, engine):
        super().__init__(engine=engine)

    def train_valid_test_datasets_provider(self):
        args = get_args()
        tokenizer = AutoTokenizer.from_pretrained(args.pretrained_model_name_or_path)

        def tokenize_function(examples):
            outputs = tokenizer(examples["sentence"], truncation=True, max_length=None)
            return outputs

        folder = os.path.join(args.data_dir, args.data_name)
        datasets = load_dataset("csv", data_files={"train": os.path.join(folder, "train.tsv"),
                                                   "validation": os.path.join(folder, "dev.tsv")},
                                delimiter="\\t", quoting=3)
        tokenized_datasets = datasets.map(tokenize_function, batched=True, remove_columns=["sentence"])
        tokenized_datasets = tokenized_datasets.rename_column("label", "labels")
        train_dataset = tokenized_datasets["train"]
        valid_dataset = tokenized_datasets["validation"]

        def collate_fn(examples):
            return tokenizer.pad(examples, padding="longest", return_tensors="pt")

        return train_dataset, valid_dataset, None, collate_fn

    def model_optimizer_lr_scheduler_provider(self):
        args = get_args()
        model = AutoModelForSequenceClassification.from_pretrained(args.pretrained_model_name_or_path,
                                                                   return_dict=True)
        return model, None, None

    def run_forward_step(self, batch, model):
        output_tensor = model(**batch)
        return output_tensor.loss

    # after each epoch run metric on eval dataset
    def run_compute_metrics(self, model, eval_dataloader):
        model = model[0]
        metric = LocalAccuracy()
        for step, batch in enumerate(eval_dataloader):
            with torch.no_grad():
                outputs = model(**batch)
            predictions = outputs.logits.argmax(dim=-1)
            metric.add_batch(predictions=self.gather(predictions), references=self.gather(batch["labels"]))
        eval_metric = metric.compute()
        return eval_metric


if __name__ == "__main__":
    engine = RapidformerEngine()
    trainer = MyFintuner(engine=engine)
    trainer.train()
"""


@pytest.fixture(scope="module")
def glue(tmp_path_factory):
    """A GLUE SST-2 style folder and a tiny BERT (with tokenizer) next to it."""
    root = tmp_path_factory.mktemp("glue")
    toy.write_glue_folder(root / "glue", "sst2", train=256, dev=64)
    tokenizer = toy.train_tokenizer(toy.texts_of(toy.sentiment_records(256, 0)), root / "tokenizer")
    toy.save_tiny_model("bert", root / "tiny-bert", tokenizer)
    return root


def rapidtrain(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "rapidtrain.cli", *args]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=900,
        env=child_env({"OMP_NUM_THREADS": "1"}),
    )


def data_flags(glue: Path) -> list[str]:
    return [
        "--pretrained-model-name-or-path",
        str(glue / "tiny-bert"),
        "--data-dir",
        str(glue / "glue"),
        "--data-name",
        "sst2",
        "--seq-length",
        "32",
        "--num-workers",
        "0",
        "--lr",
        "3e-3",
    ]


@pytest.mark.slow
def test_rapidformer_finetuner_script_runs_with_only_the_import_changed(glue, tmp_path):
    """2 gloo ranks, OSS (ZeroRedundancyOptimizer) and 2 accumulation steps per global batch."""
    script = tmp_path / "my_finetuner.py"
    script.write_text(RAPIDFORMER_SCRIPT)
    run = rapidtrain(
        "--user-script",
        str(script),
        "--nproc-per-node",
        "2",
        *data_flags(glue),
        "--epochs",
        "2",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "32",
        "--oss-memory-optimization",
    )
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert "micro 8 × accumulation steps 2 × data parallel 2 = global 32" in run.stdout
    last = [line for line in run.stdout.splitlines() if line.startswith(" epoch 2 |")][0]
    assert "samples: 64" in last  # every validation sample exactly once over both ranks
    accuracy = float(last.split("accuracy: ")[1].split(" ")[0])
    assert accuracy > 0.8


# The unused-head template's three runs per layout (uninterrupted; stopped at iteration 3 with --save; resumed with
# --load), and the compose-loop template, as the `rapidtrain` command's ranks run them. What they prove is how a
# script trains, saves and resumes, not how the command starts its processes (test_rapidformer_finetuner_script...
# above and test_a_script_that_trains_nothing_is_refused start it as users do): the one-process layout's runs share
# one process, the two-rank ones one warm torchrun launch of 2 ranks (tests/compat/run_launch_scripts.py), each run
# with a process group of its own, the resumed run loading what the stopped one saved.
LAYOUTS = {"one-process": ["--nproc-per-node", "1"],
           "oss-over-ddp": ["--nproc-per-node", "2", "--oss-memory-optimization"]}
RUNNER = REPO / "tests" / "compat" / "run_launch_scripts.py"


def unused_head_runs(script: Path, glue: Path, folder: Path, layout: str) -> list[dict]:
    """The template with a spare head: uninterrupted, stopped at iteration 3 with --save, resumed with --load."""
    flags = ["--user-script", str(script), *data_flags(glue), "--epochs", "1",
             "--micro-batch-size", "8", "--global-batch-size", "16", *LAYOUTS[layout]]
    folder.mkdir(parents=True, exist_ok=True)
    straight, resumed, save = folder / "straight.txt", folder / "resumed.txt", folder / "ck"
    extras = {"straight": ["--loss-log-file", str(straight)],
              "stopped": ["--loss-log-file", str(resumed), "--save", str(save), "--exit-interval", "3"],
              "resumed": ["--loss-log-file", str(resumed), "--save", str(save), "--load", str(save)]}
    return [{"id": f"{layout}:{name}", "entry": "rapidtrain", "argv": flags + extra} for name, extra in extras.items()]


@pytest.fixture(scope="module")
def shared_runs(glue, tmp_path_factory) -> tuple[Path, dict[str, tuple[int, str]], str]:
    """Every run of LAYOUTS and the compose-loop template: the folder, each run's status and output by id, and the
    launches' output (for a run that never ended)."""
    root = tmp_path_factory.mktemp("shared-runs")
    script = root / "unused_head.py"
    template = (REPO / "templates" / "finetuner_template.py").read_text()
    marker = "        return model, None, None\n"
    assert marker in template
    script.write_text(template.replace(marker, "        model.spare_head = torch.nn.Linear(8, 8)\n" + marker))
    one = unused_head_runs(script, glue, root / "one-process", "one-process")
    compose = ["--user-script", str(REPO / "templates" / "compose_loop_template.py"), "--nproc-per-node", "2",
               *data_flags(glue), "--epochs", "3", "--micro-batch-size", "8", "--global-batch-size", "32",
               "--mixed-precision", "--fsdp-memory-optimization"]
    two = [*unused_head_runs(script, glue, root / "oss-over-ddp", "oss-over-ddp"),
           {"id": "compose-loop", "entry": "rapidtrain", "argv": compose}]
    for name, runs in (("one", one), ("two", two)):
        (root / f"{name}.json").write_text(json.dumps(runs))
    single = subprocess.run([sys.executable, str(RUNNER), str(root / "one.json")], capture_output=True, text=True,
                            cwd=REPO, timeout=900, env=child_env({"OMP_NUM_THREADS": "1"}))
    pair = torchrun(2, RUNNER, [str(root / "two.json")], warm=True, check=False, env={"OMP_NUM_THREADS": "1"})
    done = {**results(single.stdout), **results(pair.stdout)}
    return root, done, "\n".join(run.stdout[-3000:] + run.stderr[-3000:] for run in (single, pair))


def shared_run(shared_runs, run_id: str) -> str:
    _, done, launches = shared_runs
    status, output = done.get(run_id, (None, ""))
    assert status == 0, f"{run_id}: status {status}\n{output[-3000:]}\n{launches}"
    return output


@pytest.mark.slow
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_weight_the_loss_never_uses_trains_and_resumes_bitwise(shared_runs, layout):
    """The Finetuner template with a head its loss does not use (as a task's spare head, or experts no token
    reached). Over 2 ranks DDP (which OSS wraps the model in) looks for such weights instead of stopping at
    iteration 2 ("Expected to have finished reduction"). The checkpoint holds no optimizer state for that weight (it
    never had a gradient): one process (torch's loader) used to refuse it as damaged, and OSS's save made that
    state with a step at rate 0 over every parameter of the rank, decaying their moments. Now the resumed run goes
    on as the uninterrupted one: every loss bitwise."""
    for name in ("straight", "stopped", "resumed"):
        shared_run(shared_runs, f"{layout}:{name}")
    folder = shared_runs[0] / layout
    expected, got = read_losses(folder / "straight.txt"), read_losses(folder / "resumed.txt")
    assert sorted(got) == sorted(expected) == list(range(1, 17))
    assert got == expected


@pytest.mark.slow
def test_compose_loop_template_accumulates_over_two_fsdp_ranks(shared_runs):
    """The template's own AdamW is re-pointed at FSDP2's sharded parameters; 2 micro-batches per step."""
    output = shared_run(shared_runs, "compose-loop")
    epochs = [line for line in output.splitlines() if line.startswith(" epoch ")]
    assert len(epochs) == 3
    assert float(epochs[-1].rsplit(" ", 1)[1]) > 0.8


def test_a_script_that_trains_nothing_is_refused(tmp_path):
    script = tmp_path / "nothing.py"
    script.write_text("import torch\nprint('loaded', torch.__version__)\n")
    run = rapidtrain("--user-script", str(script), "--train-iters", "1", "--lr", "1e-3")
    assert run.returncode != 0
    assert "ran without training anything" in run.stderr and "templates/" in run.stderr


# ---- in process: detection, the general Trainer template, an own loop's accumulation ----

TINY_TEMPLATES = """
import torch
from torch.utils.data import TensorDataset
from rapidtrain import {base}


class Regression(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(4, 1)

    def forward(self, x, y):
        return {{"loss": torch.nn.functional.mse_loss(self.linear(x).squeeze(-1), y)}}


class Tiny({base}):
    def train_valid_test_datasets_provider(self):
        generator = torch.Generator().manual_seed(0)
        x = torch.randn(64, 4, generator=generator)
        rows = [{{"x": x[i], "y": x[i].sum()}} for i in range(64)]
        return rows[:48], rows[48:], None, None

    def model_optimizer_lr_scheduler_provider(self):
        return Regression(), None, None
"""


def run_script(tmp_path: Path, text: str, monkeypatch, *flags: str) -> None:
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(text))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    monkeypatch.setattr(sys, "path", list(sys.path))
    run_user_script(script, list(flags))


@pytest.mark.parametrize("base", ["Finetuner", "Trainer"])
def test_a_template_subclass_without_main_is_run(tmp_path, monkeypatch, base):
    """The script defines the subclass only; rapidtrain runs it (Trainer: the general template's loop)."""
    losses, save = tmp_path / "losses.txt", tmp_path / "save"
    flags = "--epochs 3 --lr 0.1 --micro-batch-size 4 --global-batch-size 8 --num-workers 0".split()
    run_script(
        tmp_path,
        TINY_TEMPLATES.format(base=base),
        monkeypatch,
        *flags,
        "--loss-log-file",
        str(losses),
        "--save",
        str(save),
    )
    values = read_losses(losses)
    assert sorted(values) == list(range(1, 19))  # 48 samples / 8 per step × 3 epochs
    first, last = (sum(values[i] for i in steps) / 6 for steps in (range(1, 7), range(13, 19)))
    assert last < first / 2
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "18"
    if base == "Finetuner":  # the Finetuner exports the model; the general Trainer keeps checkpoints only
        exported = torch.load(save / "last" / "model.pt")  # not a Hugging Face model: its full state dict
        assert set(exported) == {"linear.weight", "linear.bias"}
    else:
        assert not (save / "last").exists()


def test_several_template_subclasses_need_a_main(tmp_path, monkeypatch):
    text = TINY_TEMPLATES.format(base="Finetuner") + "\n\nclass Other(Tiny):\n    pass\n"
    with pytest.raises(UserScriptError, match=r"several templates \(Tiny, Other\)"):
        run_script(tmp_path, text, monkeypatch, "--epochs", "1", "--lr", "0.1")


def test_a_script_with_nothing_to_train_names_what_it_lacks(tmp_path, monkeypatch):
    with pytest.raises(UserScriptError, match="no subclass of Finetuner, PreTrainer or Trainer, no main"):
        run_script(tmp_path, "x = 1\n", monkeypatch, "--epochs", "1", "--lr", "0.1")


def own_loop(micro_batch_size: int) -> list[torch.Tensor]:
    """Two epochs of a plain PyTorch loop through Engine.compose; the final weights."""
    from torch.utils.data import DataLoader, TensorDataset

    from rapidtrain import Engine

    engine = Engine(
        argv=[
            "--epochs",
            "2",
            "--lr",
            "0.05",
            "--micro-batch-size",
            str(micro_batch_size),
            "--global-batch-size",
            "16",
            "--num-workers",
            "0",
            "--seed",
            "7",
            "--lr-warmup-iters",
            "1",
        ]
    )
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    x = torch.randn(48, 4, generator=torch.Generator().manual_seed(1))
    loader = DataLoader(
        TensorDataset(x, x.sum(dim=1, keepdim=True)), batch_size=micro_batch_size, shuffle=True
    )
    model, optimizer, scheduler, loader, _ = engine.compose(model=model, train_dataloader=loader)
    for _ in range(2):
        for inputs, targets in loader:
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            engine.backward(loss)
            scheduler.step()
            optimizer.step()
            optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


def test_own_loop_accumulation_equals_one_large_micro_batch(monkeypatch):
    import rapidtrain.train.engine as engine_module

    # A user's own loop runs as `python my_loop.py`, so its Engine sees a user script (general flags such as
    # --epochs); this file stands for it, whatever the test process's own __main__ is.
    monkeypatch.setattr(engine_module, "USER_SCRIPT", __file__)
    one, four = own_loop(16), own_loop(4)  # global batch 16: 1 micro-batch of 16, or 4 of 4
    for a, b in zip(one, four, strict=True):
        assert torch.allclose(a, b, atol=1e-6)
    assert not torch.allclose(one[0], own_loop_start()[0])  # and it did train


def own_loop_start() -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    return [p.detach() for p in model.parameters()]


def test_a_user_script_may_count_epochs_while_builtin_pretraining_may_not():
    from rapidtrain.config import arguments, rules
    from rapidtrain.config.settings import RunContext

    flags = ["--epochs", "2", "--lr", "1e-3"]
    builtin = rules.violations(arguments.parse_args(flags), RunContext())
    script = rules.violations(arguments.parse_args([*flags, "--user-script", "my.py"]), RunContext())
    assert any("--epochs with --task pretraining" in message for message in builtin)
    assert script == []


def test_a_user_optimizer_follows_parameters_the_wrapping_replaced():
    from rapidtrain.train.own_loop import rebind_optimizer

    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(1, 3)).sum().backward()
    optimizer.step()
    names = {id(p): n for n, p in model.named_parameters()}
    old_weight = model.weight
    moments = optimizer.state[old_weight]["exp_avg"]
    model.weight = torch.nn.Parameter(old_weight.detach().clone())  # as fully_shard or TP would
    assert rebind_optimizer(optimizer, names, model) == 1
    assert optimizer.param_groups[0]["params"][0] is model.weight
    assert optimizer.state[model.weight]["exp_avg"] is moments
    assert old_weight not in optimizer.state


def test_a_finetuner_may_count_iterations_instead_of_epochs(tmp_path, monkeypatch):
    losses = tmp_path / "losses.txt"
    run_script(
        tmp_path,
        TINY_TEMPLATES.format(base="Finetuner"),
        monkeypatch,
        "--train-iters",
        "9",
        "--lr",
        "0.1",
        "--micro-batch-size",
        "8",
        "--num-workers",
        "0",
        "--loss-log-file",
        str(losses),
    )
    assert sorted(read_losses(losses)) == list(range(1, 10))  # 6 steps per epoch: one epoch and a half
