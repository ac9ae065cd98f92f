"""Helpers shared by the benchmark scripts: child processes, memory, timing, machine facts, RESULTS.md.

Every measurement runs in a child process of its own, so that one case's allocations, compiled kernels
and thread pools never colour the next. The child prints one JSON line; the parent collects the lines and
rewrites its own section of ``RESULTS.md`` between ``<!-- name:start -->`` and ``<!-- name:end -->``.

This module imports no torch, so that a parent process stays small.
"""

from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"
_ROOT = Path(__file__).resolve().parents[1]


def run_child(script: str, args: Sequence[str], timeout: float = 900) -> dict[str, Any]:
    """Run ``python script args`` from the repository root and return the JSON object it printed last."""
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(_ROOT), os.environ.get("PYTHONPATH")]))}
    result = subprocess.run(
        [sys.executable, script, *args], capture_output=True, text=True, timeout=timeout, cwd=_ROOT, env=env
    )
    if result.returncode:
        raise RuntimeError(f"{script} {' '.join(args)} failed:\n{result.stderr[-4000:]}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        match = re.search(rf"{field}:\s+(\d+)", f.read())
    assert match is not None, field
    return int(match.group(1))


def rss_bytes() -> int:
    """Resident memory of this process now."""
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """Peak resident memory of this process.

    ``VmHWM`` rather than ``ru_maxrss``: a child started with vfork/posix_spawn inherits its parent's
    ``ru_maxrss``, whereas ``VmHWM`` belongs to the process's own address space.
    """
    return _status_kib("VmHWM") * 1024


def reset_peak_rss() -> None:
    """Make the peak equal to the current resident memory (Linux >= 4.0), to measure one stretch of code."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def median_seconds(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, list[float]]:
    """Median wall time of ``fn()`` over ``repeats`` calls after ``warmup`` untimed ones, and every sample."""
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return statistics.median(samples), samples


def median_wall_and_cpu(fn: Callable[[], object], repeats: int, warmup: int = 1) -> tuple[float, float]:
    """Median wall time and median CPU time (this process, all threads) of ``fn()`` over ``repeats`` calls.

    CPU time leaves out the time other processes take from this one, which makes it the steadier figure on
    a shared machine.
    """
    for _ in range(warmup):
        fn()
    wall, cpu = [], []
    for _ in range(repeats):
        start, cpu_start = time.perf_counter(), time.process_time()
        fn()
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - cpu_start)
    return statistics.median(wall), statistics.median(cpu)


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_line(threads: int, torch_version: str, gpu: str | None = None) -> str:
    """One line that says which machine produced a table (``gpu``: the device's name, where it ran on one)."""
    load = ", ".join(f"{x:.1f}" for x in os.getloadavg())
    return (
        f"Device: {f'GPU `{gpu}`, host ' if gpu else ''}CPU `{cpu_name()}` ({os.cpu_count()} logical cores), "
        f"{threads} intra-op thread(s), "
        f"torch {torch_version}, Python {platform.python_version()}; load average at the start {load}; "
        f"run {time.strftime('%Y-%m-%d %H:%M %Z')}."
    )


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def write_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Replace the text between ``<!-- name:start -->`` and ``<!-- name:end -->`` (appended when absent)."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.strip()}\n{end}"
    text = path.read_text() if path.exists() else "# Benchmark results\n\nWritten by the scripts in this folder.\n"
    if start in text and end in text:
        before, rest = text.split(start, 1)
        text = before + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.write_text(text)
