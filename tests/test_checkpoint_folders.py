"""Folders of shards (tensor parallelism here; ZeRO, FSDP and pipelines in tests/test_matrix.py) read by any strategy
for evaluation, with the architecture they hold, and refused in one line by a strategy that cannot resume them."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.helpers import check, cli, fit_args

DATA = ["--data.init_args.demo_size", "400", "--data.init_args.bpe_vocab_size", "300"]  # as tests.helpers.TINY


@pytest.fixture(scope="module")
def tp_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo stacked with tp.yaml, the tiny model on two processes: ``checkpoints/last.ckpt`` is a folder."""
    root = tmp_path_factory.mktemp("tp-folder")
    check(cli(fit_args(root, "--config", "configs/tp.yaml", "--trainer.accelerator", "cpu", "--trainer.max_steps=3")))
    assert (root / "checkpoints" / "last.ckpt").is_dir()
    return root


def _test_loss(root: Path, logs: Path, *config: str) -> float:
    """``test --config configs/demo.yaml CONFIG`` of the run's last checkpoint, no model option given: its loss."""
    logger = ["--trainer.logger", "lightning.pytorch.loggers.CSVLogger", "--trainer.logger.save_dir", str(logs)]
    args = ["test", "--config", "configs/demo.yaml", *config, *DATA, "--model.num_beams", "1"]
    check(cli([*args, "--trainer.default_root_dir", str(root), "--trainer.enable_progress_bar", "false", *logger]))
    (metrics,) = logs.rglob("metrics.csv")
    with metrics.open() as f:
        return next(float(row["test/loss"]) for row in csv.DictReader(f) if row.get("test/loss"))


@pytest.mark.slow
@pytest.mark.distributed
def test_a_tensor_parallel_folder_is_tested_on_one_device_as_by_its_strategy(tp_folder: Path, tmp_path: Path) -> None:
    """One device (the default strategy) reads the folder's merged weights and the architecture it holds (no
    ``--model.transformer.*`` given: the demo config's own sizes differ), and scores as tp.yaml's two processes do."""
    own = _test_loss(tp_folder, tmp_path / "tp", "--config", "configs/tp.yaml")
    one_device = _test_loss(tp_folder, tmp_path / "one", "--trainer.devices", "1")
    assert one_device == pytest.approx(own, rel=1e-5)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_folder_that_the_strategy_cannot_resume_is_one_line(tp_folder: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in tp_folder.rglob("*")}
    run = cli(fit_args(tp_folder, "--config", "configs/ddp.yaml", "--trainer.max_steps", "6", "--ckpt_path", "last"))
    assert run.returncode != 0 and run.stderr.strip().splitlines()[-1] == (
        f"error: {tp_folder / 'checkpoints' / 'last.ckpt'} is a checkpoint folder of ModelParallelStrategy, which "
        "DDPStrategy cannot resume: resume it with the strategy config that wrote it (test, predict and export read "
        "it with any)"
    )
    assert {p: p.stat().st_mtime_ns for p in tp_folder.rglob("*")} == before
