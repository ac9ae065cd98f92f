"""The steps of ``gpu_suite.py``, one per process: ``python benchmarks/gpu_steps.py STEP OUT.json [--dry-run]``.

Each writes ``{"step", "ok", "device", "tables": [{"title", "header", "rows"}], ...}`` to OUT.json. On a GPU they
run in bf16 at the issue's sizes; ``--dry-run`` runs the same code on the CPU in fp32 with tiny sizes.
"""

from __future__ import annotations

import argparse
import json
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
from common import cpu_name

ROOT = Path(__file__).resolve().parents[1]
PEAK_BF16 = {"H100": 989e12, "H200": 989e12}  # dense bf16 FLOP/s of the SXM parts, by device name
THROUGHPUT_MODEL = {"d_model": 1024, "num_heads": 16, "num_encoder_layers": 12, "num_decoder_layers": 12, "d_ff": 4096}
TINY_MODEL = {"d_model": 32, "num_heads": 2, "num_encoder_layers": 1, "num_decoder_layers": 1, "d_ff": 64}


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
    lines = run.stdout.splitlines()
    summary = next(line.strip("= ") for line in reversed(lines) if re.search(r"\d+ (passed|skipped|failed)", line))
    failed = [line.split()[1] for line in lines if line.startswith("FAILED")]
    rows = [[summary, ", ".join(failed) or "none"]]
    return {"ok": run.returncode == 0, "tables": [_table("`pytest -m gpu`", ["result", "failed"], rows)]}


# --- strategies ------------------------------------------------------------------------------------------------------

STRATEGIES = ("ddp", "zero1", "zero2", "zero3", "zero3_offload", "fsdp")


def _cli(args: list[str]) -> tuple[bool, float, str]:
    """``python cli.py ARGS``: whether it succeeded, its seconds, and its last line of error."""
    start = time.perf_counter()
    run = subprocess.run([sys.executable, "cli.py", *args], cwd=ROOT, capture_output=True, text=True)
    error = "" if run.returncode == 0 else (run.stderr.strip().splitlines() or ["?"])[-1][:200]
    return run.returncode == 0, time.perf_counter() - start, error


def strategies(setting: Setting) -> dict[str, Any]:
    """The demo with each strategy config on one device: fit 6 steps, resume from step 3, export, predict."""
    from torch_handle.export import read_checkpoint

    tmp = Path(tempfile.mkdtemp(prefix="gpu_suite-"))
    inputs = tmp / "inputs.txt"
    inputs.write_text("a man rides a bike\ntwo dogs play in the snow\n")
    sizes = ["--data.init_args.demo_size", "400" if setting.dry_run else "2000", "--data.init_args.bpe_vocab_size"]
    sizes += ["300"] if setting.dry_run else ["1000"]
    if setting.dry_run:
        sizes += [f"--model.transformer.{k}={v}" for k, v in TINY_MODEL.items()] + ["--model.max_new_tokens", "8"]
    rows, ok = [], True
    for name in STRATEGIES if not setting.dry_run else ("ddp", "zero2"):
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
        steps["export"] = ["export", str(run / "checkpoints" / "last.ckpt"), str(exported)]
        steps["predict"] = [
            "predict", "--config", "configs/demo.yaml", "--trainer.accelerator", setting.accelerator,
            "--trainer.devices", "1", "--ckpt_path", str(exported), "--data.init_args.predict_file", str(inputs),
            "--prediction_writer.output", str(tmp / f"{name}.txt"), "--trainer.enable_progress_bar", "false",
        ]  # fmt: skip
        row: list[Any] = [name]
        failure = ""
        for step, args in steps.items():
            passed, seconds, error = _cli(args) if not failure else (False, 0.0, "")
            row.append(f"{seconds:.0f} s" if passed else "failed" if not failure else "-")
            failure = failure or (f"{step}: {error}" if not passed else "")
        if not failure:
            want = read_checkpoint(run / "checkpoints" / "last.ckpt")[0]
            got = read_checkpoint(resumed / "checkpoints" / "last.ckpt")[0]
            row.append(f"{max(float((got[k] - w).abs().max()) for k, w in want.items()):.1e}")
        else:
            row.append("")
        rows.append([*row, failure or "passed"])
        ok = ok and not failure
    header = ["strategy", "fit", "resume", "export", "predict from export", "resumed - uninterrupted (max)", "result"]
    title = f"The demo config, 6 steps in `{setting.precision}` on one device, with each strategy config"
    return {"ok": ok, "tables": [_table(title, header, rows)]}


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


