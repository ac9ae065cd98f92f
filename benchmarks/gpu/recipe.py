"""``multi30k_recipe``: the Multi30k recipe on one GPU as a user runs it, end to end and timed (issue 42).

First a short run of the shipped recipe in ``bf16-mixed``, one stacked with ``multi30k_gpu`` and, with
``--recipe-compile`` on a GPU, one compiled too, under ``benchmarks/step_timers.py``: the host's time per step, part
by part, and its waits for the device. Then the user's two commands, each timed wall-clock from start to exit:
``torch-handle fit --config multi30k --config multi30k_gpu`` for all the recipe's epochs, and ``torch-handle test``
on its last checkpoint; then BLEU on every test set (``bench_multi30k``'s score, lowercased and the literature's).
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu.setting import ROOT, Setting, fmt, launched_env, mark, result_table

GPU = ["--config", "multi30k", "--config", "multi30k_gpu"]
CONFIGS = {"multi30k, bf16-mixed": ["--config", "multi30k"], "multi30k + multi30k_gpu": GPU}
COMPILED = {"+ --model.compile true": [*GPU, "--model.compile=true"]}  # --recipe-compile, on a GPU: minutes on a CPU
TINY = [
    "--model.transformer.d_model=32", "--model.transformer.num_heads=2", "--model.transformer.num_encoder_layers=1",
    "--model.transformer.num_decoder_layers=1", "--model.transformer.d_ff=64", "--model.max_new_tokens=16",
    "--data.init_args.bpe_vocab_size=300", "--trainer.limit_val_batches=2", "--trainer.limit_test_batches=2",
]  # fmt: skip


def user_command(
    setting: Setting, subcommand: str, configs: list[str], data: Path, run: Path, extra: list[str]
) -> list[str]:
    """A ``torch-handle`` command line: the user's, at tiny sizes on the CPU in a dry run."""
    command = [sys.executable, str(ROOT / "cli.py"), subcommand, *configs, f"--data.init_args.data_dir={data}"]
    command += [f"--trainer.default_root_dir={run}", f"--trainer.precision={setting.precision}"]
    return command + (["--trainer.accelerator=cpu", *TINY] if setting.dry_run else []) + extra


def timed_command(command: list[str], log: Path) -> float:
    """Runs ``command`` with its output in ``log``; its wall-clock seconds."""
    start = time.perf_counter()
    with log.open("w") as out:
        run = subprocess.run(command, cwd=ROOT, env=launched_env(), stdout=out, stderr=subprocess.STDOUT)
    if run.returncode:
        tail = log.read_text().strip().splitlines()[-3:]
        raise RuntimeError(f"{' '.join(command[1:4])}... exited {run.returncode}: {' | '.join(tail)}")
    return time.perf_counter() - start


