"""The steps of ``gpu_suite.py``, one per process: ``python benchmarks/gpu_steps.py STEP OUT.json [--dry-run]``.

Each writes ``{"step", "ok", "device", "tables": [{"title", "header", "rows"}], ...}`` to OUT.json. On a GPU they
run in bf16 at the issue's sizes; ``--dry-run`` runs the same code on the CPU in fp32 with tiny sizes.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import yaml
from common import cpu_name, markdown_table

ROOT = Path(__file__).resolve().parents[1]
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


def _table(title: str, header: list[str], rows: list[list[Any]]) -> dict[str, Any]:
    return {"title": title, "header": header, "rows": rows}


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


# --- gpu_tests -------------------------------------------------------------------------------------------------------


def gpu_tests(setting: Setting) -> dict[str, Any]:
    """``pytest -m gpu``: its closing line, and the tests that failed."""
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "tests/test_gpu.py"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    print(run.stdout, run.stderr)  # into the step's log: the failures in full
    lines = run.stdout.splitlines()
    summary = next(line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|skipped|failed)", line))
    failed = [line.split()[1] for line in lines if line.startswith("FAILED")]
    rows = [[summary, ", ".join(failed) or "none"]]
    return {"ok": run.returncode == 0, "tables": [_table("`pytest -m gpu`", ["result", "failed"], rows)]}


# --- strategies ------------------------------------------------------------------------------------------------------

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
    from torch_handle.export import main as export

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
    return {"ok": all(row[-1] == "passed" for row in rows), "tables": [_table(title, header, rows)]}


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


# --- throughput ------------------------------------------------------------------------------------------------------


def _batches(vocab: int, rows: int, length: int, count: int) -> list[dict[str, torch.Tensor]]:
    """``count`` batches of ``rows`` random sources and targets of ``length`` tokens (no padding)."""
    from torch_handle.data import BOS_ID, EOS_ID

    generator = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(count):
        src = torch.randint(4, vocab, (rows, length), generator=generator)
        src[:, -1] = EOS_ID
        tgt = torch.randint(4, vocab, (rows, length + 1), generator=generator)
        tgt[:, 0] = BOS_ID
        batches.append({"src": src, "tgt": tgt})
    return batches


def _throughput_sizes(setting: Setting) -> tuple[Any, int, int, int, int]:
    """The throughput steps' model config, rows, tokens per sequence, warm-up and timed steps."""
    from torch_handle.model import TransformerConfig

    dims = TINY_MODEL if setting.dry_run else THROUGHPUT_MODEL
    vocab, length, rows = (300, 32, 2) if setting.dry_run else (32000, 2048, 8)
    warmup, steps = (1, 2) if setting.dry_run else (3, 10)
    config = TransformerConfig(
        **dims, src_vocab_size=vocab, tgt_vocab_size=vocab, position="rope", norm_first=True, tie_embeddings=True
    )
    return config, rows, length, warmup, steps


