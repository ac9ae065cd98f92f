"""``benchmarks/bench_decoding.py`` runs end to end on a trained model, so the script behind the decoding figures
cannot rot between the runs that write them."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import ROOT, RUN_TIMEOUT, env


@pytest.mark.slow
def test_this_checkout_against_itself_gives_the_same_outputs(tiny_demo_run: Path, tmp_path: Path) -> None:
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    source = tmp_path / "in.txt"
    source.write_text("the dog sees a cat\nmy king\ntwo old birds helped the dog\nthe cat\n", encoding="utf-8")
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_decoding.py"), "--checkpoint", str(tiny_demo_run)]
    command += ["--source", str(source), "--before", str(ROOT), "--batch-size", "3", "--rounds", "1", "--no-write"]
    command += ["--compile"]
    run = subprocess.run(command, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(
        r"^\| (greedy|beam 5) \| (file|sorted) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| (\w+) \|$", run.stdout, re.M
    )
    assert len(rows) == 4, run.stdout
    assert all(same == "yes" for *_, same in rows), run.stdout  # one code, one model: one set of outputs
    # --compile: CompiledDecode on the longest-first batches, the last (1 of 4 sentences) filled to 3 rows.
    compiled = re.findall(
        r"^\| (greedy|beam 5) \| [\d.]+ \| [\d.]+ \| [\d.]+ \| (\w+) \| ([\d.]+) \|$", run.stdout, re.M
    )
    assert [name for name, *_ in compiled] == ["greedy", "beam 5"], run.stdout
    assert all(same == "yes" and float(first) > 0 for _, same, first in compiled), run.stdout
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == results


@pytest.mark.slow
def test_the_step_benchmark_times_every_step_at_every_capacity(tiny_demo_run: Path, tmp_path: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_decode_step.py"), "--checkpoint", str(tiny_demo_run)]
    command += ["--capacity", "8", "5", "--sources", "2", "--beams", "3", "--warmup", "2", "--steps", "3"]
    run = subprocess.run(command, cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT)
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| ([a-z ,()]+) \| ([\d.]+) \| ([\d.]+) \|$", run.stdout, re.M)
    assert [name for name, *_ in rows] == [
        "compiled, written positions only", "static cache, eager", "dynamic (eager) cache"
    ], run.stdout  # fmt: skip
    assert all(float(ms) > 0 for _, *cells in rows for ms in cells), run.stdout
    short = subprocess.run(command + ["--capacity", "4"], cwd=tmp_path, env=env(), capture_output=True, text=True)
    assert short.returncode == 2
    assert short.stderr.splitlines()[-1].endswith("--capacity must hold --warmup + --steps = 5 positions")


@pytest.mark.slow
def test_the_layout_benchmark_pairs_both_layouts_on_both_workloads(tiny_demo_run: Path, tmp_path: Path) -> None:
    source = tmp_path / "in.txt"
    source.write_text("the dog sees a cat\nmy king\ntwo old birds helped the dog\n", encoding="utf-8")
    command = [sys.executable, str(ROOT / "benchmarks" / "bench_cpu_layout.py"), "--dry-run"]
    run = subprocess.run(
        command + ["--checkpoint", str(tiny_demo_run), "--source", str(source)],
        cwd=tmp_path, env=env(), capture_output=True, text=True, timeout=RUN_TIMEOUT,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    rows = re.findall(r"^\| (.+?) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+)/(\d+) \| (\w+) \|$", run.stdout, re.M)
    labels = [row[0] for row in rows]
    assert [label.startswith("fresh d 32") for label in labels] == [True, True, False, False], run.stdout
    assert [", greedy" in label for label in labels] == [True, False, True, False], run.stdout
    assert all(", beam 5" in label for label in labels[1::2]), run.stdout
    # Both layouts decode the same outputs (a transposed copy of the same values), each timed in both pairs.
    assert all(same == "yes" and total == "2" and float(ratio) > 0 for *_, ratio, _, total, same in rows), run.stdout
    alone = subprocess.run(command + ["--source", str(source)], cwd=tmp_path, env=env(), capture_output=True, text=True)
    assert alone.returncode == 2
    assert alone.stderr.splitlines()[-1].endswith("--checkpoint and --source go together")
