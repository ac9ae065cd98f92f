"""``strategies``: the demo config with each strategy config on one device in ``bf16-mixed``: fit 6 steps, resume
from step 3, export, predict from the export; the strategies side by side on the one GPU."""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu.setting import ROOT, TINY_MODEL, Setting, result_table

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")


def _cli(args: list[str], port: int) -> tuple[bool, float, str]:
    """``python cli.py ARGS``: whether it succeeded, its seconds, and its last line of error."""
    start = time.perf_counter()
    env = os.environ | {"MASTER_PORT": str(port)}  # the strategies run side by side: one rendezvous port each
    run = subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True, env=env)
    error = "" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1][:200]
    return run.returncode == 0, time.perf_counter() - start, error


def _export(args: list[str]) -> tuple[bool, float, str]:
    """``torch-handle export CHECKPOINT OUTPUT`` called in this process: as :func:`_cli` reports it."""
    from torch_handle.export.__main__ import main as export

    start = time.perf_counter()
    try:
        export(args)
    except (SystemExit, Exception) as error:  # noqa: BLE001 - any failure is this row's result, not the step's
        return False, time.perf_counter() - start, f"{type(error).__name__}: {error}"[:200]
    return True, time.perf_counter() - start, ""


def strategies(setting: Setting) -> dict[str, Any]:
    """The demo with each strategy config on one device: fit 6 steps, resume from step 3, export, predict. The
    strategies run side by side (one GPU holds them all), each its four commands in turn."""
    from concurrent.futures import ThreadPoolExecutor

    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    (tmp / "inputs.txt").write_text("a man rides a bike\ntwo dogs play in the snow\n")
    names = STRATEGIES if not setting.dry_run else ("ddp", "zero2")
    with ThreadPoolExecutor(len(names)) as pool:
        rows = list(pool.map(lambda i: _strategy_row(names[i], 29400 + i, tmp, setting), range(len(names))))
    header = ["strategy", "fit", "resume", "export", "predict from export", "resumed - uninterrupted (max)", "result"]
    title = f"The demo config, 6 steps in `{setting.precision}` on one device, with each strategy config"
    return {"ok": all(row[-1] == "passed" for row in rows), "tables": [result_table(title, header, rows)]}


def _strategy_row(name: str, port: int, tmp: Path, setting: Setting) -> list[Any]:
    from torch_handle.export import read_checkpoint

    sizes = ["--data.init_args.demo_size", "400" if setting.dry_run else "2000", "--data.init_args.bpe_vocab_size"]
    sizes += ["300"] if setting.dry_run else ["1000"]
    if setting.dry_run:
        sizes += [f"--model.transformer.{k}={v}" for k, v in TINY_MODEL.items()] + ["--model.max_new_tokens", "8"]
    common = [
        "--config", "configs/demo.yaml", "--config", f"configs/{name}.yaml",
        "--trainer.accelerator", setting.accelerator, "--trainer.devices", "1",
        "--trainer.precision", setting.precision, "--trainer.limit_val_batches", "0",
        "--trainer.logger", "true", "--trainer.enable_progress_bar", "false",  # the demo's LR monitor needs one
        "--checkpoint.every_n_train_steps", "3", "--checkpoint.save_top_k", "-1", "--checkpoint.monitor", "null",
        "--trainer.max_steps", "6",
        *sizes,
    ]  # fmt: skip
    run, resumed, exported = tmp / name, tmp / f"{name}-resumed", tmp / f"{name}.safetensors"
    steps = {"fit": ["fit", *common, "--trainer.default_root_dir", str(run)]}
    step3 = run / "checkpoints" / "epoch=0-step=3.ckpt"
    steps["resume"] = ["fit", *common, "--trainer.default_root_dir", str(resumed), "--ckpt_path", str(step3)]
    steps["export"] = [str(run / "checkpoints" / "last.ckpt"), str(exported)]  # in this process, below
    steps["predict"] = [
        "predict", "--config", "configs/demo.yaml", "--trainer.accelerator", setting.accelerator,
        "--trainer.devices", "1", "--ckpt_path", str(exported),
        "--data.init_args.predict_file", str(tmp / "inputs.txt"),
        "--prediction_writer.output", str(tmp / f"{name}.txt"), "--trainer.enable_progress_bar", "false",
    ]  # fmt: skip
    row: list[Any] = [name]
    failure = ""
    for step, args in steps.items():
        # export in this process: `torch-handle export` is the same function behind argparse, and a launch of its
        # own would pay its imports again beside the others on the GPU host
        command = _export if step == "export" else functools.partial(_cli, port=port)
        passed, seconds, error = command(args) if not failure else (False, 0.0, "")
        row.append(f"{seconds:.0f} s" if passed else "failed" if not failure else "-")
        failure = failure or (f"{step}: {error}" if not passed else "")
    if not failure:
        want = read_checkpoint(run / "checkpoints" / "last.ckpt")[0]
        got = read_checkpoint(resumed / "checkpoints" / "last.ckpt")[0]
        row.append(f"{max(float((got[k] - w).abs().max()) for k, w in want.items()):.1e}")
    else:
        row.append("")
    return [*row, failure or "passed"]
