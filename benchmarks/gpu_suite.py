"""Every GPU path in one command (issue 15): bf16 tests, each strategy end to end, 400M throughput and MFU, the 32k
model, decoding, the Multi30k recipe; every figure written as Markdown, the device named.

    python benchmarks/gpu_suite.py --out "$OUT"                     # on one H100/H200, under 9 minutes
    python benchmarks/gpu_suite.py --dry-run --out /tmp/suite       # on CPU with tiny sizes (CI runs this)

Each step runs in its own process under a time limit (a CUDA out-of-memory or a hang ends that step only) and
writes ``OUT/STEP.json``. The steps whose results do not depend on speed (tests, strategies, Multi30k BLEU) run side
by side first, then the timed ones one at a time; the parent gathers them into ``OUT/gpu_suite.md``, prints it, and
exits 1 if a step failed. ``--dry-run`` runs the same code on the CPU, fp32, tiny models and lengths, so that the
suite cannot rot between the sessions that have a GPU. The steps (:mod:`gpu_steps`):

- ``gpu_tests``: ``pytest -m gpu`` (bf16 SDPA/flex/xformers against naive, full and local, every position type,
  bf16 gradients); on a CPU they skip.
- ``strategies``: the demo config with each strategy config on one device in ``bf16-mixed``: fit 6 steps, resume
  from step 3, export, predict from the export; the strategies side by side on the one GPU.
- ``throughput``: the ~400M encoder-decoder (d 1024, 16 heads, 12+12 layers, d_ff 4096, vocabulary 32k) at 2,048
  source and 2,048 target tokens, through Seq2SeqModule and ``lightning.Trainer``: tokens/s, MFU by the
  encoder-decoder FLOPs formula (checked against ``FlopCounterMode``), peak memory, and the same step in a plain
  PyTorch loop (Lightning's overhead); each lever on and off in the same run (compiled layers, fused AdamW, attention
  with no padding mask).
- ``strategy_throughput``: the same model through ``lightning.Trainer`` with each strategy config's strategy (DDP,
  ZeRO-1/2/3, FSDP) on one device, each in its own process: tokens/s against DDP, peak memory.
- ``long``: ``summarization_32k``'s model, one training step at 32,768 source tokens, flex against the blocked SDPA
  kernel; then the longest source that fits, doubling.
- ``decoding``: greedy with the key/value cache against recomputing the prefix at 256 new tokens; beam-4
  sentences/s on Multi30k-sized sources.
- ``multi30k``: the shipped Multi30k recipe in ``bf16-mixed`` for the minutes left, then its test BLEU (``--multi30k``
  names the data, written by ``torch-handle prepare multi30k``; without it the step is skipped).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from common import markdown_table

ROOT = Path(__file__).resolve().parents[1]
# step -> seconds it may take on the GPU and in a dry run. The first three give figures that do not depend on speed
# (pass/fail, BLEU), so they run side by side; the timed steps then run one at a time on an otherwise idle device.
# The whole suite: max(side by side) + sum(timed) = 180 + 700 s at most. From its steps' times in three H200 sessions
# it would take about 11 minutes, over the 9; decoding, 79 s for about 10 s of timed work, shows where:
# start-up.
LIMITS = {
    "gpu_tests": (150, 200),  # flex compiles a kernel per mask
    "strategies": (180, 300),  # 6 configs side by side, 4 launches each
    "multi30k": (180, 300),  # the recipe for --multi30k-epochs (Lightning's max_time stops it in time), then BLEU
    "throughput": (180, 120),  # seven loops, three of them compiling first, and a profiled step
    "strategy_throughput": (300, 120),  # six strategies, one process each: past 180 s for four on an H100
    "long": (100, 120),
    "decoding": (120, 60),  # 54 s of it CUDA start-up and first kernels on an H200
}
SIDE_BY_SIDE = ("gpu_tests", "strategies", "multi30k")


def run_step(step: str, out: Path, dry_run: bool, multi30k: Path, epochs: int) -> dict[str, Any]:
    """``python benchmarks/gpu_steps.py STEP`` in a fresh process; its JSON, or why there is none."""
    limit = LIMITS[step][1 if dry_run else 0]
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_steps.py"), step, str(out / f"{step}.json")]
    command += ["--multi30k", str(multi30k.resolve()), "--multi30k-epochs", str(epochs)]
    env = os.environ | {"PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    start = time.perf_counter()
    log = out / f"{step}.log"
    with log.open("w") as sink:  # written as it runs: a step stopped at its limit leaves its log
        try:
            run = subprocess.run(
                [*command, *(["--dry-run"] if dry_run else [])],
                cwd=ROOT,
                env=env,  # the checkout need not be installed
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=limit,
            )
        except subprocess.TimeoutExpired:
            return {"step": step, "ok": False, "error": f"over its {limit} s limit", "seconds": limit}
    seconds = time.perf_counter() - start
    if run.returncode or not (out / f"{step}.json").exists():
        tail = (log.read_text().strip().splitlines() or [f"exit {run.returncode}"])[-1]
        return {"step": step, "ok": False, "error": f"exit {run.returncode}: {tail}", "seconds": seconds}
    return {**json.loads((out / f"{step}.json").read_text()), "seconds": seconds}


def report(results: list[dict[str, Any]], dry_run: bool) -> str:
    """Markdown: one line on the device, then each step's tables (or its error)."""
    device = next((r["device"] for r in results if r.get("device")), "unknown device")
    lines = [f"# GPU suite{' (dry run on CPU: tiny sizes, not figures)' if dry_run else ''}", f"Device: {device}."]
    for r in results:
        status = "passed" if r["ok"] else f"FAILED: {r['error']}"
        lines.append(f"## {r['step']}: {status} ({r['seconds']:.0f} s)")
        for table in r.get("tables", []):
            lines.append(table["title"])
            lines.append(markdown_table(table["header"], table["rows"]))
    return "\n\n".join(lines) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for gpu_suite.md and each step's JSON and log")
    parser.add_argument("--dry-run", action="store_true", help="CPU, fp32, tiny sizes: checks the code, not the GPU")
    parser.add_argument("--step", choices=list(LIMITS), action="append", help="default: every step")
    parser.add_argument(
        "--multi30k", type=Path, default=Path("data/multi30k"), help="Multi30k (torch-handle prepare); absent: skipped"
    )
    parser.add_argument("--multi30k-epochs", type=int, default=20, help="the multi30k step's epochs (124 steps each)")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    def run(step: str) -> dict[str, Any]:
        return run_step(step, args.out, args.dry_run, args.multi30k, args.multi30k_epochs)

    steps = args.step or list(LIMITS)
    together = [step for step in steps if step in SIDE_BY_SIDE]
    with ThreadPoolExecutor(max(len(together), 1)) as pool:
        done = dict(zip(together, pool.map(run, together), strict=True))
    results = [done[step] if step in done else run(step) for step in steps]
    text = report(results, args.dry_run)
    (args.out / "gpu_suite.md").write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
