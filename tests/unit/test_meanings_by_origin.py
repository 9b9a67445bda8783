"""Flags whose meaning differs between the parsers users come from take their origin's: MoE token dropping by the
MoE flags typed (Megatron-Core dropless unless a capacity factor is given; DeepSpeed-MoE and Rapidformer at capacity
1), and every key of a DeepSpeed config DeepSpeed does not run is read as a flag, said why it changes nothing, or
refused by name."""

from __future__ import annotations

import json

import pytest

from rapidtrain.config.arguments import parse_args
from rapidtrain.config.flag_surface import FlagRefused

MOE = "--num-layers 2 --hidden-size 32 --num-attention-heads 4 --seq-length 16 --lr 1e-3 --train-iters 1 " \
      "--num-experts 4".split()


def dropping(extra: str) -> tuple[bool, float, str]:
    args = parse_args(MOE + extra.split())
    note = next(n for n in args.compat_notes if n.startswith("MoE token dropping"))
    return not args.disable_moe_token_dropping, args.moe_capacity_factor, note


def test_megatron_core_flags_mean_dropless_unless_a_capacity_factor_is_given():
    drops, _, note = dropping("--moe-router-topk 2 --moe-token-dispatcher-type alltoall")
    assert not drops and "Megatron-Core's meaning (its flags --moe-router-topk, --moe-token-dispatcher-type)" in note
    drops, factor, note = dropping("--moe-router-topk 2 --moe-expert-capacity-factor 1.5")
    assert drops and factor == 1.5 and "capacity factor 1.5 as given" in note


def test_deepspeed_moe_and_rapidformer_flags_mean_capacity_one():
    drops, factor, note = dropping("--topk 2 --moe-min-capacity 2")
    assert drops and factor == 1.0 and "DeepSpeed-MoE's and Rapidformer's meaning (its flags --moe-min-capacity, " \
                                       "--topk)" in note
    drops, _, note = dropping("")  # no flag only one origin has: rapidtrain's default, said with the other choice
    assert drops and "give --disable-moe-token-dropping for Megatron-Core's dropless" in note
    args = parse_args(MOE + ["--moe-router-topk", "2", "--disable-moe-token-dropping"])
    assert args.disable_moe_token_dropping and not any(n.startswith("MoE token") for n in args.compat_notes)


def deepspeed_flags(tmp_path, config: dict, *extra: str) -> list[str]:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    return ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16",
            "--lr", "1e-3", "--train-iters", "1", "--tensor-model-parallel-size", "2", "--deepspeed",
            "--deepspeed_config", str(path), *extra]


def test_each_key_of_a_deepspeed_config_deepspeed_does_not_run_is_named(tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "steps_per_print": 10,
              "wall_clock_breakdown": False, "prescale_gradients": True, "gradient_clipping": 1.0,
              "zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8, "overlap_comm": True},
              "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.95], "eps": 1e-8}},
              "activation_checkpointing": {"partition_activations": True}}
    args = parse_args(deepspeed_flags(tmp_path, config, "--nproc-per-node", "4"))
    notes = "\n".join(args.compat_notes)
    assert "each other key follows" in notes and "its other keys have no effect" not in notes
    for key in ("steps_per_print", "wall_clock_breakdown", "prescale_gradients", "zero_optimization.reduce_bucket_size",
                "zero_optimization.overlap_comm", "optimizer.params.lr", "activation_checkpointing."
                                                                        "partition_activations"):
        assert f": {key}" in notes, key
    assert "gradient_accumulation_steps 4: --global-batch-size 16 (micro 2 × 4 × data parallel 2)" in notes
    assert args.global_batch_size == 16 and (args.adam_beta1, args.adam_beta2, args.adam_eps) == (0.9, 0.95, 1e-8)
    assert "--lr (Megatron's schedule sets the rate at every step)" in notes and args.lr == 1e-3


@pytest.mark.parametrize("config, named", [
    ({"scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}}, "scheduler.type: DeepSpeed's "
                                                                              "learning-rate scheduler"),
    ({"curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}}, "curriculum_learning.enabled: "
                                                                              "DeepSpeed's curriculum learning"),
    ({"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}, "zero_optimization.offload_"
                                                                                  "optimizer.device: ZeRO-Offload"),
    ({"some_future_block": {"x": 1}}, "some_future_block.x: a DeepSpeed setting rapidtrain does not read"),
])
def test_keys_that_would_change_the_run_are_refused_by_name(tmp_path, config, named):
    with pytest.raises(FlagRefused, match=named.replace(".", r"\.")):
        parse_args(deepspeed_flags(tmp_path, config))


def test_curriculum_learning_is_refused_where_deepspeed_runs_the_layout_too(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "steps_per_print": 1,
                                "curriculum_learning": {"enabled": True, "curriculum_type": "seqlen"}}))
    flags = ["--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4", "--seq-length", "16", "--lr",
             "1e-3", "--train-iters", "1", "--deepspeed", "--deepspeed_config", str(path)]
    with pytest.raises(FlagRefused, match=r"curriculum_learning\.enabled: DeepSpeed's curriculum learning"):
        parse_args(flags)
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "curriculum_learning": {"enabled": False}}))
    assert parse_args(flags).zero_2_memory_optimization
