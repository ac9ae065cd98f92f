"""``benchmarks/bench_vocab_parallel.py --dry-run`` runs both settings on two processes, so the script cannot rot."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.helpers import ROOT, RUN_TIMEOUT, env


@pytest.mark.slow
@pytest.mark.distributed
def test_dry_run_measures_both_settings_and_they_agree_on_the_loss() -> None:
    run = subprocess.run(
        [sys.executable, "benchmarks/bench_vocab_parallel.py", "--dry-run"],
        cwd=ROOT, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]  # the script asserts the two losses agree
    rows = [line for line in run.stdout.splitlines() if line.startswith(("| replicated", "| split by vocabulary"))]
    assert len(rows) == 2
    assert rows[0].split(" | ")[4] == rows[1].split(" | ")[4]  # the loss column
