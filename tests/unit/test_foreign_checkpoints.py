"""Megatron-LM and DeepSpeed checkpoint folders, read in one process: which kind a folder is, the tensor/pipeline
shards merged back into the built-in GPT's weights (every layout, both of Megatron's spellings), the fused
query/key/value and SwiGLU layouts against Megatron's documented order, data-only unpickling, and the refusals
(another model's flags, an unknown folder, a crafted file). Loading into a run's layout is tested with torchrun in
tests/distributed/test_foreign_checkpoints.py.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import pytest
import torch

from rapidtrain.checkpoint.checkpointer import CheckpointError
from rapidtrain.checkpoint.deepspeed_folder import read_deepspeed
from rapidtrain.checkpoint.foreign import read_foreign, whole_model, whole_moments
from rapidtrain.checkpoint.foreign_formats import detect_foreign, refuse_unknown_folder
from rapidtrain.checkpoint.foreign_pickle import Stored, load_foreign_pickle
from rapidtrain.checkpoint.megatron_layout import (
    core_names,
    fit_vocabulary,
    flatten,
    legacy_nested,
    merge_stages,
    split_for_megatron,
    stack_experts,
)
from rapidtrain.checkpoint.megatron_legacy import read_megatron_legacy, write_megatron_legacy
from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig

GPT = dict(num_layers=4, hidden_size=64, num_attention_heads=4, vocab_size=256, max_position_embeddings=32,
           seq_length=32)
LLAMA = dict(GPT, normalization="RMSNorm", swiglu=True, num_attention_heads=8, num_query_groups=4,
             add_bias_linear=False, position_embedding_type="rope", tie_embeddings=False)


def model_state(shape: dict) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config = ModelConfig(**shape)
    return config, {name: value.clone() for name, value in build_model(config, seed=3).state_dict().items()}


def expected(config: ModelConfig, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    whole = dict(state)
    if config.tie_embeddings:
        whole["output.weight"] = whole["embedding.word_embeddings.weight"]
    return whole


def assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name


@pytest.mark.parametrize("shape", [GPT, LLAMA], ids=["gpt", "llama"])
@pytest.mark.parametrize("layout", [(1, 1), (2, 2), (2, 1), (1, 4), (4, 2)], ids=lambda t: f"tp{t[0]}pp{t[1]}")
def test_megatron_legacy_folder_of_any_layout_gives_the_whole_model(tmp_path, shape, layout):
    """Written as Megatron's save_checkpoint lays it out at TP × PP (legacy nesting and names, vocabulary padded
    to the saved TP's multiple), read back and merged: every built-in weight equal."""
    config, state = model_state(shape)
    tensor, pipeline = layout
    multiple = 128 * tensor  # Megatron pads the vocabulary to --make-vocab-size-divisible-by × TP: 512 at TP 4
    padded = -(-config.vocab_size // multiple) * multiple
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=tensor, pipeline_parallel=pipeline, iteration=7,
                          consumed_samples=56, vocab_rows=padded, extra_args={"make_vocab_size_divisible_by": 128})
    found = detect_foreign(tmp_path)
    assert found is not None and found.kind == "megatron-legacy" and found.tag == "iter_0000007"
    saved = read_megatron_legacy(found)
    assert (saved.iteration, saved.consumed_samples) == (7, 56)
    assert [len(stage) for stage in saved.stages] == [tensor] * pipeline
    assert_same(whole_model(saved, config), expected(config, state))


@pytest.mark.parametrize("layout", [(2, 2), (4, 1)], ids=lambda t: f"tp{t[0]}pp{t[1]}")
def test_megatron_core_names_read_as_the_legacy_ones(tmp_path, layout):
    """Megatron-Core's spelling (decoder.layers.N.self_attention.linear_qkv, Transformer Engine's fused layer norms
    and _extra_state entries) gives the same weights."""
    config, state = model_state(LLAMA)
    stages = split_for_megatron(state, config, *layout, config.vocab_size)
    for stage in stages:
        for shard in stage:
            for name in [n for n in shard if n.endswith("input_layernorm.weight")]:
                fused = name.replace("input_layernorm.weight", "self_attention.linear_qkv.layer_norm_weight")
                shard[fused] = shard.pop(name)
                shard[name.replace("input_layernorm.weight", "self_attention.linear_qkv._extra_state")] = torch.zeros(1)
    read = [[core_names(shard) for shard in stage] for stage in stages]
    assert_same(merge_stages(read, config, "test"), expected(config, state))


