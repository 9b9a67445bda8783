"""Megatron's learning-rate schedule in samples: each style against numbers worked out by hand."""

import math

import pytest
import torch

from rapidtrain.optim.lr_schedule import (
    LRScheduler,
    LRScheduleSettings,
    learning_rate_at,
    lr_schedule_from_iters,
)

# 100 iterations of global batch 8: the decay horizon is 800 samples; 10 warm-up iterations are 80.
LR, MIN_LR, GLOBAL_BATCH = 0.01, 0.001, 8


def schedule(style, **overrides):
    arguments = dict(
        lr=LR,
        min_lr=MIN_LR,
        style=style,
        train_iters=100,
        lr_decay_iters=None,
        lr_warmup_iters=10,
        lr_warmup_fraction=None,
        global_batch_size=GLOBAL_BATCH,
    )
    arguments.update(overrides)
    return lr_schedule_from_iters(**arguments)


def test_iteration_flags_become_samples():
    settings = schedule("linear")
    assert settings.decay_samples == 800
    assert settings.warmup_samples == 80
    by_fraction = schedule("linear", lr_warmup_iters=0, lr_warmup_fraction=0.05, lr_decay_iters=50)
    assert by_fraction.decay_samples == 400  # --lr-decay-iters wins over --train-iters
    assert by_fraction.warmup_samples == pytest.approx(20.0)  # 5% of the decay horizon


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "inverse-square-root"])
def test_warmup_is_linear_from_zero(style):
    settings = schedule(style)
    assert learning_rate_at(settings, 0) == 0.0
    assert learning_rate_at(settings, 20) == pytest.approx(0.0025)
    assert learning_rate_at(settings, 40) == pytest.approx(0.005)
    assert learning_rate_at(settings, 80) == pytest.approx(0.01)


def test_warmup_by_fraction_and_from_init_lr():
    settings = schedule("linear", lr_warmup_iters=0, lr_warmup_fraction=0.05)  # 40 samples
    assert learning_rate_at(settings, 20) == pytest.approx(0.005)
    assert learning_rate_at(settings, 40) == pytest.approx(0.01)
    # After warm-up: (1 - (420 - 40) / 760) of the range above min_lr = 0.5.
    assert learning_rate_at(settings, 420) == pytest.approx(0.0055)
    warm_from = schedule("linear", lr_warmup_init=0.001)
    assert learning_rate_at(warm_from, 0) == pytest.approx(0.001)
    assert learning_rate_at(warm_from, 40) == pytest.approx(0.0055)


def test_linear_decay():
    settings = schedule("linear")
    assert learning_rate_at(settings, 440) == pytest.approx(0.0055)  # halfway through 80..800
    assert learning_rate_at(settings, 260) == pytest.approx(0.001 + 0.75 * 0.009)
    assert learning_rate_at(settings, 800) == pytest.approx(0.001)
    assert learning_rate_at(settings, 808) == 0.001  # past the horizon: min_lr


def test_cosine_decay():
    settings = schedule("cosine")
    assert learning_rate_at(settings, 440) == pytest.approx(0.0055)
    # A quarter of the way: 0.001 + 0.5 (1 + cos(pi/4)) 0.009 = 0.00868198...
    assert learning_rate_at(settings, 260) == pytest.approx(0.008681980515339464)
    assert learning_rate_at(settings, 808) == 0.001


def test_constant_stays_at_lr_even_past_the_horizon():
    settings = schedule("constant")
    assert learning_rate_at(settings, 440) == 0.01
    assert learning_rate_at(settings, 10_000) == 0.01


def test_inverse_square_root():
    settings = schedule("inverse-square-root")
    assert learning_rate_at(settings, 320) == pytest.approx(0.005)  # 0.01 * sqrt(80 / 320)
    assert learning_rate_at(settings, 720) == pytest.approx(0.01 / 3)  # 0.01 * sqrt(80 / 720)
    floored = schedule("inverse-square-root", min_lr=0.004)
    assert learning_rate_at(floored, 720) == 0.004
    assert learning_rate_at(settings, 808) == 0.001


@pytest.mark.parametrize(
    ("wsd_style", "expected_at_720"),
    [
        ("linear", 0.0055),
        ("cosine", 0.0055),
        ("exponential", 0.001 + (2 * 0.5**0.5 - 1) * 0.009),  # 0.004727922...
        ("minus_sqrt", 0.001 + (1 - 0.5**0.5) * 0.009),  # 0.003636038...
    ],
)
def test_wsd_holds_then_anneals_over_the_last_samples(wsd_style, expected_at_720):
    # 20 iterations of annealing = the last 160 samples (640..800).
    settings = schedule("WSD", lr_wsd_decay_iters=20, lr_wsd_decay_style=wsd_style)
    assert settings.wsd_decay_samples == 160
    assert learning_rate_at(settings, 600) == pytest.approx(0.01)
    assert learning_rate_at(settings, 640) == pytest.approx(0.01)
    assert learning_rate_at(settings, 720) == pytest.approx(expected_at_720)
    assert learning_rate_at(settings, 800) == pytest.approx(0.001)
    assert learning_rate_at(settings, 801) == 0.001


