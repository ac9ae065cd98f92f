"""Precision is configuration: ``--trainer.precision`` on two CPU processes, with DDP and with DeepSpeed ZeRO-2.

On CPU, ``bf16-mixed`` trains under ``torch.autocast("cpu", torch.bfloat16)`` with DDP and with DeepSpeed's
bf16 mode. ``16-mixed`` (fp16 with loss scaling) has no CPU kernels in either: Lightning replaces it by
``bf16-mixed`` for its own precision plugin, with a warning, and DeepSpeed's CPU accelerator refuses fp16.
"""

from __future__ import annotations

import math
import subprocess
from pathlib import Path

import pytest
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

from tests.helpers import STRATEGY_CONFIGS, check, cli, fit_args, train_losses

STEPS = 2


def run(strategy: str, precision: str, root: Path) -> subprocess.CompletedProcess:
    """A 2-step run of the tiny model; ``--trainer.precision`` follows the strategy config, which sets 32-true."""
    return cli(
        fit_args(
            root,
            "--config", STRATEGY_CONFIGS[strategy],
            "--trainer.accelerator", "cpu",
            "--trainer.precision", precision,
            "--trainer.max_steps", str(STEPS),
        )
    )  # fmt: skip


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("strategy", ["ddp", "zero2"])
def test_bf16_mixed_trains(strategy: str, tmp_path: Path) -> None:
    check(run(strategy, "bf16-mixed", tmp_path))
    losses = train_losses(tmp_path)
    assert list(losses) == list(range(2 * STEPS))  # two ranks, one batch each per step
    assert all(math.isfinite(loss) for loss in losses.values()), losses
    assert (tmp_path / "checkpoints" / "last.ckpt").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_16_mixed_on_cpu_with_ddp_falls_back_to_bf16(tmp_path: Path) -> None:
    result = check(run("ddp", "16-mixed", tmp_path))
    assert "AMP with fp16 is not supported on CPU. Using `precision='bf16-mixed'` instead." in result.stderr
    assert all(math.isfinite(loss) for loss in train_losses(tmp_path).values())


@pytest.mark.slow
@pytest.mark.distributed
def test_16_mixed_on_cpu_with_deepspeed_is_a_one_line_error(tmp_path: Path) -> None:
    if CPU_Accelerator().is_fp16_supported():
        pytest.skip("this CPU has fp16 kernels (AMX-FP16 / AVX512-FP16): DeepSpeed trains in fp16")
    result = run("zero2", "16-mixed", tmp_path)
    assert result.returncode != 0
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert errors == [
        "error: trainer.precision=16-mixed: DeepSpeed has no fp16 kernels on this CPU; use bf16-mixed or 32-true"
    ], result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "checkpoints").exists()