def test_fused_qkv_is_grouped_by_key_value_head():
    """Megatron's fused q/k/v rows, per query group: its query heads, then its key head, then its value head (each
    head_dim rows): built by hand here, the merge gives each head's rows to q/k/v in head order."""
    config = ModelConfig(**dict(LLAMA, num_layers=1, num_attention_heads=4, num_query_groups=2))
    heads, groups, head_dim, hidden = 4, 2, 16, 64
    q = torch.arange(heads * head_dim * hidden, dtype=torch.float32).reshape(heads * head_dim, hidden)
    k, v = -torch.rand(groups * head_dim, hidden), torch.rand(groups * head_dim, hidden) + 10
    rows = []
    for g in range(groups):
        rows += [q[(2 * g + h) * head_dim:(2 * g + h + 1) * head_dim] for h in range(2)]
        rows += [k[g * head_dim:(g + 1) * head_dim], v[g * head_dim:(g + 1) * head_dim]]
    fused = torch.cat(rows)
    tensor_ranks = list(fused.chunk(2))  # TP 2: one whole group per rank
    shards = [{"decoder.layers.0.self_attention.linear_qkv.weight": part} for part in tensor_ranks]
    with pytest.raises(CheckpointError, match="1 transformer layers"):  # the merge checks the layer count
        merge_stages([shards], ModelConfig(**dict(LLAMA, num_layers=2, num_attention_heads=4, num_query_groups=2)),
                     "test")
    whole = merge_stages([shards], config, "test")
    assert torch.equal(whole["layers.0.attention.q_proj.weight"], q)
    assert torch.equal(whole["layers.0.attention.k_proj.weight"], k)
    assert torch.equal(whole["layers.0.attention.v_proj.weight"], v)


def test_swiglu_first_layer_holds_each_ranks_gate_then_up_rows():
    """SwiGLU: Megatron's fc1 output is split in halves, silu of the first gating the second; each tensor rank holds
    its rows of both, so the whole gate is rank 0's first half then rank 1's first half."""
    config = ModelConfig(**dict(LLAMA, num_layers=1))
    gate, up = torch.rand(config.ffn_size, 64), torch.rand(config.ffn_size, 64)
    per_rank = [torch.cat([g, u]) for g, u in zip(gate.chunk(2), up.chunk(2), strict=True)]
    whole = merge_stages([[{"decoder.layers.0.mlp.linear_fc1.weight": part} for part in per_rank]], config, "t")
    assert torch.equal(whole["layers.0.mlp.gate.weight"], gate)
    assert torch.equal(whole["layers.0.mlp.fc1.weight"], up)


def test_vocabulary_padding_is_cut_or_added_but_another_vocabulary_refused():
    embedding = torch.rand(512, 8)
    whole = {"embedding.word_embeddings.weight": embedding}
    fit_vocabulary(whole, 384, 256, "test")  # 512 rows padded for TP 2; this run pads to 384
    assert torch.equal(whole["embedding.word_embeddings.weight"], embedding[:384])
    fit_vocabulary(whole, 400, 256, "test")
    assert whole["embedding.word_embeddings.weight"].shape == (400, 8)
    assert whole["embedding.word_embeddings.weight"][384:].abs().sum() == 0
    with pytest.raises(CheckpointError, match="another tokenizer"):
        fit_vocabulary({"output.weight": torch.rand(1024, 8)}, 384, 256, "test")


def test_model_flags_that_differ_from_the_checkpoints_are_named(tmp_path):
    config, state = model_state(GPT)
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=2, pipeline_parallel=1, iteration=3,
                          consumed_samples=12, vocab_rows=256)
    saved = read_megatron_legacy(detect_foreign(tmp_path))
    other = ModelConfig(**dict(GPT, num_layers=2, swiglu=True))
    with pytest.raises(CheckpointError) as refused:
        whole_model(saved, other)
    message = str(refused.value)
    assert "--num-layers (checkpoint 4, now 2)" in message and "--swiglu (checkpoint False, now True)" in message
    assert "--hidden-size" not in message


def test_release_checkpoint_and_old_qkv_order(tmp_path):
    """`release` in the tracker: weights only, iteration 0; checkpoint_version < 2 (another q/k/v order) refused."""
    config, state = model_state(GPT)
    directory = write_megatron_legacy(tmp_path, state, config, tensor_parallel=1, pipeline_parallel=1, iteration=5,
                                      consumed_samples=20, vocab_rows=256)
    directory.rename(tmp_path / "release")
    (tmp_path / "latest_checkpointed_iteration.txt").write_text("release")
    saved = read_megatron_legacy(detect_foreign(tmp_path))
    assert saved.release and saved.iteration == 0
    file = tmp_path / "release" / "mp_rank_00" / "model_optim_rng.pt"
    content = torch.load(file, weights_only=False)
    torch.save({**content, "checkpoint_version": 1.0}, file)
    with pytest.raises(CheckpointError, match="checkpoint_version 1.0"):
        read_megatron_legacy(detect_foreign(tmp_path))


