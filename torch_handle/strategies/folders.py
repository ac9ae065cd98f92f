"""Checkpoint folders written whole or not at all, and checked before they are loaded, for the strategies that
save one file per rank."""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from lightning.fabric.utilities.types import _PATH
from typing_extensions import override

from torch_handle.checkpoints import (
    check_checkpoint,
    hidden_sibling,
    recover_interrupted_save,
)
from torch_handle.unpickling import unpickling_only_data


class _SafeFolders:
    """Checkpoint folders written whole or not at all, and checked before they are loaded, for strategies that
    save one file per rank.

    Lightning writes single-file checkpoints atomically; DeepSpeed and FSDP's sharded checkpoints are folders
    that every rank writes into, and a run killed half-way through would leave one that looks valid. So all
    ranks write ``.NAME.partial`` beside the target, and global rank 0 renames it into place after a barrier
    (which assumes one file system shared by all nodes, as resuming needs anyway). A folder cannot replace
    another in one rename, so the previous one is first moved to ``.NAME.stale``; a kill between the two renames
    leaves no ``NAME``, and :func:`~torch_handle.checkpoints.recover_interrupted_save` puts ``.stale`` back (here
    before the next save, and wherever a checkpoint is resolved).
    """

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        final = Path(self.broadcast(str(filepath)))
        partial, stale = hidden_sibling(final, "partial"), hidden_sibling(final, "stale")
        if self.is_global_zero:
            recover_interrupted_save(final)
            _remove(partial)
        self.barrier("atomic_save_start")
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier("atomic_save_written")
        if self.is_global_zero:
            _remove(stale)
            if final.exists():
                os.replace(final, stale)
            os.replace(partial, final)
            _remove(stale)
        self.barrier("atomic_save_done")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        check_checkpoint(checkpoint_path)
        with unpickling_only_data(Path(checkpoint_path)):
            return super().load_checkpoint(checkpoint_path, weights_only)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)
