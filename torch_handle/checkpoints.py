"""Finding and checking checkpoints before anything is loaded or written."""

from __future__ import annotations

import zipfile
from pathlib import Path


class CheckpointError(ValueError):
    """A checkpoint path that does not exist or holds no checkpoint; the message says what to do."""


def is_deepspeed_checkpoint(path: Path) -> bool:
    """DeepSpeed saves a folder per checkpoint with a ``latest`` tag file and a folder per tag."""
    return path.is_dir() and (path / "latest").is_file()


def check_checkpoint(path: str | Path) -> Path:
    """Return ``path`` if it holds a Lightning/DeepSpeed/FSDP checkpoint, else raise :class:`CheckpointError`."""
    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist: pass an existing file with --ckpt_path")
    if path.is_file() and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a checkpoint (not a torch.save archive): pass a .ckpt file")
    if path.is_dir() and not (is_deepspeed_checkpoint(path) or (path / ".metadata").is_file()):
        raise CheckpointError(f"{path} is a folder but not a DeepSpeed or FSDP checkpoint: pass a .ckpt path")
    return path


def last_checkpoint(folder: str | Path) -> Path:
    """``last.ckpt`` in ``folder`` (the newest ``last*.ckpt`` if several), or a :class:`CheckpointError`."""
    candidates = sorted(Path(folder).glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise CheckpointError(
            f"no last checkpoint in {folder}: train first (python cli.py fit --config ...) or pass --ckpt_path"
        )
    return check_checkpoint(candidates[-1])