def throughput(setting: Setting) -> dict[str, Any]:
    """The ~400M model through Seq2SeqModule and Trainer, against the same step in a plain loop; each lever on and
    off in the same run (``torch.compile`` of the layers, fused AdamW, attention without a padding mask)."""
    from torch_handle.data import EOS_ID, PAD_ID
    from torch_handle.flops import training_flops
    from torch_handle.model import Transformer

    config, rows, length, warmup, steps = _throughput_sizes(setting)
    dims, vocab = TINY_MODEL if setting.dry_run else THROUGHPUT_MODEL, config.src_vocab_size
    batches = _batches(vocab, rows, length, warmup + steps)
    padded = [{"src": b["src"].clone(), "tgt": b["tgt"]} for b in batches]
    for b in padded:  # one padding token per source: the attention needs a mask, and SDPA leaves the flash kernel
        b["src"][:, -2:] = torch.tensor([EOS_ID, PAD_ID])
    peak = setting.peak_flops()
    runs = [  # (loop, levers); "compile": the layers, "loss": the loss too, "foreach": AdamW not fused,
        # "padded": one padding token per source; "dropout0" and "double" (twice the rows): the references' setting;
        # "residual": dropout on the residual branches and embeddings only, as in the paper (and fairseq's defaults)
        ("Lightning", ()),
        ("Lightning", ("compile",)),
        ("plain", ()),
        ("plain", ("foreach",)),
        ("plain", ("padded",)),
        ("plain", ("compile", "loss")),
        ("Lightning", ("compile", "dropout0", "double")),
        ("Lightning", ("compile", "residual", "double")),
    ]
    if setting.dry_run:  # compiling needs a C++ toolchain on a CPU, and takes minutes: the GPU run measures it
        runs = [run for run in runs if "compile" not in run[1]]
    results, mfus, table = {}, {}, []
    names = {"compile": "compiled layers", "loss": "compiled loss", "foreach": "foreach AdamW",
             "padded": "one padding token per source (masked attention)",
             "dropout0": "dropout 0", "double": f"{2 * rows} rows",
             "residual": "attention and activation dropout 0 (the paper's dropout)"}  # fmt: skip
    for loop, levers in runs:
        model_config = dataclasses.replace(config, dropout=0.0) if "dropout0" in levers else config
        if "residual" in levers:
            model_config = dataclasses.replace(config, attention_dropout=0.0, activation_dropout=0.0)
        run_rows = 2 * rows if "double" in levers else rows
        inputs = padded if "padded" in levers else batches
        if run_rows != rows:
            inputs = _batches(vocab, run_rows, length, warmup + steps)
        timing = Timing(model_config, setting, warmup, steps)
        if loop == "Lightning":  # built where it runs: a 400M model's host init took seconds a build
            step, memory = _lightning_step(timing, inputs, levers, init_device=setting.device)
        else:
            step, memory = _plain_step(timing, inputs, levers)
        results[(loop, levers)] = step
        flops = training_flops(config, [length] * run_rows, [length] * run_rows)
        mfus[(loop, levers)] = flops / step / peak * 100 if peak else None
        lever = ", ".join(names[lever] for lever in levers) or "eager"
        tokens = f"{2 * run_rows * length / step:,.0f}"
        table.append([loop, lever, _fmt(step, 3), tokens, _fmt(mfus[(loop, levers)], 1), _fmt(memory)])
        mark(" | ".join(map(str, table[-1])))  # the log keeps the rows of a step stopped at its limit
        _free(setting)
    # like for like: the module's `compile` compiles its layers and its loss
    pairs = {"eager": ((), ()), "compiled": (("compile",), ("compile", "loss"))}
    overhead = [
        f"{name} {(results[('Lightning', ours)] / results[('plain', theirs)] - 1) * 100:+.1f}%"
        for name, (ours, theirs) in pairs.items()
        if ("Lightning", ours) in results
    ]
    tables = []
    if not setting.dry_run:
        tables.append(_profile(config, batches, setting))
        mark("profiled step")
    with setting.device:  # initialised where it runs: a 400M model's host init took seconds a build
        model = Transformer(config).train()
    counted = _counted_flops(model, {k: v.to(setting.device) for k, v in batches[0].items()}, setting)
    mark("FLOPs counted")
    best = max((m for (_, levers), m in mfus.items() if not {"dropout0", "residual"} & set(levers) and m), default=None)
    referenced = mfus.get(("Lightning", ("compile", "dropout0", "double")))
    residual = mfus.get(("Lightning", ("compile", "residual", "double")))
    flops = training_flops(config, [length] * rows, [length] * rows)
    title = (
        f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters ({dims}, dropout {config.dropout}), "
        f"vocabulary {vocab}, {rows} x ({length} + {length}) tokens a step, `{setting.precision}`, AdamW; median of "
        f"{steps} steps after {warmup}. Lightning's overhead against the plain loop: {', '.join(overhead)} (goal <= "
        f"2%). Best MFU {_fmt(best, 1) or '-'}%; at dropout 0 and {2 * rows} rows, as the decoder-only references "
        f"train: {_fmt(referenced, 1) or '-'}% (goal >= 45%); with dropout {config.dropout} on the residual branches "
        f"and embeddings alone, as in the paper: {_fmt(residual, 1) or '-'}%. FLOPs by the formula {flops:.3e} a "
        f"step; FlopCounterMode counted {counted / flops:.3f} of them. MFU against {peak or 'no known'} FLOP/s."
    )
    header = ["loop", "levers", "step (s)", "tokens/s", "MFU (%)", "peak memory (GiB)"]
    return {"ok": True, "tables": [_table(title, header, table), *tables]}


