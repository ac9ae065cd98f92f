"""``benchmarks/bench_averaging.py --dry-run``: one EMA fit keeping every epoch's checkpoint gives the four
candidates, the averages are of the trained weights (not of their EMA), and test is scored for three."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, RUN_TIMEOUT, env

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_averaging import EMA_ROW, TRAINED_ROW  # noqa: E402


@pytest.mark.slow
def test_dry_run_averages_the_trained_weights_and_scores_test_for_three(shared_data: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_averaging.py"), "--data", str(shared_data / "multi30k")]
    command += ["--run", "run", "--threads", "1", "--dry-run"]
    run = subprocess.run(command, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| [\d.]+ \| [\d.]+ \| (.+?) \|", run.stdout, re.M)
    averages = [f"average of the last {n} epochs' trained weights" for n in (2, 3)]
    assert [name for name, _ in rows] == [TRAINED_ROW, EMA_ROW, *averages], run.stdout
    assert sum(not test.startswith("not scored") for _, test in rows) == 3
    folder = tmp_path / "run" / "checkpoints"
    epochs = [torch.load(path, weights_only=True) for path in sorted(folder.glob("epoch=*.ckpt"))]
    assert len(epochs) == 3 and all(e["state_dict"].keys() == e["current_model_state"].keys() for e in epochs)
    trained = torch.load(folder / "trained" / "last.ckpt", weights_only=True)["state_dict"]
    averaged = torch.load(folder / "trained" / "averaged-3.ckpt", weights_only=True)["state_dict"]
    for name, weights in epochs[-1]["current_model_state"].items():
        assert torch.equal(trained[name], weights)
        if weights.is_floating_point():  # the mean of the trained weights, as average sums it
            mean = sum(e["current_model_state"][name].double() for e in epochs) / 3
            assert torch.equal(averaged[name], mean.to(weights.dtype))
    assert any(not torch.equal(epochs[-1]["state_dict"][name], w) for name, w in trained.items())  # not the EMA
