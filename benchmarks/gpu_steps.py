"""Runs one step of ``gpu_suite.py`` in this process: ``python benchmarks/gpu_steps.py STEP OUT.json [--dry-run]``.

Each step lives in a module of its own under ``benchmarks/gpu/`` (what they share: ``gpu/setting.py``) and writes
``{"step", "ok", "device", "tables": [{"title", "header", "rows"}], ...}`` to OUT.json. On a GPU they run in bf16 at
the issue's sizes; ``--dry-run`` runs the same code on the CPU in fp32 with tiny sizes.
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gpu.averaging import multi30k_averaging
from gpu.decoding import decoding
from gpu.fp8 import fp8, fp8_loss
from gpu.gpu_tests import gpu_tests
from gpu.long import long
from gpu.multi30k import multi30k
from gpu.recipe import multi30k_recipe
from gpu.setting import ROOT, Setting, device_line, mark, wait_for_turn
from gpu.strategies import strategies
from gpu.strategy_throughput import STRATEGY_CONFIGS, launch_strategies, one_strategy, strategy_throughput
from gpu.throughput import throughput


def _imported(*modules: str) -> tuple[()]:
    """Import ``modules`` now, before the step's turn on the device: Lightning's import is slow on a GPU host."""
    import importlib

    for module in modules:
        importlib.import_module(module)
    return ()


# what a timed step does on the host before its turn (``--wait``): the suite runs it beside the side-by-side steps
PREPARE: dict[str, Callable[[Setting], tuple[Any, ...]]] = {
    "throughput": lambda setting: _imported("lightning", "torch_handle.module", "torch_handle.flops"),
    "strategy_throughput": lambda setting: (launch_strategies(setting),),
    "long": lambda setting: _imported("torch_handle.model"),
    "decoding": lambda setting: _imported("torch_handle.model"),
    "fp8": lambda setting: _imported("lightning", "torch_handle.module", "torch_handle.flops"),
    "fp8_wide": lambda setting: _imported("lightning", "torch_handle.module", "torch_handle.flops"),
}
STEPS = {
    "gpu_tests": gpu_tests,
    "strategies": strategies,
    "throughput": throughput,
    "long": long,
    "decoding": decoding,
    "multi30k": multi30k,
    "fp8_loss": fp8_loss,
    "fp8": fp8,
    "fp8_wide": functools.partial(fp8, wide=True),
    "multi30k_recipe": multi30k_recipe,
    "multi30k_averaging": multi30k_averaging,
    "strategy_throughput": strategy_throughput,
    "one_strategy": one_strategy,
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true")
    parser.add_argument("--multi30k", type=Path, default=ROOT / "data" / "multi30k", help="the multi30k step's data")
    parser.add_argument("--multi30k-epochs", type=int, default=20, help="the multi30k step's epochs (124 steps each)")
    parser.add_argument(
        "--recipe-epochs", type=int, help="multi30k_recipe's and multi30k_averaging's epochs (default: the config's)"
    )
    parser.add_argument("--recipe-compile", action="store_true", help="multi30k_recipe also times a compiled run")
    parser.add_argument("--strategy", choices=STRATEGY_CONFIGS, help="one_strategy's strategy config")
    parser.add_argument("--overrides", type=json.loads, default={}, help="one_strategy's options over the config's")
    parser.add_argument("--profile", action="store_true", help="one_strategy profiles its last step")
    parser.add_argument(
        "--wait", action="store_true", help="prepare on the host, write OUT.ready, use the device after a stdin line"
    )
    args = parser.parse_args()
    mark(f"{args.step}: imported")
    setting = Setting(args.dry_run)
    device = device_line(setting)
    mark(f"on {device}")
    ready = args.out.with_suffix(".ready") if args.wait else None
    extra = (args.multi30k, args.multi30k_epochs) if args.step == "multi30k" else ()
    extra = (args.multi30k,) if args.step == "fp8_loss" else extra
    extra = (args.multi30k, args.recipe_epochs, args.recipe_compile) if args.step == "multi30k_recipe" else extra
    extra = (args.multi30k, args.recipe_epochs) if args.step == "multi30k_averaging" else extra
    if args.step == "one_strategy":  # waits inside, with its model built
        extra = (args.strategy, args.overrides, args.profile, ready)
    else:
        extra += PREPARE[args.step](setting) if args.step in PREPARE else ()
        if ready:
            wait_for_turn(ready)
    result = {"step": args.step, "device": device, **STEPS[args.step](setting, *extra)}
    mark(f"{args.step}: done")
    result.setdefault("error", "" if result["ok"] else "see its table")
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
