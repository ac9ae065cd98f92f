"""Our own trained models as a starting point: ``--model.init_from`` takes what :func:`torch_handle.load` reads.

A Hugging Face folder is read by :mod:`torch_handle.pretrained`; an export, a checkpoint (file or folder) or a run
folder (e.g. a denoising pretraining run, ``--config pretrain``) is read here, and gives the fine-tuning run its
architecture, its weights and its tokenizer alike.
"""

from __future__ import annotations

from pathlib import Path

from torch import Tensor

from torch_handle.atomic import temporary_folder
from torch_handle.checkpoints import TOKENIZER_FILE, CheckpointError, is_deepspeed_checkpoint, last_checkpoint
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.export import (
    Decoding,
    exported_decoding,
    exported_metadata,
    exported_weights,
    fill_exported,
    is_exported,
    read_metadata,
    read_model,
)
from torch_handle.model import Transformer
from torch_handle.model.config import TransformerConfig
from torch_handle.pretrained import fill, is_pretrained_folder, pretrained_config
from torch_handle.pretrained.hub import model_path
from torch_handle.pretrained.layout import FRESH
from torch_handle.pretrained.reader import read_weights

KINDS = (
    "a .safetensors export, a .ckpt file, a DeepSpeed or FSDP checkpoint folder, a run folder, or a Hugging Face "
    "model folder (or its hub id, owner/name)"
)


def read_trained(path: Path) -> tuple[dict[str, Tensor], TransformerConfig, Tokenizer, Decoding]:
    """The weights, config, tokenizer and decoding defaults of an export, a checkpoint or a run folder (its
    ``checkpoints/last.ckpt``).

    Raises:
        CheckpointError: ``path`` is none of these, or damaged; the message names it.
    """
    if is_exported(path):
        config, tokenizer = exported_metadata(path)
        return exported_weights(path), config, tokenizer, exported_decoding(path, config)
    weights, config, text, decoding = read_model(_checkpoint(path))
    return weights, config, Tokenizer.from_str(text), decoding


def trained_metadata(path: Path) -> tuple[TransformerConfig, Tokenizer]:
    """:func:`read_trained`'s config and tokenizer, read without the weights (which a model built from the config
    then reads once)."""
    if is_exported(path):
        return exported_metadata(path)
    config, text = read_metadata(_checkpoint(path))
    return config, Tokenizer.from_str(text)


def _checkpoint(path: Path) -> Path:
    """``path``, or the last checkpoint of the run folder ``path``."""
    if path.is_dir() and not (is_deepspeed_checkpoint(path) or (path / ".metadata").is_file()):
        if not (path / "checkpoints").is_dir():
            raise CheckpointError(f"{path} is a folder but not a checkpoint or a run folder: pass {KINDS}")
        return last_checkpoint(path / "checkpoints")
    return path


def init_config(init_from: str | Path) -> TransformerConfig:
    """The architecture of ``--model.init_from``: a Hugging Face folder's, or one of ours (:func:`trained_metadata`)."""
    path = init_path(init_from)
    if is_pretrained_folder(path):
        return pretrained_config(path)[0]
    return trained_metadata(path)[0]


def init_weights(model: Transformer, init_from: str | Path) -> None:
    """Fills ``model`` with the weights of ``--model.init_from``, built from :func:`init_config`."""
    path = init_path(init_from)
    if is_pretrained_folder(path):
        fill(model, read_weights(path), str(path))
    elif is_exported(path):
        fill_exported(model, path, FRESH)
    else:
        state = read_trained(path)[0]
        missing, unexpected = model.load_state_dict(state, strict=False)
        if unexpected or any(not name.startswith(FRESH) for name in missing):
            model.load_state_dict(state, strict=True)  # raises, naming them


def init_tokenizer_path(init_from: str) -> str:
    """What ``--data.tokenizer_path`` reads for ``--model.init_from``: a Hugging Face folder itself, else our model's
    tokenizer (``<mask>`` of a pretraining run included) written to a file removed when the process exits."""
    path = init_path(init_from)
    if is_pretrained_folder(path):
        return str(path)
    tokenizer = temporary_folder() / TOKENIZER_FILE
    trained_metadata(path)[1].save(tokenizer)
    return str(tokenizer)


def init_path(init_from: str | Path) -> Path:
    """The local path of ``--model.init_from`` (a hub id's cached folder), refused in one line when there is none."""
    path = model_path(init_from, "--model.init_from")
    if not path.exists():
        raise CheckpointError(f"--model.init_from {path} does not exist: pass {KINDS}")
    return path
