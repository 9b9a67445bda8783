"""Megatron's and Rapidformer's flags: each one works, or the plan says why it changes nothing here; their
leniencies and meanings are applied once, when the flags are parsed, and printed as plan notes."""

from __future__ import annotations

import json

import pytest
import torch

from rapidtrain.config import arguments, plan, rules, settings
from rapidtrain.config.flag_surface import FlagRefused
from rapidtrain.config.settings import RunContext
from rapidtrain.data.samplers import MegatronRandomSampler
from rapidtrain.parallel.deepspeed import DeepSpeedConfigConflict, merge_user_config

BASE = ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "1000"]


def resolve(argv: list[str], world: int = 1, entry: str | None = "pretrain") -> settings.Plan:
    args = arguments.parse_args(BASE + argv, entry=entry)
    ctx = RunContext(world, "cpu")
    assert rules.violations(args, ctx) == []
    return plan.from_args(args, ctx)


def notes(p: settings.Plan) -> str:
    return "\n".join(p.notes)


def test_megatrons_leniencies_warn_instead_of_refusing():
    p = resolve(["--sequence-parallel", "--finetune", "--data-path", "d"])
    assert not p.layout.sequence_parallel and p.checkpoint.finetune
    assert "--sequence-parallel is turned off" in notes(p) and "--finetune without --load does nothing" in notes(p)
    assert resolve(["--sequence-parallel", "--tensor-model-parallel-size", "2", "--data-path", "d"],
                   world=2).layout.sequence_parallel


@pytest.mark.parametrize("layout, world, served", [
    ([], 2, "zero-redundancy"),
    (["--tensor-model-parallel-size", "2"], 4, "fsdp2"),
])
def test_distributed_optimizer_shards_optimizer_state_over_data_parallel(layout, world, served):
    p = resolve(["--use-distributed-optimizer", "--data-path", "d"] + layout, world=world)
    assert p.switches.partitioning_engine == served and p.switches.partitioning in ("oss", "zero-1")
    assert p.memory.optimizer_bytes < resolve(["--data-path", "d"] + layout, world=world).memory.optimizer_bytes
    assert "--use-distributed-optimizer: Megatron's optimizer-state sharding" in notes(p)


def test_flags_without_effect_each_have_a_plan_line():
    p = resolve(["--DDP-impl", "local", "--no-contiguous-buffers-in-local-ddp", "--use-mcore-models",
                 "--app-name", "text_classify", "--log-timers-to-tensorboard", "--keep-last", "--data-path", "d"])
    text = notes(p)
    for flag in ("--DDP-impl local", "--no-contiguous-buffers-in-local-ddp", "--use-mcore-models", "--app-name",
                 "TensorBoard flags without --tensorboard-dir", "--keep-last"):
        assert flag in text, flag


def test_megatron_checkpoint_folder_loads_as_load_and_gives_the_shape(tmp_path):
    """Rapidformer's --pretrained-model-name-or-path naming a Megatron-format checkpoint: --load it (MoE
    included), the shape flags not given taken from the flags it was saved with."""
    folder = tmp_path / "ckpt"
    (folder / "iter_0000003").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("3\n")
    saved = {"num_layers": 6, "hidden_size": 48, "num_attention_heads": 6, "num_experts": [4],
             "model_type": "ModelType.encoder_or_decoder"}  # a user script had set args.model_type
    (folder / "iter_0000003" / "common.json").write_text(json.dumps(
        {"args": saved, "plan": {"model": {"model_type": "gpt"}}}))
    p = resolve(["--pretrained-model-name-or-path", str(folder), "--data-path", "d", "--hidden-size", "48"])
    assert p.checkpoint.load == str(folder) and p.checkpoint.load_is_pretrained_model
    assert (p.model.num_layers, p.model.num_attention_heads, p.model.num_experts) == (6, 6, (4,) * 6)
    assert p.model.model_type == "gpt" and "--num-layers, --num-attention-heads, --num-experts" in notes(p)
    args = arguments.parse_args(BASE + ["--pretrained-model-name-or-path", str(folder), "--load", "other"])
    assert "pretrained-checkpoint-or-load" in {r.name for r in rules.RULES if r.violated(args, RunContext())}


