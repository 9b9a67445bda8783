"""Megatron's and Rapidformer's user-code API over rapidtrain, in one process: masks, mpu, the Megatron-shaped
models, the loss-function contract and the log line it feeds."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import rapidtrain
from rapidtrain.compat import megatron, mpu
from rapidtrain.core.errors import UserError
from rapidtrain.core.metrics import IntervalStats
from rapidtrain.data.gpt_dataset import ltor_masks_and_position_ids
from rapidtrain.models import build_model
from rapidtrain.parallel.runner import as_loss
from rapidtrain.train.engine import Engine
from rapidtrain.train.reporting import IntervalTotals, IterationResult, build_log_line

FLAGS = ["--train-iters", "1", "--lr", "1e-3", "--tokenizer-type", "NullTokenizer", "--vocab-size", "100",
         "--data-path", "unused", "--num-layers", "2", "--hidden-size", "32", "--num-attention-heads", "4",
         "--seq-length", "16", "--hidden-dropout", "0", "--attention-dropout", "0"]


@pytest.fixture
def engine():
    return Engine(argv=FLAGS)


def test_public_names_are_megatrons():
    names = ["mpu", "get_tokenizer", "print_rank_0", "get_timers", "average_losses_across_data_parallel_group",
             "get_ltor_masks_and_position_ids", "ModelType", "GPTModel", "BertModel", "GPTFinetuner",
             "RapidformerEngine", "get_args", "PreTrainer", "Finetuner", "build_train_valid_test_datasets"]
    assert all(getattr(rapidtrain, name) is not None for name in names)
    assert rapidtrain.mpu is mpu and rapidtrain.megatron_pretrain is megatron.pretrain


@pytest.mark.parametrize("reset", [False, True])
def test_ltor_masks_are_megatrons(reset):
    """Causal mask [1, 1, s, s] (or per sample with --reset-attention-mask), positions restarting after each end
    of document, the loss mask 0 on end-of-document tokens: as rapidtrain's own dataset computes them."""
    eod = 7
    tokens = torch.tensor([[1, 2, eod, 3, 4, eod, 5, 6], [eod, 1, 2, 3, eod, eod, 4, 5]])
    attention, loss_mask, positions = megatron.get_ltor_masks_and_position_ids(tokens, eod, reset, reset, True)
    assert attention.shape == ((2, 1, 8, 8) if reset else (1, 1, 8, 8)) and attention.dtype == torch.bool
    assert torch.equal(loss_mask, (tokens != eod).float())
    for row in range(2):
        ours = ltor_masks_and_position_ids(tokens[row].numpy(), tokens[row].numpy(), eod, True, reset, reset)
        assert np.array_equal(positions[row].numpy(), ours["position_ids"])
        expected = ours["attention_mask"][0] if reset else np.triu(np.ones((8, 8), dtype=bool), 1)
        assert np.array_equal(attention[row if reset else 0, 0].numpy(), expected)


def test_mpu_in_one_process(engine):
    assert (mpu.get_tensor_model_parallel_world_size(), mpu.get_data_parallel_world_size(),
            mpu.get_pipeline_model_parallel_world_size()) == (1, 1, 1)
    assert mpu.get_data_parallel_group() is None and mpu.is_pipeline_first_stage() and mpu.is_pipeline_last_stage()
    assert (mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(),
            mpu.get_data_parallel_world_size(with_context_parallel=True), mpu.get_context_parallel_group()) == (1, 0, 1,
                                                                                                           None)
    batch = mpu.broadcast_data(["text"], {"text": torch.arange(6).view(2, 3)}, torch.int64)
    assert torch.equal(batch["text"], torch.arange(6).view(2, 3))
    with pytest.raises(TypeError, match="'text' has data type torch.float32"):
        mpu.broadcast_data(["text"], {"text": torch.zeros(2)}, torch.int64)
    averaged = megatron.average_losses_across_data_parallel_group([torch.tensor(1.5), torch.tensor(2.0)])
    assert averaged.tolist() == [1.5, 2.0]


def test_gpt_model_in_megatrons_shape_is_the_built_in_gpt(engine):
    """GPTModel(num_tokentypes, parallel_output, pre_process, post_process) takes its shape from the flags and
    starts from the built-in pretraining's weights; Megatron's causal mask is the causal attention it applies, a
    per-sample one is applied as given."""
    model = rapidtrain.GPTModel(num_tokentypes=0, parallel_output=True, pre_process=True, post_process=True)
    reference = build_model(engine.plan.model, seed=engine.plan.training.seed)
    assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), reference.state_dict().values(),
                                                 strict=True))
    tokens = torch.randint(0, 100, (2, 16))
    eod = 5
    causal, _, positions = megatron.get_ltor_masks_and_position_ids(tokens, eod, False, False, False)
    torch.testing.assert_close(model(tokens, positions, causal), reference(tokens, positions), rtol=0, atol=0)
    reset, _, positions = megatron.get_ltor_masks_and_position_ids(tokens, eod, True, True, False)
    torch.testing.assert_close(model(tokens, positions, reset), reference(tokens, positions, ~reset))
    with pytest.raises(UserError, match="build the whole model"):
        rapidtrain.GPTModel(pre_process=False)


