"""A checkpoint save that runs out of room: ``python tests/checkpoint_save.py FOLDER {kill,full}``.

Trains a BoringModel one step with :class:`~torch_handle.callbacks.checkpointing.Checkpoint` (``last.ckpt``,
a few KB), then
saves a 4 MB checkpoint over it with file writes capped or the disk full: ``kill`` caps the file size so the
kernel kills the process mid-write (SIGXFSZ, as ``kill -9`` would), ``full`` runs on a 1 MB tmpfs mounted at
FOLDER. Prints ``saved`` or ``error: ...`` (the CLI's line) when the save returns. Run by tests/test_faults.py.
"""

from __future__ import annotations

import resource
import signal
import sys
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.demos.boring_classes import BoringModel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_handle.callbacks.checkpointing import Checkpoint  # noqa: E402
from torch_handle.checkpoints import CheckpointError  # noqa: E402


def trainer(folder: str, steps: int) -> L.Trainer:
    return L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[Checkpoint(dirpath=folder, save_last=True)],
    )


def main(folder: str, mode: str) -> None:
    first = trainer(folder, 1)
    model = BoringModel()
    first.fit(model)
    model.big = torch.nn.Parameter(torch.zeros(2**20))  # the next checkpoint is 4 MB
    if mode == "kill":
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)  # Python ignores it; the kernel's default kills
        size = (Path(folder) / "last.ckpt").stat().st_size
        resource.setrlimit(resource.RLIMIT_FSIZE, (size + 2**20, resource.RLIM_INFINITY))
    try:
        first.save_checkpoint(Path(folder) / "last.ckpt")
    except CheckpointError as err:
        print(f"error: {err}")
        return
    print("saved")


if __name__ == "__main__":
    main(*sys.argv[1:])