def test_missing_rank_file_is_named(tmp_path):
    config, state = model_state(GPT)
    directory = write_megatron_legacy(tmp_path, state, config, tensor_parallel=2, pipeline_parallel=2, iteration=1,
                                      consumed_samples=4, vocab_rows=256)
    (directory / "mp_rank_01_001" / "model_optim_rng.pt").unlink()
    with pytest.raises(CheckpointError, match="mp_rank_01_001 has no model_optim_rng.pt"):
        read_megatron_legacy(detect_foreign(tmp_path))


def test_deepspeed_pipeline_layer_files(tmp_path):
    """DeepSpeed's pipeline engine saves each layer of Megatron-DeepSpeed's GPTModelPipe in its own file
    (layer_LL-model_TT-model_states.pt, numbered by position in the layer list, the tied head's embedding again
    at the end) and no module in mp_rank_TT_model_states.pt."""
    config, state = model_state(GPT)
    shard = flatten(legacy_nested(split_for_megatron(state, config, 1, 1, 256)[0][0]))
    folder = tmp_path / "global_step4"
    folder.mkdir()
    (tmp_path / "latest").write_text("global_step4")
    embedding = {k.removeprefix("language_model.embedding."): v for k, v in shard.items() if "embedding" in k}
    files = {1: embedding}
    for layer in range(config.num_layers):
        prefix = f"language_model.encoder.layers.{layer}."
        files[3 + layer] = {k.removeprefix(prefix): v for k, v in shard.items() if k.startswith(prefix)}
    files[4 + config.num_layers] = {k.rpartition(".")[2]: v for k, v in shard.items() if "final_norm" in k}
    files[5 + config.num_layers] = embedding  # the tied output layer
    for index, tensors in files.items():
        torch.save(tensors, folder / f"layer_{index:02d}-model_00-model_states.pt")
    args = argparse.Namespace(num_layers=4, hidden_size=64, consumed_train_samples=32)
    torch.save({"module": None, "args": args, "iteration": 4, "global_steps": 4, "global_samples": 16,
                "lr_scheduler": {"num_steps": 32}}, folder / "mp_rank_00_model_states.pt")
    found = detect_foreign(tmp_path)
    assert found is not None and found.kind == "deepspeed"
    saved = read_deepspeed(found)
    assert (saved.iteration, saved.consumed_samples) == (4, 32)
    assert_same(whole_model(saved, config), expected(config, state))


def test_unknown_folders_are_refused_naming_what_is_there(tmp_path):
    assert detect_foreign(tmp_path / "missing") is None
    refuse_unknown_folder(tmp_path / "missing")  # a first run's --load: from scratch
    refuse_unknown_folder(tmp_path)  # an empty one too
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"config.json, model.safetensors: a Hugging Face model"):
        refuse_unknown_folder(tmp_path)
    other = tmp_path / "other"
    (other / "global_step3").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"holds global_step3/: rapidtrain reads"):
        refuse_unknown_folder(other)
    (other / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match="global_step9.*incomplete"):
        detect_foreign(other)


PAYLOAD_MODULE = '''
from pathlib import Path

MARK = Path(__file__).with_name("ran")

def touch(path):
    Path(path).write_text("ran")

class Backend:
    def __reduce__(self):
        return (touch, (str(MARK),))

class Crafted:
    def __reduce__(self):
        import os
        return (os.system, ("touch " + str(MARK),))
'''


