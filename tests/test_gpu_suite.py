"""``benchmarks/gpu_suite.py --dry-run`` runs every step of the GPU suite on the CPU at tiny sizes, so that the one
command a GPU session spends its device time on cannot rot between the sessions that have a GPU."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from tests.helpers import ROOT, env

sys.path.insert(0, str(ROOT / "benchmarks"))
from bench_averaging import EMA_ROW, TRAINED_ROW  # noqa: E402

STEPS = ["gpu_tests", "strategies", "multi30k", "fp8_loss", "multi30k_averaging"]  # side by side
STEPS += ["throughput", "strategy_throughput", "long", "decoding", "fp8", "multi30k_recipe"]  # timed


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.timeout(900)
def test_dry_run_passes_every_step_and_writes_its_tables(tmp_path: Path, shared_data: Path) -> None:
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run", "--out", str(tmp_path)]
    command += ["--multi30k", str(shared_data / "multi30k")]
    run = subprocess.run(command, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=850)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-3000:]
    report = (tmp_path / "gpu_suite.md").read_text()
    assert report == run.stdout.removesuffix("\n")  # printed as written
    for step in STEPS:
        result = json.loads((tmp_path / f"{step}.json").read_text())
        assert result["ok"] and result["device"].startswith("CPU "), result
        assert f"## {step}: passed" in report
    strategies = json.loads((tmp_path / "strategies.json").read_text())["tables"][0]["rows"]
    assert [row[0] for row in strategies] == ["ddp", "zero2"] and all(row[-1] == "passed" for row in strategies)
    throughput = json.loads((tmp_path / "throughput.json").read_text())["tables"][0]
    assert "FlopCounterMode counted" in throughput["title"]
    levers = [row[:2] for row in throughput["rows"]]  # compiling is left to the GPU run
    assert levers == [
        ["Lightning", "eager"],
        ["plain", "eager"],
        ["plain", "foreach AdamW"],
        ["plain", "one padding token per source (masked attention)"],
    ]
    zero = json.loads((tmp_path / "strategy_throughput.json").read_text())["tables"][0]["rows"]
    assert [row[0] for row in zero] == ["ddp", "zero2", "zero3", "zero3_submodules"] and zero[0][3] == "100.0"
    assert all(float(row[1]) > 0 for row in zero)
    log = (tmp_path / "strategy_throughput.log").read_text()  # prepared side by side, then one turn each
    assert log.split("every strategy prepared")[1].count("its turn on the device") == 4
    decoding = json.loads((tmp_path / "decoding.json").read_text())["tables"][0]["rows"]
    assert [row[0].split(",")[1] for row in decoding] == [" 16 tokens"] * 3 + [" up to 64 tokens (stops at EOS)"] + [
        " 16 tokens"
    ]
    assert decoding[-1][0].endswith("SDPA's own pick of kernel (cuDNN's on Hopper)") and float(decoding[-1][3]) >= 0
    breakdown, timed, bleu = json.loads((tmp_path / "multi30k_recipe.json").read_text())["tables"]
    parts = {row[0]: row[1:] for row in breakdown["rows"]}  # ms/step and syncs/step of each config
    assert {"forward and loss", "divergence check (StopOnDivergence)", "data: next batch (sampler, collation)"} <= {
        *parts
    }
    assert len(parts["whole step"]) == 2 and float(parts["whole step"][0].replace(",", "")) > 0  # the GPU config's
    assert [row[0].split(" (")[0] for row in timed["rows"]] == ["fit", "training steps/s", "test", "fit + test"]
    assert timed["rows"][2][2].startswith("BLEU ") and bleu["rows"][0][:2] == ["test_2016_flickr", 20]
    for step in ("throughput", "strategy_throughput", "long", "decoding", "multi30k_recipe"):  # prepared meanwhile
        log = (tmp_path / f"{step}.log").read_text()
        assert log.index(f"{step}: imported") < log.index("its turn on the device") < log.index(f"{step}: done")
    fp8 = json.loads((tmp_path / "fp8.json").read_text())["tables"][0]["rows"]  # a CPU refuses float8 in one line
    assert [row[1] for row in fp8] == ["bf16", "float8"] * 2 and float(fp8[0][2]) > 0
    assert all(row[2].startswith("refused: --model.fp8 needs an NVIDIA GPU with FP8") for row in fp8[1::2])
    fp8_loss = json.loads((tmp_path / "fp8_loss.json").read_text())["tables"][0]["rows"]
    assert [row[0] for row in fp8_loss] == ["bf16, ddp", "float8, ddp"] and float(fp8_loss[0][2]) > 0
    assert fp8_loss[0][-1] == "passed" and "--model.fp8 needs an NVIDIA GPU with FP8" in fp8_loss[1][-1]
    assert re.search(r"The whole suite: \d+ s", report)
    assert report.index("## multi30k") < report.index("## throughput")  # side by side first, then the timed steps
    bleu = json.loads((tmp_path / "multi30k.json").read_text())["tables"][0]
    assert bleu["rows"][0][:2] == ["test_2016_flickr", 20] and float(bleu["rows"][0][2]) >= 0
    averaging = json.loads((tmp_path / "multi30k_averaging.json").read_text())  # chosen on val, test scored once
    weights = {row[0]: row[1:] for row in averaging["tables"][0]["rows"]}
    assert [*weights][:2] == [TRAINED_ROW, EMA_ROW] and averaging["chosen"] in weights
    tested = [name for name, cells in weights.items() if not cells[2].startswith("not scored")]
    assert tested == [*weights][:2] + [averaging["chosen"]] and len(weights) == 4  # two averages tried


@pytest.mark.slow
@pytest.mark.skipif(torch.cuda.is_available(), reason="the step must fail: it asks for a GPU that is absent")
def test_a_failing_step_is_reported_and_fails_the_suite(tmp_path: Path) -> None:
    """A step that raises is one FAILED line with its error, and the suite exits 1 (the others still run)."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--step", "decoding", "--out", str(tmp_path)]
    run = subprocess.run(command, cwd=ROOT, env=env(CUDA_VISIBLE_DEVICES=""), capture_output=True, text=True)
    assert run.returncode == 1
    assert "## decoding: FAILED: exit 1: " in run.stdout


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_strategy_waiting_for_its_turn_exits_when_the_suite_has_gone(tmp_path: Path) -> None:
    """strategy_throughput's children prepare, then wait on stdin for their turn; if it ends (the suite stopped at its
    limit) they exit at once instead of holding the device."""
    out = tmp_path / "ddp.json"
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_steps.py"), "one_strategy", str(out), "--strategy"]
    command += ["ddp", "--wait", "--dry-run"]
    run = subprocess.run(
        command, cwd=ROOT, env=env(PYTHONPATH=str(ROOT)), stdin=subprocess.DEVNULL, capture_output=True, text=True
    )
    assert run.returncode == 1
    last = run.stderr.strip().splitlines()[-1]
    assert last == "no turn on the device came: the process that launched this one has ended"
    assert out.with_suffix(".ready").exists() and not out.exists()
    assert "on_fit_start" not in run.stdout  # nothing reached the device


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_stopped_suite_leaves_no_step_running(tmp_path: Path) -> None:
    """``timeout`` (SIGTERM) on the suite while its steps run or wait for their turn stops every one of them: each
    runs in a session of its own, so nothing else would reach them."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_suite.py"), "--dry-run", "--out", str(tmp_path)]
    command += ["--step", "strategies", "--step", "strategy_throughput", "--step", "decoding"]
    suite = subprocess.Popen(command, cwd=ROOT, env=env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while not (tmp_path / "decoding.ready").exists() and time.monotonic() < deadline:  # prepared, waiting its turn
        time.sleep(0.2)
    assert (tmp_path / "decoding.ready").exists()
    suite.terminate()
    assert suite.wait(timeout=60) == 143
    time.sleep(1)
    assert _running_with(str(tmp_path)) == [], "steps left running after the suite stopped"


def _running_with(text: str) -> list[str]:
    """The command lines of this machine's live processes that mention ``text`` (zombies have none)."""
    lines = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        with contextlib.suppress(OSError):  # a process that ended while being read
            line = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
            lines += [line] if text in line else []
    return lines
