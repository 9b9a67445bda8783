"""Pipeline parallelism (torch.distributed.pipelining): PP 2 × DP 2, TP 2 × PP 2 and the interleaved schedule
reproduce one process's losses, gradient norms and evaluation; stages hold exactly their parts under the full
model's names, with the tied embedding kept on the first and last stage."""

from __future__ import annotations

import pytest
import torch

from rapidtrain.models import ModelConfig, build_model
from rapidtrain.parallel.pipeline import (
    _concatenate,
    _record_micro_batch,
    _rename,
    keep_stages,
    local_stage_indices,
    stage_layers,
    stage_view,
    tied_copies,
)
from tests.distributed.parallel_runs import ITERATIONS, layout_runs
from tests.launch import read_grad_norms, read_losses, relative_difference

TOLERANCE = 1e-5  # fp32, relative


@pytest.fixture(scope="module")
def runs(tmp_path_factory, demo_data):
    return layout_runs(tmp_path_factory, demo_data)


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["pp2_dp2", "tp2_pp2", "pp2_interleaved"])
def test_pipeline_matches_one_process_losses_and_grad_norms(runs, layout):
    """6 iterations on 4 ranks (1F1B with 2 micro-batches per rank, TP 2 × PP 2 with 4, interleaved with
    two virtual stages per rank): every loss and global gradient norm equal one process's within 1e-5."""
    losses, single = read_losses(runs.losses(layout)), read_losses(runs.losses("single"))
    assert sorted(losses) == list(range(1, ITERATIONS + 1))
    assert relative_difference(losses, single) < TOLERANCE
    assert (
        relative_difference(read_grad_norms(runs.losses(layout)), read_grad_norms(runs.losses("single")))
        < TOLERANCE
    )


@pytest.mark.slow
def test_pipeline_evaluation_comes_from_the_last_stage(runs):
    """Validation at iterations 3 and 6 and the test loss, printed by the last stage, equal one process's
    (the printed 7 digits) and the data-parallel layout's."""
    single = runs.evaluation("single")
    assert len(single) == 3
    for layout in ("pp2_dp2", "tp2_dp2"):
        assert runs.evaluation(layout) == pytest.approx(single, rel=1e-5)


def small_gpt(**overrides) -> torch.nn.Module:
    settings = dict(
        num_layers=4,
        hidden_size=16,
        num_attention_heads=2,
        seq_length=8,
        max_position_embeddings=8,
        vocab_size=32,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )
    return build_model(ModelConfig(**(settings | overrides)), seed=5)


def test_stages_split_layers_evenly_and_interleave():
    assert stage_layers((2, 2)) == [["0", "1"], ["2", "3"]]
    assert stage_layers((1, 3, 0)) == [["0"], ["1", "2", "3"], []]
    assert local_stage_indices(pipeline_rank=1, pipeline_size=2, virtual_stages=2) == [1, 3]
    assert local_stage_indices(pipeline_rank=1, pipeline_size=2, virtual_stages=2, schedule="zbv") == [1, 2]


def test_stages_keep_their_parts_under_the_full_models_names():
    full = small_gpt().state_dict()  # tied: both names
    first, last = keep_stages(small_gpt(), [0], (2, 2)), keep_stages(small_gpt(), [1], (2, 2))
    assert first.final_norm is None and first.output is None and list(first.layers) == ["0", "1"]
    assert last.embedding is None and list(last.layers) == ["2", "3"]
    names = set(first.state_dict()) | set(last.state_dict())
    assert names == set(small_gpt().state_dict())  # nothing lost, nothing renamed
    for name, param in [*first.named_parameters(), *last.named_parameters()]:
        assert torch.equal(param, full[name]), name  # the same initial values as the whole model
    # The last stage keeps its own copy of the tied word embedding, equal to the first stage's.
    assert torch.equal(last.output.weight, first.embedding.word_embeddings.weight)
    assert [name for name, _ in tied_copies(first)] == ["embedding.word_embeddings.weight"]
    assert [name for name, _ in tied_copies(last)] == ["output.weight"]
    assert tied_copies(keep_stages(small_gpt(tie_embeddings=False), [1], (2, 2))) == []