def test_foreign_classes_are_built_as_inert_records_and_crafted_calls_refused(tmp_path, monkeypatch):
    """args holding another program's objects (Megatron's enums, here a class whose unpickling would run its
    function) load as `Stored` records of name and arguments: the function never runs. A call of os.system is
    refused. Megatron's rng_state numpy arrays and the args Namespace load as themselves."""
    (tmp_path / "foreign_payload.py").write_text(PAYLOAD_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    import foreign_payload  # noqa: PLC0415 - written above
    args = argparse.Namespace(num_layers=2, params_dtype=torch.bfloat16, backend=foreign_payload.Backend())
    torch.save({"args": args, "rng": np.random.get_state(), "w": torch.ones(2)}, tmp_path / "benign.pt")
    torch.save({"args": foreign_payload.Crafted()}, tmp_path / "crafted.pt")
    monkeypatch.delitem(sys.modules, "foreign_payload")
    loaded = load_foreign_pickle(tmp_path / "benign.pt")
    assert loaded["args"].num_layers == 2 and loaded["args"].params_dtype is torch.bfloat16
    assert isinstance(loaded["args"].backend, Stored)
    assert loaded["args"].backend.qualified_name == "foreign_payload.touch"
    assert loaded["rng"][0] == "MT19937" and torch.equal(loaded["w"], torch.ones(2))
    with pytest.raises(CheckpointError, match="posix.system|os.system"):
        load_foreign_pickle(tmp_path / "crafted.pt")
    assert not (tmp_path / "ran").exists()
    assert "foreign_payload" not in sys.modules  # nothing imported the module the files name


def write_torch_dist(root, state: dict[str, torch.Tensor], config: ModelConfig, iteration: int, consumed: int,
                     stacked: bool = True) -> None:
    """A folder as Megatron-Core's dist_checkpointing writes with --ckpt-format torch_dist: torch.distributed.checkpoint
    files of whole Core-named tensors (layers stacked on a leading axis, or one key per layer), common.pt with the
    args and position, metadata.json naming the backend, optimizer entries beside the model's."""
    import json

    import torch.distributed.checkpoint as dcp

    shard = {name.replace(".mlp.experts.", ".mlp.experts.experts."): value  # the routed experts' torch_dist key
             for name, value in split_for_megatron(state, config, 1, 1, config.vocab_size)[0][0].items()}
    tensors: dict[str, torch.Tensor] = {}
    for name, value in shard.items():
        if stacked and name.startswith("decoder.layers."):
            rest = name.split(".", 3)[3]
            tensors.setdefault(f"decoder.layers.{rest}", torch.stack(
                [shard[f"decoder.layers.{i}.{rest}"] for i in range(config.num_layers)]))
        else:
            tensors[name] = value
    tensors["optimizer.state.exp_avg.embedding.word_embeddings.weight"] = torch.zeros(3)
    directory = root / f"iter_{iteration:07d}"
    dcp.save(tensors, checkpoint_id=str(directory), no_dist=True)
    args = argparse.Namespace(num_layers=config.num_layers, hidden_size=config.hidden_size,
                              consumed_train_samples=consumed, tensor_model_parallel_size=2)
    torch.save({"args": args, "checkpoint_version": 3.0, "iteration": iteration,
                "opt_param_scheduler": {"num_steps": consumed}}, directory / "common.pt")
    (directory / "metadata.json").write_text(json.dumps({"sharded_backend": "torch_dist",
                                                        "sharded_backend_version": 1, "common_backend": "torch"}))
    (root / "latest_checkpointed_iteration.txt").write_text(str(iteration))


@pytest.mark.parametrize("stacked", [True, False], ids=["stacked_layers", "layer_keys"])
def test_megatron_torch_dist_folder_gives_the_whole_model(tmp_path, stacked):
    """Read with torch's FileSystemReader (through the safe reader), no megatron-core: layers unstacked, the fused
    q/k/v and SwiGLU halves split as in the legacy format, position and schedule from common.pt."""
    from rapidtrain.checkpoint.megatron_dist import read_megatron_dist

    config, state = model_state(LLAMA)
    write_torch_dist(tmp_path, state, config, iteration=6, consumed=48, stacked=stacked)
    found = detect_foreign(tmp_path)
    assert found is not None and found.kind == "megatron-torch-dist"
    saved = read_megatron_dist(found)
    assert (saved.iteration, saved.consumed_samples, saved.scheduler) == (6, 48, {"num_steps": 48})
    assert_same(whole_model(saved, config), expected(config, state))


def test_export_and_generation_name_a_foreign_folder(tmp_path):
    """The one-process reader (rapidtrain generate, convert_checkpoint.py) says what the folder is and what reads it,
    instead of calling a Megatron-LM folder incomplete."""
    from rapidtrain.checkpoint.reader import checkpoint_directory

    config, state = model_state(GPT)
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=1, pipeline_parallel=1, iteration=2,
                          consumed_samples=8, vocab_rows=256)
    with pytest.raises(CheckpointError, match=r"Megatron-LM checkpoint \(legacy format\), iter_0000002.*--load"):
        checkpoint_directory(tmp_path)



@pytest.mark.parametrize("finetune", [False, True], ids=["load", "finetune"])
def test_the_plan_names_the_foreign_checkpoint_and_what_carries_over(tmp_path, finetune):
    from rapidtrain.config import arguments, plan
    from rapidtrain.config.describe import describe_plan
    from rapidtrain.config.settings import RunContext

    config, state = model_state(GPT)
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=2, pipeline_parallel=1, iteration=4,
                          consumed_samples=16, vocab_rows=256)
    argv = ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--load", str(tmp_path),
            *(["--finetune"] if finetune else [])]
    text = describe_plan(plan.from_args(arguments.parse_args(argv), RunContext(1, "cpu")))
    assert "Megatron-LM checkpoint (legacy format), iter_0000004: its model weights" in text
    carried = "only, from iteration 0" if finetune else ", iteration, consumed samples and learning-rate schedule"
    assert carried in text and ("The optimizer starts fresh" if finetune else "the optimizer starts fresh") in text


