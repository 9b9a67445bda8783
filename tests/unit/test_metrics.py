"""Megatron's log line to the character, throughput and MFU arithmetic, timers, memory, TensorBoard."""

from datetime import datetime

import pytest
import torch

from rapidtrain.core.metrics import (
    IntervalStats,
    TensorBoardWriter,
    ThroughputMeter,
    Timer,
    format_log_line,
    mfu,
    peak_memory_bytes,
    tflops_per_device,
)

REFERENCE_LINE = (
    " [2024-04-06 03:02:12] iteration       71/     100 | consumed samples:         9088 |"
    " elapsed time per iteration (ms): 5361.6 | throughput per GPU (TFLOP/s/GPU): 243.6 |"
    " learning rate: 1.420000E-05 | global batch size:   128 | lm loss: 1.818812E+00 |"
    " loss scale: 1.0 | grad norm: 1.300 | number of skipped iterations:   0 |"
    " number of nan iterations:   0 |"
)


def reference_fields(**overrides):
    fields = dict(
        iteration=71,
        train_iters=100,
        consumed_samples=9088,
        seconds_per_iteration=5.3616,
        learning_rate=1.42e-5,
        global_batch_size=128,
        losses={"lm loss": 1.818812},
        loss_scale=1.0,
        grad_norm=1.3,
        # 243.6 TFLOP/s on each of 8 devices for 5.3616 s.
        flops_per_iteration=243.6e12 * 5.3616 * 8,
        world_size=8,
        timestamp=datetime(2024, 4, 6, 3, 2, 12),
    )
    fields.update(overrides)
    return fields


def test_log_line_matches_megatrons_reference_exactly():
    assert format_log_line(**reference_fields()) == REFERENCE_LINE


def test_throughput_field_only_when_flops_are_known():
    line = format_log_line(**reference_fields(flops_per_iteration=None))
    assert "throughput" not in line
    assert line == REFERENCE_LINE.replace(" throughput per GPU (TFLOP/s/GPU): 243.6 |", "")


def test_extra_fields_and_moe_loss_are_appended_as_name_value():
    line = format_log_line(
        **reference_fields(
            losses={"lm loss": 1.818812, "load balancing loss": 1.0},
            grad_norm=None,
            skipped_iterations=3,
            extras={
                "tokens per second": 12345.678,
                "data time (ms)": 3.25,
                "peak memory (MB)": 2048,
                "MFU": "41.2%",
            },
        )
    )
    assert line.endswith(
        " lm loss: 1.818812E+00 | load balancing loss: 1.000000E+00 | loss scale: 1.0 |"
        " number of skipped iterations:   3 | number of nan iterations:   0 |"
        " tokens per second: 12345.7 | data time (ms): 3.25 | peak memory (MB): 2048 | MFU: 41.2% |"
    )


def test_tflops_and_mfu_arithmetic():
    # 1.2e15 FLOPs per iteration in 2 s on 4 devices: 150 TFLOP/s each; 150 / 989 peak = 15.17%.
    assert tflops_per_device(1.2e15, 2.0, 4) == pytest.approx(150.0)
    assert mfu(1.2e15, 2.0, 4, peak_tflops=989.0) == pytest.approx(150.0 / 989.0)


class FakeClock:
    """A clock the test advances by hand, so timings are exact numbers."""

    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_timer_accumulates_intervals():
    clock = FakeClock()
    timer = Timer(clock=clock)
    with timer:
        clock.now += 0.25
    clock.now += 10.0  # not timed
    timer.start()
    clock.now += 0.5
    assert timer.elapsed(reset=False) == 0.75  # the running interval counts up to now
    timer.stop()
    assert timer.elapsed() == 0.75
    assert timer.elapsed() == 0.0
    with pytest.raises(RuntimeError, match="without start"):
        timer.stop()


def test_throughput_meter_reports_each_interval():
    clock = FakeClock()
    meter = ThroughputMeter(clock=clock)
    meter.start()
    for _ in range(4):
        clock.now += 0.5
        meter.record(samples=8, tokens=8 * 128)
    stats = meter.interval()
    assert stats == IntervalStats(iterations=4, seconds=2.0, samples=32, tokens=4096)
    assert (stats.seconds_per_iteration, stats.samples_per_second, stats.tokens_per_second) == (
        0.5,
        16.0,
        2048.0,
    )
    clock.now += 3.0
    meter.record(samples=8)
    assert meter.interval() == IntervalStats(iterations=1, seconds=3.0, samples=8, tokens=0)


def test_cpu_peak_memory_covers_a_live_tensor():
    block = torch.ones(64 * 2**20 // 4)  # 64 MiB, written, so resident
    assert block.sum().item() == 64 * 2**20 // 4
    assert peak_memory_bytes("cpu") >= 64 * 2**20


def test_tensorboard_writer_is_a_no_op_without_a_directory(tmp_path):
    writer = TensorBoardWriter(None)
    writer.add_scalar("lm loss", 1.0, 1)
    writer.close()
    assert not writer.enabled
    assert list(tmp_path.iterdir()) == []


def test_tensorboard_writer_writes_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with TensorBoardWriter(tmp_path / "tb") as writer:
        writer.add_scalar("lm loss", 2.5, 1)
        writer.add_scalars({"lm loss": 2.0, "learning-rate": 1e-4}, 2)
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("lm loss")] == [(1, 2.5), (2, 2.0)]
    assert [e.value for e in events.Scalars("learning-rate")] == [pytest.approx(1e-4)]
