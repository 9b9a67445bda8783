"""What Pai-Megatron-Patch's 2025-26 launch scripts ask of rapidtrain beyond the flags it had (found by
tests/compat/test_pai_sweep.py): SFT on Pai's idxmap data, --moe-layer-recompute, activation offloading
(--cpu-offloading), MLA scripts' --use-rope-scaling, the per-split paths the 2024 Idxmap scripts pass beside
--data-path, and the optimizer-offload flags and optimizers (trained where rapidtrain serves them, refused by name
where it does not)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from rapidtrain.config import rules
from rapidtrain.config.arguments import parse_args
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.plan import from_args
from rapidtrain.config.rules import FlagConflict
from rapidtrain.config.settings import RunContext
from rapidtrain.core.errors import UserError
from rapidtrain.data.gpt_dataset import GPTDatasetConfig, build_gpt_datasets
from rapidtrain.data.idxmap_sft import IdxmapSftDataset, sft_sample
from rapidtrain.data.raw_json import SampleLayout
from rapidtrain.models import ModelConfig, build_model
from rapidtrain.models.moe import moe_layers
from rapidtrain.parallel.recompute import (
    OffloadActivations,
    apply_activation_offload,
    apply_moe_recompute,
    count_saved_activations,
)
from rapidtrain.parallel.transforms import recompute_blocks
from tests.compat.launch_data import pai_sft_row
from tests.unit.test_gpt_dataset import write_corpus

BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "2"]


def plan_text(flags: list[str], world: int = 1) -> str:
    args = parse_args(BASE + flags)
    ctx = RunContext(world_size=world)
    rules.validate(args, ctx)
    return describe_plan(from_args(args, ctx))


def refusal(flags: list[str], world: int = 1) -> str:
    """The message that stops these flags (exit status 2, no traceback): the surface's refusal (a UserError) or the
    rules' conflicts (FlagConflict, a SystemExit of status 2)."""
    with pytest.raises((UserError, FlagConflict)) as stop:
        plan_text(flags, world)
    assert not isinstance(stop.value, FlagConflict) or stop.value.code == 2
    return str(stop.value)


# ---- SFT idxmap: Pai's toolkits/sft_data_preprocessing layout ----

def test_sft_idxmap_row_gives_its_tokens_labels_and_per_row_weights():
    row = pai_sft_row([([5, 6], [7, 8]), ([9], [10, 11, 12])], seq_length=12)
    sample = sft_sample(np.array(row), 12, SampleLayout())
    assert sample["tokens"].tolist() == [5, 6, 7, 8, 9, 10, 11, 12, 0, 0, 0, 0]
    # targets: 7 after 6, 8 after 7; 10, 11, 12 after 9, 10, 11
    assert sample["labels"].tolist() == [0, 7, 8, 0, 10, 11, 12, 0, 0, 0, 0, 0]
    weights = sample["loss_mask"]
    assert np.flatnonzero(weights).tolist() == [1, 2, 4, 5, 6]
    assert weights.sum() == pytest.approx(1.0) and weights[1] == pytest.approx(0.2)  # one row, its 5 targets
    assert sample["position_ids"].tolist() == list(range(12)) and "attention_mask" not in sample


def test_sft_idxmap_packed_rows_restart_positions_keep_attention_and_weigh_each_conversation():
    row = pai_sft_row([([5, 6], [7, 8]), ([9], [10, 11, 12])], seq_length=12)
    sample = sft_sample(np.array(row), 12, SampleLayout(reset_position_ids=True, reset_attention_mask=True))
    assert sample["position_ids"].tolist() == [0, 1, 2, 3, 0, 1, 2, 3, 0, 1, 2, 3]
    weights = sample["loss_mask"]
    assert weights[1:3].tolist() == [0.5, 0.5] and weights[4:7] == pytest.approx([1 / 3] * 3)
    masked = sample["attention_mask"][0]  # True: may not attend
    assert not masked[5, 4] and masked[5, 3] and masked[2, 3]