def test_deepspeed_tensor_parallel_model_files_are_merged(tmp_path):
    """Megatron-DeepSpeed at TP 2: mp_rank_00_model_states.pt and mp_rank_01_model_states.pt, each `module` one tensor
    rank's part in the legacy model's nesting; without args the position comes from DeepSpeed's own counters."""
    config, state = model_state(LLAMA)
    folder = tmp_path / "global_step6"
    folder.mkdir()
    (tmp_path / "latest").write_text("global_step6\n")
    for rank, shard in enumerate(split_for_megatron(state, config, 2, 1, 256)[0]):
        torch.save({"module": legacy_nested(shard), "global_steps": 6, "global_samples": 24, "dp_world_size": 1,
                    "mp_world_size": 2}, folder / f"mp_rank_{rank:02d}_model_states.pt")
    saved = read_deepspeed(detect_foreign(tmp_path))
    assert (saved.iteration, saved.consumed_samples) == (6, 24) and len(saved.stages[0]) == 2
    assert_same(whole_model(saved, config), expected(config, state))


def test_flags_that_change_the_function_but_not_the_shape_are_named():
    """--rotary-base, --rotary-percent and the norm's epsilon leave the shapes alone (the weights load) but change
    what the model computes: named for the log, with both values; the rotary flags only where rope is used."""
    from rapidtrain.checkpoint.foreign import function_differences

    llama = ModelConfig(**dict(LLAMA, rotary_base=10000))
    saved = {"rotary_base": 500000, "rotary_percent": 1.0, "norm_epsilon": 1e-6}
    assert function_differences(saved, llama) == ["--rotary-base (checkpoint 500000, now 10000)",
                                                  "--norm-epsilon (checkpoint 1e-06, now 1e-05)"]
    assert function_differences({"rotary_base": 500000, "layernorm_epsilon": 1e-5}, ModelConfig(**GPT)) == []


# Today's models: DeepSeek-V3-like (MLA with a query LoRA, a dense first layer, sigmoid router with expert bias, shared
# experts) and DeepSeek-V2-Lite / Qwen-MoE-like (queries projected directly, every layer MoE, gated shared experts).
MOE_MLA = dict(num_layers=2, hidden_size=32, num_attention_heads=4, ffn_hidden_size=64, vocab_size=256,
               max_position_embeddings=32, seq_length=32, normalization="RMSNorm", swiglu=True, add_bias_linear=False,
               position_embedding_type="rope", tie_embeddings=False, multi_latent_attention=True, kv_lora_rank=16,
               qk_head_dim=8, qk_pos_emb_head_dim=4, v_head_dim=8, qk_layernorm=True, moe_ffn_hidden_size=24,
               moe_router_topk=2)
DEEPSEEK_V3 = dict(MOE_MLA, q_lora_rank=16, num_experts=(0, 4), moe_router_score_function="sigmoid",
                   moe_router_enable_expert_bias=True, moe_shared_expert_intermediate_size=48)
QWEN_MOE = dict(MOE_MLA, q_lora_rank=None, num_experts=(4, 4), moe_shared_expert_intermediate_size=32,
                moe_shared_expert_gate=True)


def moe_state(shape: dict) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    config, state = model_state(shape)
    for name in [n for n in state if n.endswith("expert_bias")]:
        state[name] = torch.randn(state[name].shape)  # zeros as built: would hide a mix-up
    return config, state


@pytest.mark.parametrize(("shape", "layout", "experts"), [
    (DEEPSEEK_V3, (2, 1, 2), "sequential"), (QWEN_MOE, (2, 1, 2), "te_grouped"),
    (DEEPSEEK_V3, (2, 2, 2), "legacy_grouped"), (QWEN_MOE, (1, 2, 1), "sequential"),
], ids=["v3-tp2ep2-sequential", "qwen-tp2ep2-te_grouped", "v3-tp2pp2ep2-legacy_grouped", "qwen-pp2-sequential"])
def test_megatron_core_moe_mla_folder_of_any_layout_gives_the_whole_model(tmp_path, shape, layout, experts):
    """Routed experts in each implementation's names, divided over expert-parallel rank folders (`mp_rank_TT_EEE`
    read by the saved args as expert ranks, `mp_rank_TT_PPP_EEE`), shared experts, router and expert bias, MLA's
    projections and latent norms: merged at TP 1, every built-in weight equal."""
    config, state = moe_state(shape)
    tensor, pipeline, expert = layout
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=tensor, pipeline_parallel=pipeline, iteration=5,
                          consumed_samples=20, vocab_rows=256, expert_parallel=expert, experts=experts)
    names = sorted(p.name for p in (tmp_path / "iter_0000005").iterdir())
    assert len(names) == tensor * pipeline * expert and (expert == 1 or names[1].endswith("_001"))
    saved = read_megatron_legacy(detect_foreign(tmp_path))
    assert [len(stage) for stage in saved.stages] == [tensor] * pipeline
    assert_same(whole_model(saved, config), state)


