"""``benchmarks/bench_zero_host.py --dry-run`` runs its five settings, so the script cannot rot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, RUN_TIMEOUT, env


@pytest.mark.slow
@pytest.mark.distributed
def test_dry_run_measures_ddp_zero2_and_zero3_as_shipped_and_as_deepspeed_defaults() -> None:
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_zero_host.py", "--dry-run"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = [line.split(" | ") for line in run.stdout.splitlines() if line.startswith(("| DDP", "| ZeRO-"))]
    assert [row[0] for row in rows] == ["| DDP", "| ZeRO-2 as shipped: no overflow check in bf16"] + [
        "| ZeRO-2 with DeepSpeed's default check_grad_overflow: true",
        "| ZeRO-3 as shipped: each layer one unit",
        "| ZeRO-3 with DeepSpeed's default hooks on every submodule",
    ]
    assert rows[0][3] == "1.00 |" and all(float(row[1]) > 0 for row in rows)
