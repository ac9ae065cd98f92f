"""Every GPU path in one command (issue 15): bf16 tests, each strategy end to end, 400M throughput and MFU, the 32k
model, decoding, the Multi30k recipe; every figure written as Markdown, the device named.

    python benchmarks/gpu_suite.py --out "$OUT"                     # on one H100/H200, under 9 minutes
    python benchmarks/gpu_suite.py --dry-run --out /tmp/suite       # on CPU with tiny sizes (CI runs this)

Each step runs in its own process under a time limit (a CUDA out-of-memory or a hang ends that step only) and
writes ``OUT/STEP.json``. All start at once: the steps whose results do not depend on speed (tests, strategies,
Multi30k BLEU) run side by side, while the timed ones prepare on the host (imports, models built on the CPU) and then
take the device one at a time, each alone on it; the parent gathers them into ``OUT/gpu_suite.md`` with the whole
suite's time, prints it, and exits 1 if a step failed. ``--dry-run`` runs the same code on the CPU, fp32, tiny
models and lengths, so that the suite cannot rot between the sessions that have a GPU. The steps, one module each in
``benchmarks/gpu/``, run by ``gpu_steps.py``:

- ``gpu_tests``: ``pytest -m gpu`` (bf16 SDPA/flex/xformers against naive, full and local, every position type,
  bf16 gradients; BART, mBART, Marian, PEGASUS, T5 and LED folders against transformers in bf16); on a CPU they
  skip.
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
  sentences/s on Multi30k-sized sources; the cache on SDPA's own pick of kernel (cuDNN's on Hopper) against
  ``generate``'s; each loop's first call.
- ``fp8_loss``: ``--model.fp8`` against bf16 as a user runs it: ``cli.py fit --config multi30k`` with a
  Transformer-base model, compiled, 300 steps under ddp, fsdp and fsdp2; validation loss at the last step.
- ``fp8``: the ~400M model's tokens/s in float8 against bf16, compiled, at two settings (MFU against the bf16 peak).
- ``fp8_wide``: the same comparison at four times the width (d 4096, 2+2 layers).
- ``multi30k``: the shipped Multi30k recipe in ``bf16-mixed`` for the minutes left, then its test BLEU (``--multi30k``
  names the data, written by ``torch-handle prepare multi30k``; without it the step is skipped).
- ``multi30k_recipe``: the recipe as a user runs it on one GPU (``--config multi30k --config multi30k_gpu``), alone
  on the device: each config's host time per step, part by part; then the whole fit and the test, timed, and BLEU.
- ``multi30k_averaging`` (on a GPU only when named, ``--step``: it takes a call of its own; a dry run runs it with
  the rest): one fit of the GPU recipe with ``--config ema`` keeping every epoch's checkpoint, then
  ``bench_averaging``'s comparison of its trained weights, their EMA and averages of its last checkpoints' trained
  weights; validation BLEU chooses the average, test_2016_flickr is scored once for each of the three (issue 41).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from common import markdown_table

ROOT = Path(__file__).resolve().parents[1]
# step -> seconds it may take on the GPU and in a dry run (a timed step's from its turn). The first three give
# figures that do not depend on speed (pass/fail, BLEU), so they run side by side; the timed steps then run one at a
# time on an otherwise idle device. Much of a step's time is start-up (imports, Lightning's above all; first
# kernels), which each step's log shows with gpu.setting.mark; the timed steps do theirs beside the side-by-side steps.
# Each step's measured time: benchmarks/RESULTS.md, section "GPU suite", fourth and fifth H200 sessions.
LIMITS = {
    "gpu_tests": (240, 200),  # flex compiles a kernel per mask; the families' bf16 parity imports transformers
    "strategies": (180, 300),  # 6 configs side by side, 3 launches and an export each
    "multi30k": (180, 300),  # a minute of the recipe (Lightning's max_time), then BLEU
    "fp8_loss": (300, 300),  # five compiled 300-step fits side by side, each a launch of its own
    "throughput": (210, 120),  # eight loops, four compiling first, a profiled step
    "strategy_throughput": (200, 120),  # six strategies, one process each, prepared side by side
    "long": (100, 120),
    "decoding": (120, 60),  # warm-up dominates: each loop meets every length up to 256 tokens
    "fp8": (150, 120),  # four compiled loops of the ~400M model
    "fp8_wide": (90, 120),  # two compiled loops of a 4-layer model four times as wide
    "multi30k_recipe": (560, 240),  # two short timed fits, the full fit (60 epochs), its test and BLEU
    "multi30k_averaging": (590, 300),  # the full fit with EMA (--recipe-epochs shortens it), 7 BLEU scorings
}
SIDE_BY_SIDE = ("gpu_tests", "strategies", "multi30k", "fp8_loss", "multi30k_averaging")
OPT_IN = ("multi30k_averaging",)  # a call of its own on a GPU (--step); a dry run runs it with the rest


def launch(
    step: str, out: Path, dry_run: bool, multi30k: Path, epochs: int, recipe: list[str]
) -> subprocess.Popen[str]:
    """``python benchmarks/gpu_steps.py STEP`` in a fresh process (and session), its log written as it runs. A timed
    step gets ``--wait``: it prepares on the host at once, beside the side-by-side steps, and uses the device only
    when :func:`finish` gives it its turn."""
    command = [sys.executable, str(ROOT / "benchmarks" / "gpu_steps.py"), step, str(out / f"{step}.json")]
    command += ["--multi30k", str(multi30k.resolve()), "--multi30k-epochs", str(epochs)]
    command += recipe  # the options of multi30k_recipe and multi30k_averaging
    command += [*(["--dry-run"] if dry_run else []), *(["--wait"] if step not in SIDE_BY_SIDE else [])]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),  # need not install
        "GPU_STEPS_LAUNCHED": str(time.time()),  # gpu.setting.mark's times in the step's log count from here
    }
    with (out / f"{step}.log").open("w") as log:
        stdin = subprocess.DEVNULL if step in SIDE_BY_SIDE else subprocess.PIPE
        return subprocess.Popen(
            command, cwd=ROOT, env=env, stdin=stdin, stdout=log, stderr=subprocess.STDOUT, text=True,
            start_new_session=True,  # at its limit, the step and every process it started are stopped together
        )  # fmt: skip


def finish(step: str, child: subprocess.Popen[str], out: Path, dry_run: bool, launched: float) -> dict[str, Any]:
    """A step's JSON, or why there is none. A timed step first gets its turn, once prepared; its seconds and limit
    count from its turn, a side-by-side step's from its launch."""
    limit = LIMITS[step][1 if dry_run else 0]
    start = launched
    if child.stdin is not None:  # preparing since the suite began; a preparation past the limit counts as a hang
        while child.poll() is None and not (out / f"{step}.ready").exists() and time.perf_counter() < start + limit:
            time.sleep(0.1)
        start = time.perf_counter()
        with contextlib.suppress(BrokenPipeError):  # it ended while preparing: its exit status says why
            child.stdin.write("go\n")
            child.stdin.close()
    try:
        child.wait(timeout=max(0.0, start + limit - time.perf_counter()))
    except subprocess.TimeoutExpired:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()
        return {"step": step, "ok": False, "error": f"over its {limit} s limit", "seconds": limit}
    seconds = time.perf_counter() - start
    if child.returncode or not (out / f"{step}.json").exists():
        log = (out / f"{step}.log").read_text()
        tail = (log.strip().splitlines() or [f"exit {child.returncode}"])[-1]
        return {"step": step, "ok": False, "error": f"exit {child.returncode}: {tail}", "seconds": seconds}
    return {**json.loads((out / f"{step}.json").read_text()), "seconds": seconds}


