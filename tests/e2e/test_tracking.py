"""TensorBoard, Weights & Biases (offline) and MLflow (a local file store) receive the log line's scalars and the
plan from one real 2-rank run, and --profile traces the requested steps on the requested rank; every file is
read back with the tool's own reader (W&B: its protobuf records; MLflow: MlflowClient; TensorBoard:
EventAccumulator)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from tests.launch import TINY_GPT_SHAPE, pretrain
from tests.wandb_records import read_run

pytestmark = pytest.mark.slow  # one 2-rank run with three trackers and the profiler

ARGS = [*TINY_GPT_SHAPE, "--micro-batch-size", "2", "--global-batch-size", "8", "--num-workers", "0",
        "--log-interval", "2", "--eval-iters", "0", "--lr", "1e-3", "--train-iters", "6"]


def log_line_losses(stdout: str) -> dict[int, float]:
    """iteration → the lm loss the log line printed (%.6E)."""
    found = re.findall(r"iteration +(\d+)/ +\d+ \|.*?lm loss: ([0-9.E+-]+)", stdout)
    return {int(i): float(v) for i, v in found}


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory, demo_data):
    root = tmp_path_factory.mktemp("tracked")
    result = pretrain(2, ARGS + [
        "--tensorboard-dir", str(root / "tb"), "--save", str(root / "ck"), "--save-interval", "100",
        "--wandb-project", "rapidtrain-test", "--wandb-exp-name", "tiny-gpt",
        "--mlflow-experiment", "tiny", "--mlflow-tracking-uri", f"file:{root / 'mlruns'}",
        "--profile", "--profile-step-start", "2", "--profile-step-end", "4", "--profile-ranks", "1"],
        env={"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""}, warm=True)
    return root, result.stdout


def test_every_tracker_has_the_log_lines_losses_and_the_plan(tracked_run, monkeypatch):
    from mlflow import MlflowClient
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, stdout = tracked_run
    printed = log_line_losses(stdout)
    assert sorted(printed) == [2, 4, 6]

    runs = list((root / "ck" / "wandb" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1, "only the logging rank opens a W&B run"
    wandb_run = read_run(runs[0])
    assert (wandb_run["project"], wandb_run["name"]) == ("rapidtrain-test", "tiny-gpt")
    assert wandb_run["config"]["layout"]["world_size"] == 2
    assert wandb_run["config"]["batches"]["global_batch_size"] == 8
    wandb_losses = {step: values["train/lm loss"] for step, values in wandb_run["history"].items()}

    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3 reads its file store only when asked to
    client = MlflowClient(tracking_uri=(root / "mlruns").as_uri())
    experiment = client.get_experiment_by_name("tiny")
    (mlflow_run,) = client.search_runs([experiment.experiment_id])
    assert mlflow_run.info.run_name == "tiny-gpt" and mlflow_run.info.status == "FINISHED"
    assert mlflow_run.data.params["layout.world_size"] == "2"
    plan = json.loads(Path(client.download_artifacts(mlflow_run.info.run_id, "plan.json", str(root))).read_text())
    assert plan["logging"]["tracking"]["mlflow_experiment"] == "tiny"
    mlflow_losses = {m.step: m.value for m in client.get_metric_history(mlflow_run.info.run_id, "train/lm loss")}

    events = EventAccumulator(str(root / "tb"))
    events.Reload()
    tensorboard_losses = {e.step: e.value for e in events.Scalars("train/lm loss")}
    assert "plan/text_summary" in events.Tags()["tensors"]

    for name, losses in [("W&B", wandb_losses), ("MLflow", mlflow_losses), ("TensorBoard", tensorboard_losses)]:
        assert sorted(losses) == [2, 4, 6], name
        for step, value in losses.items():  # the log line rounds to 7 digits, TensorBoard stores float32
            assert value == pytest.approx(printed[step], rel=1e-6), (name, step)
    assert wandb_losses == mlflow_losses  # both keep the float64 the log line was built from
    for key in ("train/learning rate", "train/grad norm", "train/tokens per second"):
        assert [m.step for m in client.get_metric_history(mlflow_run.info.run_id, key)] == [2, 4, 6]
        assert all(key in wandb_run["history"][step] for step in (2, 4, 6))


def test_profile_traces_the_requested_steps_on_the_requested_rank(tracked_run):
    root, stdout = tracked_run
    traces = sorted((root / "tb").glob("*.pt.trace.json"))
    assert [t.name.split(".")[0] for t in traces] == ["rank1"], "--profile-ranks 1: rank 0 traces nothing"
    trace = json.loads(traces[0].read_text())
    names = [event.get("name", "") for event in trace["traceEvents"]]
    assert sorted({n for n in names if n.startswith("ProfilerStep#")}) == ["ProfilerStep#2", "ProfilerStep#3"]
    assert any(n.startswith("aten::") for n in names)  # operators recorded inside the steps
    assert "profiler: rank 1 traced steps 2-3" in stdout