@pytest.mark.parametrize("shape", [DEEPSEEK_V3, QWEN_MOE], ids=["layer_keys", "stacked_layers"])
def test_megatron_torch_dist_moe_mla_folder_gives_the_whole_model(tmp_path, shape):
    """torch_dist: `mlp.experts.experts.linear_fc1.weight` [experts, 2f, h] per layer, or stacked [layers, experts,
    ...] where every layer is alike (Megatron-Core writes per-layer keys when --moe-layer-freq mixes dense layers)."""
    from rapidtrain.checkpoint.megatron_dist import read_megatron_dist

    config, state = moe_state(shape)
    write_torch_dist(tmp_path, state, config, iteration=2, consumed=8, stacked=not config.num_experts[0] == 0)
    assert_same(whole_model(read_megatron_dist(detect_foreign(tmp_path)), config), state)


def test_legacy_grouped_mlp_weights_are_read_as_megatrons_view_not_a_transpose():
    """Megatron's GroupedMLP reads weight1 [h, E·2f] as .view(E, h, 2f) (each expert's input-major [h, 2f]: its gate
    columns, then its up columns) and weight2 [E·f, h] as .view(E, f, h): built by hand here, the experts come out."""
    config = ModelConfig(**dict(QWEN_MOE, num_layers=1, num_experts=(2,), moe_shared_expert_intermediate_size=None,
                                moe_shared_expert_gate=False))
    hidden, ffn = 32, 24
    gate, up, down = torch.rand(2, hidden, ffn), torch.rand(2, hidden, ffn), torch.rand(2, ffn, hidden)
    weight1 = torch.cat([gate, up], dim=2).reshape(hidden, 2 * 2 * ffn)  # the memory Megatron views
    weight2 = down.reshape(2 * ffn, hidden)
    shard = stack_experts({"decoder.layers.0.mlp.experts.weight1": weight1,
                           "decoder.layers.0.mlp.experts.weight2": weight2}, 2, "test")
    whole = merge_stages([[shard]], config, "test")
    assert torch.equal(whole["layers.0.mlp.experts.w_gate"], gate)
    assert torch.equal(whole["layers.0.mlp.experts.w1"], up)
    assert torch.equal(whole["layers.0.mlp.experts.w2"], down)


def test_mla_rotary_rows_go_from_megatrons_pairs_to_the_built_in_halves():
    """Megatron's MLA rotates the rotary dimensions as DeepSeek does, (x0, x1), (x2, x3) in pairs; the built-in rope
    rotates halves (x0, x2 | x1, x3): the rotary key's rows of kv_down (after the latent) are reordered so, and each
    query head's rotary rows likewise; the latent and unrotated rows stay."""
    config = ModelConfig(**dict(QWEN_MOE, num_layers=1, num_experts=(), num_attention_heads=2))
    kv_down = torch.arange(20.0).unsqueeze(1).expand(20, 32)  # 16 latent rows, then rotary rows 16, 17, 18, 19
    query = torch.arange(24.0).unsqueeze(1).expand(24, 32)  # per head: 8 unrotated rows, then 4 rotary
    whole = merge_stages([[{"decoder.layers.0.self_attention.linear_kv_down_proj.weight": kv_down,
                            "decoder.layers.0.self_attention.linear_q_proj.weight": query}]], config, "test")
    assert whole["layers.0.attention.kv_down_proj.weight"][:, 0].tolist() == [*range(16), 16, 18, 17, 19]
    assert whole["layers.0.attention.q_proj.weight"][:, 0].tolist() == [*range(8), 8, 10, 9, 11,
                                                                          *range(12, 20), 20, 22, 21, 23]


