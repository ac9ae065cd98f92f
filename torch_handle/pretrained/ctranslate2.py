"""A model of an imported family as a CTranslate2 folder: the Hugging Face folder :func:`write_hf` writes, converted by
CTranslate2's own ``TransformersConverter``, so that CTranslate2's loader for the family decides every detail (offsets,
biases, normalization order, special tokens) as it does for the original model."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path

from torch_handle.atomic import atomic_folder
from torch_handle.ctranslate2 import CTRANSLATE2, CTRANSLATE2_AVAILABLE, ExportError, check_free
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.export import Decoding
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.pretrained.writer import hf_family, write_hf

log = logging.getLogger(__name__)

CONVERTED = ("bart", "mbart", "marian", "pegasus", "t5")  # the families CTranslate2's converter reads (not LED)
_WEIGHTS = ("model.safetensors", "config.json", "generation_config.json")  # converted; the rest are the tokenizer's


def converted_family(config: TransformerConfig) -> tuple[str | None, str]:
    """The family CTranslate2 converts ``config`` as; else None and one line naming the obstacle."""
    family, reason = hf_family(config)
    if family is None:
        return None, reason
    if family not in CONVERTED:
        return None, f"CTranslate2 has no converter for {family} models: export --format hf and use transformers"
    if family == "t5" and not config.scale_decoder_output:
        return None, (
            "scale_decoder_output=False (T5 v1.1, Flan-T5, mT5): CTranslate2 4.8 scales T5's output when "
            "tie_word_embeddings is true, which transformers 5 reports for these too; export --format hf instead"
        )
    if not config.shares_source_embedding:
        return None, (
            "separate source and target vocabularies: CTranslate2's Marian converter writes one vocabulary; "
            "export --format hf and use transformers"
        )
    return family, ""


def write_converted(model: Transformer, tokenizer: Tokenizer, decoding: Decoding, out_dir: str | Path) -> Path:
    """Write ``model`` (of a family in :data:`CONVERTED`) as the CTranslate2 folder ``out_dir``, whole or not at all,
    with its tokenizer's files (``tokenizer.json``, or Marian's ``.spm`` files and vocabularies) beside the weights.

    Raises:
        ExportError: no family expresses the model, no ``ctranslate2``/``transformers``, or ``out_dir`` holds files.
    """
    out = Path(out_dir)
    check_free(out)
    family, reason = converted_family(model.config)
    if family is None:
        raise ExportError(reason)
    if not CTRANSLATE2_AVAILABLE:
        raise ExportError(f"{CTRANSLATE2} is not installed: pip install 'torch-handle[bench]'")
    try:
        from ctranslate2.converters import TransformersConverter
    except ImportError as err:  # its converter imports transformers
        raise ExportError(f"converting a {family} model needs transformers ({err}): pip install transformers") from None
    with tempfile.TemporaryDirectory() as tmp, atomic_folder(out) as dest:
        folder = write_hf(model, tokenizer, decoding, Path(tmp) / family)
        files = sorted(str(f) for f in folder.iterdir() if f.name not in _WEIGHTS)
        TransformersConverter(str(folder), copy_files=files).convert(str(dest), force=True)
    log.info("wrote a CTranslate2 model (converted as %s) to %s", family, out)
    return out
