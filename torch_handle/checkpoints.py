"""Finding and checking checkpoints before anything is loaded or written.

Loading a checkpoint must never run code, yet DeepSpeed loads its shards with ``torch.load(weights_only=False)``
and torch.distributed.checkpoint unpickles its ``.metadata`` and non-tensor items with plain ``pickle``. So
:func:`check_checkpoint` reads every pickle of a file or folder first, without unpickling anything it has not
allowed, and refuses the whole checkpoint in one line if any pickle names a global that torch's weights-only
unpickler would refuse.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals
from torch.nn import Module

TOKENIZER_FILE = "tokenizer.json"  # written beside the checkpoints, so evaluation decodes as training encoded
CONFIG_FILE = "transformer.json"

# DeepSpeed's optimizer shards pickle these plain classes: an enum, a loss scaler's attributes, and (ZeRO-1/2) a
# dataclass of two ints; rebuilding them calls no code of the file's choosing.
_DEEPSPEED_GLOBALS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
}
# Opcodes that reach a callable other than through a literal GLOBAL name; torch.save never writes them.
_OPAQUE_OPCODES = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}
_PICKLE_SUFFIXES = {".pt", ".pth", ".ckpt", ".bin", ".pkl"}  # files DeepSpeed and Lightning hand to torch.load
_DCP_CLASS_MODULES = ("torch.distributed.checkpoint.", "pathlib")


class CheckpointError(ValueError):
    """A checkpoint path that does not exist or holds no checkpoint; the message says what to do."""


def is_deepspeed_checkpoint(path: Path) -> bool:
    """DeepSpeed saves a folder per checkpoint with a ``latest`` tag file and a folder per tag."""
    return path.is_dir() and (path / "latest").is_file()


def check_checkpoint(path: str | Path) -> Path:
    """Return ``path`` if it holds a Lightning/DeepSpeed/FSDP checkpoint whose pickles load without running
    code, else raise :class:`CheckpointError`."""
    path = Path(path)
    recover_interrupted_save(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist: pass the path of an existing checkpoint")
    if path.is_file() and not zipfile.is_zipfile(path):
        raise CheckpointError(f"{path} is not a checkpoint (not a torch.save archive): pass a .ckpt file")
    if path.is_file():
        pickled = _data_pickle(path)
        if pickled is None or "state_dict" not in _pickled_strings(pickled):
            raise CheckpointError(
                f"{path} is a torch.save archive but not a Lightning checkpoint (no 'state_dict'): pass a .ckpt file"
            )
        _check_globals(pickled, path, path)
        return path
    if path.is_dir() and not (is_deepspeed_checkpoint(path) or (path / ".metadata").is_file()):
        raise CheckpointError(f"{path} is a folder but not a DeepSpeed or FSDP checkpoint: pass a .ckpt path")
    if is_deepspeed_checkpoint(path):
        deepspeed_tag(path)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        _check_pickles(file, path)
    return path


def last_checkpoint(folder: str | Path) -> Path:
    """``last.ckpt`` in ``folder`` (the newest ``last*.ckpt`` if several), or a :class:`CheckpointError`.

    A sharded save killed between its two renames left no ``last.ckpt``: the previous one is put back first.
    """
    folder = Path(folder)
    for stale in folder.glob(".last*.ckpt.stale"):
        recover_interrupted_save(stale.with_name(stale.name[1 : -len(".stale")]))
    candidates = sorted(folder.glob("last*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not candidates:
        raise CheckpointError(
            f"no last checkpoint in {folder}: train first (python cli.py fit --config ...) or pass --ckpt_path"
        )
    return check_checkpoint(candidates[-1])


def resolve_ckpt_path(ckpt_path: str | None, folder: str | Path, fit: bool = False) -> str | None:
    """The checked checkpoint a ``cli.py`` subcommand loads.

    ``last`` is the newest last checkpoint in ``folder`` (recovered from an interrupted save); so is no path,
    except for ``fit``, which then starts from scratch, as it does with ``last`` before the first save.
    """
    if ckpt_path is None and fit:
        return None
    if ckpt_path in (None, "last"):
        if fit and not any(Path(folder).glob("last*.ckpt")) and not any(Path(folder).glob(".last*.ckpt.stale")):
            return ckpt_path
        return str(last_checkpoint(folder))
    return str(check_checkpoint(ckpt_path))


def hidden_sibling(path: Path, kind: str) -> Path:
    """``.NAME.partial`` (a save in progress) or ``.NAME.stale`` (the previous save, moved aside)."""
    return path.with_name(f".{path.name}.{kind}")


def recover_interrupted_save(path: Path) -> None:
    """Puts the previous checkpoint back where a save killed between its two renames left none.

    Only the previous copy is known to be complete: a ``.partial`` may be a save killed mid-write.
    """
    stale, partial = hidden_sibling(path, "stale"), hidden_sibling(path, "partial")
    if path.exists() or not stale.exists():
        return
    os.replace(stale, path)
    if partial.is_dir():
        shutil.rmtree(partial, ignore_errors=True)
    else:
        partial.unlink(missing_ok=True)


def deepspeed_tag(path: Path) -> str:
    """The tag named by a DeepSpeed folder's ``latest`` file: one sub-folder name, nothing that leaves ``path``."""
    tag = (path / "latest").read_text(errors="replace").strip()
    if not tag or tag in (".", "..") or "/" in tag or "\\" in tag or not (path / tag).is_dir():
        raise CheckpointError(
            f"{path / 'latest'} names {tag!r}, not a checkpoint folder inside {path}: the checkpoint is damaged "
            "or tampered with; pass another checkpoint"
        )
    return tag


