"""configs/slurm.sbatch on one node of two tasks, under a stand-in for srun and scontrol: preempted, requeued, resumed.

The stand-in srun starts ``SLURM_NTASKS`` copies of the command with the variables Slurm's srun gives each task, so
Lightning's own ``SLURMEnvironment`` (not its process launcher) sets the ranks, as on a cluster; scontrol records
what it is asked.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from tests.fault_injection import TERM_AT
from tests.helpers import ROOT, RUN_TIMEOUT, check, cli, env
from tests.test_resume import batches_run, demo_args, weights

SRUN = """#!/usr/bin/env bash
# srun on one node: SLURM_NTASKS tasks, each with its rank; exits with the highest task status, as srun does
pids=()
for ((rank = 0; rank < SLURM_NTASKS; rank++)); do
  SLURM_PROCID=$rank SLURM_LOCALID=$rank SLURM_NODEID=0 "$@" &
  pids+=($!)
done
status=0
for pid in "${pids[@]}"; do
  wait "$pid"
  code=$?
  ((code > status)) && status=$code
done
exit $status
"""
SCONTROL = """#!/usr/bin/env bash
echo "$@" >> "$SCONTROL_LOG"
"""


def _allocation(tmp_path: Path, args: list[str], **extra: str) -> subprocess.CompletedProcess:
    """``bash configs/slurm.sbatch ARGS`` as SLURM runs it in job 4242 of 1 node x 2 tasks."""
    bin_dir = tmp_path / "bin"
    if not bin_dir.exists():
        bin_dir.mkdir()
        for name, text in (("srun", SRUN), ("scontrol", SCONTROL)):
            (bin_dir / name).write_text(text)
            (bin_dir / name).chmod(0o755)
    slurm = {
        "SLURM_JOB_ID": "4242",
        "SLURM_JOB_NAME": "torch-handle",
        "SLURM_NNODES": "1",
        "SLURM_NTASKS": "2",
        "SLURM_NTASKS_PER_NODE": "2",
        "SLURM_NODELIST": "localhost",
        "SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": str(ROOT),  # the console script does not put the checkout on the path; the test callbacks need it
    }
    return subprocess.run(
        ["bash", "configs/slurm.sbatch", *args],
        cwd=ROOT,
        env=env(**slurm, **extra),
        capture_output=True,
        text=True,
        timeout=RUN_TIMEOUT,
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.skipif(shutil.which("torch-handle") is None, reason="the console script is not installed")
def test_a_preempted_job_requeues_itself_and_the_next_allocation_continues_exactly(tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    check(cli(demo_args(2, reference)))
    want, total = weights(reference), batches_run(reference)

    root = tmp_path / "job"
    args = demo_args(2, root)[1:]  # the script runs `torch-handle fit`
    first = _allocation(tmp_path, args, **{TERM_AT: "8"})  # SIGTERM at step 8, as at preemption
    assert first.returncode == 143, first.stderr[-3000:]
    assert "Initializing distributed: GLOBAL_RANK: 1, MEMBER: 2/2" in first.stderr  # ranks from SLURM's variables
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"
    assert 0 < batches_run(root) < total

    second = _allocation(tmp_path, args)  # the requeued job: the same script, the same arguments
    assert second.returncode == 0, second.stderr[-3000:]
    assert (tmp_path / "scontrol.log").read_text() == "requeue 4242\n"  # done: not requeued again
    assert batches_run(root) == total  # steps 1-8 once, then 9 on: nothing repeated, nothing skipped
    for name, tensor in want.items():
        assert torch.equal(weights(root)[name], tensor), name
