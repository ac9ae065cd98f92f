"""Reading a Hugging Face model folder without ``transformers``: its JSON files, weights and tokenizer.

Weights come one file (shard) at a time, so that importing peaks near the model's own size. ``pytorch_model.bin`` is
a pickle: it is opened only when its first bytes are a ``torch.save`` zip archive, and then only by torch's
weights-only unpickler, which rebuilds tensors and nothing that runs code.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from torch_handle.errors import CheckpointError
from torch_handle.export.exported import safetensors_header, safetensors_tensors
from torch_handle.jsonfiles import json_object
from torch_handle.unpickling import ARCHIVE_MAGIC, archive_pickles, check_globals, head

CONFIG = "config.json"
GENERATION = "generation_config.json"
_WEIGHTS = ("model.safetensors", "pytorch_model.bin")  # in order of preference, each alone or sharded


def is_pretrained_folder(path: Path) -> bool:
    """A folder that ``save_pretrained`` wrote: a ``config.json`` beside weights."""
    return path.is_dir() and (path / CONFIG).is_file() and any(_weight_files(path, name) for name in _WEIGHTS)


def read_json(path: Path, required: bool = True) -> dict[str, Any]:
    """The object in the JSON file ``path``; an empty one for a missing optional file."""
    if not path.is_file():
        if required:
            raise CheckpointError(f"{path} is missing: pass a folder written by save_pretrained")
        return {}
    return json_object(path, CheckpointError, "pass a folder written by save_pretrained")


def _weight_files(folder: Path, name: str) -> list[Path]:
    """The files of weights ``name``: itself, or the shards its ``.index.json`` lists (each once, in order)."""
    if (folder / name).is_file():
        return [folder / name]
    index = folder / f"{name}.index.json"
    if not index.is_file():
        return []
    weight_map = read_json(index).get("weight_map")
    if not isinstance(weight_map, dict):
        raise CheckpointError(f"{index} has no weight_map: pass a folder written by save_pretrained")
    if not all(isinstance(shard, str) for shard in weight_map.values()):
        raise CheckpointError(f"{index} maps tensors to shards that are not file names: pass a save_pretrained folder")
    shards = list(dict.fromkeys(weight_map.values()))
    for shard in shards:  # a bare file name; a link (the Hugging Face cache's shards point into its blobs/) is fine
        if Path(shard).name != shard or shard in ("", ".", ".."):
            raise CheckpointError(
                f"{index} lists the shard {shard!r}, which is not a file of {folder}: refused; "
                "pass a folder written by save_pretrained"
            )
    return [folder / shard for shard in shards]


def check_zip(file: Path) -> None:
    """Refuse ``file`` unless torch.load would read it as a ``torch.save`` archive (its first bytes) whose pickles
    name only the globals weights-only loading allows: the checks our own checkpoints pass."""
    if head(file) != ARCHIVE_MAGIC:
        raise CheckpointError(
            f"{file} is not a torch.save zip archive: re-save the model with save_pretrained (safetensors)"
        )
    for pickled in archive_pickles(file, file, file):
        check_globals(pickled, file, file)


def weight_files(folder: Path) -> list[Path]:
    """The files that hold the folder's weights (safetensors before ``.bin``), each present, a ``.bin`` checked by
    :func:`check_zip`."""
    for name in _WEIGHTS:
        files = _weight_files(folder, name)
        if files:
            break
    else:
        raise CheckpointError(f"{folder} has no model.safetensors or pytorch_model.bin: pass a save_pretrained folder")
    for file in files:
        if not file.is_file():
            raise CheckpointError(f"{file} is listed in the index but missing: download the whole folder")
        if file.suffix == ".safetensors":
            check_safetensors(file)
        else:
            check_zip(file)
    return files


def check_safetensors(file: Path) -> None:
    """Refuse ``file`` unless safetensors reads its header and finds the file as long as the header says (a
    truncated download, or another format under this name, fails here)."""
    safetensors_header(file, "download the folder again")


def weight_names(folder: Path) -> set[str]:
    """The names of the folder's tensors, from the safetensors headers, without reading the tensors (a
    ``pytorch_model.bin`` is mapped, not read)."""
    names: set[str] = set()
    for file in weight_files(folder):
        if file.suffix == ".safetensors":
            names.update(safetensors_header(file, "download the folder again")[1])
        else:
            names.update(_load_bin(file))
    return names


def _load_bin(file: Path) -> dict[str, Tensor]:
    """The state dict of a ``pytorch_model.bin`` (checked by :func:`check_zip`), mapped by the weights-only loader."""
    try:
        state = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
    except Exception as err:  # the weights-only unpickler refuses with several exception types
        raise CheckpointError(f"{file} holds more than tensors ({str(err).splitlines()[0]}): refused") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"{file} is not a state dict: pass a folder written by save_pretrained")
    return state


def read_weights(folder: Path) -> Iterator[tuple[str, Tensor]]:
    """Every tensor of the folder's weights as ``(name, tensor)``, one shard at a time, a safetensors shard's largest
    first and each through a mapping of its own (:func:`torch_handle.export.safetensors_tensors`)."""
    for file in weight_files(folder):
        if file.suffix == ".safetensors":
            yield from safetensors_tensors(file)
            continue
        state = _load_bin(file)
        yield from state.items()
        del state
