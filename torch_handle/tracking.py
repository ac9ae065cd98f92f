"""Experiment trackers (``--config mlflow``, ``--config wandb``): their local store in the run folder, the resolved
config and the checkpoint paths logged to them, and a resumed run (``--ckpt_path last``) continuing the same tracker
run, whose id the run folder keeps in ``tracking.json``.

Lightning's own loggers do the logging (hyperparameters, and every ``self.log`` metric: per-token losses, learning
rates, BLEU/ROUGE); this module only places them and carries their run ids across a resume.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jsonargparse import Namespace
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import Logger, MLFlowLogger, WandbLogger
from lightning_utilities.core.imports import RequirementCache
from typing_extensions import override

from torch_handle.errors import SetupError

RUN_IDS = "tracking.json"
"""The run folder's record of its trackers' run ids: ``{"mlflow": ID, "wandb": ID}``."""
TRACKERS = {  # logger class name: (its key in RUN_IDS and extra, its pip package)
    "MLFlowLogger": ("mlflow", "mlflow"),
    "WandbLogger": ("wandb", "wandb"),
}


def _logger_configs(config: Namespace) -> list[Namespace]:
    logger = config.trainer.logger
    loggers = logger if isinstance(logger, list) else [logger]
    return [item for item in loggers if isinstance(item, Namespace) and "class_path" in item]


def _tracker(item: Namespace) -> str | None:
    return item.class_path.rsplit(".", 1)[-1] if item.class_path.rsplit(".", 1)[-1] in TRACKERS else None


def configure_trackers(config: Namespace, resume: bool) -> None:
    """Checks each tracker's extra is installed, puts its local store in the run folder unless configured elsewhere
    (``MLFLOW_TRACKING_URI``, ``tracking_uri``, ``save_dir``), and on resume hands it the run folder's run id."""
    root = Path(config.trainer.default_root_dir)
    ids = read_run_ids(root) if resume else {}
    for item in _logger_configs(config):
        name = _tracker(item)
        if name is None:
            continue
        key, package = TRACKERS[name]
        if not RequirementCache(package):
            raise SetupError(f"--config {key} needs {package}: pip install 'torch-handle[{key}]'")
        args = item.init_args
        if name == "MLFlowLogger":
            if not args.get("tracking_uri"):
                # MLflow's local store in the run folder: SQLite (MLflow 3 refuses its file store by default).
                args.tracking_uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{root.resolve()}/mlflow.db"
            if args.tracking_uri.startswith("sqlite:") and args.get("artifact_location") is None:
                args.artifact_location = str(root.resolve() / "mlartifacts")
            if ids.get(key) and args.get("run_id") is None:
                args.run_id = ids[key]
        else:
            if args.get("save_dir") in (None, "."):
                args.save_dir = str(root)
            if ids.get(key) and args.get("id") is None:
                args.id = ids[key]
                args.resume = "allow"  # a keyword wandb.init takes: continue that run


def read_run_ids(root: Path) -> dict[str, str]:
    """The run ids :func:`record_run_ids` wrote (none yet: empty); anything but an object of strings is one line."""
    path = root / RUN_IDS
    if not path.is_file():
        return {}
    try:
        ids = json.loads(path.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError):
        ids = None
    if not isinstance(ids, dict) or not all(isinstance(v, str) for v in ids.values()):
        raise SetupError(f"{path} is not a JSON object of tracker run ids (strings): delete it to start new runs")
    return ids


def is_tracker(logger: object) -> bool:
    return isinstance(logger, (MLFlowLogger, WandbLogger))


def trackers(trainer: Trainer) -> list[Logger]:
    return [logger for logger in trainer.loggers if is_tracker(logger)]


def record_run_ids(trainer: Trainer) -> None:
    """Writes each tracker's run id (starting its run) to the run folder, for :func:`configure_trackers` on resume.
    Rank 0 only: the trackers log from there."""
    ids = {}
    for logger in trackers(trainer):
        if isinstance(logger, MLFlowLogger):
            ids["mlflow"] = logger.experiment and logger.run_id
        else:
            ids["wandb"] = logger.experiment.id
    if ids:
        path = Path(trainer.default_root_dir) / RUN_IDS
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**read_run_ids(path.parent), **ids}) + "\n", encoding="utf-8")


def log_checkpoint_paths(trainer: Trainer) -> None:
    """The best and last checkpoints' paths, as tags (MLflow: parameters cannot change on resume) or run summary."""
    callback = trainer.checkpoint_callback
    if callback is None:
        return
    paths = {
        "checkpoint/last": getattr(callback, "last_model_path", ""),
        "checkpoint/best": getattr(callback, "best_model_path", ""),
    }
    paths = {key: os.path.abspath(value) for key, value in paths.items() if value}
    for logger in trackers(trainer):
        if isinstance(logger, MLFlowLogger):
            for key, value in paths.items():
                logger.experiment.set_tag(logger.run_id, key, value)
        else:
            logger.experiment.summary.update(paths)


class SaveConfig(SaveConfigCallback):
    """Lightning's ``config.yaml`` in the log folder, also logged to each tracker as an artifact."""

    @override
    def save_config(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if not trackers(trainer):
            return
        path = Path(trainer.log_dir or trainer.default_root_dir) / self.config_filename
        if not path.is_file():
            self.parser.save(self.config, str(path), skip_none=False, overwrite=True)
        for logger in trackers(trainer):
            if isinstance(logger, MLFlowLogger):
                logger.experiment.log_artifact(logger.run_id, str(path))
            else:
                logger.experiment.save(str(path), base_path=str(path.parent), policy="now")
