"""Real data: Multi30k En-De through ``TranslationDataModule``, and a short training on it that learns.

Uses ``lightning.Trainer`` directly, the API a notebook or script uses, rather than the CLI.
"""

from __future__ import annotations

import csv
from pathlib import Path

import lightning as L
import pytest
from conftest import tiny_config
from lightning.pytorch.loggers import CSVLogger

from torch_handle.data import BOS_ID, EOS_ID, PAD_ID, TranslationDataModule
from torch_handle.module import Seq2SeqModule

pytestmark = [pytest.mark.usefixtures("single_thread"), pytest.mark.slow]  # trains and tokenizes real Multi30k

MAX_TOKENS = 2048
TRAIN_STEPS = 60
VAL_BATCHES = 4


@pytest.fixture
def multi30k(shared_data: Path) -> TranslationDataModule:
    # The joint BPE is trained on all 29,000 training pairs (both languages) in about a second.
    return TranslationDataModule(
        data_dir=str(shared_data / "multi30k"),
        test_split="test_2016_flickr",
        bpe_vocab_size=1000,
        max_tokens=MAX_TOKENS,
    )


def test_multi30k_reads_every_split_line_aligned(multi30k: TranslationDataModule, shared_data: Path) -> None:
    multi30k.setup("fit")
    multi30k.setup("test")
    sizes = {split: len(multi30k.dataset(split)) for split in ("train", "val", "test")}
    assert sizes == {"train": 29000, "val": 1014, "test": 1000}  # Multi30k task 1, as the data README states
    assert multi30k.vocab_size == 1000
    val = multi30k.dataset("val")
    german = (shared_data / "multi30k" / "val.de").read_text(encoding="utf-8").splitlines()
    english = (shared_data / "multi30k" / "val.en").read_text(encoding="utf-8").splitlines()
    for i in (0, 1, len(german) - 1):
        assert (val[i].src_text, val[i].tgt_text) == (english[i], german[i])
    umlauts = [line for line in german if any(c in line for c in "äöüßÄÖÜ")]
    assert len(umlauts) > 100
    tokenizer = multi30k.tokenizer
    assert [tokenizer.decode(tokenizer.encode(line)) for line in umlauts] == umlauts  # byte-level: lossless


def test_multi30k_batches_respect_the_token_budget(multi30k: TranslationDataModule) -> None:
    multi30k.setup("fit")
    seen = 0
    for i, batch in enumerate(multi30k.train_dataloader()):
        src, tgt = batch["src"], batch["tgt"]  # (B, S), (B, T)
        assert src.shape[0] == tgt.shape[0] == len(batch["tgt_text"])
        assert src.numel() <= MAX_TOKENS and tgt.numel() <= MAX_TOKENS
        assert (tgt[:, 0] == BOS_ID).all()
        assert ((src == EOS_ID).sum(dim=1) == 1).all() and ((tgt == EOS_ID).sum(dim=1) == 1).all()
        assert (src[:, -1] != PAD_ID).any() and (tgt[:, -1] != PAD_ID).any()  # no all-padding column
        seen += src.shape[0]
        if i == 20:
            break
    assert seen > 20 * 30  # length bucketing packs short captions many to a batch


def test_short_training_on_multi30k_lowers_validation_loss(multi30k: TranslationDataModule, tmp_path: Path) -> None:
    L.seed_everything(0)
    config = tiny_config(d_model=64, d_ff=128, norm_first=True)
    module = Seq2SeqModule(
        config, vocab_size=multi30k.vocab_size, lr=3e-3, warmup_steps=10, generate_every_n_val_epochs=0
    )
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=TRAIN_STEPS,
        limit_val_batches=VAL_BATCHES,
        num_sanity_val_steps=0,
        log_every_n_steps=10,
        logger=CSVLogger(tmp_path, name="multi30k"),
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        use_distributed_sampler=False,  # the data module shards its token-budget batches itself
    )
    (first,) = trainer.validate(module, datamodule=multi30k, verbose=False)
    trainer.fit(module, datamodule=multi30k)
    (last,) = trainer.validate(module, datamodule=multi30k, verbose=False)
    assert trainer.global_step == TRAIN_STEPS
    # Measured: 6.96 nats (about ln 1000, uniform over the vocabulary) falling to about 5.0 after 60 steps.
    # A 1-nat margin fails on any broken loss, mask, optimizer or data pairing, and survives seed noise.
    assert first["val/loss"] > 6.5
    assert last["val/loss"] < first["val/loss"] - 1.0, (first, last)
    with open(Path(trainer.logger.log_dir) / "metrics.csv", encoding="utf-8") as f:
        rows = list(csv.DictReader(f))
    train_losses = [float(row["train/loss"]) for row in rows if row.get("train/loss")]
    val_losses = [float(row["val/loss"]) for row in rows if row.get("val/loss")]
    assert len(train_losses) == TRAIN_STEPS // 10 and train_losses[-1] < train_losses[0] - 1.0
    assert val_losses == pytest.approx([first["val/loss"], last["val/loss"]])
