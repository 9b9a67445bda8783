"""One iteration of the real loop (Engine → compose → Trainer.train_step) in a single process, per switch."""

from __future__ import annotations

import copy

import pytest
import torch

from rapidtrain.models import build_model
from rapidtrain.models.config import ModelConfig
from rapidtrain.train.engine import Engine
from rapidtrain.train.trainer import Trainer, TrainingStopped

CONFIG = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                     vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
BASE = ["--train-iters", "10", "--lr", "1e-3", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "32"]


class TinyTrainer(Trainer):
    """A GPT forward step returning (per-token loss, loss_fn → (sum, tokens)) like the built-in one."""

    def run_forward_step(self, data_iterator, model):
        batch = next(data_iterator)
        losses = model(batch["tokens"], labels=batch["labels"])
        return losses, lambda per_token: ((per_token * batch["loss_mask"]).sum(), batch["loss_mask"].sum())


def make_batches(global_batch: int, micro: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 128, (global_batch, 33), generator=generator)
    mask = (torch.rand(global_batch, 32, generator=generator) > 0.3).float()  # uneven token counts per sample
    return [{"tokens": tokens[i:i + micro, :-1], "labels": tokens[i:i + micro, 1:], "loss_mask": mask[i:i + micro]}
            for i in range(0, global_batch, micro)]


def trainer_for(flags: list[str], model: torch.nn.Module | None = None) -> TinyTrainer:
    engine = Engine(argv=BASE + flags)
    trainer = TinyTrainer(engine)
    trainer.model, *_ = engine.compose(model or build_model(CONFIG, seed=7))
    return trainer


def test_loss_and_update_do_not_depend_on_the_micro_batch_split():
    """micro 4 × 1 step, 2 × 2 and 1 × 4: the same per-token global-batch loss and the same new weights.

    SGD makes the update linear in the gradient (Adam's first step is ±lr wherever a gradient is nonzero, which
    amplifies rounding noise in near-zero gradients).
    """
    results, weights = [], []
    for micro in (4, 2, 1):
        trainer = trainer_for(["--micro-batch-size", str(micro), "--global-batch-size", "4", "--optimizer", "sgd"])
        assert trainer.engine.plan.batches.accumulation_steps == 4 // micro
        results.append(trainer.train_step(make_batches(4, micro)))
        weights.append(torch.cat([p.detach().flatten() for p in trainer.model.parameters()]))
    for other, w in zip(results[1:], weights[1:], strict=True):
        assert float(other.loss) == pytest.approx(float(results[0].loss), rel=1e-6)
        assert float(other.grad_norm) == pytest.approx(float(results[0].grad_norm), rel=1e-5)
        torch.testing.assert_close(w, weights[0], rtol=1e-5, atol=1e-7)


def test_loss_is_the_token_mean_of_the_global_batch():
    trainer = trainer_for(["--micro-batch-size", "2", "--global-batch-size", "4"])
    batches = make_batches(4, 2)
    reference = build_model(CONFIG, seed=7)
    with torch.no_grad():
        sums = [(reference(b["tokens"], labels=b["labels"]) * b["loss_mask"]).sum() for b in batches]
    expected = float(sum(sums) / sum(b["loss_mask"].sum() for b in batches))
    assert float(trainer.train_step(batches).loss) == pytest.approx(expected, rel=1e-6)


def test_clip_grad_zero_still_reports_the_norm_and_clipping_bounds_the_update():
    clipped = trainer_for(["--clip-grad", "0.01", "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0"])
    free = trainer_for(["--clip-grad", "0", "--optimizer", "sgd", "--sgd-momentum", "0", "--weight-decay", "0"])
    before = torch.cat([p.detach().flatten() for p in clipped.model.parameters()])
    a, b = clipped.train_step(make_batches(1, 1)), free.train_step(make_batches(1, 1))
    assert float(a.grad_norm) == pytest.approx(float(b.grad_norm), rel=1e-6) and float(a.grad_norm) > 0.01
    moved_clipped = torch.cat([p.detach().flatten() for p in clipped.model.parameters()]) - before
    moved_free = torch.cat([p.detach().flatten() for p in free.model.parameters()]) - before
    # SGD without weight decay moves by lr × grad: clipping scales the step down to norm 0.01.
    assert float(moved_clipped.norm() / 1e-3) == pytest.approx(0.01, rel=1e-3)
    assert float(moved_free.norm() / 1e-3) == pytest.approx(float(a.grad_norm), rel=1e-3)


def test_learning_rate_schedule_advances_per_step_only():
    trainer = trainer_for(["--lr-warmup-iters", "4", "--micro-batch-size", "2", "--global-batch-size", "2"])
    optimizer = trainer.engine.runner.optimizer
    assert optimizer.param_groups[0]["lr"] == 0.0
    trainer.train_step(make_batches(2, 2))
    assert optimizer.param_groups[0]["lr"] == pytest.approx(1e-3 / 4)  # linear warm-up: 1 of 4 iterations