def test_rapidformer_gpt_model_hands_back_the_balancing_losses(tmp_path):
    """Rapidformer's GPTModel returns (per-token loss, one balancing loss per MoE layer) and adds no gradient of
    its own: its forward step's loss + coeff × Σ losses gives the built-in model's gradients (which inject it)."""
    from rapidtrain.rapidformer import GPTModel as RapidformerGPT

    engine = Engine(argv=FLAGS + ["--num-experts", "2", "--moe-loss-coeff", "0.1", "--mlp-type", "residual"])
    model = RapidformerGPT()
    builtin = build_model(engine.plan.model, seed=engine.plan.training.seed)
    tokens, labels = torch.randint(0, 100, (2, 16)), torch.randint(0, 100, (2, 16))
    output, *aux = model(tokens, None, None, labels=labels)
    assert len(aux) == 2 and all(a.requires_grad for a in aux)
    (output.mean() + 0.1 * sum(aux)).backward()
    builtin(tokens, labels=labels).mean().backward()
    for (name, a), b in zip(model.named_parameters(), builtin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, msg=name)
    assert any("residual_mlp" in name for name, _ in model.named_parameters())  # PR-MoE's dense MLPs
    model.eval()
    assert model(tokens, None, None, labels=labels)[1:] == (None, None)


def test_model_type_is_free_for_user_code(engine):
    args = rapidtrain.get_args()
    args.model_type = rapidtrain.ModelType.encoder_or_decoder
    assert engine.plan.model.model_type == "gpt"  # rapidtrain reads its plan
    assert rapidtrain.GPTModel().config.model_type == "gpt"
    assert (args.mmap_warmup, args.zero_stage, args.deepspeed_configuration, args.moe) == (False, 0, None, False)
    # What Megatron's args carry once the run is resolved, written from the plan.
    assert (args.padded_vocab_size, args.train_iters) == (engine.plan.model.vocab_size, engine.plan.train_iters)


def test_tokenizer_timers_and_print(engine, capsys):
    tokenizer = rapidtrain.get_tokenizer()
    assert tokenizer.eod == 100 and rapidtrain.get_tokenizer() is tokenizer
    timers = rapidtrain.get_timers()
    timers("batch-generator").start()
    timers("batch-generator").stop()
    assert timers.log(["batch-generator"]).startswith("time (ms) | batch-generator: ")
    rapidtrain.print_rank_0("hello from rank 0")
    assert "hello from rank 0" in capsys.readouterr().out


# ---- the forward-step contract and the log line ----

def test_megatron_loss_function_dict_is_a_mean_loss_with_reported_values():
    output = torch.tensor([2.0, 4.0])
    parts = as_loss((output, lambda out: (out.mean(), {"lm loss": out.mean(), "moe loss": torch.tensor(0.5)})))
    assert parts.tokens is None and float(parts.value) == 3.0
    assert {k: v.tolist() for k, v in parts.reported.items()} == {"lm loss": [3.0, 1.0], "moe loss": [0.5, 1.0]}
    core = as_loss((torch.tensor(6.0), torch.tensor(3), {"lm loss": torch.tensor([6.0, 3.0])}))
    assert int(core.tokens) == 3 and core.reported["lm loss"].tolist() == [6.0, 3.0]
    with pytest.raises(ValueError, match="report a number"):
        as_loss((torch.tensor(1.0), {"lm loss": torch.zeros(3)}))


def _result(loss: float, skipped: bool = False, reported: dict | None = None) -> IterationResult:
    return IterationResult(torch.tensor(loss, dtype=torch.float64), None if skipped else torch.tensor(1.0),
                           skipped, False, 4, 64, reported=reported or {})


def test_log_line_shows_the_reported_dict_and_leaves_skipped_iterations_out(engine):
    """Megatron's log: the loss function's entries averaged over the interval's iterations that were not
    skipped; an interval of skipped fp16 iterations shows no loss at all (never 0.0)."""
    interval = IntervalStats(2, 1.0, 8, 128)
    kwargs = dict(iteration=2, train_iters=2, consumed_samples=8, learning_rate=0.0, loss_scale=1024.0,
                  loss_name="lm loss", flops_per_iteration=None, device=torch.device("cpu"))
    skipped = IntervalTotals()
    for _ in range(2):
        skipped.add(_result(0.0, skipped=True))
    line, scalars = build_log_line(engine.plan, skipped, interval, **kwargs)
    assert "lm loss" not in line and "number of skipped iterations:   2" in line and "train/lm loss" not in scalars
    mixed = IntervalTotals()
    mixed.add(_result(9.0, reported={"lm loss": torch.tensor([3.0, 1.0], dtype=torch.float64)}))
    mixed.add(_result(0.0, skipped=True, reported={"lm loss": torch.tensor([100.0, 1.0], dtype=torch.float64)}))
    line, _ = build_log_line(engine.plan, mixed, interval, **kwargs,
                             reported={"lm loss": 3.0}, params_norm=12.5, global_batch_size=6)
    assert "lm loss: 3.000000E+00" in line and "9.000000E+00" not in line
    assert "params norm: 12.500" in line and "global batch size:     6" in line
    assert mixed.reported["lm loss"].tolist() == [3.0, 1.0]  # the skipped iteration's values are left out


@pytest.mark.parametrize("shape", [(2, 4), (8,)])
def test_per_token_losses_with_a_b_by_s_loss_mask_are_the_masked_mean(shape):
    """Megatron's forward-step contract: losses [b, s] or [b·s] beside a loss mask [b, s]."""
    losses = torch.arange(8.0).reshape(shape)
    mask = torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0]])
    parts = as_loss((losses, mask))
    assert (float(parts.value), int(parts.tokens)) == (0 + 1 + 4 + 6, 4)
    with pytest.raises(ValueError, match=r"shape \(6,\) with a loss mask of shape \(2, 4\)"):
        as_loss((torch.zeros(6), mask))
