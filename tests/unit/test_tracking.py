"""The writers behind one interface (MLflow's SQLite store read back with MlflowClient, W&B's refusal without a
login), the plan's tracking and profiler settings, and the profiler's window over training steps."""

from __future__ import annotations

import json

import pytest
import torch

from rapidtrain.config import arguments, plan, settings
from rapidtrain.config.describe import describe_plan
from rapidtrain.config.settings import LoggingSettings, ProfileSettings, TrackingSettings
from rapidtrain.core.errors import UserError
from rapidtrain.train.profiling import Profiler
from rapidtrain.train.tracking import MlflowTracker, WandbTracker, Writers, flatten


def resolved(argv: list[str]) -> settings.Plan:
    args = arguments.parse_args(["--train-iters", "20", "--lr", "1e-4", *argv], entry="pretrain")
    return plan.from_args(args, settings.RunContext(1, "cpu"))


def test_plan_resolves_tracker_defaults_as_megatron():
    p = resolved(["--save", "ck", "--wandb-project", "p", "--wandb-exp-name", "run1", "--mlflow-experiment", "e"])
    assert p.logging.tracking == TrackingSettings("p", "run1", "ck/wandb", "e", None, "run1")
    assert resolved([]).logging.tracking is None
    described = describe_plan(p)
    assert "weights & biases: project p, run run1, files in ck/wandb" in described
    assert "mlflow: experiment e, run run1" in described


def test_plan_resolves_the_profile_window_and_its_folder():
    p = resolved(["--profile", "--profile-step-start", "3", "--profile-step-end", "5", "--tensorboard-dir", "tb"])
    assert p.profile == ProfileSettings(True, 3, 5, (0,), "tb")
    assert "over iterations 4-5, traces in tb" in describe_plan(p)
    assert resolved(["--profile", "--profile-step-end", "12"]).profile.trace_dir == "profile"


def test_mlflow_sqlite_store_holds_metrics_params_and_plan(tmp_path, monkeypatch):
    from mlflow import MlflowClient

    monkeypatch.chdir(tmp_path)
    uri = f"sqlite:///{tmp_path / 'store' / 'mlflow.db'}"
    config = {"layout": {"world_size": 2, "tensor_parallel_size": 1}, "notes": ["a", "b"]}
    tracker = MlflowTracker(TrackingSettings(mlflow_experiment="exp", mlflow_tracking_uri=uri,
                                             mlflow_run_name="r1"), config)
    tracker.add_config(config)
    writers = Writers([tracker])
    writers.add_scalars({"train/lm loss": 2.5, "train/learning rate": 1e-3}, 10)
    writers.add_scalars({"train/lm loss": 2.25}, 20)
    writers.close(failed=True)

    client = MlflowClient(tracking_uri=uri)
    run = client.get_run(tracker.run_id)
    assert run.info.run_name == "r1" and run.info.status == "FAILED"
    assert run.data.params["layout.world_size"] == "2" and run.data.params["notes"] == '["a", "b"]'
    assert [(m.step, m.value) for m in client.get_metric_history(tracker.run_id, "train/lm loss")] == [
        (10, 2.5), (20, 2.25)]
    artifacts = tmp_path / "store" / "mlartifacts"  # beside the database, not ./mlruns in the working folder
    (plan_file,) = artifacts.rglob("plan.json")
    assert json.loads(plan_file.read_text()) == config
    assert not (tmp_path / "mlruns").exists()


def test_wandb_without_a_login_is_a_user_error_naming_offline_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no saved key
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("WANDB_MODE", "online")
    with pytest.raises(UserError) as raised:
        WandbTracker(TrackingSettings(wandb_project="p", wandb_save_dir=str(tmp_path / "w")), {})
    assert "--wandb-project p" in str(raised.value) and "WANDB_MODE=offline" in str(raised.value)


def test_writers_open_only_what_the_settings_name(tmp_path):
    assert not Writers.open(LoggingSettings(), {})
    writers = Writers.open(LoggingSettings(tensorboard_dir=str(tmp_path / "tb")), {"a": 1})
    assert len(writers.writers) == 1
    writers.add_scalar("train/lm loss", 1.0, 1)
    writers.close()
    assert list((tmp_path / "tb").glob("events.out.tfevents.*"))


def test_flatten_joins_nested_keys():
    assert flatten({"a": {"b": 1, "c": {"d": None}}, "e": [1]}) == {"a.b": 1, "a.c.d": None, "e": [1]}


def profiled_steps(tmp_path, first_step: int, steps: int = 6) -> tuple[set[str], Profiler]:
    """Run training-like steps first_step..steps-1 under a Profiler over steps [2, 4); the ProfilerStep names
    in its trace."""
    settings = ProfileSettings(True, 2, 4, (0,), str(tmp_path))
    profiler = Profiler(settings, rank=0, device=torch.device("cpu"), first_step=first_step)
    weights = torch.randn(32, 32)
    profiler.step(first_step)
    for completed in range(first_step + 1, steps + 1):
        (weights @ weights).sum()
        profiler.step(completed)
    profiler.close()
    if profiler.trace_path is None:
        return set(), profiler
    events = json.loads(profiler.trace_path.read_text())["traceEvents"]
    return {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}, profiler


def test_profiler_traces_steps_start_to_end(tmp_path):
    names, profiler = profiled_steps(tmp_path, first_step=0)
    assert names == {"ProfilerStep#2", "ProfilerStep#3"}
    assert profiler.trace_path.name.startswith("rank0.steps2-4.") and profiler.trace_path.name.endswith(
        ".pt.trace.json")


def test_profiler_of_a_resumed_run_traces_what_is_left_of_the_window(tmp_path):
    assert profiled_steps(tmp_path / "inside", first_step=3)[0] == {"ProfilerStep#3"}
    names, profiler = profiled_steps(tmp_path / "past", first_step=5)
    assert names == set() and "past --profile-step-end 4" in profiler.note


def test_profiler_does_nothing_on_ranks_not_listed(tmp_path):
    profiler = Profiler(ProfileSettings(True, 0, 2, (1,), str(tmp_path)), 0, torch.device("cpu"), 0)
    for completed in range(4):
        profiler.step(completed)
    assert not profiler.active and profiler.trace_path is None and not list(tmp_path.iterdir())