def test_moe_and_mla_flags_that_differ_from_the_checkpoints_are_named(tmp_path):
    config, state = moe_state(DEEPSEEK_V3)
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=2, pipeline_parallel=1, iteration=3,
                          consumed_samples=12, vocab_rows=256, expert_parallel=2)
    saved = read_megatron_legacy(detect_foreign(tmp_path))
    other = ModelConfig(**dict(DEEPSEEK_V3, num_experts=(4, 4), moe_ffn_hidden_size=16, q_lora_rank=8))
    with pytest.raises(CheckpointError) as refused:
        whole_model(saved, other)
    message = str(refused.value)
    assert "--q-lora-rank (checkpoint 16, now 8)" in message
    assert ("--num-experts / --moe-layer-freq (checkpoint 4 experts in layers 1, now 4 experts in layers 0, 1)"
            in message)
    other = ModelConfig(**dict(DEEPSEEK_V3, moe_ffn_hidden_size=16, moe_shared_expert_intermediate_size=None,
                               multi_latent_attention=False))
    with pytest.raises(CheckpointError) as refused:
        whole_model(saved, other)
    message = str(refused.value)
    assert "--moe-ffn-hidden-size (checkpoint 24, now 16)" in message
    assert "--moe-shared-expert-intermediate-size (checkpoint 48, now None)" in message
    assert "--multi-latent-attention (checkpoint True, now False)" in message


def test_what_stays_unread_is_refused_by_name(tmp_path):
    """Legacy folders whose experts were cut by another expert tensor parallel size than TP, and torch_dist's
    per-expert layout: refused, each naming what and how to get round it."""
    config, state = moe_state(DEEPSEEK_V3)
    write_megatron_legacy(tmp_path, state, config, tensor_parallel=2, pipeline_parallel=1, iteration=3,
                          consumed_samples=12, vocab_rows=256, expert_parallel=2,
                          extra_args={"expert_tensor_parallel_size": 1})
    with pytest.raises(CheckpointError, match="--expert-tensor-parallel-size 1 and --tensor-model-parallel-size 2.*"
                                              "torch_dist"):
        read_megatron_legacy(detect_foreign(tmp_path))
    shard = split_for_megatron(state, config, 1, 1, 256)[0][0]
    shard["decoder.layers.1.mlp.experts.experts.3.linear_fc1.weight_w"] = torch.ones(24, 32)
    with pytest.raises(CheckpointError, match=r"experts\.3\.linear_fc1\.weight_w.*singleton_local_shards"):
        merge_stages([[shard]], config, "test")


@pytest.mark.parametrize("kind", ["legacy", "torch_dist"])
def test_multi_token_prediction_layers_are_read(tmp_path, kind):
    """DeepSeek-V3's multi-token prediction (`mtp.layers.K.enorm / hnorm / eh_proj / transformer_layer.* /
    final_layernorm`, on the last pipeline stage, its transformer layer an MoE layer like the decoder's last):
    saved at PP 2 × EP 2 × TP 2 (eh_proj cut by rows) or in torch_dist, read into the built-in's mtp.depths.K; a run
    without --mtp-num-layers is refused naming it."""
    from rapidtrain.checkpoint.megatron_dist import read_megatron_dist

    config, state = moe_state(dict(DEEPSEEK_V3, mtp_num_layers=1))
    assert any(name.startswith("mtp.depths.0.layer.mlp.experts.") for name in state)
    if kind == "legacy":
        write_megatron_legacy(tmp_path, state, config, tensor_parallel=2, pipeline_parallel=2, iteration=5,
                              consumed_samples=20, vocab_rows=256, expert_parallel=2)
        saved = read_megatron_legacy(detect_foreign(tmp_path))
    else:
        write_torch_dist(tmp_path, state, config, iteration=2, consumed=8, stacked=False)
        saved = read_megatron_dist(detect_foreign(tmp_path))
    assert_same(whole_model(saved, config), state)
    if kind == "legacy":
        with pytest.raises(CheckpointError, match=r"--mtp-num-layers \(checkpoint 1, now 0\)"):
            whole_model(saved, ModelConfig(**DEEPSEEK_V3))


def test_transformer_engine_spelling_of_mla_and_grouped_experts_gives_the_whole_model():
    """Transformer Engine's layer spec: the latents' norms fused into the up projections (`linear_q_up_proj.
    layer_norm_weight`), the down projections duplicated on every tensor rank (TELinear) instead of cut by rows, and
    TEGroupedMLP's single grouped expert weight (`linear_fc1.weight`, flat by expert): the same weights."""
    config, state = moe_state(DEEPSEEK_V3)
    whole_down = split_for_megatron(state, config, 1, 1, 256)[0][0]
    shards = split_for_megatron(state, config, 2, 1, 256)[0]
    for shard in shards:
        for name in list(shard):
            if "down_proj" in name:
                shard[name] = whole_down[name].clone()
            elif name.endswith("q_layernorm.weight") or name.endswith("kv_layernorm.weight"):
                projection = "linear_q_up_proj" if "q_layernorm" in name else "linear_kv_up_proj"
                shard[name.replace(name.split(".")[-2], projection).replace(".weight", ".layer_norm_weight")] = (
                    shard.pop(name))
            elif ".mlp.experts.linear_fc" in name:
                shard[name] = shard[name].flatten(0, 1)
    read = [[stack_experts(core_names(shard), 4, "test") for shard in shards]]
    assert_same(merge_stages(read, config, "test"), state)


