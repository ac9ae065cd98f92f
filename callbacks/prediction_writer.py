"""Write ``predict`` outputs to a text file, one line per input, in input order."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from torch_handle.atomic import atomic_write_text


class PredictionWriter(BasePredictionWriter):
    """Collects every prediction and writes them once, atomically, at the end of ``predict``.

    Args:
        output: File to write; defaults to ``predictions.txt`` in the trainer's ``default_root_dir``.
    """

    def __init__(self, output: str | None = None) -> None:
        super().__init__(write_interval="epoch")
        self.output = output

    @override
    def write_on_epoch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        predictions: Sequence[Any],
        batch_indices: Sequence[Any],
    ) -> None:
        if trainer.world_size > 1:
            raise RuntimeError("predict writes one file from one process: run it with --trainer.devices 1")
        lines = [" ".join(text.split()) for batch in predictions for text in batch]
        path = Path(self.output or Path(trainer.default_root_dir) / "predictions.txt")
        atomic_write_text(path, "".join(f"{line}\n" for line in lines))
        rank_zero_info(f"Wrote {len(lines)} predictions to {path}")
