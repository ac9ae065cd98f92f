"""Write ``predict`` outputs to a text file, one line per input, in input order, from any number of processes."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from typing_extensions import override

from torch_handle.atomic import atomic_write_text

STDOUT = "-"


def new_output(folder: str | Path) -> Path:
    """Reserves ``predictions-YYYYmmdd-HHMMSS.txt`` in ``folder`` (``-1``, ``-2``... within one second): a
    name no earlier run holds, created exclusively so that two runs never share it."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        path = folder / f"predictions-{stamp}{f'-{n}' if n else ''}.txt"
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        except FileExistsError:
            continue
        return path
    raise FileExistsError(f"{folder}: predictions-{stamp}*.txt all taken")


class PredictionWriter(BasePredictionWriter):
    """Collects every prediction and writes them once, atomically, from rank 0 at the end of ``predict``.

    On several processes each predicts its shard; rank 0 gathers ``(input index, text)`` pairs by the batch
    indices Lightning records, drops the repeats that even out the shards, and writes them in input order.
    The file's path is printed on a line of its own once the run (and its progress bar) has ended.

    Args:
        output: File to write (replaced if it exists), or ``-`` for standard output. By default a new
            ``predictions-<timestamp>.txt`` in the trainer's ``default_root_dir``: an earlier run's is never
            overwritten.
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output = output
        self._pending: tuple[Path | None, str] | None = None  # what teardown prints: (file written, text)

    @override
    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        # One predict loader: ``predictions`` is per batch, ``batch_indices`` per loader, then per batch.
        pairs = [
            (index, text)
            for batch, indices in zip(predictions, batch_indices[0], strict=True)
            for index, text in zip(indices, batch, strict=True)
        ]
        if trainer.world_size > 1:
            shards: list[Any] | None = [None] * trainer.world_size if trainer.is_global_zero else None
            dist.gather_object(pairs, shards, dst=0)
            pairs = [pair for shard in shards or [] for pair in shard]
        if not trainer.is_global_zero:
            return
        by_index = dict(pairs)
        text = "".join(f"{' '.join(by_index[i].split())}\n" for i in sorted(by_index))
        if self.output == STDOUT:
            self._pending = (None, text)
            return
        path = Path(self.output) if self.output else new_output(trainer.default_root_dir)
        try:
            atomic_write_text(path, text)
        except BaseException:
            if not self.output:
                path.unlink(missing_ok=True)  # the reserved name, still empty
            raise
        self._pending = (path, text)

    @override
    def teardown(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Prints the path (or, for ``-``, the predictions) after every callback's ``on_predict_end``: after
        the progress bar has closed its line."""
        if self._pending is None:
            return
        path, text = self._pending
        self._pending = None
        sys.stdout.write(text if path is None else f"{path}\n")
        sys.stdout.flush()