def host_breakdown(setting: Setting, data: Path, work: Path, compiled: bool) -> dict[str, Any]:
    """Each config's host time per step, part by part, from a short fit under ``step_timers.py``; ``compiled`` adds
    the GPU config compiled (its compilation, about a minute, falls in the steps left out)."""
    steps, skip = (12, 2) if setting.dry_run else (150, 30)
    parts: dict[str, dict[str, list[float]]] = {}
    rates = []
    runs = CONFIGS | COMPILED if compiled and not setting.dry_run else CONFIGS
    if setting.dry_run:  # the code of a breakdown, once: CI runs the dry run
        runs = dict(list(runs.items())[-1:])
    for name, configs in runs.items():
        out = work / f"timers-{len(parts)}.json"
        fit = user_command(setting, "fit", configs, data, work / f"timers-{len(parts)}", [])
        fit[1:3] = [str(ROOT / "benchmarks" / "step_timers.py"), str(out), "--skip", str(skip), "fit"]
        fit += [f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0", "--trainer.num_sanity_val_steps=0"]
        timed_command(fit, work / f"timers-{len(parts)}.log")
        result = json.loads(out.read_text())
        parts[name] = {part: [ms, syncs] for part, ms, syncs in result["parts"]}
        rates.append(f"{name}: {1e3 / parts[name]['whole step'][0]:.1f} steps/s")
        # into the step's log at once, which the suite keeps: a call whose time runs out later still has it
        mark(f"host breakdown, {name}: done: {json.dumps(result['parts'])}")
    names = list(parts[next(iter(parts))])
    rows = [[part, *(cell for config in parts.values() for cell in _cells(config.get(part)))] for part in names]
    header = ["part of the step (host)"] + [f"{c}: {unit}" for c in parts for unit in ("ms/step", "syncs/step")]
    title = (
        f"Host time per training step of the Multi30k recipe, part by part (`benchmarks/step_timers.py`, steps "
        f"{skip + 1}-{steps} of a fit; a part that waits for the GPU counts the wait, the compiling of a compiled "
        "run its first steps; syncs counted by "
        f"`torch.cuda.set_sync_debug_mode`): {'; '.join(rates)}."
    )
    return result_table(title, header, rows)


def _cells(part: list[float] | None) -> list[str]:
    return ["", ""] if part is None else [fmt(part[0], 3), fmt(part[1], 2)]


def multi30k_recipe(setting: Setting, data: Path, epochs: int | None, compiled: bool) -> dict[str, Any]:
    """The breakdown, then the user's fit and test, timed; skipped, not failed, without the data."""
    import bench_multi30k
    import torch

    if not (data / "train.en").is_file():
        return {"ok": True, "tables": [result_table("Multi30k recipe", ["result"], [[f"skipped: no {data}/train.en"]])]}
    work = Path(tempfile.mkdtemp(prefix="gpu_suite-recipe-"))
    tables = [host_breakdown(setting, data, work, compiled)]
    run, configs = work / "run", GPU
    extra = ["--trainer.max_steps=3"] if setting.dry_run else [f"--trainer.max_epochs={epochs}"] if epochs else []
    fit_seconds = timed_command(user_command(setting, "fit", configs, data, run, extra), work / "fit.log")
    mark(f"fit: {fit_seconds:.0f} s")
    test_log = work / "test.log"
    test_seconds = timed_command(user_command(setting, "test", configs, data, run, []), test_log)
    mark(f"test: {test_seconds:.0f} s")
    printed = [line for line in test_log.read_text().splitlines() if line.startswith(("BLEU ", "chrF2 "))]
    last = torch.load(next(run.rglob("last.ckpt")), map_location="cpu", weights_only=True, mmap=True)
    steps = last["global_step"]
    rate = _logged_rate(run)
    rows = [
        ["fit (wall, start-up and tokenizer training included)", fmt(fit_seconds, 1), f"{steps} steps"],
        ["training steps/s (Throughput's window means, validation left out)", fmt(rate, 1), ""],
        ["test (wall, beam search on test_2016_flickr)", fmt(test_seconds, 1), " / ".join(printed)],
        ["fit + test", fmt(fit_seconds + test_seconds, 1), "the issue's goal: at most 180 s"],
    ]
    title = (
        f"`torch-handle fit --config multi30k --config multi30k_gpu` ({steps} steps), then "
        f"`torch-handle test` on its last checkpoint, alone on one device in `{setting.precision}`."
    )
    tables.append(result_table(title, ["command", "seconds (or steps/s)", "result"], rows))
    scores = bench_multi30k.score(run, data, 20 if setting.dry_run else None, device=setting.device.type)
    tables.append(result_table("BLEU of that run (`bench_multi30k.py`'s score)", bench_multi30k.HEADER, scores))
    return {"ok": True, "tables": tables, "fit_seconds": fit_seconds, "test_seconds": test_seconds}


def _logged_rate(run: Path) -> float | None:
    """The mean of the run's logged ``train/device/batches_per_sec`` (the Throughput callback's windows)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    values = []
    for events in run.glob("lightning_logs/version_*/events.out.tfevents.*"):
        accumulator = EventAccumulator(str(events), size_guidance={"scalars": 0})
        accumulator.Reload()
        if "train/device/batches_per_sec" in accumulator.Tags()["scalars"]:
            values += [event.value for event in accumulator.Scalars("train/device/batches_per_sec")]
    return sum(values) / len(values) if values else None
