"""Write ``predict`` outputs to a text file, one line per input, in input order, from any number of processes."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import lightning as L
import torch.distributed as dist
from lightning.pytorch.callbacks import BasePredictionWriter
from lightning.pytorch.utilities import rank_zero_info
from typing_extensions import override

from torch_handle.atomic import atomic_write_text


class PredictionWriter(BasePredictionWriter):
    """Collects every prediction and writes them once, atomically, from rank 0 at the end of ``predict``.

    On several processes each predicts its shard; rank 0 gathers ``(input index, text)`` pairs by the batch
    indices Lightning records, drops the repeats that even out the shards, and writes them in input order.

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
        lines = [" ".join(by_index[i].split()) for i in sorted(by_index)]
        path = Path(self.output or Path(trainer.default_root_dir) / "predictions.txt")
        atomic_write_text(path, "".join(f"{line}\n" for line in lines))
        rank_zero_info(f"Wrote {len(lines)} predictions to {path}")
