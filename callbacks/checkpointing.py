"""Lightning's ModelCheckpoint, plus the tokenizer and model config written beside the checkpoints."""

from __future__ import annotations

import json
from pathlib import Path

import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import rank_zero_only
from typing_extensions import override

from torch_handle.atomic import atomic_write_text
from torch_handle.checkpoints import CONFIG_FILE, TOKENIZER_FILE


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that also keeps ``tokenizer.json`` and ``transformer.json`` in its folder.

    ``last.ckpt`` is also written when training ends between two scheduled saves, so it is always the end
    state of the run.

    Test, predict, resume and export then decode exactly as training encoded, with no other file to
    carry along. Checkpoint files themselves are written atomically by Lightning (``_atomic_save``).
    """

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._save_companions(trainer, pl_module)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``last.ckpt`` holds the final weights even when ``max_steps`` stops training between saves."""
        super().on_train_end(trainer, pl_module)
        if self.save_last and trainer.global_step != self._last_global_step_saved and not trainer.sanity_checking:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @rank_zero_only
    def _save_companions(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.dirpath is None:
            return
        folder = Path(self.dirpath)
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is not None:
            atomic_write_text(folder / TOKENIZER_FILE, tokenizer.to_str())
        config = getattr(pl_module, "config", None)
        if config is not None:
            atomic_write_text(folder / CONFIG_FILE, json.dumps(config.to_dict(), indent=2))