@dataclasses.dataclass
class Timing:
    """What every timed loop of the throughput step shares: the model's config, the device, and how many steps."""

    config: Any
    setting: Setting
    warmup: int
    steps: int


def _free(setting: Setting) -> None:
    import gc

    gc.collect()
    if setting.device.type == "cuda":
        torch.cuda.empty_cache()


def _lightning_step(
    timing: Timing,
    batches: list[dict[str, torch.Tensor]],
    levers: tuple[str, ...],
    strategy: Any = "auto",
    profiled: list[dict[str, Any]] | None = None,
    before_fit: Callable[[], None] = lambda: None,
    init_device: torch.device | str = "cpu",
) -> tuple[float, float | None]:
    """Median step of Seq2SeqModule under ``lightning.Trainer`` (its AdamW is fused on a GPU), and peak memory.
    ``profiled``: the last step runs under cProfile and the torch profiler, whose results are appended to it.
    ``before_fit`` runs once the module and trainer are built, before anything reaches the device. ``init_device``:
    where the module is built and initialised (the strategies' processes build theirs on the host before their turn)."""
    config, setting, warmup, steps = timing.config, timing.setting, timing.warmup, timing.steps
    import lightning as L

    from torch_handle.module import Seq2SeqModule

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []
            self.profilers: tuple[Any, Any] | None = None

        def on_fit_start(self, *args: Any) -> None:
            mark("on_fit_start: the strategy is set up")

        def on_train_start(self, *args: Any) -> None:
            mark("on_train_start")

        def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
            setting.sync()
            if profiled is not None and trainer.global_step == warmup + steps - 1:
                import cProfile

                from torch.profiler import ProfilerActivity, profile

                activity = ProfilerActivity.CUDA if setting.device.type == "cuda" else ProfilerActivity.CPU
                self.profilers = (profile(activities=[activity]), cProfile.Profile())
                self.profilers[0].__enter__()
                self.profilers[1].enable()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            setting.sync()
            self.seconds.append(time.perf_counter() - self.start)
            if self.profilers is not None:
                torch_profile, host = self.profilers
                host.disable()
                torch_profile.__exit__(None, None, None)
                gpu_us = sum(e.self_device_time_total for e in torch_profile.key_averages())
                assert profiled is not None
                profiled.append({"cprofile": host, "gpu_ms": gpu_us / 1e3, "wall_ms": self.seconds[-1] * 1e3})
                self.profilers = None

    torch.manual_seed(0)
    with torch.device(init_device):
        module = Seq2SeqModule(
            transformer=config, vocab_size=config.src_vocab_size, warmup_steps=2, generate_every_n_val_epochs=0,
            compile="compile" in levers,
        )  # fmt: skip
    mark("model built")
    timer = Timer()
    trainer = L.Trainer(
        accelerator=setting.accelerator, devices=1, strategy=strategy, precision=setting.precision,
        max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    before_fit()
    setting.reset_peak()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    mark(f"fit returned: {warmup} + {steps} steps")
    timed_steps = timer.seconds[warmup : warmup + steps - (profiled is not None)]  # not the profiled one
    return sorted(timed_steps)[len(timed_steps) // 2], setting.peak_gib()


def _plain_model(config: Any, setting: Setting, levers: tuple[str, ...]) -> Callable[[dict[str, torch.Tensor]], None]:
    """One training step of a fresh model (loss, backward, AdamW) in a hand-written loop, with ``levers``: the
    module's own loss function, so that the loop differs from the LightningModule's step only by Lightning."""
    from torch_handle.loss import token_sums
    from torch_handle.model import Transformer

    torch.manual_seed(0)
    with setting.device:  # initialised where it runs, not on the host first
        model = Transformer(config).train()
    if "compile" in levers:
        for layer in (*model.encoder_layers, *model.decoder_layers):
            layer.compile()
    fused = "foreach" not in levers
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused or None, foreach=None if fused else True)

    sums = torch.compile(token_sums) if "loss" in levers else token_sums

    def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:  # the module's loss, per target token
        loss_sum, _, tokens = sums(logits, labels, config.pad_id, 0.1)
        return loss_sum / tokens

    def step(batch: dict[str, torch.Tensor]) -> None:
        labels = batch["tgt"][:, 1:]
        targets = labels != config.pad_id  # as the module: logits at the targets only
        with setting.autocast():
            loss = loss_fn(model(batch["src"], batch["tgt"][:, :-1], targets), labels[targets])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def _plain_step(
    timing: Timing, batches: list[dict[str, torch.Tensor]], levers: tuple[str, ...]
) -> tuple[float, float | None]:
    """Median step of the same model, loss and optimizer in a hand-written loop, and peak memory."""
    setting = timing.setting
    step = _plain_model(timing.config, setting, levers)
    on_device = [{k: v.to(setting.device) for k, v in b.items()} for b in batches]
    setting.reset_peak()
    it = iter(on_device)
    return timed(lambda: step(next(it)), setting, repeats=timing.steps, warmup=timing.warmup), setting.peak_gib()


def _profile(config: Any, batches: list[dict[str, torch.Tensor]], setting: Setting) -> dict[str, Any]:
    """Where a compiled step's GPU time goes: the kernels that take most of it, from one profiled step."""
    from torch.profiler import ProfilerActivity, profile

    step = _plain_model(config, setting, ("compile",))
    on_device = [{k: v.to(setting.device) for k, v in b.items()} for b in batches[:3]]
    step(on_device[0])
    step(on_device[1])
    setting.sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step(on_device[2])
        setting.sync()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = max(sum(e.self_device_time_total for e in events), 1)
    events.sort(key=lambda e: e.self_device_time_total, reverse=True)
    rows = [
        [e.key[:90].replace("|", "/"), e.count, _fmt(e.self_device_time_total / 1e3, 1),
         _fmt(e.self_device_time_total / total * 100, 1)]
        for e in events[:14]
    ]  # fmt: skip
    title = f"One compiled step (plain loop) under the profiler: {total / 1e3:,.1f} ms of GPU kernels, the largest"
    return _table(title, ["kernel", "calls", "GPU ms", "share (%)"], rows)


def _counted_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor], setting: Setting) -> float:
    """FLOPs of one forward and backward as ``FlopCounterMode`` counts them (matrix products and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with setting.autocast():
            logits = model(batch["src"], batch["tgt"][:, :-1])
        logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


# --- strategy_throughput ---------------------------------------------------------------------------------------------

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


def _launch_strategies(setting: Setting) -> Launched:
    """One ``one_strategy --wait`` process per strategy config: each prepares on the host, then waits for its turn."""
    names = STRATEGY_CONFIGS if not setting.dry_run else ("ddp", "zero2", "zero3", "zero3_submodules")
    folder = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    children = {}
    for port, name in enumerate(names, start=29600):  # a rendezvous port each, fixed before any of them fits
        command = [sys.executable, __file__, "one_strategy", str(folder / f"{name}.json"), "--strategy", name]
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
    folder, children = launched or _launch_strategies(setting)
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
        ratio = _fmt(seconds["ddp"] / step * 100, 1) if "ddp" in seconds else ""
        rows.append([name, _fmt(step, 3), f"{result['tokens'] / step:,.0f}", ratio, _fmt(result["peak"])])
        mark(" | ".join(map(str, rows[-1])))
    title = (
        f"The throughput step's model (eager, `{setting.precision}`, the same batches) through `lightning.Trainer` "
        "with each strategy config's strategy, one device; `zero3_submodules` is ZeRO-3 with DeepSpeed's hooks on "
        "every submodule instead of one unit per layer. Goals: ZeRO-1/2 >= 95% of DDP's tokens/s, ZeRO-3 >= 80%."
    )
    header = ["strategy", "step (s)", "tokens/s", "% of DDP", "peak memory (GiB)"]
    return {"ok": len(seconds) == len(children), "tables": [_table(title, header, rows)]}


def _wait_for_turn(ready: Path) -> None:
    """Say this process is prepared (``ready`` exists), then block until the process that launched it (the suite,
    or strategy_throughput) gives it the device with a line on stdin."""
    ready.touch()
    if not sys.stdin.readline():  # end of input: the launching process has gone (its limit), so no turn comes
        sys.exit("no turn on the device came: the process that launched this one has ended")
    mark("its turn on the device")


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
    config, rows, length, warmup, steps = _throughput_sizes(setting)
    batches = _batches(config.src_vocab_size, rows, length, warmup + steps)
    mark("strategy and batches made")
    profiled: list[dict[str, Any]] = []
    wait = functools.partial(_wait_for_turn, ready) if ready else lambda: None
    timing = Timing(config, setting, warmup, steps)
    step, peak = _lightning_step(timing, batches, (), settings, profiled if profile else None, wait)
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
        [f"{Path(file).name}:{line} {function}"[:90], calls, _fmt(own * 1e3, 1), _fmt(total * 1e3, 1)]
        for (file, line, function), (_, calls, own, total, _) in entries
    ]
    title = (
        f"`{strategy}`: one step under cProfile and the torch profiler, {profiled['wall_ms']:,.1f} ms (slowed by "
        f"them), {profiled['gpu_ms']:,.1f} ms of GPU kernels; the host functions with the most time of their own, then "
        "DeepSpeed's with the most including their callees"
    )
    return _table(title, ["function", "calls", "own ms", "with callees ms"], rows)


# --- long ------------------------------------------------------------------------------------------------------------


def long(setting: Setting) -> dict[str, Any]:
    """``summarization_32k``'s model: one training step at 32,768 source tokens per kernel, then the longest source."""
    from torch_handle.model import Transformer, TransformerConfig

    settings = yaml.safe_load((ROOT / "configs" / "summarization_32k.yaml").read_text())["model"]["transformer"]
    settings = {**settings, "dropout": 0.0}  # flex has no attention dropout: both kernels without it
    length, target = (512, 16) if setting.dry_run else (32768, 256)
    if setting.dry_run:
        settings = {**settings, "window": 32}
    rows, seconds = [], {}
    for backend in ("sdpa",) if setting.dry_run else ("flex", "sdpa"):  # flex has no backward pass on a CPU
        model = Transformer(TransformerConfig(**{**settings, "attention_backend": backend})).to(setting.device)
        step, peak = _long_step(model, length, target, setting)
        seconds[backend] = step
        rows.append([backend, f"{length:,}", _fmt(step, 3), f"{length / step:,.0f}", _fmt(peak)])
        mark(" | ".join(rows[-1]))
        del model
        _free(setting)
    fastest = min(seconds, key=seconds.get)
    model = Transformer(TransformerConfig(**{**settings, "attention_backend": fastest})).to(setting.device)
    shorter = length // 8  # 8 sources of 4k against 1 of 32k: the same source and target tokens
    step, peak = _long_step(model, shorter, target // 8, setting, rows=8)
    rows.append([f"{fastest}, 8 sources", f"{shorter:,}", _fmt(step, 3), f"{8 * shorter / step:,.0f}", _fmt(peak)])
    flat = seconds[fastest] / step
    mark(" | ".join(rows[-1]))
    longest, deadline = length, time.monotonic() + (20 if setting.dry_run else 25)
    while time.monotonic() < deadline and longest < (2048 if setting.dry_run else 2**22):
        try:
            _long_step(model, 2 * longest, target, setting, repeats=1)
        except torch.OutOfMemoryError:
            break
        longest *= 2
    mark(f"longest source: {longest:,} tokens")
    title = (
        f"`configs/summarization_32k.yaml`'s model (dropout 0: flex has none), one source and {target} target tokens, "
        f"`{setting.precision}`, a training step (forward, backward, AdamW), median of 10. Time per source token at "
        f"{length:,} over {shorter:,} (8 sources of {target // 8} target tokens: the same tokens) with `{fastest}`: "
        f"{flat:.2f} "
        f"(goal: within 15% of 1). Longest source that trained with `{fastest}` in the time left, doubling: "
        f"{longest:,} tokens."
    )
    header = ["kernel", "source tokens", "step (s)", "source tokens/s", "peak memory (GiB)"]
    return {"ok": True, "tables": [_table(title, header, rows)]}


def _long_step(
    model: Any, length: int, target: int, setting: Setting, repeats: int = 10, rows: int = 1
) -> tuple[float, float | None]:
    # the model's own ids, not torch_handle.data's: that package imports Lightning, slow on the GPU host
    vocab, c = model.config.src_vocab_size, model.config
    src = torch.randint(4, vocab, (rows, length), device=setting.device)
    src[:, -1] = c.eos_id
    tgt = torch.randint(4, vocab, (rows, target + 1), device=setting.device)
    tgt[:, 0] = c.bos_id
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        with setting.autocast():
            logits = model(src, tgt[:, :-1])
        F.cross_entropy(logits.float().flatten(0, 1), tgt[:, 1:].flatten()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    setting.reset_peak()
    return timed(step, setting, repeats=repeats), setting.peak_gib()


# --- decoding --------------------------------------------------------------------------------------------------------


def _sdpa_choices(config: Any, rows: int, length: int, setting: Setting) -> str:
    """Which kernel SDPA picks for each decoding attention (torch's own dispatcher, no kernel run): the log's clue
    to a warm-up that grows with the number of sequence lengths a loop meets (a kernel plan built per shape)."""
    from torch.nn.attention import SDPBackend

    d = config.d_model // config.num_heads
    mask = torch.ones(rows, 1, 1, length, dtype=torch.bool, device=setting.device)  # the memory's padding mask

    def pick(queries: int, keys: int, **options: Any) -> str:
        q = torch.zeros(rows, config.num_heads, queries, d, device=setting.device, dtype=setting.dtype)
        k = torch.zeros(rows, config.num_heads, keys, d, device=setting.device, dtype=setting.dtype)
        try:
            return SDPBackend(torch._fused_sdp_choice(q, k, k, **options)).name
        except (RuntimeError, ValueError, AttributeError) as error:  # a private function: say so, do not fail the step
            return f"unknown ({type(error).__name__})"

    return (
        f"cached self-attention {pick(1, 100)}, cross-attention {pick(1, length, attn_mask=mask)}; recomputed: "
        f"causal self-attention {pick(100, 100, is_causal=True)}, cross-attention {pick(100, length, attn_mask=mask)}"
    )


@torch.no_grad()
def decoding(setting: Setting) -> dict[str, Any]:
    """Greedy with the key/value cache, eager and replayed as a CUDA graph, against recomputing the prefix; beam-4.
    The cached loop also runs on SDPA's own pick of kernel (cuDNN's on Hopper, a plan per new shape): each loop's
    first call is timed too, since that is what one ``generate`` call on a new batch meets."""
    import contextlib

    from torch_handle.model import Transformer, TransformerConfig, generate
    from torch_handle.model.generation import StaticDecoder
    from torch_handle.model.kernels import decoding_kernels

    settings = yaml.safe_load((ROOT / "configs" / "multi30k.yaml").read_text())["model"]["transformer"]
    settings = {**settings, **(TINY_MODEL if setting.dry_run else {}), "max_len": 512}
    model = Transformer(TransformerConfig(**settings)).to(setting.device).eval()
    rows, length, new = (4, 12, 16) if setting.dry_run else (64, 24, 256)
    src = torch.randint(4, model.config.src_vocab_size, (rows, length), device=setting.device)
    src[:, -1] = model.config.eos_id  # the model's ids: torch_handle.data would import Lightning (see _long_step)
    start = torch.full((rows, 1), model.config.bos_id, device=setting.device)
    mark("model built")
    mark(f"SDPA's kernel for the decoder's attention: {_sdpa_choices(model.config, rows, length, setting)}")

    def cached(kernels: Callable[[], contextlib.AbstractContextManager[None]] = decoding_kernels) -> None:
        with setting.autocast(), kernels():  # a fixed number of steps: a fresh model's EOS would end generate()
            memory, padding = model.encode(src), model.memory_padding(src)
            cache, token = model.new_cache(new), start
            for _ in range(new):
                token = model.decode(token, memory, padding, cache)[:, -1:].argmax(-1)

    def graphed() -> None:  # capture included: one graph per batch, as generate(cuda_graph=True) makes
        with setting.autocast(), decoding_kernels():
            memory, padding = model.encode(src), model.memory_padding(src)
            step, token = StaticDecoder(model, memory, padding, new, graph=True), start
            for _ in range(new):
                token = step(token)[:, -1:].argmax(-1)

    def recomputed() -> None:
        with setting.autocast(), decoding_kernels():
            memory, padding = model.encode(src), model.memory_padding(src)
            tokens = start
            for _ in range(new):
                tokens = torch.cat((tokens, model.decode(tokens, memory, padding)[:, -1:].argmax(-1)), dim=1)

    def beam() -> None:
        with setting.autocast():
            generate(model, src, 64 if not setting.dry_run else 8, num_beams=4)

    with setting.autocast():  # the process's one-time costs (cuBLAS, first kernels), before any first call is timed
        generate(model, src, 4)
    loops = {
        "cache": (cached, 3),
        "graph": (graphed, 3),
        "recomputed": (recomputed, 1),
        "beam": (beam, 3),
        "cache, SDPA's pick": (functools.partial(cached, contextlib.nullcontext), 3),  # last: its plans stay cached
    }
    seconds, first = {}, {}
    for name, (fn, repeats) in loops.items():
        setting.sync()
        begun = time.perf_counter()
        fn()
        setting.sync()
        first[name] = time.perf_counter() - begun
        seconds[name] = timed(fn, setting, repeats=repeats, warmup=0)
        mark(f"{name}: {seconds[name]:.3f} s, first call {first[name]:.1f} s")
    without = seconds["recomputed"]
    title = (
        f"The Multi30k recipe's model (`configs/multi30k.yaml`, fresh weights), {rows} sources of {length} tokens, "
        f"`{setting.precision}`, attention on SDPA's kernels other than cuDNN's (as `generate` runs) unless said. "
        f"Greedy at {new} new tokens with the cache: {without / seconds['cache']:.1f}x faster than recomputing "
        f"eagerly, {without / seconds['graph']:.1f}x replayed as a CUDA graph (goal >= 5x). First call: the same "
        "call on a process that has not yet met these shapes."
    )
    header = ["decoding", "seconds", "sentences/s", "first call (s)"]
    names = {
        "cache": f"greedy, {new} tokens, key/value cache",
        "graph": f"greedy, {new} tokens, static key/value cache, CUDA graph (capture included)",
        "recomputed": f"greedy, {new} tokens, prefix recomputed",
        "beam": "beam 4, up to 64 tokens (stops at EOS)",
        "cache, SDPA's pick": f"greedy, {new} tokens, key/value cache, SDPA's own pick of kernel (cuDNN's on Hopper)",
    }
    table = [[names[n], _fmt(seconds[n], 3), _fmt(rows / seconds[n], 1), _fmt(first[n], 2)] for n in loops]
    return {"ok": True, "tables": [_table(title, header, table)]}


# --- multi30k --------------------------------------------------------------------------------------------------------


def multi30k(setting: Setting, data: Path, epochs: int) -> dict[str, Any]:
    """The shipped Multi30k recipe (``configs/multi30k.yaml``) trained in ``bf16-mixed``, then BLEU on its test sets
    (``bench_multi30k``'s fit and score). Skipped, not failed, without the data (``torch-handle prepare multi30k``)."""
    import bench_multi30k

    if not (data / "train.en").is_file():
        return {"ok": True, "tables": [_table("Multi30k", ["result"], [[f"skipped: no {data}/train.en"]])]}
    run = Path(tempfile.mkdtemp(prefix="gpu_suite-multi30k-"))
    extra = [f"--trainer.max_epochs={epochs}", f"--trainer.precision={setting.precision}"]
    extra += [
        f"--trainer.accelerator={setting.accelerator}",
        "--trainer.devices=1",
        "--trainer.enable_progress_bar=false",
    ]
    # Beside the other side-by-side steps (strategies is the longest), so that the suite fits its 9 minutes:
    # Lightning's max_time stops the fit after one minute and the last checkpoint is scored (its BLEU and times:
    # benchmarks/RESULTS.md, section "GPU suite").
    extra += bench_multi30k.DRY_RUN if setting.dry_run else ["--trainer.max_time=00:00:01:00"]
    seconds = bench_multi30k.fit(data, run, torch.get_num_threads(), extra)
    mark(f"fit: {seconds:.0f} s")
    rows = bench_multi30k.score(run, data, 20 if setting.dry_run else None, device=setting.device.type)
    last = torch.load(next(run.rglob("last.ckpt")), map_location="cpu", weights_only=True, mmap=True)
    trained = f"{last['global_step']} steps ({last['epoch'] + 1} of {epochs} epochs begun)"
    title = (
        f"`configs/multi30k.yaml` for {trained} in `{setting.precision}` on one device, beside the other "
        f"side-by-side steps: {seconds / 60:.1f} min "
        f"wall for the fit (start-up and tokenizer training included); beam search on the last checkpoint. "
        f"sacreBLEU `{bench_multi30k.CASED.get_signature().format()}`, lowercased, and the literature's BLEU on "
        "`lc.norm.tok` text (`bench_multi30k.py`)."
    )
    return {"ok": True, "tables": [_table(title, bench_multi30k.HEADER, rows)]}


def _imported(*modules: str) -> tuple[()]:
    """Import ``modules`` now, before the step's turn on the device: Lightning's import is slow on a GPU host."""
    import importlib

    for module in modules:
        importlib.import_module(module)
    return ()


# what a timed step does on the host before its turn (``--wait``): the suite runs it beside the side-by-side steps
PREPARE: dict[str, Callable[[Setting], tuple[Any, ...]]] = {
    "throughput": lambda setting: _imported("lightning", "torch_handle.module", "torch_handle.flops"),
    "strategy_throughput": lambda setting: (_launch_strategies(setting),),
    "long": lambda setting: _imported("torch_handle.model"),
    "decoding": lambda setting: _imported("torch_handle.model"),
}
STEPS = {
    "gpu_tests": gpu_tests,
    "strategies": strategies,
    "throughput": throughput,
    "long": long,
    "decoding": decoding,
    "multi30k": multi30k,
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
    if args.step == "one_strategy":  # waits inside, with its model built
        extra = (args.strategy, args.overrides, args.profile, ready)
    else:
        extra += PREPARE[args.step](setting) if args.step in PREPARE else ()
        if ready:
            _wait_for_turn(ready)
    result = {"step": args.step, "device": device, **STEPS[args.step](setting, *extra)}
    mark(f"{args.step}: done")
    result.setdefault("error", "" if result["ok"] else "see its table")
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
