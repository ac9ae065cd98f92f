"""Tokenizer, datasets, batching and the LightningDataModules.

The DataModules are imported on first use, so that inference (:func:`torch_handle.load`), which reads
``torch_handle.data.tokenizer`` and ``torch_handle.data.batching`` through this package, imports no Lightning.
"""

from importlib import import_module
from typing import Any

from torch_handle.data.batching import (
    Batch,
    Collator,
    Example,
    ExampleDataset,
    LengthSortedSampler,
    TokenBudgetBatchSampler,
)
from torch_handle.data.demo import demo_corpus
from torch_handle.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from torch_handle.errors import DataError

_LIGHTNING = {
    "DenoisingDataModule": "torch_handle.data.pretrain",
    "Seq2SeqDataModule": "torch_handle.data.base",
    "SummarizationDataModule": "torch_handle.data.summarization",
    "TranslationDataModule": "torch_handle.data.translation",
}
"""The names that need Lightning, and the module each comes from."""

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Batch",
    "Collator",
    "DataError",
    "DenoisingDataModule",
    "Example",
    "ExampleDataset",
    "LengthSortedSampler",
    "Seq2SeqDataModule",
    "SummarizationDataModule",
    "TokenBudgetBatchSampler",
    "Tokenizer",
    "TranslationDataModule",
    "demo_corpus",
]


def __getattr__(name: str) -> Any:
    if name not in _LIGHTNING:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = globals()[name] = getattr(import_module(_LIGHTNING[name]), name)  # found directly from now on
    return value
