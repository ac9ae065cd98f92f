"""Tokenizer, datasets, batching and the LightningDataModules."""

from torch_handle.data.base import Seq2SeqDataModule
from torch_handle.data.batching import (
    Batch,
    Collator,
    Example,
    ExampleDataset,
    LengthSortedSampler,
    TokenBudgetBatchSampler,
)
from torch_handle.data.demo import demo_corpus
from torch_handle.data.summarization import SummarizationDataModule
from torch_handle.data.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, Tokenizer
from torch_handle.data.translation import TranslationDataModule
from torch_handle.errors import DataError

__all__ = [
    "BOS_ID",
    "EOS_ID",
    "PAD_ID",
    "UNK_ID",
    "Batch",
    "Collator",
    "DataError",
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
