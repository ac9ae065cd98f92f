"""``torch.profiler`` over a few training steps, written for TensorBoard and as a Chrome trace."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override


class Profiling(Callback):
    """Profiles ``wait + warmup + active`` training steps once, then gets out of the way.

    Only ``active`` steps are recorded, so traces stay a few MB instead of the gigabytes a whole-run
    profile produces. Each rank writes ``{dirpath}/*.pt.trace.json``: open it in TensorBoard's profiler
    plugin or in ``chrome://tracing`` / Perfetto.

    Args:
        dirpath: Output folder; defaults to ``{log_dir}/profiler``.
        wait: Steps skipped first (start-up noise).
        warmup: Steps traced but discarded (profiler overhead settles).
        active: Steps recorded.
        profile_memory: Also record tensor allocations (bigger traces; for memory hunts).
        record_shapes: Record operator input shapes.
        with_stack: Record Python stacks (much bigger traces).
    """

    def __init__(
        self,
        dirpath: str | None = None,
        wait: int = 1,
        warmup: int = 1,
        active: int = 3,
        profile_memory: bool = False,
        record_shapes: bool = True,
        with_stack: bool = False,
    ) -> None:
        super().__init__()
        self.dirpath = dirpath
        self.schedule = torch.profiler.schedule(wait=wait, warmup=warmup, active=active, repeat=1)
        self.steps = wait + warmup + active
        self.options = {"profile_memory": profile_memory, "record_shapes": record_shapes, "with_stack": with_stack}
        self._profiler: torch.profiler.profile | None = None
        self._step = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        folder = Path(self.dirpath or Path(trainer.log_dir or trainer.default_root_dir) / "profiler")
        activities = [torch.profiler.ProfilerActivity.CPU]
        if trainer.strategy.root_device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        self._profiler = torch.profiler.profile(
            activities=activities,
            schedule=self.schedule,
            on_trace_ready=torch.profiler.tensorboard_trace_handler(
                str(folder), worker_name=f"rank{trainer.global_rank}"
            ),
            **self.options,
        )
        self._profiler.start()
        self.folder = folder

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        if self._profiler is None:
            return
        self._profiler.step()
        self._step += 1
        if self._step >= self.steps:
            self._stop()

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._profiler is not None:
            self._stop()

    def _stop(self) -> None:
        assert self._profiler is not None
        self._profiler.stop()
        self._profiler = None
        rank_zero_info(f"Profiler traces in {self.folder}")