def test_scheduler_sets_every_group_with_its_lr_mult():
    weight, bias = torch.nn.Parameter(torch.ones(2, 2)), torch.nn.Parameter(torch.ones(2))
    optimizer = torch.optim.SGD([{"params": [weight]}, {"params": [bias], "lr_mult": 0.1}], lr=1.0)
    scheduler = LRScheduler(optimizer, schedule("linear"))
    assert [group["lr"] for group in optimizer.param_groups] == [0.0, 0.0]  # Megatron starts at 0
    for _ in range(5):
        scheduler.step(GLOBAL_BATCH)
    assert scheduler.num_steps == 40
    assert scheduler.get_lr() == pytest.approx(0.005)
    assert scheduler.get_last_lr() == pytest.approx([0.005, 0.0005])


def test_state_dict_resumes_at_the_same_sample():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    scheduler = LRScheduler(optimizer, schedule("cosine"))
    scheduler.step(260)
    state = scheduler.state_dict()
    assert state["num_steps"] == 260 and state["lr_decay_steps"] == 800 and state["max_lr"] == LR

    fresh_optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    resumed = LRScheduler(fresh_optimizer, schedule("cosine"))
    resumed.load_state_dict(state)
    assert resumed.num_steps == 260
    assert fresh_optimizer.param_groups[0]["lr"] == pytest.approx(0.008681980515339464)


def test_loading_a_different_schedule_is_refused_unless_overridden():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0)
    saved = LRScheduler(optimizer, schedule("cosine")).state_dict()
    saved["num_steps"] = 440
    other = LRScheduler(optimizer, schedule("linear", lr=0.02))
    with pytest.raises(ValueError, match="lr saved 0.01, now 0.02"):
        other.load_state_dict(saved)
    other.load_state_dict(saved, schedule_from="flags")  # --override-opt_param-scheduler
    assert other.get_lr() == pytest.approx(0.001 + 0.5 * 0.019)
    other.load_state_dict(saved, schedule_from="checkpoint")  # --use-checkpoint-opt_param-scheduler
    assert other.settings.lr == 0.01 and other.settings.decay_style == "cosine"
    original = LRScheduler(torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1.0), schedule("cosine"))
    original.step(440)
    assert other.get_lr() == pytest.approx(original.get_lr())


def test_bad_flags_are_refused_with_their_names():
    with pytest.raises(ValueError, match="--lr-warmup-fraction and --lr-warmup-iters"):
        schedule("linear", lr_warmup_fraction=0.1)
    with pytest.raises(ValueError, match="warm-up .* must be shorter than the decay horizon"):
        schedule("linear", lr_warmup_iters=100)
    with pytest.raises(ValueError, match="--min-lr"):
        schedule("linear", min_lr=0.1)
    with pytest.raises(ValueError, match="WSD needs --lr-wsd-decay-iters"):
        schedule("WSD")
    with pytest.raises(ValueError, match="--train-iters"):
        schedule("linear", train_iters=None)


def test_settings_can_be_given_in_samples_directly():
    settings = LRScheduleSettings(lr=1.0, decay_samples=1000, warmup_samples=0, decay_style="cosine")
    assert learning_rate_at(settings, 0) == 1.0
    assert learning_rate_at(settings, 500) == pytest.approx(0.5)
    assert learning_rate_at(settings, 1000) == pytest.approx(0.0)
    assert math.isclose(learning_rate_at(settings, 250), 0.5 * (1 + math.cos(math.pi / 4)))


def test_lr_warmup_init_starts_the_warm_up_there_from_the_flags():
    """Megatron-Core's --lr-warmup-init (DeepSeek-V3's recipes): the warm-up climbs from it to --lr linearly."""
    from rapidtrain.config import arguments, plan, settings
    from rapidtrain.config.describe import describe_plan
    from rapidtrain.optim.lr_schedule import lr_schedule_for

    args = arguments.parse_args(["--train-iters", "100", "--lr", "1e-3", "--min-lr", "1e-5", "--lr-warmup-iters", "10",
                                 "--lr-warmup-init", "1e-4", "--global-batch-size", "4", "--micro-batch-size", "4"])
    planned = plan.from_args(args, settings.RunContext(1, "cpu"))
    schedule = lr_schedule_for(planned.schedule, 4, 100)
    assert learning_rate_at(schedule, 0) == pytest.approx(1e-4)
    assert learning_rate_at(schedule, 20) == pytest.approx(1e-4 + 0.5 * (1e-3 - 1e-4))
    assert learning_rate_at(schedule, 40) == pytest.approx(1e-3)
    assert "warm-up 10 iterations from 1.0E-04" in describe_plan(planned)