def test_sft_idxmap_dataset_reads_one_document_a_sample_of_indexed_data(tmp_path):
    seq = 8
    rows = [pai_sft_row([([1 + i, 2], [3, 4 + i])], seq) for i in range(6)]
    prefix = str(tmp_path / "sft")
    from rapidtrain.data.indexed import IndexedDatasetBuilder

    builder = IndexedDatasetBuilder(prefix + ".bin", np.int32)
    for row in rows:
        builder.add_item(row)
        builder.end_document()
    builder.finalize(prefix + ".idx")
    config = GPTDatasetConfig(data_prefix=[prefix], split="1,0,0", seq_length=2 * seq, seed=3, eod=0,
                              cache_dir=str(tmp_path / "cache"))
    train, _, _ = build_gpt_datasets(config, [12, 0, 0])
    dataset = IdxmapSftDataset(train, seq, SampleLayout())
    seen = {tuple(dataset[i]["tokens"][:4].tolist()) for i in range(12)}
    assert seen == {(1 + i, 2, 3, 4 + i) for i in range(6)}  # every sample one whole document, each seen
    for i in range(12):
        sample = dataset[i]
        first = sample["tokens"][0]
        assert sample["labels"][1:3].tolist() == [3, 4 + first - 1]


def test_finetune_on_mmap_plans_pai_sft_idxmap_and_packing_keeps_each_conversation_apart(tmp_path):
    prefix = write_corpus(str(tmp_path / "d"), [[1, 2, 3, 4]] * 4)
    flags = ["--data-path", prefix, "--dataset", "MMAP", "--train-mode", "finetune", "--eod-mask-loss",
             "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"]
    text = plan_text(flags)
    assert "Pai's SFT idxmap" in text and "loss the mean over rows" in text
    assert "--eod-mask-loss: no effect here; the SFT idxmap's labels say" in text
    packed = plan_text(flags + ["--reset-position-ids"])
    assert "mean over conversations, packed" in packed and "--reset-attention-mask: with SFT idxmap packing" in packed
    assert "--train-mode finetune with --dataset LLama-Pretrain-Idxmap" in refusal(
        [f for f in flags if f != "MMAP"][:2] + ["--dataset", "LLama-Pretrain-Idxmap", "--train-mode", "finetune",
                                                  "--tokenizer-type", "NullTokenizer", "--vocab-size", "100"])


# ---- recomputing MoE layers, offloading activations ----

MOE = ModelConfig(num_layers=2, hidden_size=32, num_attention_heads=4, seq_length=16, max_position_embeddings=16,
                  vocab_size=64, hidden_dropout=0.0, attention_dropout=0.0, num_experts=(4, 4), ffn_hidden_size=64,
                  moe_router_topk=2)


def loss_and_grads(model: torch.nn.Module) -> tuple[float, dict[str, torch.Tensor], dict, int]:
    tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
    with count_saved_activations(model.parameters()) as kept:
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).mean()
    loss.backward()
    grads = {name.replace("_checkpoint_wrapped_module.", ""): p.grad for name, p in model.named_parameters()}
    stats = {name.replace("._checkpoint_wrapped_module", ""): layer.routing_stats.clone()
             for name, layer in moe_layers(model).items()}
    return loss.item(), grads, stats, kept["bytes"]


@pytest.mark.parametrize("wrap", ["moe_recompute", "offload"])
def test_moe_recompute_and_activation_offload_keep_losses_gradients_and_routing_counts(wrap):
    plain = loss_and_grads(build_model(MOE, seed=1))
    model = build_model(MOE, seed=1)
    if wrap == "moe_recompute":
        assert apply_moe_recompute(model) == 2
    else:
        assert apply_activation_offload(model, recompute_blocks(model)[:1]) == 1
        assert isinstance(recompute_blocks(model)[0], OffloadActivations)
    assert set(model.state_dict()) == set(build_model(MOE, seed=1).state_dict())  # checkpoints keep their keys
    loss, grads, stats, kept = loss_and_grads(model)
    if wrap == "moe_recompute":  # the MoE layers keep only their inputs for backward
        assert kept < 0.8 * plain[3], (kept, plain[3])
    assert loss == pytest.approx(plain[0], rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, plain[1][name], rtol=1e-5, atol=1e-6)
    for name, counted in stats.items():  # backward's recomputation is not counted as another forward
        torch.testing.assert_close(counted, plain[2][name])


def test_offloaded_activations_leave_for_host_memory():
    """The tensors the wrapped layer saves pass through save_on_cpu's hooks: none stays among the plain ones."""
    model = build_model(MOE, seed=1)
    blocks = recompute_blocks(model)
    apply_activation_offload(model, blocks)
    seen = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        tokens = torch.randint(0, 64, (2, 17), generator=torch.Generator().manual_seed(0))
        model(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    plain = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: plain.append(t) or t, lambda t: t):
        fresh = build_model(MOE, seed=1)
        fresh(tokens[:, :-1], labels=tokens[:, 1:]).mean().backward()
    assert len(seen) < len(plain) / 2  # the layers' own saves went to the inner (offloading) hooks