def throughput(setting: Setting) -> dict[str, Any]:
    """The ~400M model through Seq2SeqModule and Trainer, against the same step in a plain loop."""
    import lightning as L

    from torch_handle.flops import training_flops
    from torch_handle.model import Transformer, TransformerConfig
    from torch_handle.module import Seq2SeqModule

    dims = TINY_MODEL if setting.dry_run else THROUGHPUT_MODEL
    vocab, length, rows = (300, 32, 2) if setting.dry_run else (32000, 2048, 8)
    warmup, steps = (1, 2) if setting.dry_run else (3, 10)
    config = TransformerConfig(
        **dims, src_vocab_size=vocab, tgt_vocab_size=vocab, position="rope", norm_first=True, tie_embeddings=True
    )
    batches = _batches(vocab, rows, length, warmup + steps)
    flops = training_flops(config, [length] * rows, [length] * rows)
    tokens = 2 * rows * length

    class Timer(L.Callback):
        def __init__(self) -> None:
            self.seconds: list[float] = []

        def on_train_batch_start(self, *args: Any) -> None:
            setting.sync()
            self.start = time.perf_counter()

        def on_train_batch_end(self, *args: Any) -> None:
            setting.sync()
            self.seconds.append(time.perf_counter() - self.start)

    torch.manual_seed(0)
    module = Seq2SeqModule(transformer=config, vocab_size=vocab, warmup_steps=2, generate_every_n_val_epochs=0)
    timer = Timer()
    trainer = L.Trainer(
        accelerator=setting.accelerator, devices=1, precision=setting.precision, max_steps=warmup + steps,
        logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
        limit_val_batches=0, callbacks=[timer],
    )  # fmt: skip
    setting.reset_peak()
    trainer.fit(module, train_dataloaders=torch.utils.data.DataLoader(batches, batch_size=None))
    lightning_step = sorted(timer.seconds[warmup:])[steps // 2]
    lightning_peak = setting.peak_gib()

    model = Transformer(config).to(setting.device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=setting.device.type == "cuda")
    on_device = [{k: v.to(setting.device) for k, v in b.items()} for b in batches]

    def plain_step(batch: dict[str, torch.Tensor]) -> None:
        with setting.autocast():
            logits = model(batch["src"], batch["tgt"][:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch["tgt"][:, 1:].flatten(), label_smoothing=0.1)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    setting.reset_peak()
    it = iter(on_device)
    plain = timed(lambda: plain_step(next(it)), setting, repeats=steps, warmup=warmup)
    plain_peak = setting.peak_gib()

    counted = _counted_flops(model, on_device[0], setting)
    peak = setting.peak_flops()
    rows_out = [
        ["Lightning (Seq2SeqModule, Trainer)", _fmt(lightning_step, 3), f"{tokens / lightning_step:,.0f}",
         _fmt(flops / lightning_step / peak * 100, 1) if peak else "", _fmt(lightning_peak)],
        ["plain PyTorch loop", _fmt(plain, 3), f"{tokens / plain:,.0f}",
         _fmt(flops / plain / peak * 100, 1) if peak else "", _fmt(plain_peak)],
    ]  # fmt: skip
    title = (
        f"{sum(p.numel() for p in model.parameters()) / 1e6:,.1f}M parameters ({dims}), vocabulary {vocab}, "
        f"{rows} x ({length} + {length}) tokens a step, `{setting.precision}`, AdamW. Lightning's overhead: "
        f"{(lightning_step / plain - 1) * 100:+.1f}% (goal <= 2%). FLOPs by the formula {flops:.3e} a step; "
        f"FlopCounterMode counted {counted / flops:.3f} of them. MFU against {peak or 'no known'} FLOP/s."
    )
    header = ["loop", "step (s)", "tokens/s", "MFU (%)", "peak memory (GiB)"]
    return {"ok": True, "tables": [_table(title, header, rows_out)]}


def _counted_flops(model: torch.nn.Module, batch: dict[str, torch.Tensor], setting: Setting) -> float:
    """FLOPs of one forward and backward as ``FlopCounterMode`` counts them (matrix products and attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        with setting.autocast():
            logits = model(batch["src"], batch["tgt"][:, :-1])
        logits.float().sum().backward()
    model.zero_grad(set_to_none=True)
    return float(counter.get_total_flops())


# --- long ------------------------------------------------------------------------------------------------------------


def long(setting: Setting) -> dict[str, Any]:
    """``summarization_32k``'s model: one training step at 32,768 source tokens per kernel, then the longest source."""
    from torch_handle.model import Transformer, TransformerConfig

    settings = yaml.safe_load((ROOT / "configs" / "summarization_32k.yaml").read_text())["model"]["transformer"]
    length, target = (512, 16) if setting.dry_run else (32768, 256)
    if setting.dry_run:
        settings = {**settings, "window": 32}
    rows, seconds = [], {}
    for backend in ("sdpa",) if setting.dry_run else ("flex", "sdpa"):  # flex has no backward pass on a CPU
        model = Transformer(TransformerConfig(**{**settings, "attention_backend": backend})).to(setting.device)
        step, peak = _long_step(model, length, target, setting)
        seconds[backend] = step
        rows.append([backend, f"{length:,}", _fmt(step, 3), f"{length / step:,.0f}", _fmt(peak)])
    fastest = min(seconds, key=seconds.get)
    model = Transformer(TransformerConfig(**{**settings, "attention_backend": fastest})).to(setting.device)
    longest, deadline = length, time.monotonic() + (20 if setting.dry_run else 45)
    while time.monotonic() < deadline and longest < (2048 if setting.dry_run else 2**22):
        try:
            _long_step(model, 2 * longest, target, setting, repeats=1)
        except torch.OutOfMemoryError:
            break
        longest *= 2
    title = (
        f"`configs/summarization_32k.yaml`'s model, one source of {length:,} tokens and {target} target tokens, "
        f"`{setting.precision}`, a training step (forward, backward, AdamW). Longest source that trained with "
        f"`{fastest}` in the time left, doubling: {longest:,} tokens."
    )
    header = ["kernel", "source tokens", "step (s)", "source tokens/s", "peak memory (GiB)"]
    return {"ok": True, "tables": [_table(title, header, rows)]}


def _long_step(model: Any, length: int, target: int, setting: Setting, repeats: int = 2) -> tuple[float, float | None]:
    from torch_handle.data import BOS_ID, EOS_ID

    vocab = model.config.src_vocab_size
    src = torch.randint(4, vocab, (1, length), device=setting.device)
    src[:, -1] = EOS_ID
    tgt = torch.randint(4, vocab, (1, target + 1), device=setting.device)
    tgt[:, 0] = BOS_ID
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


@torch.no_grad()
def decoding(setting: Setting) -> dict[str, Any]:
    """Greedy with the key/value cache against recomputing the prefix; beam-4 sentences/s."""
    from torch_handle.data import BOS_ID, EOS_ID
    from torch_handle.model import Transformer, TransformerConfig, generate

    settings = yaml.safe_load((ROOT / "configs" / "multi30k.yaml").read_text())["model"]["transformer"]
    settings = {**settings, **(TINY_MODEL if setting.dry_run else {}), "max_len": 512}
    model = Transformer(TransformerConfig(**settings)).to(setting.device).eval()
    rows, length, new = (4, 12, 16) if setting.dry_run else (64, 24, 256)
    src = torch.randint(4, model.config.src_vocab_size, (rows, length), device=setting.device)
    src[:, -1] = EOS_ID
    start = torch.full((rows, 1), BOS_ID, device=setting.device)

    def cached() -> None:
        with setting.autocast():
            memory, padding = model.encode(src), model.memory_padding(src)
            cache, token = model.new_cache(new), start
            for _ in range(new):
                token = model.decode(token, memory, padding, cache)[:, -1:].argmax(-1)

    def recomputed() -> None:
        with setting.autocast():
            memory, padding = model.encode(src), model.memory_padding(src)
            tokens = start
            for _ in range(new):
                tokens = torch.cat((tokens, model.decode(tokens, memory, padding)[:, -1:].argmax(-1)), dim=1)

    with_cache = timed(cached, setting, repeats=3)
    without = timed(recomputed, setting, repeats=1)
    with setting.autocast():
        beam = timed(lambda: generate(model, src, 64 if not setting.dry_run else 8, num_beams=4), setting, repeats=3)
    title = (
        f"The Multi30k recipe's model (`configs/multi30k.yaml`, fresh weights), {rows} sources of {length} tokens, "
        f"`{setting.precision}`. Greedy at {new} new tokens with the cache: {without / with_cache:.1f}x faster than "
        f"recomputing (goal >= 5x)."
    )
    header = ["decoding", "seconds", "sentences/s"]
    table = [
        [f"greedy, {new} tokens, key/value cache", _fmt(with_cache, 3), _fmt(rows / with_cache, 1)],
        [f"greedy, {new} tokens, prefix recomputed", _fmt(without, 3), _fmt(rows / without, 1)],
        ["beam 4, up to 64 tokens (stops at EOS)", _fmt(beam, 3), _fmt(rows / beam, 1)],
    ]
    return {"ok": True, "tables": [_table(title, header, table)]}


STEPS = {"gpu_tests": gpu_tests, "strategies": strategies, "throughput": throughput, "long": long, "decoding": decoding}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("step", choices=list(STEPS))
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args()
    setting = Setting(args.dry_run)
    result = {"step": args.step, "device": device_line(setting), **STEPS[args.step](setting)}
    result.setdefault("error", "" if result["ok"] else "see its table")
    args.out.write_text(json.dumps(result))


if __name__ == "__main__":
    main()
