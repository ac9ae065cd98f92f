"""``--config ema``: the average differs from the raw weights, is what test, export and ``load`` read, and a run
resumed from a checkpoint ends with the same average and weights as an uninterrupted one."""

from __future__ import annotations

from pathlib import Path
from unittest.mock import Mock

import pytest
import torch
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.strategies import DDPStrategy, DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy

from tests.helpers import check, cli, fit_args
from torch_handle.callbacks.ema import EMA
from torch_handle.errors import SetupError
from torch_handle.export import MODEL_PREFIX, read_checkpoint

STEPS, RESUME_STEP = 6, 4
EMA_ARGS = ["--config", "ema", "--trainer.callbacks.init_args.decay", "0.5"]  # a short run moves a 0.5 average


def ema_fit(root: Path, *extra: str) -> dict:
    """The ``last.ckpt`` of a tiny EMA run of :data:`STEPS` steps, saved when training ends (the schedule saves at
    :data:`RESUME_STEP` only)."""
    schedule = ["--trainer.max_steps", str(STEPS), "--checkpoint.every_n_train_steps", str(RESUME_STEP)]
    check(cli(["fit", *EMA_ARGS, *fit_args(root, *schedule, *extra)[1:]]))
    return torch.load(root / "checkpoints" / "last.ckpt", weights_only=True)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ema_is_saved_evaluated_and_resumed(tmp_path: Path) -> None:
    whole = ema_fit(tmp_path / "whole", "--checkpoint.save_top_k", "-1")
    assert whole["averaging_state"]["n_averaged"].item() == STEPS
    # The raw weights are kept: last.ckpt, saved after WeightAveraging's on_train_end, resumes from them.
    differs = [name for name, value in whole["state_dict"].items() if value.is_floating_point()]
    assert any(not torch.equal(whole["state_dict"][name], whole["current_model_state"][name]) for name in differs)
    weights, _, _ = read_checkpoint(tmp_path / "whole" / "checkpoints" / "last.ckpt")  # test, export and load
    for name, value in weights.items():
        torch.testing.assert_close(value, whole["state_dict"][MODEL_PREFIX + name].float(), rtol=0, atol=0)

    checkpoint = tmp_path / "whole" / "checkpoints" / f"epoch=0-step={RESUME_STEP}.ckpt"
    assert torch.load(checkpoint, weights_only=True)["averaging_state"]["n_averaged"].item() == RESUME_STEP
    resumed = ema_fit(tmp_path / "resumed", "--checkpoint.save_top_k", "-1", "--ckpt_path", str(checkpoint))
    assert resumed["averaging_state"]["n_averaged"].item() == STEPS  # the average went on, not restarted
    for key in ("state_dict", "current_model_state"):
        for name, value in whole[key].items():
            torch.testing.assert_close(resumed[key][name], value, rtol=0, atol=1e-6, msg=f"{key} {name}")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ema_leaves_training_untouched(tmp_path: Path) -> None:
    """An EMA run's trained weights are those of the same fit without ``--config ema``: what ``average --trained``
    and ``benchmarks/bench_averaging.py`` compare as the plain run (validation runs on the average, then swaps back)."""
    ema = ema_fit(tmp_path / "ema", "--trainer.val_check_interval", "2")
    schedule = ["--trainer.max_steps", str(STEPS), "--checkpoint.every_n_train_steps", str(RESUME_STEP)]
    check(cli(fit_args(tmp_path / "plain", *schedule, "--trainer.val_check_interval", "2")))
    plain = torch.load(tmp_path / "plain" / "checkpoints" / "last.ckpt", weights_only=True)["state_dict"]
    assert plain.keys() == ema["current_model_state"].keys()
    for name, value in plain.items():
        torch.testing.assert_close(ema["current_model_state"][name], value, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("strategy", [DeepSpeedStrategy, FSDPStrategy, ModelParallelStrategy])
def test_ema_refuses_strategies_it_cannot_average(strategy: type) -> None:
    trainer = Mock(strategy=Mock(spec=strategy))
    with pytest.raises(SetupError, match=rf"^--config ema cannot average under {strategy.__name__} \(.*ddp$"):
        EMA().setup(trainer, Mock(), "fit")


def test_ema_averages_under_ddp() -> None:
    module = BoringModel()
    callback = EMA(decay=0.5)
    callback.setup(Mock(strategy=Mock(spec=DDPStrategy)), module, "fit")
    assert callback._average_model is not None


def test_ema_rejects_a_bad_decay() -> None:
    with pytest.raises(SetupError, match=r"decay must lie in \[0, 1\]"):
        EMA(decay=1.5)
