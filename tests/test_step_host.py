"""The training step's host work (issue 42): the divergence check that waits for the device only every n steps, the
throughput counted from the collator's lengths, batches moved without their texts, padding done in one pass."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader

from torch_handle.callbacks.divergence import DivergenceError, StopOnDivergence
from torch_handle.callbacks.throughput import _lengths, _tokens
from torch_handle.data import TranslationDataModule

pytestmark = pytest.mark.usefixtures("single_thread")


class _Linear(L.LightningModule):
    """One linear layer whose loss turns NaN at ``bad_step``; records its weight before each step."""

    def __init__(self, fused: bool, bad_step: int) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 1)
        self.fused, self.bad_step = fused, bad_step
        self.weights: list[torch.Tensor] = []

    def on_train_batch_start(self, batch: torch.Tensor, batch_idx: int) -> None:
        self.weights.append(self.layer.weight.detach().clone())

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        loss = self.layer(batch).pow(2).mean()
        return loss * float("nan") if self.global_step == self.bad_step else loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.1, fused=self.fused)

    def train_dataloader(self) -> DataLoader:
        return DataLoader(torch.randn(64, 4, generator=torch.Generator().manual_seed(0)), batch_size=4)


@pytest.mark.parametrize("fused", [True, False], ids=["fused (skips on the device)", "for-loop (read each step)"])
def test_divergence_stops_at_the_read_with_the_weights_before_the_bad_step(fused: bool, tmp_path) -> None:
    """A fused optimizer skips the NaN step and those after it on the device, and the host reads the checks every
    ``read_every_n_steps`` (here after four steps): the run ends there naming the bad step, its weights those before
    it. A for-loop optimizer cannot skip, so its run ends at the bad step itself, before the update."""
    module = _Linear(fused, bad_step=1)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=10,
        callbacks=[StopOnDivergence(read_every_n_steps=4)],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        default_root_dir=tmp_path,
    )
    with pytest.raises(DivergenceError, match=r"^training diverged at step 1: loss nan, gradient norm nan"):
        trainer.fit(module)
    assert len(module.weights) == (4 if fused else 2)  # steps begun before the read
    torch.testing.assert_close(module.layer.weight.detach(), module.weights[1], rtol=0, atol=0)
    assert not torch.equal(module.weights[1], module.weights[0])  # the first step was applied
    assert trainer.optimizers[0].state[module.layer.weight]["step"].item() == 1


def test_read_every_n_steps_must_be_positive() -> None:
    with pytest.raises(ValueError, match="^StopOnDivergence's read_every_n_steps must be >= 1, got 0$"):
        StopOnDivergence(read_every_n_steps=0)


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
