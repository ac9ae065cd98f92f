"""``torch-handle average``: the mean of checkpoints' weights, one error line for two architectures, and the averaged
checkpoint through ``test``, ``export`` and ``load``."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import check, cli
from torch_handle.average import last_checkpoints, write_average
from torch_handle.cli import command

ROOT = Path(__file__).resolve().parents[1]


def _checkpoint(path: Path, step: int, shape: tuple[int, int] = (4, 3), seed: int = 0) -> dict[str, torch.Tensor]:
    """A Lightning-shaped checkpoint of random float32 and bfloat16 weights, an integer buffer and optimizer state."""
    generator = torch.Generator().manual_seed(seed)
    weights = {
        "model.w": torch.randn(shape, generator=generator),
        "model.h": torch.randn(5, generator=generator).bfloat16(),
        "model.count": torch.tensor([3, 1]),
    }
    state = {"state_dict": weights, "global_step": step, "epoch": step // 10, "optimizer_states": [{"step": step}]}
    torch.save(state, path)
    return weights


def test_the_average_of_two_checkpoints_is_the_mean_of_their_tensors(tmp_path: Path) -> None:
    a = _checkpoint(tmp_path / "a.ckpt", step=10, seed=1)
    b = _checkpoint(tmp_path / "b.ckpt", step=20, seed=2)
    write_average([tmp_path / "a.ckpt", tmp_path / "b.ckpt"], tmp_path / "out" / "avg.ckpt")
    averaged = torch.load(tmp_path / "out" / "avg.ckpt", weights_only=True)
    torch.testing.assert_close(averaged["state_dict"]["model.w"], (a["model.w"] + b["model.w"]) / 2, rtol=0, atol=0)
    want_h = ((a["model.h"].double() + b["model.h"].double()) / 2).bfloat16()
    assert averaged["state_dict"]["model.h"].dtype == torch.bfloat16
    torch.testing.assert_close(averaged["state_dict"]["model.h"], want_h, rtol=0, atol=0)
    assert torch.equal(averaged["state_dict"]["model.count"], a["model.count"])
    assert not torch.equal(a["model.w"], b["model.w"])
    assert averaged["global_step"] == 20 and "optimizer_states" not in averaged  # the newest's fields, no optimizer


@pytest.mark.parametrize(
    ("shape", "name", "line"),
    [
        ((5, 3), "model.w", "model.w is (4, 3) in {a} but (5, 3) in {b}: average checkpoints of one run"),
        (None, "model.extra", "{b} holds the tensor model.extra, which {a} lacks: average checkpoints of one run"),
    ],
)
def test_a_mismatched_pair_is_one_line_and_a_failure(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    shape: tuple[int, int] | None,
    name: str,
    line: str,
) -> None:
    a, b = tmp_path / "a.ckpt", tmp_path / "b.ckpt"
    _checkpoint(a, step=10)
    weights = _checkpoint(b, step=20, shape=shape or (4, 3))
    if shape is None:
        torch.save({"state_dict": {**weights, name: torch.zeros(2)}, "global_step": 20}, b)
    monkeypatch.setattr(sys, "argv", ["torch-handle", "average", str(a), str(b), "--out", str(tmp_path / "avg.ckpt")])
    with pytest.raises(SystemExit) as exited:
        command()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.splitlines() == [f"error: {line.format(a=a, b=b)} (one architecture)"]
    assert not (tmp_path / "avg.ckpt").exists()


def test_last_n_takes_the_highest_steps_and_last_ckpt_once(tmp_path: Path) -> None:
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for step in (10, 20, 30):
        _checkpoint(folder / f"epoch={step // 10}-step={step}.ckpt", step=step)
    shutil.copyfile(folder / "epoch=3-step=30.ckpt", folder / "last.ckpt")
    assert last_checkpoints(tmp_path / "run", 2) == [folder / "epoch=2-step=20.ckpt", folder / "epoch=3-step=30.ckpt"]
    _checkpoint(folder / "last.ckpt", step=40)  # training went on past the last named save
    assert last_checkpoints(folder, 2) == [folder / "epoch=3-step=30.ckpt", folder / "last.ckpt"]
    with pytest.raises(ValueError, match=r"holds 4 checkpoints of distinct steps: keep more while training"):
        last_checkpoints(tmp_path / "run", 5)


def test_last_n_skips_an_earlier_average_and_the_average_holds_no_resume_state(tmp_path: Path) -> None:
    """``--last N --out RUN/checkpoints/averaged.ckpt`` twice: the second run averages the same inputs, not the first
    average (same newest step, sorted first); callbacks' state and an EMA run's raw weights are resume state, not
    written."""
    folder = tmp_path / "run" / "checkpoints"
    folder.mkdir(parents=True)
    for step in (10, 20):
        _checkpoint(folder / f"epoch={step // 10}-step={step}.ckpt", step=step, seed=step)
    state = torch.load(folder / "epoch=2-step=20.ckpt", weights_only=True)
    ema = {"current_model_state": state["state_dict"], "averaging_state": {"n_averaged": torch.tensor(20)}}
    torch.save(state | ema | {"callbacks": {"EMA": {}}, "loops": {}}, folder / "epoch=2-step=20.ckpt")
    inputs = [folder / "epoch=1-step=10.ckpt", folder / "epoch=2-step=20.ckpt"]
    assert last_checkpoints(folder, 2) == inputs
    write_average(inputs, folder / "averaged.ckpt")
    assert last_checkpoints(folder, 2) == inputs
    averaged = torch.load(folder / "averaged.ckpt", weights_only=True)
    assert averaged["global_step"] == 20
    assert not {"callbacks", "loops", "optimizer_states", "current_model_state", "averaging_state"} & averaged.keys()


def test_trained_averages_an_ema_runs_trained_weights_and_refuses_other_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--trained`` reads each checkpoint's ``current_model_state`` (where EMA keeps the trained weights) instead of
    its ``state_dict`` (the EMA); a checkpoint without it is one line naming it."""
    trained = []
    for step in (10, 20):
        ema = _checkpoint(tmp_path / f"{step}.ckpt", step=step, seed=step)
        trained.append({name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in ema.items()})
        state = torch.load(tmp_path / f"{step}.ckpt", weights_only=True)
        torch.save(state | {"current_model_state": trained[-1]}, tmp_path / f"{step}.ckpt")
    argv = ["torch-handle", "average", str(tmp_path / "10.ckpt"), str(tmp_path / "20.ckpt"), "--trained"]
    monkeypatch.setattr(sys, "argv", [*argv, "--out", str(tmp_path / "avg.ckpt")])
    command()
    averaged = torch.load(tmp_path / "avg.ckpt", weights_only=True)["state_dict"]
    torch.testing.assert_close(averaged["model.w"], (trained[0]["model.w"] + trained[1]["model.w"]) / 2, rtol=0, atol=0)
    _checkpoint(tmp_path / "plain.ckpt", step=30)
    monkeypatch.setattr(sys, "argv", [*argv[:2], str(tmp_path / "plain.ckpt"), "--trained", "--out", "x.ckpt"])
    with pytest.raises(SystemExit) as exited:
        command()
    assert exited.value.code == 1
    assert capsys.readouterr().err.splitlines() == [
        f"error: {tmp_path / 'plain.ckpt'} holds no trained weights apart from its average (current_model_state): it "
        "is not from a run with --config ema; average it without --trained"
    ]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_averaged_checkpoint_tests_exports_and_loads(tiny_demo_run: Path, tmp_path: Path) -> None:
    import torch_handle

    run = tmp_path / "run"
    shutil.copytree(tiny_demo_run / "checkpoints", run / "checkpoints")
    for stale in (run / "checkpoints").glob("*.ckpt"):
        if stale.name != "last.ckpt":
            stale.unlink()
    last = torch.load(run / "checkpoints" / "last.ckpt", weights_only=True)
    shifted = {k: v + 0.01 if v.is_floating_point() else v for k, v in last["state_dict"].items()}
    torch.save({**last, "state_dict": shifted, "global_step": last["global_step"] + 1}, run / "checkpoints" / "b.ckpt")
    out = tmp_path / "averaged" / "avg.ckpt"
    check(cli(["average", str(run), "--last", "2", "--out", str(out)]))

    loaded = torch_handle.load(out)
    want = {k.removeprefix("model."): (v + shifted[k]) / 2 for k, v in last["state_dict"].items()}
    for name, tensor in loaded.model.state_dict().items():
        torch.testing.assert_close(tensor, want[name].float())
    args = ["--config=demo", f"--trainer.default_root_dir={run}", "--trainer.limit_test_batches=2"]
    tested = check(cli(["test", *args, f"--ckpt_path={out}"]))
    assert f"checkpoint: {out}" in tested.stdout and "BLEU " in tested.stdout
    check(cli(["export", str(out), str(tmp_path / "avg.safetensors")]))
    assert torch_handle.load(tmp_path / "avg.safetensors").translate("a dog") == loaded.translate("a dog")
