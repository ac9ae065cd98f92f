"""``fp8`` and ``fp8_loss``: training in float8 (``--model.fp8``) against ``bf16-mixed`` on one GPU.

- ``fp8`` (timed, alone on the device): the ~400M model of ``throughput`` through ``lightning.Trainer`` with compiled
  layers, bf16 against float8, at the references' setting (dropout 0, 16 rows) and at the shipped default (dropout
  0.1, 8 rows): tokens/s, the ratio, MFU counted against the bf16 peak, peak memory. ``fp8_wide``: the same at four
  times the width (d 4096, 2+2 layers), where each product is sixteen times larger.
- ``fp8_loss`` (beside the other untimed steps): ``configs/multi30k.yaml`` with a Transformer-base model (d 512,
  6+6 layers) compiled, 300 steps of Multi30k as the user types it (``cli.py fit``), bf16 against float8 under each
  strategy config that claims float8 (ddp, fsdp, and fsdp2 as ``tp`` with ``tensor_parallel_size: 1``): the validation
  loss at step 300 and the last logged training loss, from the run's TensorBoard events.

On a CPU (``--dry-run``) the float8 rows must refuse in one line, and the table says so.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from gpu.setting import ROOT, TINY_MODEL, Setting, fmt, free_memory, mark, result_table
from gpu.throughput import Timing, lightning_step, random_batches, throughput_sizes

REFUSAL = "--model.fp8 needs an NVIDIA GPU with FP8 tensor cores"
BASE_MODEL = {"d_model": 512, "num_heads": 8, "num_encoder_layers": 6, "num_decoder_layers": 6, "d_ff": 2048}
STEPS = 300
# (row, strategy config and its overrides for one device, fp8)
LOSS_RUNS = [
    ("bf16, ddp", ["--config", "configs/ddp.yaml"], False),
    ("float8, ddp", ["--config", "configs/ddp.yaml"], True),
    ("float8, fsdp", ["--config", "configs/fsdp.yaml"], True),
    ("float8, fsdp2", ["--config", "configs/tp.yaml", "--trainer.strategy.init_args.tensor_parallel_size", "1"], True),
]  # fmt: skip


def fp8(setting: Setting, wide: bool = False) -> dict[str, Any]:
    """Tokens/s of the ~400M model, compiled, bf16 against float8 at two settings, alone on the device; ``wide``
    (``fp8_wide``): a model four times as wide instead (d 4096, 2+2 layers), whose products are large enough for
    float8's casts to pay, at dropout 0."""
    config, rows, length, warmup, steps = throughput_sizes(setting)
    settings = [(0.0, 2 * rows), (config.dropout, rows)]
    if wide:
        dims = {"d_model": 4 * config.d_model, "num_heads": 2 * config.num_heads, "d_ff": 4 * config.d_ff}
        config = dataclasses.replace(config, **dims, num_encoder_layers=2, num_decoder_layers=2)
        settings = [(0.0, rows)]
    peak = setting.peak_flops()
    from torch_handle.flops import training_flops

    table, ok = [], True
    for dropout, run_rows in settings:
        model_config = dataclasses.replace(config, dropout=dropout)
        batches = random_batches(config.src_vocab_size, run_rows, length, warmup + steps)
        flops = training_flops(config, [length] * run_rows, [length] * run_rows)
        bf16 = None
        for name in ("bf16", "float8"):
            levers = ("fp8",) if name == "float8" else ()
            if not setting.dry_run:  # compiling needs a C++ toolchain on a CPU, and minutes: the GPU measures it
                levers += ("compile",)
            timing = Timing(model_config, setting, warmup, steps)
            try:
                step, memory = lightning_step(timing, batches, levers, init_device=setting.device)
            except Exception as error:  # noqa: BLE001 - the row says why; a CPU must refuse float8 in one line
                refused = setting.dry_run and name == "float8" and str(error).startswith(REFUSAL)
                ok = ok and refused
                table.append([f"dropout {dropout}, {run_rows} rows", name, f"{'refused' if refused else 'failed'}: "
                              f"{str(error).splitlines()[0][:160]}", "", "", "", ""])  # fmt: skip
                continue
            bf16 = step if name == "bf16" else bf16
            ratio = bf16 / step if bf16 else None
            mfu = flops / step / peak * 100 if peak else None
            tokens = f"{2 * run_rows * length / step:,.0f}"
            table.append([f"dropout {dropout}, {run_rows} rows", name, fmt(step, 3), tokens, fmt(ratio, 3),
                          fmt(mfu, 1), fmt(memory)])  # fmt: skip
            mark(" | ".join(map(str, table[-1])))
            free_memory(setting)
    size = f"d {config.d_model}, {config.num_encoder_layers}+{config.num_decoder_layers} layers, d_ff {config.d_ff}"
    title = (
        f"The throughput step's model ({size}), {length} + {length} tokens a row, "
        f"`{setting.precision}`, compiled layers{' (not in a dry run)' if setting.dry_run else ''}, Lightning's loop, "
        f"median of {steps} steps after {warmup}: `--model.fp8` against bf16. MFU counts the same FLOPs against the "
        f"bf16 peak ({peak or 'none known'} FLOP/s) in both rows."
    )
    header = ["setting", "products", "step (s)", "tokens/s", "x bf16", "MFU (%, bf16 peak)", "peak memory (GiB)"]
    return {"ok": ok, "tables": [result_table(title, header, table)]}