def test_plan_says_moe_recompute_and_offload_and_refuses_what_megatron_refuses():
    moe = ["--num-experts", "4"]
    text = plan_text(moe + ["--moe-layer-recompute", "--recompute-activations"])
    assert "and each MoE layer whole (torch.utils.checkpoint" in text
    assert "each MoE layer" not in plan_text(moe + ["--moe-layer-recompute", "--recompute-granularity", "full"])
    offload = plan_text(["--cpu-offloading", "--cpu-offloading-num-layers", "1"])
    assert "activations of the first 1 layer(s) of each pipeline stage kept in host memory" in offload
    assert "--cpu-offloading-num-layers 0: no layer's activations" in plan_text(["--cpu-offloading"])
    assert "--cpu-offloading-num-layers 1: no effect without --cpu-offloading" in plan_text(
        ["--cpu-offloading-num-layers", "1"])
    assert "--moe-layer-recompute: no effect without --num-experts" in plan_text(["--moe-layer-recompute"])
    assert "--cpu-offloading with --recompute-activations (selective)" in refusal(
        ["--cpu-offloading", "--cpu-offloading-num-layers", "1", "--recompute-activations"])
    assert "--cpu-offloading-num-layers 2: give 0 to --num-layers - 1 (1)" in refusal(
        ["--cpu-offloading", "--cpu-offloading-num-layers", "2"])


# ---- rope scaling with MLA, Idxmap's per-split paths, optimizer offload ----

MLA = ["--multi-latent-attention", "--kv-lora-rank", "16", "--qk-head-dim", "16", "--qk-pos-emb-head-dim", "8",
       "--v-head-dim", "16", "--position-embedding-type", "rope"]


def test_use_rope_scaling_with_mla_has_no_effect_as_in_megatron_core():
    text = plan_text(MLA + ["--rope-type", "yarn", "--rotary-scaling-factor", "40", "--use-rope-scaling"])
    assert "--use-rope-scaling: no effect with --multi-latent-attention" in text and "YaRN's" in text
    assert "Llama 3.1" not in plan_text(MLA + ["--use-rope-scaling"]).split("model:")[1].split("\n")[0]


def test_idxmap_dataset_reads_data_path_so_per_split_paths_beside_it_do_nothing(tmp_path):
    prefix = write_corpus(str(tmp_path / "d"), [[1, 2, 3, 4]] * 8)
    data = ["--tokenizer-type", "NullTokenizer", "--vocab-size", "100", "--data-path", prefix]
    text = plan_text(data + ["--train-data-path", prefix, "--dataset", "LLama-Pretrain-Idxmap"])
    assert f"--train-data-path {prefix}: no effect here; --dataset LLama-Pretrain-Idxmap reads --data-path" in text
    assert "--data-path with --train-data-path" in refusal(data + ["--train-data-path", prefix])


def test_optimizer_offload_fraction_and_pai_offloading_adams():
    zero = ["--zero-1-memory-optimization", "--optimizer-cpu-offload"]
    assert "--optimizer-offload-fraction 1.0: the whole optimizer state on the CPU" in plan_text(
        zero + ["--optimizer-offload-fraction", "1.0"], world=2)
    assert "--optimizer-offload-fraction 0.5: rapidtrain's --cpu-offload" in refusal(
        zero + ["--optimizer-offload-fraction", "0.5"], world=2)
    assert "--optimizer-offload-fraction 0.5: no effect here" in plan_text(["--optimizer-offload-fraction", "0.5"])
    for value in ("hybridadam", "cpu-adam"):
        assert f"--optimizer {value}: Pai-Megatron-Patch's fork's Adam" in refusal(["--optimizer", value])
    assert "--optimizer-offload-policy auto: Pai's policy" in refusal(["--optimizer-offload-policy", "auto"])
    # the refusal names the flag as the script spelled it
    assert "--optimizer-cpu-offload (--cpu-offload) moves the optimizer state" in refusal(
        ["--optimizer-cpu-offload", "--tensor-model-parallel-size", "2"], world=2)


def test_memory_estimate_counts_offloaded_layers_on_the_host_on_cuda_only():
    def activations(flags: list[str], device: str) -> float:
        args = parse_args(BASE + ["--num-layers", "4"] + flags)
        ctx = RunContext(world_size=1, device_type=device)
        rules.validate(args, ctx)
        return from_args(args, ctx).memory.stage_activation_bytes[0]

    for device, shrinks in (("cuda", True), ("cpu", False)):
        plain = activations([], device)
        offloaded = activations(["--cpu-offloading", "--cpu-offloading-num-layers", "2"], device)
        assert (offloaded < 0.8 * plain) if shrinks else offloaded == plain, (device, offloaded, plain)
