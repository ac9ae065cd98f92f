"""What every step of the GPU suite shares: where it runs (:class:`Setting`), its log marks, timing, and the
result tables each step writes as ``{"step", "ok", "device", "tables": [{"title", "header", "rows"}], ...}``."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from common import cpu_name

ROOT = Path(__file__).resolve().parents[2]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s of the SXM parts, by device name
THROUGHPUT_MODEL = {"d_model": 1024, "num_heads": 16, "num_encoder_layers": 12, "num_decoder_layers": 12, "d_ff": 4096}
TINY_MODEL = {"d_model": 32, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1, "d_ff": 64}
LAUNCHED = "GPU_STEPS_LAUNCHED"  # the launching process's time.time(), so that imports count in mark()
_LOADED = time.time()


def mark(what: str) -> None:
    """``[seconds since launch] what`` into the step's log: where a step's time goes beyond its timed loops."""
    print(f"[{time.time() - float(os.environ.get(LAUNCHED, _LOADED)):6.1f} s] {what}", flush=True)


def launched_env() -> dict[str, str]:
    """The environment for a child step process: this one's, with the launch time its marks count from."""
    return os.environ | {LAUNCHED: str(time.time())}


class Setting:
    """Where and at what sizes a step runs: the GPU in bf16, or (dry run) the CPU in fp32 with tiny sizes."""

    def __init__(self, dry_run: bool) -> None:
        self.dry_run = dry_run
        self.device = torch.device("cpu" if dry_run else "cuda")
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.precision = "32-true" if dry_run else "bf16-mixed"
        self.accelerator = "cpu" if dry_run else "gpu"

    def autocast(self) -> torch.autocast:
        return torch.autocast(self.device.type, dtype=self.dtype, enabled=not self.dry_run)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()

    def peak_gib(self) -> float | None:
        return torch.cuda.max_memory_allocated() / 2**30 if self.device.type == "cuda" else None

    def peak_flops(self) -> float | None:
        name = torch.cuda.get_device_name() if self.device.type == "cuda" else ""
        return next((flops for key, flops in PEAK_BF16.items() if key in name), None)


def device_line(setting: Setting) -> str:
    if setting.device.type == "cuda":
        props = torch.cuda.get_device_properties(0)
        name = f"{props.name}, {props.total_memory / 2**30:.0f} GiB, CUDA {torch.version.cuda}"
    else:
        name = f"CPU {cpu_name()}"
    return f"{name}, torch {torch.__version__}"


def timed(fn: Callable[[], object], setting: Setting, repeats: int, warmup: int = 1) -> float:
    """Median seconds of ``fn`` after ``warmup`` calls, the device synchronised around each."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        setting.sync()
        start = time.perf_counter()
        fn()
        setting.sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def result_table(title: str, header: list[str], rows: list[list[Any]]) -> dict[str, Any]:
    return {"title": title, "header": header, "rows": rows}


def fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def free_memory(setting: Setting) -> None:
    import gc

    gc.collect()
    if setting.device.type == "cuda":
        torch.cuda.empty_cache()


def wait_for_turn(ready: Path) -> None:
    """Say this process is prepared (``ready`` exists), then block until the process that launched it (the suite,
    or strategy_throughput) gives it the device with a line on stdin."""
    ready.touch()
    if not sys.stdin.readline():  # end of input: the launching process has gone (its limit), so no turn comes
        sys.exit("no turn on the device came: the process that launched this one has ended")
    mark("its turn on the device")
