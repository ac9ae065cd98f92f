"""Finding and checking checkpoints before anything is loaded or written.

Loading a checkpoint must never run code, yet DeepSpeed loads its shards with ``torch.load(weights_only=False)``
and torch.distributed.checkpoint unpickles its ``.metadata`` and non-tensor items with plain ``pickle``. Two
guards stand in the way, each enough alone. :func:`check_checkpoint` tells what each file is as its loader does
(``torch.load`` reads a file as a zip archive when it starts with a zip header, else unpickles it), reads every
pickle without unpickling anything it has not allowed, and refuses the whole checkpoint in one line if a file is
not an archive, is damaged or missing, or names a global that torch's weights-only unpickler would refuse. Then
:func:`~torch_handle.unpickling.unpickling_only_data` loads it with every unpickler of the process restricted to
plain data.
"""

from __future__ import annotations

import io
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.nn import Module

from torch_handle.commands import typed_command
from torch_handle.errors import CheckpointError
from torch_handle.unpickling import (
    ARCHIVE_MAGIC,
    MetadataUnpickler,
    NotMetadata,
    archive_pickles,
    check_globals,
    damaged,
    data_pickle,
    head,
    is_deepspeed_checkpoint,
    pickled_strings,
    refused,
    unpickling_only_data,
)

TOKENIZER_FILE = "tokenizer.json"  # written beside the checkpoints, so evaluation decodes as training encoded
CONFIG_FILE = "transformer.json"

_PICKLE_SUFFIXES = {".pt", ".pth", ".ckpt", ".bin", ".pkl"}  # files DeepSpeed and Lightning hand to torch.load
_PICKLE_PROTO = b"\x80"  # the first byte of a pickle of protocol 2 or later (legacy torch.save writes 2)


