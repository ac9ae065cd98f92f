"""Any training checkpoint to one portable safetensors file, or a CTranslate2 or a Hugging Face model folder.

``python -m torch_handle.export CKPT OUTPUT [--format ctranslate2|hf]``.

Accepts a Lightning ``.ckpt`` file (single device, DDP), a DeepSpeed ZeRO-1/2/3 checkpoint folder, or an FSDP,
tensor- or pipeline-parallel (distributed checkpoint) folder. The output holds the Transformer's weights in float32
and, in the safetensors metadata, the model config (special ids included), the tokenizer and the decoding settings
(:class:`Decoding`) as JSON, so that :func:`load_exported` rebuilds a model that decodes exactly as it was
trained, on one CPU, with no Lightning, DeepSpeed or process group. Exports written before the decoding
settings were stored still load, with :class:`Decoding`'s defaults.
The attention backend is not part of an export (it is written as ``auto``): the loading machine picks its own,
so a model trained with xformers on a GPU loads on a CPU. A damaged or foreign file is refused in one line.
``--format ctranslate2`` writes a CTranslate2 model folder instead (:func:`export_ctranslate2`), ``--format hf`` a
Hugging Face one (:func:`torch_handle.pretrained.writer.export_hf`). The command also takes a Hugging Face model
folder, read as :func:`torch_handle.load` reads it (:func:`torch_handle.pretrained.writer.export_folder`).
"""

from torch_handle.export.exported import (
    DEFAULT_MAX_SOURCE_TOKENS,
    FORMAT,
    Decoding,
    empty_model,
    exported_decoding,
    exported_metadata,
    exported_weights,
    fill_exported,
    has_type,
    is_exported,
    load_exported,
    meta_shell,
    safetensors_tensors,
    too_many_layers,
)
from torch_handle.export.write import (
    MODEL_PREFIX,
    export,
    export_ctranslate2,
    merged_checkpoint,
    read_checkpoint,
    read_metadata,
    read_model,
)

__all__ = [
    "DEFAULT_MAX_SOURCE_TOKENS",
    "FORMAT",
    "MODEL_PREFIX",
    "Decoding",
    "empty_model",
    "export",
    "export_ctranslate2",
    "exported_decoding",
    "exported_metadata",
    "exported_weights",
    "fill_exported",
    "has_type",
    "is_exported",
    "load_exported",
    "merged_checkpoint",
    "meta_shell",
    "too_many_layers",
    "read_checkpoint",
    "read_metadata",
    "read_model",
    "safetensors_tensors",
]