def fp8_loss(setting: Setting, data: Path) -> dict[str, Any]:
    """``cli.py fit --config multi30k`` for 300 steps with a Transformer-base model, bf16 against float8 under each
    strategy config, side by side on the one device; validation and training losses read back from TensorBoard."""
    if not (data / "train.en").is_file():
        return {"ok": True, "tables": [result_table("fp8 loss", ["result"], [[f"skipped: no {data}/train.en"]])]}
    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite-fp8-"))
    runs = LOSS_RUNS if not setting.dry_run else [LOSS_RUNS[0], LOSS_RUNS[1]]
    with ThreadPoolExecutor(len(runs)) as pool:
        rows = list(pool.map(lambda i: _loss_row(*runs[i], tmp / str(i), 29500 + i, setting, data), range(len(runs))))
    base = rows[0][2]  # bf16 under ddp: every float8 run's validation loss against it
    for row in rows:
        row.insert(3, fmt((row[2] / base - 1) * 100, 2) if row[2] and base and row[0].startswith("float8") else "")
        row[2] = fmt(row[2], 4) if row[2] else ""
    refused = setting.dry_run and all(REFUSAL in row[-1] for row in rows if row[0].startswith("float8"))
    ok = all(row[-1] == "passed" for row in rows) or refused
    steps = 6 if setting.dry_run else STEPS
    title = (
        f"`cli.py fit --config configs/multi30k.yaml --config STRATEGY` on one device, `{setting.precision}`, "
        f"{'tiny' if setting.dry_run else 'Transformer-base (d 512, 8 heads, 6+6 layers, d_ff 2048)'} model, "
        f"compiled{' (not in a dry run)' if setting.dry_run else ''}, {steps} steps of Multi30k, side by side: "
        "validation loss (per-token NLL on Multi30k's validation split) at the last step, float8 against bf16 under "
        "ddp (under fsdp and fsdp2 too), and the last logged training loss"
    )
    header = ["run", "seconds", "val loss", "float8 - bf16 (%)", "train loss (last logged)", "result"]
    return {"ok": ok, "tables": [result_table(title, header, rows)]}


def _loss_row(
    name: str, strategy: list[str], float8: bool, run: Path, port: int, setting: Setting, data: Path
) -> list[Any]:
    import time

    steps = 6 if setting.dry_run else STEPS
    dims = TINY_MODEL if setting.dry_run else BASE_MODEL
    command = [
        sys.executable, "cli.py", "fit", "--config", "configs/multi30k.yaml", *strategy,
        "--trainer.accelerator", setting.accelerator, "--trainer.devices", "1", "--trainer.precision",
        setting.precision, "--trainer.max_steps", str(steps), "--trainer.check_val_every_n_epoch", "null",
        "--trainer.val_check_interval", str(steps), "--trainer.log_every_n_steps", str(min(50, steps)),
        "--trainer.enable_progress_bar", "false", "--trainer.default_root_dir", str(run),
        "--data.init_args.data_dir", str(data), "--model.lr", "5e-4", "--model.warmup_steps", str(steps // 3),
        "--model.transformer.dropout", "0.1",
        *[f"--model.transformer.{k}={v}" for k, v in dims.items()],
        *(["--model.compile", "true"] if not setting.dry_run else []),
        *(["--model.fp8", "true"] if float8 else []),
    ]  # fmt: skip
    if setting.dry_run:
        command += ["--data.init_args.bpe_vocab_size", "300", "--trainer.limit_val_batches", "2"]
    start = time.perf_counter()
    env = os.environ | {"MASTER_PORT": str(port)}  # side by side: one rendezvous port each
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
    seconds = time.perf_counter() - start
    if done.returncode:
        lines = done.stderr.strip().splitlines() or ["?"]
        mark(f"{name} failed:\n" + "\n".join(lines[-60:]))  # into the step's log, which the suite keeps
        error = next((line for line in reversed(lines) if "Error" in line), lines[-1])[:200]
        return [name, f"{seconds:.0f}", None, "", f"failed: {error}"]
    scalars = _scalars(run)
    val = scalars.get("val/loss", [])
    train = scalars.get("train/loss", [])
    last_train = f"{train[-1][1]:.4f} (step {train[-1][0]})" if train else ""
    return [name, f"{seconds:.0f}", val[-1][1] if val else None, last_train, "passed"]


def _scalars(run: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar the run's TensorBoard logger wrote: tag -> [(step, value)], in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    scalars: dict[str, list[tuple[int, float]]] = {}
    for events in sorted(run.rglob("events.out.tfevents.*")):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            scalars.setdefault(tag, []).extend((e.step, e.value) for e in accumulator.Scalars(tag))
    return {tag: sorted(values) for tag, values in scalars.items()}