def test_megatron_checkpoint_shape_yields_to_flags_that_set_it_under_another_name(tmp_path):
    """--window-size and --num-key-value-heads set --sliding-window and --num-query-groups: given, the checkpoint's
    saved values do not replace theirs (the window alone changes no weight, so the load takes it)."""
    folder = tmp_path / "ckpt"
    (folder / "iter_0000003").mkdir(parents=True)
    (folder / "latest_checkpointed_iteration.txt").write_text("3\n")
    saved = {"num_layers": 2, "hidden_size": 64, "num_attention_heads": 4, "sliding_window": 4096,
             "num_query_groups": 1, "group_query_attention": True}
    (folder / "iter_0000003" / "common.json").write_text(json.dumps({"args": saved}))
    p = resolve(["--pretrained-model-name-or-path", str(folder), "--data-path", "d", "--window-size", "63,0",
                 "--num-key-value-heads", "2"])
    assert (p.model.sliding_window, p.model.num_query_groups) == (64, 2)
    assert "--sliding-window" not in notes(p).split("model shape taken from the checkpoint")[-1]
    assert resolve(["--pretrained-model-name-or-path", str(folder), "--data-path", "d"]).model.sliding_window == 4096


def test_rapidformers_own_save_folder_as_pretrained_path_starts_fresh(tmp_path):
    save = str(tmp_path / "run")
    p = resolve(["--pretrained-model-name-or-path", save, "--save", save, "--data-path", "d"])
    assert p.checkpoint.load == save and not p.checkpoint.load_is_pretrained_model
    assert "holds no checkpoint yet, so training starts from scratch" in notes(p)
    args = arguments.parse_args(BASE + ["--pretrained-model-name-or-path", str(tmp_path / "typo"), "--save", save,
                                        "--data-path", "d"])
    messages = rules.violations(args, RunContext())
    assert any("no such folder" in m for m in messages)  # a missing folder that is not --save is refused


def test_megatron_tasks_data_flags_by_template():
    built_in = resolve(["--train-data", "a", "--valid-data", "b"])
    assert built_in.data.split_paths == (("a",), ("b",), None)
    assert "--train-data: the built-in pretraining reads it as --train-data-path" in notes(built_in)
    script = arguments.parse_args(BASE + ["--train-data", "a.txt"], entry=None)  # a user script reads it itself
    assert script.train_data == ["a.txt"] and script.train_data_path is None
    finetune = arguments.parse_args(["--task", "sequence_classification", "--epochs", "1", "--lr", "1e-4",
                                     "--data-path", "glue", "--data-name", "mrpc"])
    assert finetune.data_dir == "glue"


def test_hugging_face_fine_tuning_names_the_flags_it_does_not_read(tmp_path):
    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "bert", "num_hidden_layers": 2,
                                                    "hidden_size": 32, "num_attention_heads": 2,
                                                    "max_position_embeddings": 64}))
    argv = ["--task", "sequence_classification", "--epochs", "1", "--lr", "1e-4", "--pretrained-model-name-or-path",
            str(folder), "--data-dir", "d", "--num-layers", "2", "--vocab-file", "v.txt", "--hidden-dropout", "0.2"]
    p = plan.from_args(arguments.parse_args(argv), RunContext())
    assert "--vocab-file, --hidden-dropout: not used" in notes(p)
    too_long = arguments.parse_args(argv + ["--seq-length", "128"])
    assert any("--seq-length 128 (config.json max positions: 64)" in m for m in rules.violations(too_long,
                                                                                                RunContext()))


def test_deepspeed_config_file_merges_and_refuses_conflicts_naming_both_values():
    generated = {"train_batch_size": 16, "gradient_clipping": 1.0, "zero_optimization": {"stage": 2},
                 "bf16": {"enabled": True}, "wall_clock_breakdown": False}
    user = {"steps_per_print": 5, "zero_optimization": {"stage": 2, "reduce_bucket_size": 1000},
            "wall_clock_breakdown": True, "train_batch_size": 16}
    merged = merge_user_config(user, generated, "ds.json")
    assert merged["zero_optimization"] == {"stage": 2, "reduce_bucket_size": 1000}
    assert merged["steps_per_print"] == 5 and merged["wall_clock_breakdown"] is True
    conflicting = {"zero_optimization": {"stage": 3}, "gradient_clipping": 0.5, "fp16": {"enabled": True},
                   "scheduler": {"type": "WarmupLR"}}
    with pytest.raises(DeepSpeedConfigConflict) as error:
        merge_user_config(conflicting, generated, "ds.json")
    message = str(error.value)
    assert "zero_optimization.stage: --deepspeed_config 3, the flags 2 (--zero-N-memory-optimization)" in message
    assert "gradient_clipping: --deepspeed_config 0.5, the flags 1.0 (--clip-grad)" in message
    assert "fp16.enabled: --deepspeed_config true, the flags false" in message and "scheduler" in message