def check_checkpoint(path: str | Path) -> Path:
    """Return ``path`` if it holds a Lightning/DeepSpeed/FSDP checkpoint whose pickles load without running
    code, else raise :class:`CheckpointError`."""
    path = Path(path)
    recover_interrupted_save(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint {path} does not exist: pass the path of an existing checkpoint")
    if path.is_file() and head(path) != ARCHIVE_MAGIC:
        if head(path).startswith(_PICKLE_PROTO):
            raise refused(path, path, "starts with a pickle, not a torch.save archive (torch.load would unpickle it)")
        raise CheckpointError(f"{path} is not a checkpoint (not a torch.save archive): pass a .ckpt file")
    if path.is_file():
        pickled = data_pickle(path)
        if pickled is None:
            raise CheckpointError(
                f"{path} is not a Lightning checkpoint (a truncated or damaged archive): pass another .ckpt"
                + _another(path)
            )
        if "state_dict" not in pickled_strings(pickled):
            raise CheckpointError(
                f"{path} is a torch.save archive but not a Lightning checkpoint (no 'state_dict'): pass a .ckpt file"
            )
        check_globals(pickled, path, path)
        return path
    if path.is_dir() and not (is_deepspeed_checkpoint(path) or (path / ".metadata").is_file()):
        if (path / "config.json").is_file():
            raise CheckpointError(
                f"{path} is a Hugging Face model folder, not a training checkpoint: pass a .ckpt path, or start a "
                "run from it with --model.init_from"
            )
        raise CheckpointError(f"{path} is a folder but not a DeepSpeed or FSDP checkpoint: pass a .ckpt path")
    if is_deepspeed_checkpoint(path):
        deepspeed_tag(path)
    for file in sorted(p for p in path.rglob("*") if p.is_file()):
        _check_pickles(file, path)
    if is_deepspeed_checkpoint(path):
        _check_deepspeed_shards(path)
    return path


def _another(path: Path) -> str:
    """The newest other (non-empty) ``.ckpt`` file beside ``path``, as a hint (none: "")."""
    others = [p for p in path.parent.glob("*.ckpt") if p.name != path.name and p.is_file() and p.stat().st_size]
    return f", such as {max(others, key=lambda p: p.stat().st_mtime)}" if others else ""


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
            f"no last checkpoint in {folder}: train first ({typed_command('fit')} --config ...) or pass --ckpt_path"
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

    with unpickling_only_data(path):
        state_dict = get_fp32_state_dict_from_zero_checkpoint(str(path), tag=deepspeed_tag(path))
    state_dict = state_dict if module is None else with_tied_weights(state_dict, module)
    return {**checkpoint_fields(path), "state_dict": state_dict}


def folder_kind(path: Path) -> str:
    """Which strategy wrote a checked checkpoint folder: ``deepspeed``, ``model_parallel`` (its distributed checkpoint
    holds ``state_dict``) or ``fsdp`` (``model``)."""
    if is_deepspeed_checkpoint(path):
        return "deepspeed"
    keys = MetadataUnpickler(io.BytesIO((path / ".metadata").read_bytes())).load().state_dict_metadata
    return "model_parallel" if any(key.startswith("state_dict.") for key in keys) else "fsdp"


def checkpoint_fields(path: Path) -> dict[str, Any]:
    """Lightning's fields of a checked checkpoint (``hyper_parameters``, ``epoch``, ...): of a file, the file; of a
    DeepSpeed folder, its client state; of a distributed checkpoint, the ``meta.pt`` Lightning writes beside it.
    Tensors are mapped, not read: reading the fields leaves the weights on disk."""
    if path.is_file():
        return torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    if is_deepspeed_checkpoint(path):
        states = next((path / deepspeed_tag(path)).glob("*model_states.pt"))
        return torch.load(states, map_location="cpu", mmap=True, weights_only=True)
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


def _check_pickles(file: Path, checkpoint: Path) -> None:
    """Refuses ``file`` if loading it could run code, or if it is damaged; files nothing unpickles pass."""
    if file.name == ".metadata":
        _check_dcp(file, checkpoint)
    elif file.suffix == ".distcp":
        return  # read only at the items .metadata lists, each checked by _check_dcp
    elif head(file) == ARCHIVE_MAGIC:
        for pickled in archive_pickles(file, file, checkpoint):
            check_globals(pickled, file, checkpoint)
    elif file.suffix in _PICKLE_SUFFIXES or head(file).startswith(_PICKLE_PROTO):
        if file.stat().st_size == 0:
            raise damaged(file, checkpoint, "is empty")
        raise refused(file, checkpoint, "is not a torch.save archive (torch.load would unpickle it as a bare pickle)")


def _check_deepspeed_shards(path: Path) -> None:
    """A DeepSpeed folder's tag holds model states and, under ZeRO, one optimizer shard per rank that saved
    (DeepSpeed counts them only after unpickling every shard, and then raises a bare ``ValueError``)."""
    folder = path / deepspeed_tag(path)
    models, shards = sorted(folder.glob("*_model_states.pt")), sorted(folder.glob("*_optim_states.pt"))
    if not models:
        raise damaged(folder, path, "holds no model states (*_model_states.pt): they are missing")
    with unpickling_only_data(path):
        states = torch.load(models[0], map_location="cpu", mmap=True, weights_only=True)
    zero = (states.get("ds_config") or {}).get("zero_optimization", {}).get("stage", 0)
    ranks = states.get("dp_world_size", 1)
    if zero and len(shards) != ranks:
        raise damaged(folder, path, f"holds {len(shards)} of the {ranks} optimizer shards (*_optim_states.pt) "
                       f"that its {ranks} ranks saved: the others are missing")  # fmt: skip


def _check_dcp(file: Path, checkpoint: Path) -> None:
    """The ``.metadata`` pickle, then every item it points to: each must lie whole in a shard of the folder and be a
    ``torch.save`` archive; the pickles of the non-tensor items are checked too (torch.distributed.checkpoint loads
    those with ``weights_only=False``, tensors with ``weights_only=True``)."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    try:
        metadata = MetadataUnpickler(io.BytesIO(file.read_bytes())).load()
        kinds = metadata.state_dict_metadata
        items = [
            (info, isinstance(kinds[index.fqn], BytesStorageMetadata)) for index, info in metadata.storage_data.items()
        ]
    except NotMetadata as err:
        raise refused(file, checkpoint, f"is not plain checkpoint metadata ({' '.join(str(err).split())})") from err
    except Exception as err:  # anything a truncated or corrupt pickle raises
        raise damaged(file, checkpoint, f"is truncated or corrupt ({' '.join(str(err).split())})") from err
    for item, is_bytes in items:
        shard = file.parent / item.relative_path
        if shard.resolve().parent != file.parent.resolve():
            raise refused(file, checkpoint, f"points outside the checkpoint folder ({item.relative_path!r})")
        if not shard.is_file():
            raise damaged(shard, checkpoint, "is missing (its .metadata lists it)")
        if shard.stat().st_size < item.offset + item.length:
            raise damaged(shard, checkpoint, f"is truncated ({shard.stat().st_size} bytes; an item ends at byte "
                           f"{item.offset + item.length})")  # fmt: skip
        if head(shard, item.offset) != ARCHIVE_MAGIC:
            raise refused(shard, checkpoint, f"holds an item at byte {item.offset} that is not a torch.save archive")
        if is_bytes:
            with shard.open("rb") as f:
                f.seek(item.offset)
                blob = f.read(item.length)
            for pickled in archive_pickles(blob, shard, checkpoint):
                check_globals(pickled, shard, checkpoint)