def deepspeed_state(path: Path, module: Module | None = None) -> dict[str, Any]:
    """A DeepSpeed checkpoint folder as one Lightning checkpoint: its client state (Lightning's fields) and the
    full float32 ``state_dict`` that DeepSpeed gathers from the shards, with tied weights filled in from
    ``module`` (DeepSpeed stores a shared parameter under one of its names only)."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    state_dict = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=deepspeed_tag(path))
    state_dict = state_dict if module is None else with_tied_weights(state_dict, module)
    return {**checkpoint_fields(path), "state_dict": state_dict}


def folder_kind(path: Path) -> str:
    """Which strategy wrote a checked checkpoint folder: ``deepspeed``, ``model_parallel`` (its distributed checkpoint
    holds ``state_dict``) or ``fsdp`` (``model``)."""
    if is_deepspeed_checkpoint(path):
        return "deepspeed"
    keys = _MetadataUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load().state_dict_metadata
    return "model_parallel" if any(key.startswith("state_dict.") for key in keys) else "fsdp"


def checkpoint_fields(path: Path) -> dict[str, Any]:
    """Lightning's fields of a checked checkpoint (``hyper_parameters``, ``epoch``, ...): of a file, the file; of a
    DeepSpeed folder, its client state; of a distributed checkpoint, the ``meta.pt`` Lightning writes beside it."""
    if path.is_file():
        return torch.load(path, map_location="cpu", weights_only=True)
    if is_deepspeed_checkpoint(path):
        return torch.load(next((path / deepspeed_tag(path)).glob("*model_states.pt")), "cpu", weights_only=True)
    meta = path / "meta.pt"
    return torch.load(meta, map_location="cpu", weights_only=True) if meta.is_file() else {}


def with_tied_weights(state_dict: dict[str, Tensor], module: Module) -> dict[str, Tensor]:
    """``state_dict`` plus the names of ``module``'s tied parameters that it holds under another name."""
    names: dict[int, list[str]] = {}
    for name, param in module.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    filled = dict(state_dict)
    for group in names.values():
        present = [name for name in group if name in filled]
        for name in group:
            if present and name not in filled:
                filled[name] = filled[present[0]]
    return filled


def _refuse(file: Path, checkpoint: Path, what: str) -> CheckpointError:
    return CheckpointError(
        f"{file} {what}, so loading {checkpoint} could run code: refused; load only checkpoints you trust, "
        "re-saved by torch-handle"
    )


def _check_pickles(file: Path, checkpoint: Path) -> None:
    """Refuses ``file`` if loading it could run code; files nothing unpickles pass."""
    if file.name == ".metadata":
        _check_dcp(file, checkpoint)
    elif zipfile.is_zipfile(file):
        for pickled in _archive_pickles(file, file, checkpoint):
            _check_globals(pickled, file, checkpoint)
    elif file.suffix in _PICKLE_SUFFIXES:
        raise _refuse(file, checkpoint, "is not a torch.save archive (a bare pickle)")