def test_keep_last_completes_the_epoch_instead_of_dropping_its_rest():
    kept = MegatronRandomSampler(10, 0, micro_batch_size=2, data_parallel_rank=0, data_parallel_size=2,
                                 keep_last=True)
    dropped = MegatronRandomSampler(10, 0, 2, 0, 2)
    assert (kept.samples_per_epoch, dropped.samples_per_epoch) == (12, 8)
    order = kept.epoch_permutation(0)
    assert sorted(set(order)) == list(range(10)) and order[10:] == order[:2]


def test_a_warm_up_past_a_short_fine_tune_is_shortened_with_a_warning(capsys):
    from rapidtrain.train.engine import Engine

    engine = Engine(argv=["--task", "sequence_classification", "--epochs", "2", "--lr", "1e-3",
                          "--lr-warmup-iters", "100"])
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    scheduler = engine.build_scheduler(optimizer, None, steps_per_epoch=5)
    assert scheduler.settings.warmup_samples == 9 * engine.plan.batches.global_batch_size
    assert "--lr-warmup-iters 100 is not shorter than this run's 10 iterations" in capsys.readouterr().out


def test_deepspeed_config_zero_sizes_win_over_defaults_but_not_over_flags():
    """A config's ZeRO bucket sizes (DeepSpeedExamples' 1e7) replace rapidtrain's defaults when no --zero-* flag set
    them, and its pinned offload buffers replace the device's choice (none on a CPU run); a size a flag set must
    agree."""
    generated = {"zero_optimization": {"stage": 3, "reduce_bucket_size": 500_000_000,
                                       "offload_optimizer": {"device": "cpu", "pin_memory": False}}}
    user = {"zero_optimization": {"reduce_bucket_size": 1e7, "offload_optimizer": {"pin_memory": True}}}
    merged = merge_user_config(user, generated, "ds.json", ("zero_optimization.reduce_bucket_size",))
    assert merged["zero_optimization"]["reduce_bucket_size"] == 1e7
    assert merged["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    with pytest.raises(DeepSpeedConfigConflict, match="reduce_bucket_size: --deepspeed_config 10000000.0"):
        merge_user_config(user, generated, "ds.json")


def test_spec_local_is_rapidtrains_own_layers_and_a_module_spec_is_refused():
    """Megatron-LM's BERT functional tests pass `--spec local` (its layers without Transformer Engine): that plans,
    with a note; a spec by module path (the hybrid Mamba stack) imports Megatron-Core code and stops, naming it."""
    assert "--spec local: Megatron's layers without Transformer Engine" in notes(resolve(["--spec", "local"]))
    with pytest.raises(FlagRefused) as stopped:
        resolve(["--spec", "megatron.core.models.hybrid.hybrid_layer_specs", "hybrid_stack_spec"])
    assert "hybrid_layer_specs hybrid_stack_spec: a Megatron-Core layer spec" in str(stopped.value)


def test_sinkhorn_load_balancing_plans_sinkhorn_routing_without_a_balancing_loss():
    """Megatron-LM's MoE functional tests (gpt3_mcore_tp2_pp2_ep2_te_4experts2parallel and 21 more) route with
    --moe-router-load-balancing-type sinkhorn: the model's router chooses by Sinkhorn-balanced logits and the balancing
    loss is off (Megatron asserts its coefficient 0); a coefficient or router setting it would ignore stops the run."""
    moe = ["--num-experts", "4", "--moe-router-topk", "1", "--moe-router-load-balancing-type", "sinkhorn"]
    p = resolve(moe)
    assert p.model.moe_aux_loss_type == "sinkhorn" and p.model.moe_aux_loss_coeff == 0.0
    assert "Sinkhorn routing" in notes(p)
    for extra, named in ((["--moe-aux-loss-coeff", "0.01"], "--moe-aux-loss-coeff 0.01"),
                         (["--moe-router-enable-expert-bias"], "--moe-router-enable-expert-bias")):
        with pytest.raises(FlagRefused) as stopped:
            resolve(moe + extra)
        assert named in str(stopped.value)