def write_universal(root, shard: dict[str, torch.Tensor], moments: dict[str, dict[str, torch.Tensor]], args,
                    step: int, tag: str = "global_step4_universal") -> None:
    """A folder laid out as DeepSpeed's ds_to_universal writes it (its output from a real engine is tested in
    tests/distributed/test_foreign_checkpoints.py): zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt as dicts with the
    whole tensor under `param` (and `cat_dim`), step.pt the bare count, the model-states file copied beside."""
    for name, value in shard.items():
        folder = root / tag / "zero" / name
        folder.mkdir(parents=True)
        for key, tensor in (("fp32", value), *((k, m[name]) for k, m in moments.items())):
            torch.save({"param": tensor, "cat_dim": 0}, folder / f"{key}.pt")
        torch.save(torch.tensor(float(step)), folder / "step.pt")
    torch.save({"module": None, "args": args, "iteration": 4, "global_steps": 4, "global_samples": 16,
                "lr_scheduler": {"num_steps": 16}, "universal_checkpoint_info": {"original_vocab_size": 200}},
               root / tag / "mp_rank_00_model_states.pt")
    (root / "latest_universal").write_text(tag)


def test_deepspeed_universal_folder_in_pipeline_engine_names(tmp_path):
    """Megatron-DeepSpeed's GPTModelPipe names its parameters by position in the layer list (`tied_modules.embed.`
    for the tied embedding, `K.input_layernorm.weight`, `K.weight` for the final norm, as DeepSpeed's pipeline engine
    records them in param_shapes); a universal folder of them gives the whole model, the vocabulary cut to the
    tokenizer's 200 rows padded back with zeros, and Adam's moments and step; the plan names it."""
    config, state = model_state(GPT)
    shard = flatten(legacy_nested(split_for_megatron(state, config, 1, 1, 256)[0][0]))
    pipe: dict[str, torch.Tensor] = {}
    for name, value in shard.items():
        if name.startswith("language_model.embedding."):
            pipe[f"tied_modules.embed.{name.removeprefix('language_model.embedding.')}"] = value
        elif name.startswith("language_model.encoder.layers."):
            layer, _, rest = name.removeprefix("language_model.encoder.layers.").partition(".")
            pipe[f"{3 + int(layer)}.{rest}"] = value
        else:
            pipe[f"{4 + config.num_layers}.{name.rpartition('.')[2]}"] = value
    pipe["tied_modules.embed.word_embeddings.weight"] = pipe["tied_modules.embed.word_embeddings.weight"][:200]
    moments = {key: {name: torch.full_like(value, scale) for name, value in pipe.items()}
               for key, scale in (("exp_avg", 0.5), ("exp_avg_sq", 0.25))}
    write_universal(tmp_path, pipe, moments, argparse.Namespace(num_layers=4, hidden_size=64), step=3)
    found = detect_foreign(tmp_path)
    assert found is not None and (found.kind, found.tag) == ("deepspeed-universal", "global_step4_universal")
    saved = read_foreign(found)
    assert (saved.iteration, saved.consumed_samples, saved.optimizer_step) == (4, 16, 3)
    want = expected(config, state)
    for name in ("embedding.word_embeddings.weight", "output.weight"):
        want[name] = torch.cat([want[name][:200], torch.zeros(56, 64)])
    assert_same(whole_model(saved, config), want)
    got = whole_moments(saved, config)
    assert got is not None and float(got["exp_avg"]["layers.3.mlp.fc2.weight"].mean()) == 0.5
    assert not got["exp_avg_sq"]["embedding.word_embeddings.weight"][200:].any()

    from rapidtrain.config import arguments, plan
    from rapidtrain.config.describe import describe_plan
    from rapidtrain.config.settings import RunContext

    argv = ["--train-iters", "10", "--lr", "1e-4", "--tokenizer-type", "NullTokenizer", "--vocab-size", "200",
            "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--load", str(tmp_path),
            "--universal-checkpoint"]
    text = describe_plan(plan.from_args(arguments.parse_args(argv), RunContext(1, "cpu")))
    assert "DeepSpeed universal checkpoint (ds_to_universal), global_step4_universal: its model weights" in text
    assert "Adam's moments come from its zero/<parameter>/exp_avg*.pt" in text