def test_fp16_overflow_skips_the_step_and_backs_off_the_scale():
    trainer = trainer_for(["--fp16", "--initial-loss-scale", str(2.0**40), "--hysteresis", "1"])
    scaler = trainer.engine.runner.scaler
    before = copy.deepcopy(trainer.model.state_dict())
    first = trainer.train_step(make_batches(1, 1))
    assert first.skipped and scaler.loss_scale == 2.0**39
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0)  # no update on overflow
    results = [trainer.train_step(make_batches(1, 1, seed=i)) for i in range(40)]
    assert any(not r.skipped for r in results)  # the scale came down far enough to train


def test_non_finite_loss_without_loss_scaling_stops_before_the_step():
    trainer = trainer_for([])
    batches = make_batches(1, 1)
    with torch.no_grad():
        trainer.model.embedding.word_embeddings.weight[0, 0] = float("nan")
    batches[0]["tokens"][0, 0] = 0
    before = copy.deepcopy(trainer.model.state_dict())
    with pytest.raises(TrainingStopped, match="stops before the optimizer step"):
        trainer.train_step(batches)
    for name, value in trainer.model.state_dict().items():
        torch.testing.assert_close(value, before[name], rtol=0, atol=0, equal_nan=True)


def saved_activation_bytes(trainer: TinyTrainer) -> int:
    total = 0

    def pack(tensor):
        nonlocal total
        total += tensor.numel() * tensor.element_size()
        return tensor

    batch = make_batches(4, 4)[0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        trainer.model(batch["tokens"], labels=batch["labels"]).sum().backward()
    return total


def test_activation_checkpointing_keeps_fewer_activations_and_the_same_gradients():
    config = ModelConfig(num_layers=4, hidden_size=64, num_attention_heads=4, seq_length=32, max_position_embeddings=32,
                         vocab_size=128, hidden_dropout=0.0, attention_dropout=0.0)
    plain = trainer_for([], build_model(config, seed=3))
    checkpointed = trainer_for(["--checkpoint-activations"], build_model(config, seed=3))
    assert checkpointed.engine.plan.switches.activation_checkpointing
    plain_bytes, checkpointed_bytes = saved_activation_bytes(plain), saved_activation_bytes(checkpointed)
    assert checkpointed_bytes < 0.5 * plain_bytes
    grads = {n: p.grad for n, p in plain.model.named_parameters()}
    for name, param in checkpointed.model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name.replace("_checkpoint_wrapped_module.", "")])


def test_optimizer_flags_choose_the_optimizer():
    assert isinstance(trainer_for(["--optimizer", "sgd"]).engine.runner.optimizer, torch.optim.SGD)
    assert isinstance(trainer_for(["--optimizer", "adafactor"]).engine.runner.optimizer, torch.optim.Adafactor)
    assert isinstance(trainer_for([]).engine.runner.optimizer, torch.optim.AdamW)  # apex_adam without apex
    assert type(trainer_for(["--optimizers", "apex_lamb"]).engine.runner.optimizer).__name__ == "LAMB"


@pytest.mark.slow
def test_torch_compile_trains_like_eager():
    eager = trainer_for([])
    compiled = trainer_for(["--torch-compile"])
    assert compiled.engine.plan.switches.compile == "inductor"
    for seed in range(2):
        a = eager.train_step(make_batches(1, 1, seed))
        b = compiled.train_step(make_batches(1, 1, seed))
        assert float(b.loss) == pytest.approx(float(a.loss), rel=1e-4)


@pytest.mark.parametrize("foreach", [False, True], ids=["per-gradient sums (CPU)", "multi-tensor norms (CUDA)"])
def test_squared_gradient_norm_is_within_fp64_rounding_on_both_paths(foreach):
    """The two ways of adding up the gradients' squares (CPU: fp32 sums per gradient; CUDA's default: one foreach
    norm per dtype) give the fp64 value; bf16 gradients are accumulated in fp32."""
    from rapidtrain.parallel.runner import squared_norm

    generator = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=generator) * scale
             for shape, scale in [((1000, 300), 1e-3), ((300,), 2.0), ((50_000,), 1e-5), ((7, 11, 13), 0.3)]]
    grads.append(torch.randn(4096, generator=generator).to(torch.bfloat16))
    exact = sum(float(g.double().square().sum()) for g in grads)
    got = squared_norm(grads, foreach=foreach)
    assert got.dtype == torch.float64 and float(got) == pytest.approx(exact, rel=1e-6)


def test_a_run_that_fails_while_setting_up_gives_back_the_save_folder(tmp_path):
    """A user's script may catch a refusal and train again in the same process: the failed run's --save lock
    (an flock, dropped by the kernel only when the process ends) must not outlive it."""
    from rapidtrain.checkpoint.save_folder import acquire_save_lock

    class BrokenData(TinyTrainer):
        def train_valid_test_datasets_provider(self):
            raise ValueError("no data here")

    save = tmp_path / "ck"
    engine = Engine(argv=BASE + ["--micro-batch-size", "1", "--global-batch-size", "1", "--save", str(save)])
    with pytest.raises(ValueError, match="no data here"):
        BrokenData(engine).train()
    acquire_save_lock(save).release()  # raised "locked by this host's pid …" before the fix
