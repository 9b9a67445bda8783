"""Checkpoints reshard (torch.distributed.checkpoint): saved at iteration 3 of 6 under TP 2 × DP 2, PP 2 × DP 2 and
TP 2 × PP 2, loaded at TP 1, PP 1 (one process) and DP 4, they continue with one process's losses. Each
pipeline stage saves only its parameters, under the full model's names and global shapes."""

from __future__ import annotations

import pytest
from torch.distributed.checkpoint import FileSystemReader

from rapidtrain.models import ModelConfig, build_model
from tests.distributed.parallel_runs import ITERATIONS, SAVED_AT, layout_runs
from tests.launch import read_losses, relative_difference

TOLERANCE = 1e-5  # fp32, relative


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data):
    return layout_runs(tmp_path_factory, demo_data)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("loaded", "saved_at"),
    [
        ("single_from_tp2_dp2", "TP 2 → TP 1"),
        ("single_from_pp2_dp2", "PP 2 → PP 1"),
        ("dp4_from_tp2_pp2", "TP 2 × PP 2 → DP 4"),
    ],
)
def test_resharded_checkpoint_continues_with_the_same_losses(runs, loaded, saved_at):
    """Iterations 4..6 after the load equal the uninterrupted one-process run's within 1e-5."""
    continued, single = read_losses(runs.losses(loaded)), read_losses(runs.losses("single"))
    assert sorted(continued) == list(range(SAVED_AT + 1, ITERATIONS + 1)), saved_at
    assert relative_difference(continued, {i: single[i] for i in continued}) < TOLERANCE, saved_at


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["tp2_dp2", "pp2_dp2", "tp2_pp2"])
def test_resume_at_the_same_layout_continues(runs, layout):
    """The layout's own run stopped at 3 and resumed from its checkpoint: 1..6 still match one process."""
    resumed, single = read_losses(runs.losses(layout)), read_losses(runs.losses("single"))
    assert sorted(resumed) == list(range(1, ITERATIONS + 1))
    assert relative_difference(resumed, single) < TOLERANCE
    saved = runs.out / f"{layout}_saved" / "latest_checkpointed_iteration.txt"
    assert saved.read_text().strip() == str(SAVED_AT)


@pytest.mark.slow
def test_pipeline_checkpoint_holds_the_full_models_names_and_shapes(runs):
    """TP 2 × PP 2: the stages' shards together are the whole model, named and shaped as one process names
    them; the head's copy of the tied embedding is saved in the optimizer under the embedding's name."""
    metadata = FileSystemReader(str(runs.out / "tp2_pp2_saved" / f"iter_{SAVED_AT:07d}")).read_metadata()
    saved = metadata.state_dict_metadata
    config = ModelConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=4,
        seq_length=64,
        max_position_embeddings=64,
        vocab_size=2048,  # the demo tokenizer's 2,005 ids padded to a multiple of 512 · TP (parallel_runs.gpt_flags)
    )
    full = build_model(config, seed=None).state_dict()
    model_keys = {key.removeprefix("model.") for key in saved if key.startswith("model.")}
    assert model_keys == set(full)
    for name, tensor in full.items():
        assert tuple(saved[f"model.{name}"].size) == tuple(tensor.shape), name
    optimizer_keys = {key for key in saved if key.startswith("optimizer.state.")}
    assert "optimizer.state.embedding.word_embeddings.weight.exp_avg" in optimizer_keys
    assert not any(key.startswith("optimizer.state.output.weight") for key in optimizer_keys)
    assert "optimizer.state.layers.3.mlp.fc2.weight.exp_avg_sq" in optimizer_keys