def test_interleaved_stage_views_share_the_rank_model():
    model = keep_stages(small_gpt(), [0, 2], (1, 1, 1, 1))  # pipeline rank 0 of 2, two virtual stages
    views = [stage_view(model, stage, (1, 1, 1, 1)) for stage in (0, 2)]
    assert (
        list(views[0].layers) == ["0"] and views[0].embedding is model.embedding and views[0].output is None
    )
    assert list(views[1].layers) == ["2"] and views[1].embedding is None and views[1].final_norm is None
    assert views[1].layers["2"] is model.layers["2"]
    hidden = views[0](torch.zeros(1, 8, dtype=torch.long))
    assert hidden.shape == (1, 8, 16)  # a stage without a head returns hidden states


def test_trainer_forward_step_is_recorded_for_the_schedule():
    """The trainer's forward step (model call + loss function) feeds the stages; micro-batches are
    concatenated into the whole batch the schedule splits back."""
    batches = [
        {
            "tokens": torch.full((2, 8), i),
            "labels": torch.ones(2, 8, dtype=torch.long),
            "loss_mask": torch.ones(2, 8),
        }
        for i in range(3)
    ]

    def forward_step(iterator, model):
        batch = next(iterator)
        output = model(batch["tokens"], labels=batch["labels"], attention_mask=None)
        return output, lambda per_token: ((per_token * batch["loss_mask"]).sum(), batch["loss_mask"].sum())

    recorded = [_record_micro_batch(forward_step, batch) for batch in batches]
    args, kwargs = _concatenate([call for call, _ in recorded])
    assert torch.equal(args[0], torch.cat([b["tokens"] for b in batches]))
    assert set(kwargs) == {"labels"}  # None values are left out
    loss_sum, count = recorded[1][1](torch.full((2, 8), 0.5))
    assert float(loss_sum) == 8.0 and float(count) == 16.0

    with pytest.raises(ValueError, match="pipeline-model-parallel-size"):
        _record_micro_batch(lambda iterator, model: model(next(iterator)["tokens"]).loss, batches[0])


def test_head_copy_is_saved_under_the_embedding_name():
    state = {
        "state": {"output.weight": {"step": 1}, "layers.2.ln1.weight": {"step": 1}},
        "param_groups": [{"lr": 0.1, "params": ["output.weight", "layers.2.ln1.weight"]}],
    }
    renamed = _rename(state, "output.weight", "embedding.word_embeddings.weight")
    assert set(renamed["state"]) == {"embedding.word_embeddings.weight", "layers.2.ln1.weight"}
    assert renamed["param_groups"][0]["params"][0] == "embedding.word_embeddings.weight"
    assert _rename(renamed, "embedding.word_embeddings.weight", "output.weight") == state


def test_a_v_shaped_rank_runs_its_first_and_last_stage_as_views_of_one_model():
    """ZBV/DualPipeV put stages 0 and 3 of 4 on pipeline rank 0: one model keeps the embedding and the head (the tied
    weight shared, no copy), its views run one stage each; a BERT without its binary head keeps that attribute None
    in the head's view (its forward reads it)."""
    split = (1, 1, 1, 1)
    model = keep_stages(small_gpt(), [0, 3], split)
    first, last = (stage_view(model, stage, split) for stage in (0, 3))
    assert list(first.layers) == ["0"] and first.output is None and last.embedding is None
    assert last.output.weight is first.embedding.word_embeddings.weight  # tied within the rank
    assert [name for name, _ in tied_copies(model)] == ["embedding.word_embeddings.weight"]
    hidden = first(torch.zeros(1, 8, dtype=torch.long))
    assert last(hidden).shape == (1, 8, 32)  # logits
    bert = keep_stages(small_gpt(model_type="bert", bert_binary_head=False), [0, 3], split)
    assert stage_view(bert, 3, split).binary_head is None