def _archive_pickles(archive: Path | bytes, file: Path, checkpoint: Path) -> Iterator[bytes]:
    """The pickles of a ``torch.save`` archive (a file, or an item of a shard); tensor data is not read."""
    try:
        with zipfile.ZipFile(io.BytesIO(archive) if isinstance(archive, bytes) else archive) as zipped:
            for name in zipped.namelist():
                if name.endswith(".pkl"):
                    yield zipped.read(name)
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise _refuse(file, checkpoint, f"is a damaged archive ({err})") from err


def _check_globals(pickled: bytes, file: Path, checkpoint: Path) -> None:
    """Every global a ``torch.save`` pickle names must be one that ``torch.load(weights_only=True)`` allows."""
    allowed = _get_allowed_globals().keys() | _get_user_allowed_globals().keys() | _DEEPSPEED_GLOBALS
    try:
        opcodes = [(opcode.name, arg) for opcode, arg, _ in pickletools.genops(pickled)]
    except ValueError as err:  # a truncated or corrupt pickle
        raise _refuse(file, checkpoint, f"holds an unreadable pickle ({err})") from err
    for name, arg in opcodes:
        if name in _OPAQUE_OPCODES:
            raise _refuse(file, checkpoint, f"holds the pickle opcode {name}, which weights-only loading refuses")
        if name == "GLOBAL" and str(arg).replace(" ", ".") not in allowed:
            raise _refuse(file, checkpoint, f"pickles {str(arg).replace(' ', '.')!r}, which is not plain data")


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's ``.metadata``: its metadata classes and torch's plain data only."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if full in _get_allowed_globals():
            return _get_allowed_globals()[full]
        if module.startswith(_DCP_CLASS_MODULES) and not name.startswith("__"):
            found = super().find_class(module, name)
            if isinstance(found, type):  # a metadata dataclass or a path, never a function
                return found
        raise pickle.UnpicklingError(f"{full!r} is not checkpoint metadata")


def _check_dcp(file: Path, checkpoint: Path) -> None:
    """The ``.metadata`` pickle, then every non-tensor item it points to: torch.distributed.checkpoint loads those
    ``torch.save`` archives with ``weights_only=False`` (tensors with ``weights_only=True``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = _MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
        kinds = metadata.state_dict_metadata
        items = [
            info for index, info in metadata.storage_data.items() if isinstance(kinds[index.fqn], BytesStorageMetadata)
        ]
    except Exception as err:  # an UnpicklingError, or anything a corrupt pickle raises
        raise _refuse(file, checkpoint, f"is not plain checkpoint metadata ({' '.join(str(err).split())})") from err
    for item in items:
        shard = file.parent / item.relative_path
        if shard.resolve().parent != file.parent.resolve() or not shard.is_file():
            raise _refuse(file, checkpoint, f"points outside the checkpoint folder ({item.relative_path!r})")
        with shard.open("rb") as f:
            f.seek(item.offset)
            blob = f.read(item.length)
        if not zipfile.is_zipfile(io.BytesIO(blob)):
            raise _refuse(shard, checkpoint, f"holds an item at byte {item.offset} that is not a torch.save archive")
        for pickled in _archive_pickles(blob, shard, checkpoint):
            _check_globals(pickled, shard, checkpoint)


def _data_pickle(path: Path) -> bytes | None:
    """The object structure of a ``torch.save`` archive (``data.pkl``: a few KB to MB whatever the checkpoint's
    size; the tensor data beside it stays on disk), or None when the archive has no single readable one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
            return archive.read(names[0]) if len(names) == 1 else None
    except (zipfile.BadZipFile, OSError, ValueError):  # a damaged archive
        return None


def _pickled_strings(pickled: bytes) -> set[str]:
    """The string constants of a pickle, read without unpickling anything; none if it is truncated or corrupt."""
    try:
        return {arg for _, arg, _ in pickletools.genops(pickled) if isinstance(arg, str)}
    except ValueError:
        return set()
