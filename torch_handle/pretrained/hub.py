"""Hugging Face hub ids (``Helsinki-NLP/opus-mt-en-de``) as model folders: ``huggingface_hub`` fetches the files
:mod:`torch_handle.pretrained` reads (no TensorFlow, Flax or Rust weights) into its cache once, and the cache
answers from then on; offline (``HF_HUB_OFFLINE=1`` or no network) only the cache does.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from torch_handle.errors import CheckpointError
from torch_handle.pretrained.reader import is_pretrained_folder

_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")  # owner/name
_READ = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"]
_READ += ["source.spm", "target.spm", "vocab.json", "target_vocab.json"]  # Marian's sentencepiece tokenizer
_WEIGHTS = (  # safetensors when the repository has them, else the pickled .bin (checked as the reader checks it)
    ["model.safetensors", "model.safetensors.index.json", "model-*.safetensors"],
    ["pytorch_model.bin", "pytorch_model.bin.index.json", "pytorch_model-*.bin"],
)


def model_path(value: str | Path, option: str) -> Path:
    """``value`` as a local path when one exists or it has no hub id's shape (``owner/name``); else the hub cache's
    snapshot folder of that id, downloaded first when the hub is reachable.

    Args:
        value: What the user passed.
        option: How the user passed it (``--model.init_from``), for the error messages.

    Raises:
        CheckpointError: an id the hub does not have, or one not cached while offline; the message says what to pass.
    """
    path = Path(value)
    if path.exists() or not _HUB_ID.fullmatch(str(value)) or ".." in str(value):
        return path
    try:
        from huggingface_hub import constants, snapshot_download
        from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    except ImportError:
        raise CheckpointError(
            f"{option} {value} is not a local path, and fetching it from the Hugging Face hub needs huggingface_hub: "
            "pip install 'torch-handle[pretrained]', or pass a downloaded folder"
        ) from None
    offline = constants.HF_HUB_OFFLINE or os.environ.get("HF_HUB_OFFLINE", "").upper() in ("1", "ON", "YES", "TRUE")
    for weights in _WEIGHTS:
        try:
            path = Path(snapshot_download(str(value), allow_patterns=_READ + weights, local_files_only=offline))
        except LocalEntryNotFoundError:
            raise CheckpointError(
                f"{option} {value} is not a local path, and the Hugging Face hub cache does not hold it"
                f"{' (HF_HUB_OFFLINE is set)' if offline else ' (the hub is unreachable)'}: download it where the hub "
                f"is reachable (hf download {value} --local-dir FOLDER) and pass that folder"
            ) from None
        except HFValidationError:  # owner/name, but not as the hub spells ids ("a--b/c"): a missing local path
            return Path(value)
        except HfHubHTTPError as err:  # not on the hub, gated or private
            reason = str(err).splitlines()[0] if str(err) else type(err).__name__
            raise CheckpointError(
                f"{option} {value} is neither a local path nor a Hugging Face hub model ({reason}): pass a model folder"
            ) from None
        if is_pretrained_folder(path):
            break
    return path  # without weights: the reader names what is missing
