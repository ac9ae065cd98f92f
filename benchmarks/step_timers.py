"""Where a training step's host time goes: ``torch-handle fit`` run in this process with a timer around each part.

    python benchmarks/step_timers.py OUT.json fit --config multi30k --trainer.max_steps 200 ...

Each part (the data path, the batch's move to the device, forward and loss, ``self.log``, backward, each callback,
clipping, the optimizer, the scheduler, the progress bar, the loggers) is timed on the host, its nested parts left
out, from the step ``--skip`` on; "Lightning's loop, the rest" is the step's time less all of them. On a GPU a part
that waits for the device (a ``.item()``, a ``.tolist()``) shows the wait as its own time, and
``torch.cuda.set_sync_debug_mode`` counts the synchronizing calls each part makes. Writes ``{"steps", "seconds",
"parts": [[name, ms/step, syncs/step], ...]}`` and prints the table. Used by the GPU suite's ``multi30k_recipe`` step
and, with a model of negligible compute, as the CPU proxy of its host time (benchmarks/RESULTS.md, section
"Multi30k recipe on one GPU").
"""

from __future__ import annotations

import argparse
import functools
import importlib
import json
import sys
import time
import warnings
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

STEP = "Lightning's loop, the rest"


def parts() -> list[tuple[str, Any, str]]:
    """(name, owner, attribute) of each timed part; imported here, after the caller has set the path."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ModelCheckpoint, RichProgressBar, TQDMProgressBar
    from lightning.pytorch.core.module import LightningModule
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
    from lightning.pytorch.trainer.connectors.logger_connector.logger_connector import _LoggerConnector

    from torch_handle.callbacks.checkpointing import Checkpoint
    from torch_handle.callbacks.divergence import StopOnDivergence
    from torch_handle.callbacks.throughput import Throughput
    from torch_handle.module import Seq2SeqModule

    adam = importlib.import_module("torch.optim.adam")  # the module, which torch.optim's namespace hides

    return [
        (STEP, _TrainingEpochLoop, "advance"),
        ("data: next batch (sampler, collation)", _PrefetchDataFetcher, "__next__"),
        ("batch to the device", LightningModule, "_apply_batch_transfer_handler"),
        ("forward and loss", Seq2SeqModule, "training_step"),
        ("self.log", LightningModule, "log"),
        ("backward", Seq2SeqModule, "backward"),
        ("divergence check (StopOnDivergence)", StopOnDivergence, "on_before_backward"),
        ("divergence check (StopOnDivergence)", StopOnDivergence, "on_before_optimizer_step"),
        ("gradient clipping", Seq2SeqModule, "configure_gradient_clipping"),
        ("AdamW update", adam, "adam"),
        ("zero_grad", torch.optim.Optimizer, "zero_grad"),
        ("LR scheduler", torch.optim.lr_scheduler.LRScheduler, "step"),
        ("LearningRateMonitor", LearningRateMonitor, "on_train_batch_start"),
        ("checkpoint callback: RNG states, SIGTERM", Checkpoint, "on_train_batch_start"),
        ("checkpoint callback: RNG states, SIGTERM", Checkpoint, "on_train_batch_end"),
        ("checkpoint callback: ModelCheckpoint's", ModelCheckpoint, "on_train_batch_end"),
        ("Throughput (tokens/s, MFU)", Throughput, "on_train_batch_start"),
        ("Throughput (tokens/s, MFU)", Throughput, "on_train_batch_end"),
        ("progress bar", RichProgressBar, "on_train_batch_end"),
        ("progress bar", TQDMProgressBar, "on_train_batch_end"),
        ("metrics to the loggers", _LoggerConnector, "update_train_step_metrics"),
    ]


class Timers:
    """Exclusive host time and synchronizing calls per part, counted once ``skip`` steps have run."""

    def __init__(self, skip: int) -> None:
        self.skip = skip
        self.steps = 0
        self.seconds: dict[str, float] = defaultdict(float)
        self.syncs: dict[str, int] = defaultdict(int)
        self._stack: list[list[float]] = []  # per open part: [time in its children, syncs in its children]
        self.warned: list[warnings.WarningMessage] = []

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def timed(*args: Any, **kwargs: Any) -> Any:
            if name == STEP:
                self.steps += 1
                if self.steps == self.skip + 1:  # the first steps (allocations, first kernels) are left out
                    self.seconds.clear()
                    self.syncs.clear()
            self._stack.append([0.0, 0])
            syncs, start = len(self.warned), time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                elapsed, synced = time.perf_counter() - start, len(self.warned) - syncs
                children = self._stack.pop()
                self.seconds[name] += elapsed - children[0]
                self.syncs[name] += synced - children[1]
                if self._stack:
                    self._stack[-1][0] += elapsed
                    self._stack[-1][1] += synced

        return timed

    def table(self) -> list[list[Any]]:
        steps = max(self.steps - self.skip, 1)
        total = sum(self.seconds.values())
        rows = [[name, 1e3 * s / steps, self.syncs[name] / steps] for name, s in self.seconds.items()]
        rows.sort(key=lambda row: -row[1])
        return [*rows, ["whole step", 1e3 * total / steps, sum(self.syncs.values()) / steps]]


@contextmanager
def timed_parts(skip: int) -> Iterator[Timers]:
    """Patches each part with its timer for the block; counts CUDA synchronizations where there is a GPU."""
    timers = Timers(skip)
    patched = []
    for name, owner, attribute in parts():
        patched.append((owner, attribute, vars(owner).get(attribute)))  # None: inherited
        setattr(owner, attribute, timers.wrap(name, getattr(owner, attribute)))
    cuda = torch.cuda.is_available()
    with warnings.catch_warnings(record=True) as warned:
        warnings.simplefilter("default")
        warnings.filterwarnings("always", message=".*synchroniz", category=UserWarning)
        timers.warned = warned
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        try:
            yield timers
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
            for owner, attribute, original in reversed(patched):
                if original is None:
                    delattr(owner, attribute)
                else:
                    setattr(owner, attribute, original)
    for message in warned:  # the rest, as they would have shown
        if "synchroniz" not in str(message.message):
            warnings.showwarning(message.message, message.category, message.filename, message.lineno)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter, allow_abbrev=False
    )
    parser.add_argument("out", type=Path, help="the JSON file to write")
    parser.add_argument("--skip", type=int, default=10, help="steps left out at the start")
    args, command = parser.parse_known_args()
    from torch_handle.cli import main as torch_handle

    start = time.perf_counter()
    sys.argv[1:] = command  # the command line LightningCLI reads, as the torch-handle command would have it
    with timed_parts(args.skip) as timers:
        torch_handle()
    seconds = time.perf_counter() - start
    rows = timers.table()
    args.out.write_text(json.dumps({"steps": timers.steps - args.skip, "seconds": seconds, "parts": rows}))
    for name, ms, syncs in rows:
        print(f"{name:45s} {ms:8.3f} ms/step {syncs:6.2f} syncs/step")


if __name__ == "__main__":
    main()
