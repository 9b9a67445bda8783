"""LoRA settings reach peft (rank, alpha, dropout, target modules), trainable parameter counts follow them, and the
k-bit switches are planned and refused as the rules say."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.config import arguments, rules
from rapidtrain.config.plan import from_args
from rapidtrain.config.settings import RunContext
from rapidtrain.models.lora import LoraSettings
from rapidtrain.tasks import build_task, load_task_model, toy
from rapidtrain.tasks.base import load_tokenizer

HIDDEN, LAYERS, LABELS = 32, 2, 2  # toy.make_task's tiny BERT: intermediate size 2 × hidden


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
    model, _ = toy.make_task("sequence_classification", tmp_path_factory.mktemp("lora"), train=8, dev=4, hidden=HIDDEN)
    return model


def load(folder, settings: LoraSettings):
    task = build_task("sequence_classification", load_tokenizer(str(folder)), seq_length=16)
    task.prepare({"train": toy.sentiment_records(8, 0)})  # the task learns its labels from the data
    return load_task_model(task, str(folder), settings)


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


HEAD = HIDDEN * LABELS + LABELS  # the classifier trains in full beside the adapters


@pytest.mark.parametrize(
    "rank, targets, adapted",
    [
        # peft's default for BERT: query and value, each h → h: r·(h + h) per module.
        (4, (), LAYERS * 2 * 2 * HIDDEN),
        (8, (), LAYERS * 2 * 2 * HIDDEN),
        (4, ("query", "key", "value"), LAYERS * 3 * 2 * HIDDEN),
        # Every linear layer but the head: q, k, v, o (h → h), intermediate (h → 2h), output (2h → h), and the pooler.
        (2, ("all-linear",), LAYERS * (4 * 2 * HIDDEN + 2 * 3 * HIDDEN) + 2 * HIDDEN),
    ],
)
def test_trainable_parameters_follow_rank_and_targets(tiny_bert, rank, targets, adapted):
    model = load(tiny_bert, LoraSettings(rank=rank, target_modules=targets))
    assert trainable(model) == rank * adapted + HEAD


def test_full_fine_tuning_trains_everything(tiny_bert):
    model = load(tiny_bert, LoraSettings(rank=0))
    assert trainable(model) == sum(p.numel() for p in model.parameters())


def test_alpha_and_dropout_reach_peft(tiny_bert):
    model = load(tiny_bert, LoraSettings(rank=4, alpha=12.0, dropout=0.25, target_modules=("query",)))
    config = model.peft_config["default"]
    assert (config.r, config.lora_alpha, config.lora_dropout) == (4, 12.0, 0.25)
    assert set(config.target_modules) == {"query"}
    query = model.base_model.model.bert.encoder.layer[0].attention.self.query
    assert query.scaling["default"] == pytest.approx(12.0 / 4)
    assert isinstance(query.lora_dropout["default"], torch.nn.Dropout) and query.lora_dropout["default"].p == 0.25
    # The default alpha stays 2 × rank, as before the flag existed.
    assert load(tiny_bert, LoraSettings(rank=4)).peft_config["default"].lora_alpha == 8


def test_unknown_target_modules_name_the_flag_and_the_real_names(tiny_bert):
    with pytest.raises(SystemExit, match="--lora-target-modules q_proj: .*named .*query.*all-linear"):
        load(tiny_bert, LoraSettings(rank=4, target_modules=("q_proj",)))


FINETUNE = ["--task", "sequence_classification", "--pretrained-model-name-or-path", "m", "--epochs", "1",
            "--lr", "1e-4"]


def plan_for(flags: list[str], world: int = 1):
    args = arguments.parse_args([*FINETUNE, *flags])
    ctx = RunContext(world, "cpu")
    rules.validate(args, ctx)
    return from_args(args, ctx)


def refused(flags: list[str], world: int = 1) -> str:
    with pytest.raises(rules.FlagConflict) as error:
        plan_for(flags, world)
    return str(error.value)


def test_plan_names_adapters_and_the_quantised_base():
    plan = plan_for(["--lora-rank", "8", "--lora-alpha", "32", "--lora-dropout", "0.05", "--lora-target-modules",
                     "query", "value", "--load-in-4bit"])
    assert plan.lora == LoraSettings(8, 32.0, 0.05, ("query", "value"), 4)
    assert plan.engine_for("--lora-rank").engine.startswith("peft LoRA r=8, alpha=32 (scale 4), dropout=0.05 on "
                                                            "query, value")
    assert "4-bit NF4" in plan.engine_for("--load-in-4bit").engine
    assert "prepare_model_for_kbit_training" in plan.engine_for("--load-in-4bit").engine
    assert plan_for([]).engine_for("--lora-rank") is None


def test_lora_flags_without_a_rank_are_refused_not_ignored():
    message = refused(["--lora-alpha", "16", "--lora-target-modules", "query"])
    assert "--lora-alpha, --lora-target-modules set LoRA adapters, but --lora-rank is 0" in message


def test_k_bit_base_needs_adapters_one_width_and_plain_data_parallel():
    assert "quantised weights cannot be trained: add --lora-rank" in refused(["--load-in-4bit"])
    assert "keep one" in refused(["--lora-rank", "4", "--load-in-4bit", "--load-in-8bit"])
    assert "flatten or shard bitsandbytes' packed weights" in refused(
        ["--lora-rank", "4", "--load-in-4bit", "--zero-2-memory-optimization"], world=2)
    plan_for(["--lora-rank", "4", "--load-in-4bit"], world=2)  # DDP is fine: the base is frozen


def test_k_bit_checkpoints_that_cannot_work_are_refused():
    assert "cannot save bitsandbytes' Linear8bitLt" in refused(["--lora-rank", "4", "--load-in-8bit", "--save", "d"])
    assert "resuming into bitsandbytes' packed 4-bit layers" in refused(
        ["--lora-rank", "4", "--load-in-4bit", "--load", "d"])
    plan_for(["--lora-rank", "4", "--load-in-4bit", "--save", "d"])


def test_without_bitsandbytes_k_bit_loading_is_refused(monkeypatch):
    from rapidtrain.optim import optimizers

    monkeypatch.setattr(optimizers, "_version", lambda package: None)  # stand-in for a machine without it
    assert "bitsandbytes is not installed" in refused(["--lora-rank", "4", "--load-in-8bit"])


def test_bad_lora_values_are_refused():
    message = refused(["--lora-rank", "4", "--lora-alpha", "0", "--lora-dropout", "1.5"])
    assert "--lora-alpha 0 must be > 0" in message and "--lora-dropout 1.5 must be in [0, 1)" in message
