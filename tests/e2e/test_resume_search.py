"""A run stopped at any iteration and resumed with --load continues bitwise as the run that never stopped: searched
over the switches that carry state across a checkpoint, not replayed at one stop point.

Each example draws a configuration (optimizer, fp16 loss scaling with skipped steps and growth, dropout, DataLoader
workers, accumulation, batch ramp-up, MoE with its router's jitter and capacity, learning-rate schedule, GPT-2's or
Llama's architecture) and a stop
iteration; the stopped run saves there (--exit-interval), a second run loads it, and every later iteration's loss
and gradient norm must equal the uninterrupted run's bit for bit (which may itself save at every iteration: saving
must change nothing either). One process, in this process (each run ~0.5 s).
The 8 examples are derandomized so CI sees the same ones; RESUME_SEARCH_EXAMPLES=200 searches wider."""

from __future__ import annotations

import os

import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from tests.launch import ARCHITECTURES, TINY_GPT_SHAPE, read_grad_norms, read_losses

ITERATIONS = 6
BASE = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--eval-iters", "0", "--log-interval", "100", "--lr", "1e-3",
        "--lr-warmup-iters", "2", "--train-iters", str(ITERATIONS)]
OPTIMIZERS = {
    "adamw": [],
    "sgd": ["--optimizer", "sgd", "--sgd-momentum", "0.9"],
    "adafactor": ["--optimizer", "adafactor"],
    "adamw_8bit": ["--optimizer", "adamw_8bit"],
}
PRECISIONS = {
    "fp32": [],
    # 2^20 overflows the first iterations (skipped, the scale halves), then grows every 2 clean steps.
    "fp16": ["--fp16", "--initial-loss-scale", "1048576", "--hysteresis", "2", "--loss-scale-window", "2"],
}
SCHEDULES = {
    "cosine": [],
    "wsd": ["--lr-decay-style", "WSD", "--lr-wsd-decay-iters", "3"],
    "inverse-square-root": ["--lr-decay-style", "inverse-square-root"],
}
MOE = ["--num-experts", "2", "--moe-loss-coeff", "0.01", "--moe-jitter-eps", "0.1", "--moe-capacity-factor", "1.0"]

configurations = st.fixed_dictionaries({
    "optimizer": st.sampled_from(sorted(OPTIMIZERS)),
    "precision": st.sampled_from(sorted(PRECISIONS)),
    "schedule": st.sampled_from(sorted(SCHEDULES)),
    "dropout": st.sampled_from(["0", "0.1"]),
    "workers": st.sampled_from(["0", "2"]),
    "global_batch": st.sampled_from(["2", "4"]),
    "ramp_up": st.booleans(),
    "moe": st.booleans(),
    "architecture": st.sampled_from(sorted(ARCHITECTURES)),
    "stop": st.integers(1, ITERATIONS - 1),
    "straight_saves": st.booleans(),  # the uninterrupted run saves every iteration: saving must not change a run
})


def flags_of(c: dict) -> list[str]:
    flags = [*BASE, *OPTIMIZERS[c["optimizer"]], *PRECISIONS[c["precision"]], *SCHEDULES[c["schedule"]],
             "--hidden-dropout", c["dropout"], "--attention-dropout", c["dropout"], "--num-workers", c["workers"],
             "--global-batch-size", c["global_batch"]]
    if c["ramp_up"]:  # 2 → 4 samples per iteration over the first 6 samples: the batch grows mid-run
        flags += ["--global-batch-size", "4", "--rampup-batch-size", "2", "2", "6"]
    return flags + ARCHITECTURES[c["architecture"]] + (MOE if c["moe"] else [])


def train_here(args: list[str]) -> None:
    from rapidtrain.pretrain import main

    main(args)


@pytest.mark.slow
@settings(max_examples=int(os.environ.get("RESUME_SEARCH_EXAMPLES", "8")), deadline=None,
          derandomize="RESUME_SEARCH_EXAMPLES" not in os.environ, database=None,
          phases=[Phase.explicit, Phase.generate],  # no shrinking: each example trains three runs; it prints its draw
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(c=configurations)
def test_resume_at_any_iteration_continues_bitwise(c, tmp_path_factory, demo_data):
    out = tmp_path_factory.mktemp("resume")
    flags, stop = flags_of(c), c["stop"]
    straight, resumed, save = out / "straight.txt", out / "resumed.txt", out / "ck"
    saves = ["--save", str(out / "straight_ck"), "--save-interval", "1"] if c["straight_saves"] else []
    train_here(flags + saves + ["--loss-log-file", str(straight)])
    train_here(flags + ["--loss-log-file", str(resumed), "--save", str(save), "--exit-interval", str(stop)])
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == str(stop), c
    train_here(flags + ["--loss-log-file", str(resumed), "--save", str(save), "--load", str(save)])
    expected, got = read_losses(straight), read_losses(resumed)
    assert sorted(got) == sorted(expected) == list(range(1, ITERATIONS + 1)), c
    later = range(stop + 1, ITERATIONS + 1)
    assert [got[i] for i in later] == [expected[i] for i in later], c
    norms, expected_norms = read_grad_norms(resumed), read_grad_norms(straight)
    assert {i: norms.get(i) for i in later} == {i: expected_norms.get(i) for i in later}, c
