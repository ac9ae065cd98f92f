"""``strategy_throughput``: the throughput step's model through ``lightning.Trainer`` with each strategy config's
strategy (DDP, ZeRO-1/2/3, FSDP) on one device, each in its own process (``one_strategy``): tokens/s against DDP's,
peak memory."""

from __future__ import annotations

import functools
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import yaml
from common import markdown_table

from gpu.setting import ROOT, Setting, fmt, launched_env, mark, result_table, wait_for_turn
from gpu.throughput import Timing, lightning_step, random_batches, throughput_sizes

STEP_SCRIPT = ROOT / "benchmarks" / "gpu_steps.py"  # runs one_strategy in a process of its own
STRATEGY_CONFIGS = ("ddp", "zero1", "zero2", "zero3", "zero3_submodules", "fsdp")  # zero3_submodules: below


def deepspeed_default_hooks(**options: Any) -> Any:
    """Our ``DeepSpeedStrategy`` without its ZeRO-3 layer units (:func:`torch_handle.parallel.set_zero3_units`):
    DeepSpeed's own hooks on every submodule, the reference those units are measured against (``zero3_submodules``)."""
    from typing_extensions import override

    from torch_handle.strategies import DeepSpeedStrategy

    class SubmoduleHooks(DeepSpeedStrategy):
        @override
        def init_deepspeed(self) -> None:  # Lightning's
            super(DeepSpeedStrategy, self).init_deepspeed()

    return SubmoduleHooks(**options)


Launched = tuple[Path, dict[str, subprocess.Popen[str]]]  # strategy_throughput's folder and its waiting processes


def launch_strategies(setting: Setting) -> Launched:
    """One ``one_strategy --wait`` process per strategy config: each prepares on the host, then waits for its turn."""
    names = STRATEGY_CONFIGS if not setting.dry_run else ("ddp", "zero2", "zero3", "zero3_submodules")
    folder = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    children = {}
    for port, name in enumerate(names, start=29600):  # a rendezvous port each, fixed before any of them fits
        command = [sys.executable, str(STEP_SCRIPT), "one_strategy", str(folder / f"{name}.json"), "--strategy", name]
        command += ["--wait", *(["--dry-run"] if setting.dry_run else [])]
        with (folder / f"{name}.log").open("w") as log:
            env = launched_env() | {"MASTER_PORT": str(port)}
            children[name] = subprocess.Popen(
                command, stdin=subprocess.PIPE, stdout=log, stderr=log, text=True, env=env
            )
    return folder, children


def strategy_throughput(setting: Setting, launched: Launched | None = None) -> dict[str, Any]:
    """The throughput step's model under each strategy config's strategy on one device (its Lightning loop, eager):
    what ZeRO's partitioning and FSDP's sharding cost against DDP before any second device shares the work. Each
    strategy in its own process, so that one's process group and DeepSpeed's engine cannot leak into the next. The
    processes prepare side by side on the host (imports, the model built on the CPU: most of a process's time; in the
    suite, while the side-by-side steps run), then each fits alone on the otherwise idle device."""
    folder, children = launched or launch_strategies(setting)
    while any(child.poll() is None and not (folder / f"{name}.ready").exists() for name, child in children.items()):
        time.sleep(0.1)
    mark("every strategy prepared")
    rows, seconds = [], {}
    for name, child in children.items():
        assert child.stdin is not None
        if child.poll() is None:  # its turn: the others wait on their stdin, idle
            child.stdin.write("go\n")
            child.stdin.close()
            child.wait()
        log = (folder / f"{name}.log").read_text()
        print(log[-3000:], flush=True)
        out = folder / f"{name}.json"
        if child.returncode or not out.exists():
            rows.append([name, "", "", "", "failed: " + (log.strip().splitlines() or ["?"])[-1][:150]])
            continue
        result = json.loads(out.read_text())
        step = seconds[name] = result["seconds_per_step"]
        ratio = fmt(seconds["ddp"] / step * 100, 1) if "ddp" in seconds else ""
        rows.append([name, fmt(step, 3), f"{result['tokens'] / step:,.0f}", ratio, fmt(result["peak"])])
        mark(" | ".join(map(str, rows[-1])))
    title = (
        f"The throughput step's model (eager, `{setting.precision}`, the same batches) through `lightning.Trainer` "
        "with each strategy config's strategy, one device; `zero3_submodules` is ZeRO-3 with DeepSpeed's hooks on "
        "every submodule instead of one unit per layer. Goals: ZeRO-1/2 >= 95% of DDP's tokens/s, ZeRO-3 >= 80%."
    )
    header = ["strategy", "step (s)", "tokens/s", "% of DDP", "peak memory (GiB)"]
    return {"ok": len(seconds) == len(children), "tables": [result_table(title, header, rows)]}


