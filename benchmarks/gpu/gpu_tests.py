"""``gpu_tests``: ``pytest -m gpu`` (bf16 attention kernels against naive, bf16 gradients, the pretrained families'
parity with transformers in bf16); on a CPU they skip."""

from __future__ import annotations

import re
import subprocess
import sys
from typing import Any

from gpu.setting import ROOT, Setting, result_table

TESTS = ["tests/test_gpu.py", "tests/test_gpu_pretrained.py"]  # the latter skips without transformers (.whl)


def gpu_tests(setting: Setting) -> dict[str, Any]:
    """``pytest -m gpu``: its closing line, and the tests that failed."""
    workers = ["-n", "0"] if setting.dry_run else []  # on a CPU every test skips: one process collects them
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", *workers, *TESTS],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(run.stdout, run.stderr)  # into the step's log: the failures in full
    lines = run.stdout.splitlines()
    summary = next(line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|skipped|failed)", line))
    failed = [line.split()[1] for line in lines if line.startswith("FAILED")]
    rows = [[summary, ", ".join(failed) or "none"]]
    return {"ok": run.returncode == 0, "tables": [result_table("`pytest -m gpu`", ["result", "failed"], rows)]}
