"""``--config mlflow`` and ``--config wandb``: a tiny run and its resume, read back from MLflow's store and the
W&B offline folder, log to one tracker run; a missing extra is one line."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from jsonargparse import Namespace

from tests.helpers import TINY, check, cli, free_port
from torch_handle import tracking
from torch_handle.errors import SetupError

FIRST_STEPS, LAST_STEPS = 3, 6


def tracked_fit(config: str, root: Path, steps: int, *extra: str, **extra_env: str) -> None:
    at = TINY.index("--trainer.logger")
    tiny = TINY[:at] + TINY[at + 2 :]  # the tracker config names the logger
    args = ["fit", "--config", "demo", "--config", config, *tiny, "--trainer.default_root_dir", str(root)]
    check(cli([*args, "--trainer.max_steps", str(steps), "--trainer.log_every_n_steps", "1", *extra], **extra_env))


def logger_config(root: Path, name: str, **init_args: str) -> Namespace:
    logger = Namespace(class_path=f"lightning.pytorch.loggers.{name}", init_args=Namespace(**init_args))
    return Namespace(trainer=Namespace(default_root_dir=str(root), logger=logger))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mlflow_resume_continues_the_same_run(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    tracked_fit("mlflow", tmp_path, FIRST_STEPS)
    tracked_fit("mlflow", tmp_path, LAST_STEPS, "--ckpt_path", "last")
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    (run,) = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
    assert json.loads((tmp_path / tracking.RUN_IDS).read_text()) == {"mlflow": run.info.run_id}
    steps = [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(LAST_STEPS))  # the resumed run's steps follow the first run's, none twice
    assert run.data.params["transformer/d_model"] == "32" and run.data.params["lr"] == "0.01"
    assert client.get_metric_history(run.info.run_id, "lr/decay")
    assert "config.yaml" in [artifact.path for artifact in client.list_artifacts(run.info.run_id)]
    assert run.data.tags["checkpoint/last"] == str(tmp_path / "checkpoints" / "last.ckpt")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_mlflow_server_named_by_mlflow_tracking_uri(tmp_path: Path) -> None:
    from mlflow.tracking import MlflowClient

    url = f"http://127.0.0.1:{free_port()}"
    store, artifacts = f"sqlite:///{tmp_path}/server.db", str(tmp_path / "served-artifacts")
    command = [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", store, "--workers", "1"]
    host, port = url.removeprefix("http://").split(":")
    with (tmp_path / "server.log").open("w") as log:
        server = subprocess.Popen(
            [*command, "--artifacts-destination", artifacts, "--host", host, "--port", port], stdout=log, stderr=log
        )
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=5):
                    break
            except OSError:
                assert server.poll() is None and time.monotonic() < deadline, (tmp_path / "server.log").read_text()
                time.sleep(0.5)
        tracked_fit("mlflow", tmp_path / "run", FIRST_STEPS, MLFLOW_TRACKING_URI=url)
        client = MlflowClient(url)
        (run,) = client.search_runs([experiment.experiment_id for experiment in client.search_experiments()])
        steps = [metric.step for metric in client.get_metric_history(run.info.run_id, "train/loss")]
        assert steps == list(range(FIRST_STEPS))
        assert "config.yaml" in [artifact.path for artifact in client.list_artifacts(run.info.run_id)]
        assert not (tmp_path / "run" / "mlflow.db").exists()  # nothing in the local store
    finally:
        server.terminate()
        server.wait(timeout=30)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_wandb_offline_resume_continues_the_same_run(tmp_path: Path) -> None:
    tracked_fit("wandb", tmp_path, FIRST_STEPS, WANDB_MODE="offline")
    tracked_fit("wandb", tmp_path, LAST_STEPS, "--ckpt_path", "last", WANDB_MODE="offline")
    run_id = json.loads((tmp_path / tracking.RUN_IDS).read_text())["wandb"]
    runs = sorted((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and all(run.name.endswith(f"-{run_id}") for run in runs)
    assert (runs[0] / "files" / "config.yaml").is_file()


def test_resume_hands_back_the_recorded_run_ids(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (tmp_path / tracking.RUN_IDS).write_text(json.dumps({"mlflow": "abc", "wandb": "xyz"}))
    mlflow, wandb = logger_config(tmp_path, "MLFlowLogger"), logger_config(tmp_path, "WandbLogger", save_dir=".")
    tracking.configure_trackers(mlflow, resume=True)
    tracking.configure_trackers(wandb, resume=True)
    assert mlflow.trainer.logger.init_args.run_id == "abc"
    assert mlflow.trainer.logger.init_args.tracking_uri == f"sqlite:///{tmp_path.resolve()}/mlflow.db"
    assert (wandb.trainer.logger.init_args.id, wandb.trainer.logger.init_args.resume) == ("xyz", "allow")
    assert wandb.trainer.logger.init_args.save_dir == str(tmp_path)
    fresh = logger_config(tmp_path, "MLFlowLogger")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:5000")
    tracking.configure_trackers(fresh, resume=False)
    assert fresh.trainer.logger.init_args.get("run_id") is None
    assert fresh.trainer.logger.init_args.tracking_uri == "http://127.0.0.1:5000"


@pytest.mark.parametrize("text", ['["abc"]', '{"mlflow": 3}', "{not json"])
def test_a_malformed_run_ids_file_is_one_line(text: str, tmp_path: Path) -> None:
    (tmp_path / tracking.RUN_IDS).write_text(text)
    with pytest.raises(SetupError) as error:
        tracking.configure_trackers(logger_config(tmp_path, "MLFlowLogger"), resume=True)
    assert str(error.value) == (
        f"{tmp_path / tracking.RUN_IDS} is not a JSON object of tracker run ids (strings): delete it to start new runs"
    )


@pytest.mark.parametrize(("logger", "extra"), [("MLFlowLogger", "mlflow"), ("WandbLogger", "wandb")])
def test_missing_extra_is_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, logger: str, extra: str) -> None:
    monkeypatch.setattr(tracking, "RequirementCache", lambda package: False)
    with pytest.raises(SetupError, match=rf"^--config {extra} needs {extra}: pip install 'torch-handle\[{extra}\]'$"):
        tracking.configure_trackers(logger_config(tmp_path, logger), resume=False)
