"""Training from a pre-tokenized folder (``--data.init_args.pretokenized``) against the in-memory path on Multi30k.

    python benchmarks/bench_streaming.py --data ../shared/data/multi30k            # both paths, interleaved
    python benchmarks/bench_streaming.py --data DIR --steps 3 --repeats 1          # a quick check
    python benchmarks/bench_streaming.py --repeats 4 --threads 1                   # steadier on a shared machine

``prepare tokens`` writes the training split once; then each path runs, in a child process of its own and in turn
(``--repeats`` times), the shipped ``multi30k`` recipe (``torch-handle fit --config multi30k``) for ``--steps``
optimizer steps with the same tokenizer, so both train on the same batches. Tokens/s (source and target, no padding)
is timed from the end of the first ``--warmup`` steps to the last, and the peak resident memory (``VmHWM``) is the
whole process's. A loader pass (one epoch of training batches, no model) isolates the cost of reading from disk.
Nothing is written to RESULTS.md; the table is printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import lightning as L
import torch
from typing_extensions import override

from torch_handle.data import TranslationDataModule
from torch_handle.data.tokenizer import PAD_ID

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine_line, markdown_table, peak_rss_bytes, rss_bytes, run_child  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PATHS = ("in memory", "pretokenized")
CLOCK = f"{Path(__file__).stem}.StepClock"
DATA = ["--data.init_args.max_tokens=4096", "--data.init_args.max_source_tokens=128"]


def _module(data: str, tokens: str, pretokenized: bool) -> TranslationDataModule:
    return TranslationDataModule(
        data_dir=data,
        tokenizer_path=f"{tokens}/tokenizer.json",
        max_tokens=4096,
        max_source_tokens=128,
        max_target_tokens=128,
        pretokenized=tokens if pretokenized else None,
    )


class StepClock(L.Callback):
    """Times training steps after the first ``warmup``; prints tokens per second of wall time and of CPU time (this
    process's threads together, steadier on a shared machine) and the peak resident memory, as JSON.

    Args:
        warmup: Steps left out of the timing.
    """

    def __init__(self, warmup: int = 5) -> None:
        self.warmup = warmup
        self.tokens, self.start, self.cpu, self.steps = 0, 0.0, 0.0, 0

    @override
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs, batch, batch_idx) -> None:
        self.steps += 1
        if self.steps == self.warmup:
            self.start, self.cpu = time.perf_counter(), time.process_time()
        elif self.steps > self.warmup:
            self.tokens += int((batch["src"] != PAD_ID).sum() + (batch["tgt"][:, 1:] != PAD_ID).sum())

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        seconds, cpu = time.perf_counter() - self.start, time.process_time() - self.cpu
        result = {"tokens_per_s": self.tokens / seconds, "tokens_per_cpu_s": self.tokens / cpu}
        print(json.dumps({**result, "peak_rss": peak_rss_bytes(), "threads": torch.get_num_threads()}))


def child(mode: str, path: str, data: str, tokens: str, steps: int, warmup: int, run: str, threads: int) -> None:
    pretokenized = path == PATHS[1]
    if threads:
        torch.set_num_threads(threads)
    if mode == "loader":
        dm = _module(data, tokens, pretokenized)
        dm.setup("fit")
        start, rss = time.perf_counter(), rss_bytes()
        batches = sum(1 for _ in dm.train_dataloader())
        seconds = time.perf_counter() - start
        print(json.dumps({"batches_per_s": batches / seconds, "setup_rss": rss, "peak_rss": peak_rss_bytes()}))
        return
    from torch_handle.cli import main

    options = [f"--data.init_args.pretokenized={tokens}"] if pretokenized else []
    main([
        "fit", "--config", "multi30k", f"--data.init_args.data_dir={data}", *DATA,
        f"--data.init_args.tokenizer_path={tokens}/tokenizer.json", *options,
        f"--trainer.max_steps={steps}", "--trainer.limit_val_batches=0",
        "--trainer.enable_progress_bar=false", f"--trainer.default_root_dir={run}",
        "--trainer.callbacks+=" + json.dumps({"class_path": CLOCK, "init_args": {"warmup": warmup}}),
    ])  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=str(ROOT.parent / "shared" / "data" / "multi30k"), help="Multi30k folder")
    parser.add_argument("--steps", type=int, default=40, help="optimizer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of the timing")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each path, interleaved")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads of each run (0: torch's default)")
    parser.add_argument("--child", nargs=2, metavar=("MODE", "PATH"), help=argparse.SUPPRESS)
    parser.add_argument("--tokens", help=argparse.SUPPRESS)
    parser.add_argument("--run", help=argparse.SUPPRESS)
    options = parser.parse_args()
    if options.child:
        child(*options.child, options.data, options.tokens, options.steps, options.warmup, options.run, options.threads)
        return
    with tempfile.TemporaryDirectory() as work:
        tokens = f"{work}/tokens"  # the recipe's tokenizer, trained on the training split as fit trains it
        TranslationDataModule(data_dir=options.data, max_source_tokens=128).write_pretokenized(tokens)
        os.environ["PYTHONPATH"] = os.pathsep.join(
            [str(Path(__file__).resolve().parent), os.environ.get("PYTHONPATH", "")]
        )
        common = ["--data", options.data, "--tokens", tokens, "--steps", str(options.steps)]
        common += ["--warmup", str(options.warmup), "--threads", str(options.threads)]
        results: dict[tuple[str, str], list[dict]] = {}
        for repeat in range(options.repeats):
            for mode in ("fit", "loader"):
                for path in PATHS:
                    run = f"{work}/{mode}-{PATHS.index(path)}-{repeat}"
                    args = [*common, "--run", run, "--child", mode, path]
                    results.setdefault((mode, path), []).append(run_child(__file__, args))

    def median(mode: str, path: str, key: str) -> float:
        return statistics.median(r[key] for r in results[(mode, path)])

    rows = [
        [
            path,
            f"{median('fit', path, 'tokens_per_s'):,.0f}",
            f"{median('fit', path, 'tokens_per_cpu_s'):,.0f}",
            f"{median('fit', path, 'peak_rss') / 2**20:,.0f}",
            f"{median('loader', path, 'batches_per_s'):,.0f}",
            f"{median('loader', path, 'peak_rss') / 2**20:,.0f}",
        ]
        for path in PATHS
    ]
    header = ["path", "tokens/s", "tokens/CPU-s", "fit peak RSS (MiB)", "loader batches/s", "loader peak RSS (MiB)"]
    print(machine_line(results[("fit", PATHS[0])][0]["threads"], torch.__version__))
    print(markdown_table(header, rows))
    ratios = {
        key: median("fit", PATHS[1], key) / median("fit", PATHS[0], key) for key in ("tokens_per_s", "tokens_per_cpu_s")
    }
    for key in ("tokens_per_s", "tokens_per_cpu_s"):  # each run against the in-memory run just before it
        pairs = [p[key] / m[key] for m, p in zip(results[("fit", PATHS[0])], results[("fit", PATHS[1])], strict=True)]
        print(f"{key} ratio of each pair: {', '.join(f'{r:.3f}' for r in pairs)}")
    print(
        f"pretokenized / in memory: tokens/s {ratios['tokens_per_s']:.3f}, "
        f"tokens/CPU-s {ratios['tokens_per_cpu_s']:.3f} "
        f"(medians of {options.repeats} runs of each, {options.steps} steps, {options.warmup} untimed)"
    )


if __name__ == "__main__":
    main()