def one_strategy(
    setting: Setting, strategy: str, overrides: dict[str, Any], profile: bool, ready: Path | None = None
) -> dict[str, Any]:
    """One row of ``strategy_throughput``: its median step, tokens and peak memory. By hand, ``--overrides`` changes the
    strategy's options and ``--profile`` prints where the last step's time goes on the host (Python functions, the
    time the GPU was busy): how ZeRO-2's per-parameter overflow check was found (``benchmarks/RESULTS.md``)."""
    import importlib

    submodules = strategy == "zero3_submodules"
    config_file = ROOT / "configs" / f"{'zero3' if submodules else strategy}.yaml"
    settings = yaml.safe_load(config_file.read_text())["trainer"]["strategy"]
    if isinstance(settings, dict):
        module, _, name = settings["class_path"].rpartition(".")
        options = {**settings.get("init_args", {}), **overrides}
        chosen = deepspeed_default_hooks if submodules else getattr(importlib.import_module(module), name)
        settings = chosen(**options)
    config, rows, length, warmup, steps = throughput_sizes(setting)
    batches = random_batches(config.src_vocab_size, rows, length, warmup + steps)
    mark("strategy and batches made")
    profiled: list[dict[str, Any]] = []
    wait = functools.partial(wait_for_turn, ready) if ready else lambda: None
    timing = Timing(config, setting, warmup, steps)
    step, peak = lightning_step(timing, batches, (), settings, profiled if profile else None, wait)
    tables = [_host_profile(strategy, profiled[0])] if profiled else []
    for table in tables:  # into the parent's log as well
        print(table["title"], markdown_table(table["header"], table["rows"]), sep="\n", flush=True)
    return {"ok": True, "seconds_per_step": step, "tokens": 2 * rows * length, "peak": peak, "tables": tables}


def _host_profile(strategy: str, profiled: dict[str, Any]) -> dict[str, Any]:
    """The profiled step as a table: the Python functions with the most time of their own, then DeepSpeed's with the
    most time including their callees (which of its phases costs)."""
    import pstats

    stats = pstats.Stats(profiled["cprofile"]).stats.items()
    own = sorted(stats, key=lambda item: item[1][2], reverse=True)[:12]
    deepspeed = [item for item in stats if "deepspeed" in item[0][0] and item not in own]
    entries = own + sorted(deepspeed, key=lambda item: item[1][3], reverse=True)[:8]
    rows = [
        [f"{Path(file).name}:{line} {function}"[:90], calls, fmt(own * 1e3, 1), fmt(total * 1e3, 1)]
        for (file, line, function), (_, calls, own, total, _) in entries
    ]
    title = (
        f"`{strategy}`: one step under cProfile and the torch profiler, {profiled['wall_ms']:,.1f} ms (slowed by "
        f"them), {profiled['gpu_ms']:,.1f} ms of GPU kernels; the host functions with the most time of their own, then "
        "DeepSpeed's with the most including their callees"
    )
    return result_table(title, ["function", "calls", "own ms", "with callees ms"], rows)
