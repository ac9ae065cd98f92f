"""Finding and checking checkpoints before anything is loaded or written."""

from __future__ import annotations

import pickletools
import zipfile
from pathlib import Path

TOKENIZER_FILE = "tokenizer.json"  # written beside the checkpoints, so evaluation decodes as training encoded
CONFIG_FILE = "transformer.json"


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
    if path.is_file() and "state_dict" not in _pickled_strings(path):
        raise CheckpointError(
            f"{path} is a torch.save archive but not a Lightning checkpoint (no 'state_dict'): pass a .ckpt file"
        )
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


def _pickled_strings(path: Path) -> set[str]:
    """The string constants in a ``torch.save`` archive's pickle, read without unpickling anything.

    Only ``data.pkl`` is read (the object structure: a few KB to MB whatever the checkpoint's size); the
    tensor data beside it stays on disk, and no global is imported or called, so any file is safe to check.
    An archive without ``data.pkl``, or with an unreadable one, holds no strings.
    """
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
            if len(names) != 1:
                return set()
            pickled = archive.read(names[0])
        return {arg for _, arg, _ in pickletools.genops(pickled) if isinstance(arg, str)}
    except (zipfile.BadZipFile, ValueError):  # a damaged archive, or a truncated or corrupt pickle
        return set()
