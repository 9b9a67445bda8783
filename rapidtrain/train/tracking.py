"""Where a run's scalars go besides the console: TensorBoard, Weights & Biases and MLflow, behind one interface.

The loop opens one `Writers` on the logging rank (an empty one elsewhere) and hands it each log line's scalars
and evaluation results; each writer also receives the plan once, as the run's config.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse

from rapidtrain.config.settings import LoggingSettings, TrackingSettings
from rapidtrain.core.errors import UserError
from rapidtrain.core.metrics import TensorBoardWriter


class ScalarWriter(Protocol):
    """What the loop asks of a writer."""

    def add_config(self, config: Mapping[str, Any]) -> None: ...
    def add_scalars(self, values: Mapping[str, float], step: int) -> None: ...
    def flush(self) -> None: ...
    def close(self, failed: bool = False) -> None: ...


def flatten(config: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"layout": {"world_size": 2}} → {"layout.world_size": 2}: trackers whose config is a flat table."""
    flat: dict[str, Any] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(flatten(value, name + "."))
        else:
            flat[name] = value
    return flat


class TensorBoardTracker:
    """TensorBoard's scalars, and the plan as a text entry (JSON in a code block)."""

    def __init__(self, log_dir: str, max_queue: int = 10) -> None:
        self.writer = TensorBoardWriter(log_dir, max_queue=max_queue)

    def add_config(self, config: Mapping[str, Any]) -> None:
        text = json.dumps(config, indent=1, default=str)
        self.writer.add_text("plan", "    " + text.replace("\n", "\n    "))  # indented: Markdown's code block

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        self.writer.add_scalars(values, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, failed: bool = False) -> None:
        self.writer.close()


class WandbTracker:
    """A Weights & Biases run (Megatron's --wandb-* flags); WANDB_MODE=offline keeps it on disk."""

    def __init__(self, settings: TrackingSettings, config: Mapping[str, Any]) -> None:
        try:
            import wandb
        except ImportError:
            raise UserError(f"--wandb-project {settings.wandb_project} needs the `wandb` package: "
                            "`pip install 'rapidtrain[tracking]'` (or `pip install wandb`), or drop the "
                            "flag.") from None
        save_dir = settings.wandb_save_dir
        if save_dir:
            Path(save_dir).mkdir(parents=True, exist_ok=True)
        try:
            self.run = wandb.init(project=settings.wandb_project, name=settings.wandb_exp_name, dir=save_dir,
                                  config=dict(config))
        except Exception as error:  # wandb raises its own errors (no login, no network) and UsageError
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            raise UserError(
                f"--wandb-project {settings.wandb_project}: Weights & Biases could not start a run ({first}). "
                "Log in (`wandb login`, or set WANDB_API_KEY), or set WANDB_MODE=offline to keep the run on disk "
                f"under {save_dir or './wandb'} (`wandb sync` uploads it later).") from None

    def add_config(self, config: Mapping[str, Any]) -> None:
        pass  # given to wandb.init, where W&B expects it

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        self.run.log(dict(values), step=step)

    def flush(self) -> None:
        pass  # W&B's service process writes continuously

    def close(self, failed: bool = False) -> None:
        self.run.finish(exit_code=1 if failed else 0)


def _is_file_store(uri: str) -> bool:
    scheme = urlparse(uri).scheme
    return scheme in ("", "file") or (len(scheme) == 1 and os.name == "nt")  # "C:\\runs" on Windows


def _artifact_location(uri: str) -> str | None:
    """For a SQLite store, artifacts beside the database file (MLflow's default would be ./mlruns in the working
    folder); a file store keeps them inside itself and a server decides its own."""
    if uri.startswith("sqlite:///"):
        return str(Path(uri.removeprefix("sqlite:///")).resolve().parent / "mlartifacts")
    return None


class MlflowTracker:
    """An MLflow run through MlflowClient (no global state): metrics by step, the plan as params and plan.json."""

    def __init__(self, settings: TrackingSettings, config: Mapping[str, Any]) -> None:
        try:
            from mlflow import MlflowClient
        except ImportError:
            raise UserError(f"--mlflow-experiment {settings.mlflow_experiment} needs MLflow: "
                            "`pip install 'rapidtrain[tracking]'` (or `pip install mlflow-skinny`), or drop the "
                            "flag.") from None
        from mlflow.exceptions import MlflowException

        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or None
        if uri and _is_file_store(uri):
            # MLflow 3 keeps the file store in maintenance mode and refuses it unless this is set; naming a
            # file store (--mlflow-tracking-uri DIR or file:DIR) is the explicit choice it asks for.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
            uri = Path(uri.removeprefix("file:")).resolve().as_uri()
        if uri and uri.startswith("sqlite:///"):
            Path(uri.removeprefix("sqlite:///")).resolve().parent.mkdir(parents=True, exist_ok=True)
        try:
            self.client = MlflowClient(tracking_uri=uri)
            assert settings.mlflow_experiment is not None  # Writers opens this tracker only for the flag
            experiment = self.client.get_experiment_by_name(settings.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment is not None else self.client.create_experiment(
                settings.mlflow_experiment, artifact_location=_artifact_location(self.client.tracking_uri)))
            self.run_id = self.client.create_run(experiment_id, run_name=settings.mlflow_run_name).info.run_id
        except MlflowException as error:
            raise UserError(f"--mlflow-experiment {settings.mlflow_experiment} at {uri or 'the default store'}: "
                            f"MLflow could not start a run ({error.message.splitlines()[0]}). Check "
                            "--mlflow-tracking-uri (a folder, file:DIR, sqlite:///FILE.db or a server).") from None
        self.tracking_uri = self.client.tracking_uri

    def add_config(self, config: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        flat = flatten(config)
        params = [Param(key[:250], json.dumps(value, default=str)[:6000]) for key, value in flat.items()]
        for start in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[start:start + 100])
        self.client.log_dict(self.run_id, dict(config), "plan.json")

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(key, float(value), now, step) for key, value in values.items()]
        self.client.log_batch(self.run_id, metrics=metrics)

    def flush(self) -> None:
        pass  # every log_batch is written when it returns

    def close(self, failed: bool = False) -> None:
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")


class Writers:
    """The run's writers as one: each call goes to every writer. Empty on ranks that do not log."""

    def __init__(self, writers: list[ScalarWriter] | None = None) -> None:
        self.writers = list(writers or [])

    @classmethod
    def open(cls, settings: LoggingSettings, config: Mapping[str, Any]) -> Writers:
        """The writers `settings` ask for, each handed `config` (the plan) once. A writer that cannot start
        raises UserError after the ones already open are closed."""
        opened = cls()
        tracking = settings.tracking
        try:
            if settings.tensorboard_dir:
                opened.writers.append(TensorBoardTracker(settings.tensorboard_dir, settings.tensorboard_queue_size))
            if tracking is not None and tracking.wandb_project:
                opened.writers.append(WandbTracker(tracking, config))
            if tracking is not None and tracking.mlflow_experiment:
                opened.writers.append(MlflowTracker(tracking, config))
        except BaseException:
            opened.close(failed=True)
            raise
        for writer in opened.writers:
            writer.add_config(config)
        return opened

    def __bool__(self) -> bool:
        return bool(self.writers)

    def add_scalars(self, values: Mapping[str, float], step: int) -> None:
        if values:
            for writer in self.writers:
                writer.add_scalars(values, step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.add_scalars({tag: value}, step)

    def flush(self) -> None:
        for writer in self.writers:
            writer.flush()

    def close(self, failed: bool = False) -> None:
        writers, self.writers = self.writers, []
        for writer in writers:
            writer.close(failed)
