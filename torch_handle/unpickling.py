"""Reading a checkpoint's pickles without running code: what they may name, checked without unpickling them
(:func:`check_globals`), and enforced on every unpickler of the process while a checkpoint loads
(:func:`unpickling_only_data`).

torch's weights-only unpickler allows plain data and tensors; DeepSpeed's shards add a few plain classes of its
own, and torch.distributed.checkpoint's ``.metadata`` its metadata dataclasses. Nothing else is rebuilt.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch._weights_only_unpickler import _get_allowed_globals, _get_user_allowed_globals

from torch_handle.errors import CheckpointError

# DeepSpeed's optimizer shards pickle these plain classes: an enum, a loss scaler's attributes, and (ZeRO-1/2) a
# dataclass of two ints; rebuilding them calls no code of the file's choosing.
DEEPSPEED_GLOBALS = {
    "deepspeed.runtime.zero.config.ZeroStageEnum",
    "deepspeed.runtime.fp16.loss_scaler.LossScaler",
    "deepspeed.utils.tensor_fragment.fragment_address",
}
# Opcodes that reach a callable other than through a literal GLOBAL name; torch.save never writes them.
_OPAQUE_OPCODES = {"STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4"}
ARCHIVE_MAGIC = b"PK\x03\x04"  # torch.load's own test (serialization._is_zipfile): a zip header at byte 0
# The classes torch.distributed.checkpoint pickles into ``.metadata`` (besides torch's plain data): its metadata
# dataclasses and enum, its file reader's storage record, and the checkpoint's path.
DCP_CLASSES = {
    "torch.distributed.checkpoint.metadata": (
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
        "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    ),
    "torch.distributed.checkpoint.filesystem": ("_StorageInfo",),
    "pathlib": ("PosixPath", "WindowsPath"),
}  # fmt: skip


def is_deepspeed_checkpoint(path: Path) -> bool:
    """DeepSpeed saves a folder per checkpoint with a ``latest`` tag file and a folder per tag."""
    return path.is_dir() and (path / "latest").is_file()


@contextmanager
def unpickling_only_data(checkpoint: Path) -> Iterator[None]:
    """Loads ``checkpoint`` inside: every unpickler of the process accepts plain data only, so that even a file shape
    :func:`~torch_handle.checkpoints.check_checkpoint` does not know cannot run code; a pickle refused here is one
    :class:`CheckpointError` line.

    DeepSpeed (``zero_to_fp32``, its engine's resume) and torch.distributed.checkpoint's default planner
    (``load_bytes``) call ``torch.load(weights_only=False)`` deep inside Lightning's strategies, with no argument that
    reaches them, so the hook is torch's own switch, ``TORCH_FORCE_WEIGHTS_ONLY_LOAD``, set for the load alone (with
    DeepSpeed's few plain classes allowed); torch.distributed.checkpoint's file reader unpickles ``.metadata`` with
    the ``pickle`` module it imported, which here is one whose ``load`` allows metadata classes only.
    """
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.api import CheckpointException

    forced = {name: os.environ.pop(name, None) for name in _FORCE_VARIABLES}
    os.environ["TORCH_FORCE_WEIGHTS_ONLY_LOAD"] = "1"
    reader_pickle, filesystem.pickle = filesystem.pickle, _MetadataPickle()  # type: ignore[assignment]
    refusals = filesystem.pickle.refusals
    try:
        with torch.serialization.safe_globals(_deepspeed_classes() if is_deepspeed_checkpoint(checkpoint) else []):
            yield
    except (Exception, CheckpointException) as err:  # torch.distributed.checkpoint's holds each rank's error
        errors = [error for error, _ in err.failures.values()] if isinstance(err, CheckpointException) else [err]
        reasons = [_first_line(e) for e in errors if isinstance(e, pickle.UnpicklingError)] + refusals
        if not reasons:
            raise
        raise refused(
            checkpoint, checkpoint, f"holds a pickle that weights-only loading refuses ({reasons[0]})"
        ) from err
    finally:
        filesystem.pickle = reader_pickle  # type: ignore[assignment]
        for name, value in forced.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


_FORCE_VARIABLES = ("TORCH_FORCE_WEIGHTS_ONLY_LOAD", "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD")


def _first_line(err: pickle.UnpicklingError) -> str:
    """What torch's weights-only unpickler refused, from its many-line message."""
    lines = [line for line in str(err).splitlines() if "WeightsUnpickler error" in line] or str(err).splitlines()
    return " ".join(lines[0].split(". ")[0].split()) if lines else type(err).__name__


def _deepspeed_classes() -> list[type]:
    """The classes of :data:`DEEPSPEED_GLOBALS`, for ``torch.serialization.safe_globals``."""
    import importlib

    return [getattr(importlib.import_module(name.rpartition(".")[0]), name.rpartition(".")[2]) for name in
            sorted(DEEPSPEED_GLOBALS)]  # fmt: skip


def refused(file: Path, checkpoint: Path, what: str) -> CheckpointError:
    """The one line for a checkpoint that could run code."""
    return CheckpointError(
        f"{file} {what}, so loading {checkpoint} could run code: refused; load only checkpoints you trust, "
        "re-saved by torch-handle"
    )


def damaged(file: Path, checkpoint: Path, what: str) -> CheckpointError:
    """The one line for a checkpoint that is truncated, corrupt or incomplete: damage, not an attack."""
    return CheckpointError(
        f"{file} {what}: checkpoint {checkpoint} is damaged (an interrupted copy or save?); pass another checkpoint"
    )


def head(file: Path, offset: int = 0) -> bytes:
    """The bytes by which ``torch.load`` tells an archive from a pickle, at ``offset`` (an item of a shard)."""
    with file.open("rb") as f:
        f.seek(offset)
        return f.read(len(ARCHIVE_MAGIC))


def archive_pickles(archive: Path | bytes, file: Path, checkpoint: Path) -> Iterator[bytes]:
    """The pickles of a ``torch.save`` archive (a file, or an item of a shard); tensor data is not read."""
    try:
        with zipfile.ZipFile(io.BytesIO(archive) if isinstance(archive, bytes) else archive) as zipped:
            size = len(archive) if isinstance(archive, bytes) else archive.stat().st_size
            for info in zipped.infolist():
                if info.filename.endswith(".pkl"):
                    yield _stored(zipped, info, size)
    except (zipfile.BadZipFile, OSError, ValueError) as err:
        raise damaged(file, checkpoint, f"is truncated or corrupt (an archive that does not read: {err})") from err


def _stored(zipped: zipfile.ZipFile, info: zipfile.ZipInfo, size: int) -> bytes:
    """A ``.pkl`` member, read only if stored uncompressed (as ``torch.save`` writes it) and no larger than the
    archive of ``size`` bytes: a deflated member could inflate without bound."""
    if info.compress_type != zipfile.ZIP_STORED or info.file_size > size:
        raise ValueError(f"its pickle {info.filename} is compressed or larger than the archive, as torch.save never "
                         "writes one")  # fmt: skip
    return zipped.read(info.filename)


def check_globals(pickled: bytes, file: Path, checkpoint: Path) -> None:
    """Every global a ``torch.save`` pickle names must be one that ``torch.load(weights_only=True)`` allows."""
    allowed = _get_allowed_globals().keys() | _get_user_allowed_globals().keys() | DEEPSPEED_GLOBALS
    try:
        opcodes = [(opcode.name, arg) for opcode, arg, _ in pickletools.genops(pickled)]
    except ValueError as err:  # a truncated or corrupt pickle
        raise damaged(file, checkpoint, f"holds a truncated or corrupt pickle ({err})") from err
    for name, arg in opcodes:
        if name in _OPAQUE_OPCODES:
            raise refused(file, checkpoint, f"holds the pickle opcode {name}, which weights-only loading refuses")
        if name == "GLOBAL" and str(arg).replace(" ", ".") not in allowed:
            raise refused(file, checkpoint, f"pickles {str(arg).replace(' ', '.')!r}, which is not plain data")


class NotMetadata(pickle.UnpicklingError):
    """A ``.metadata`` pickle names a global that :class:`MetadataUnpickler` does not rebuild (a truncated or corrupt
    one raises other errors)."""


class MetadataUnpickler(pickle.Unpickler):
    """Unpickles torch.distributed.checkpoint's ``.metadata``: its metadata classes and torch's plain data only."""

    def find_class(self, module: str, name: str) -> Any:
        full = f"{module}.{name}"
        if "." not in name:  # a dotted name (protocol 4) would reach any attribute of the module
            if full in _get_allowed_globals():
                return _get_allowed_globals()[full]
            if name in DCP_CLASSES.get(module, ()):
                return super().find_class(module, name)
        raise NotMetadata(f"{full!r} is not checkpoint metadata")


class _MetadataPickle:
    """The ``pickle`` module as torch.distributed.checkpoint's file reader sees it inside :func:`unpickling_only_data`:
    ``.metadata`` is read by :class:`MetadataUnpickler`, whose refusals are kept (the reader's caller turns them into
    an ``AssertionError`` that says metadata is missing)."""

    dump = staticmethod(pickle.dump)

    def __init__(self) -> None:
        self.refusals: list[str] = []

    def load(self, file: io.BufferedReader) -> Any:
        try:
            return MetadataUnpickler(file).load()
        except NotMetadata as err:
            self.refusals.append(str(err))
            raise


def data_pickle(path: Path) -> bytes | None:
    """The object structure of a ``torch.save`` archive (``data.pkl``: a few KB to MB whatever the checkpoint's
    size; the tensor data beside it stays on disk), or None when the archive has no single readable one."""
    try:
        with zipfile.ZipFile(path) as archive:
            names = [name for name in archive.namelist() if name.endswith("/data.pkl") or name == "data.pkl"]
            return _stored(archive, archive.getinfo(names[0]), path.stat().st_size) if len(names) == 1 else None
    except (zipfile.BadZipFile, OSError, ValueError):  # a damaged archive
        return None


def pickled_strings(pickled: bytes) -> set[str]:
    """The string constants of a pickle, read without unpickling anything; none if it is truncated or corrupt."""
    try:
        return {arg for _, arg, _ in pickletools.genops(pickled) if isinstance(arg, str)}
    except ValueError:
        return set()