def report(results: list[dict[str, Any]], dry_run: bool, seconds: float) -> str:
    """Markdown: one line on the device and the whole suite's time, then each step's tables (or its error)."""
    device = next((r["device"] for r in results if r.get("device")), "unknown device")
    lines = [
        f"# GPU suite{' (dry run on CPU: tiny sizes, not figures)' if dry_run else ''}",
        f"Device: {device}. The whole suite: {seconds:.0f} s; a timed step's seconds count from its turn.",
    ]
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
    parser.add_argument(
        "--step", choices=list(LIMITS), action="append", help=f"default: every step but {', '.join(OPT_IN)}"
    )
    parser.add_argument(
        "--multi30k", type=Path, default=Path("data/multi30k"), help="Multi30k (torch-handle prepare); absent: skipped"
    )
    parser.add_argument("--multi30k-epochs", type=int, default=20, help="the multi30k step's epochs (124 steps each)")
    parser.add_argument(
        "--recipe-epochs", type=int, help="multi30k_recipe's and multi30k_averaging's epochs (default: the config's)"
    )
    parser.add_argument("--recipe-compile", action="store_true", help="multi30k_recipe also times a compiled run")
    args = parser.parse_args()
    recipe = ["--recipe-epochs", str(args.recipe_epochs)] if args.recipe_epochs else []
    recipe += ["--recipe-compile"] if args.recipe_compile else []
    args.out.mkdir(parents=True, exist_ok=True)
    begun = time.perf_counter()
    default = [step for step in LIMITS if args.dry_run or step not in OPT_IN]
    steps = sorted(args.step or default, key=lambda step: step not in SIDE_BY_SIDE)  # stable: side by side first
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` stops the suite: the finally below runs
    children: dict[str, tuple[subprocess.Popen[str], float]] = {}
    try:
        for step in steps:
            children[step] = (
                launch(step, args.out, args.dry_run, args.multi30k, args.multi30k_epochs, recipe),
                time.perf_counter(),
            )
        results = [finish(step, child, args.out, args.dry_run, at) for step, (child, at) in children.items()]
    finally:  # each step runs in a session of its own: stop whatever is left of them with the suite
        for child, _ in children.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(child.pid, signal.SIGKILL)
    text = report(results, args.dry_run, time.perf_counter() - begun)
    (args.out / "gpu_suite.md").write_text(text)
    print(text)
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
