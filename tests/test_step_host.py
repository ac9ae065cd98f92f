"""The training step's host work (issue 42): the throughput counted from the collator's lengths, batches moved without
their texts, padding done in one pass."""

from __future__ import annotations

import pytest
import torch

from torch_handle.callbacks.throughput import _lengths, _tokens
from torch_handle.data import TranslationDataModule

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.fixture(scope="module")
def batches() -> list[dict]:
    data = TranslationDataModule(bpe_vocab_size=300, demo_size=300, max_tokens=256)
    data.setup("fit")
    return list(data.train_dataloader())[:6]


def test_collated_lengths_and_padding_are_the_tensors(batches: list[dict]) -> None:
    for batch in batches:
        for key in ("src", "tgt"):
            ids = batch[key]
            assert batch[f"{key}_lengths"] == (ids != 0).sum(dim=1).tolist()
            assert ids.dtype == torch.long and ids.shape[1] == max(batch[f"{key}_lengths"])
            for row, n in zip(ids, batch[f"{key}_lengths"], strict=True):
                assert (row[n:] == 0).all() and (row[:n] != 0).all()


def test_throughput_counts_from_the_collators_lengths_as_from_the_tensors(batches: list[dict]) -> None:
    for batch in batches:
        tensors_only = {key: value for key, value in batch.items() if not key.endswith("_lengths")}
        for key, drop_last in (("src", False), ("tgt", True), ("tgt", False)):
            assert _lengths(batch, key, drop_last) == _lengths(tensors_only, key, drop_last)
        assert _tokens(batch) == _tokens(tensors_only)


def test_a_batch_moves_its_tensors_and_keeps_its_texts(batches: list[dict]) -> None:
    batch = batches[0]
    moved = TranslationDataModule().transfer_batch_to_device(batch, torch.device("meta"), 0)
    assert moved.keys() == batch.keys()
    assert moved["src"].device.type == "meta" and moved["tgt"].device.type == "meta"
    assert all(moved[key] is batch[key] for key in batch if not isinstance(batch[key], torch.Tensor))
