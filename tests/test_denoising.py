"""Denoising pretraining: BART's noise and its statistics, noise as a function of (seed, epoch, index), and a
pretraining run that a fine-tuning run starts from through the CLI."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torch_handle.cli import main
from torch_handle.data.batching import BatchIndices
from torch_handle.data.denoising import denoising_source, infill, noise_generator, permute_sentences, span_lengths
from torch_handle.data.pretrain import DenoisingDataModule, EpochBatchSampler
from torch_handle.data.tokenizer import MASK_TOKEN, Tokenizer
from torch_handle.errors import DataError
from torch_handle.module import Seq2SeqModule

ROOT = Path(__file__).resolve().parents[1]
MASK = -1  # outside every id of the texts below


def test_infill_masks_thirty_percent_in_poisson_spans_each_one_mask() -> None:
    n, samples = 200, 300
    masked = spans = 0
    for index in range(samples):
        ids = list(range(n))
        out = infill(ids, MASK, noise_generator(0, 0, index))
        kept = [token for token in out if token != MASK]
        assert kept == sorted(kept)  # the unmasked tokens keep their order
        masks = len(out) - len(kept)
        masked += n - len(kept)
        spans += masks
        # Every gap in the kept tokens is one span and so at least one mask: none vanishes unmarked.
        for a, b in zip([-1, *kept], [*kept, n], strict=True):
            if b - a > 1:
                between = out[out.index(a) + 1 if a >= 0 else 0 : out.index(b) if b < n else len(out)]
                assert between and all(token == MASK for token in between), (a, b, between)
    assert masked == samples * math.ceil(0.3 * n)  # exactly 30% of the tokens, every time
    assert masked / spans == pytest.approx(3.0, abs=0.15)  # spans of Poisson(3) length, one mask each


def test_span_lengths_are_poisson_and_cover_exactly() -> None:
    generator = noise_generator(1, 0, 0)
    lengths = [length for _ in range(200) for length in span_lengths(60, 3.0, generator)]
    assert sum(lengths) == 200 * 60
    assert sum(lengths) / len(lengths) == pytest.approx(3.0, abs=0.15)
    assert lengths.count(0) / len(lengths) == pytest.approx(math.exp(-3), abs=0.02)  # zero-length: inserted masks


def test_sentence_permutation_keeps_the_multiset_of_sentences() -> None:
    ids = list(range(30))
    ends = [4, 11, 12, 20, 30]
    sentences = sorted(tuple(ids[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True))
    orders = set()
    for index in range(20):
        out = permute_sentences(ids, ends, noise_generator(0, 0, index))
        starts = {ids[a]: tuple(ids[a:b]) for a, b in zip([0, *ends[:-1]], ends, strict=True)}
        found, position = [], 0
        while position < len(out):
            sentence = starts[out[position]]
            assert tuple(out[position : position + len(sentence)]) == sentence
            found.append(sentence)
            position += len(sentence)
        assert sorted(found) == sentences
        orders.add(tuple(found))
    assert len(orders) > 10


def test_noise_is_a_function_of_seed_epoch_and_index() -> None:
    ids, ends = list(range(100)), [25, 50, 100]

    def noised(seed: int, epoch: int, index: int) -> list[int]:
        return denoising_source(ids, ends, MASK, noise_generator(seed, epoch, index))

    assert noised(0, 1, 2) == noised(0, 1, 2)
    assert len({tuple(noised(*triple)) for triple in [(0, 1, 2), (1, 1, 2), (0, 2, 2), (0, 1, 3), (0, 2, 1)]}) == 5


def test_tokenizer_mask_is_added_after_the_last_id() -> None:
    tokenizer = Tokenizer.train(["a small text, to train on."] * 5, 300)
    masked = tokenizer.with_mask()
    assert tokenizer.mask_id is None and masked.mask_id == tokenizer.vocab_size
    assert masked.vocab_size == tokenizer.vocab_size + 1 and masked.with_mask() is masked
    assert masked.encode("a small text") == tokenizer.encode("a small text")  # no id moves
    assert Tokenizer.from_str(masked.to_str()).mask_id == masked.mask_id
    assert masked.backend.id_to_token(masked.mask_id) == MASK_TOKEN


def test_a_mask_that_would_take_a_used_id_is_refused() -> None:
    """ids 0, 1, 3: the library counts 3 and would give <mask> id 3, which is ``x``'s."""
    from tokenizers import Tokenizer as Backend
    from tokenizers import models

    backend = Backend(models.WordPiece({"[PAD]": 0, "[UNK]": 1, "x": 3}, unk_token="[UNK]")).to_str()
    wrapped = json.dumps({"torch_handle_specials": {"pad_id": 0, "bos_id": 0, "eos_id": 1}, "tokenizer": backend})
    with pytest.raises(DataError, match=r"^the tokenizer's ids have gaps, so <mask> would take id 3 of 'x': add"):
        Tokenizer.from_str(wrapped).with_mask()


def _text(path: Path) -> Path:
    sentences = [
        f"Sentence {i} of story {s} tells of {'ships' if i % 2 else 'stars'}." for s in range(6) for i in range(8)
    ]
    path.write_text("\n".join(" ".join(sentences[s * 8 : s * 8 + 8]) for s in range(6)) + "\n", encoding="utf-8")
    return path


def test_datamodule_noises_each_epoch_anew_and_validation_alike(tmp_path: Path) -> None:
    data = DenoisingDataModule([str(_text(tmp_path / "a.txt"))], [str(tmp_path / "a.txt")], bpe_vocab_size=300)
    train, val = data.dataset("train"), data.dataset("val")
    assert data.vocab_size == data.tokenizer.mask_id + 1
    example = train.examples[0]
    assert example.src_ids == example.tgt_ids  # held clean, noised per batch

    def batch(dataset: object, epoch: int) -> list[list[int]]:
        indices = BatchIndices([0, 1], 0)
        indices.epoch = epoch
        return [e.src_ids for e in dataset.__getitems__(indices)]

    assert batch(train, 0) == batch(train, 0) != batch(train, 1)
    assert batch(val, 0) == batch(val, 1)  # validation: the same noise every epoch
    source = batch(train, 0)[0]
    assert data.tokenizer.mask_id in source and len(source) < len(example.tgt_ids)
    sampler = EpochBatchSampler([10] * len(train), 20, shuffle=True)
    sampler.set_epoch(3)
    batches = list(sampler)
    assert {b.epoch for b in batches} == {3}  # each batch carries its epoch to the workers
    resumed = EpochBatchSampler([10] * len(train), 20, shuffle=True)
    resumed.load_state_dict({"epoch": 3, "batches_done": 1})  # a run resumed after one batch of epoch 3
    rest = list(resumed)
    assert [(list(b), b.epoch) for b in rest] == [(list(b), b.epoch) for b in batches[1:]]
    assert [e.src_ids for e in train.__getitems__(rest[-1])] == [e.src_ids for e in train.__getitems__(batches[-1])]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_fine_tuning_starts_from_a_pretraining_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, shared_data: Path
) -> None:
    # fit --config pretrain, then fit --config summarization --model.init_from that run: the fine-tuning run's first
    # weights are the pretraining run's last, and it reads the pretraining tokenizer, <mask> included.
    squality = tmp_path / "data" / "squality"
    squality.mkdir(parents=True)
    for split in ("train_plot", "dev_plot"):
        rows = [json.loads(line) for line in (shared_data / "squality" / f"{split}.jsonl").open()][:3]
        rows = [{**row, "document": row["document"][:3000], "summary": row["summary"][:500]} for row in rows]
        (squality / f"{split}.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    small = [
        "--model.transformer.d_model=32", "--model.transformer.num_heads=2", "--model.transformer.d_ff=64",
        "--model.transformer.num_encoder_layers=1", "--model.transformer.num_decoder_layers=1",
        "--trainer.max_steps=2", "--trainer.limit_val_batches=1", "--trainer.enable_progress_bar=false",
        "--data.init_args.max_tokens=2048", "--model.generate_every_n_val_epochs=0",
    ]  # fmt: skip
    main(["fit", "--config=pretrain", "--data.init_args.bpe_vocab_size=400", "--trainer.default_root_dir=pre", *small])
    pretrained = torch.load(tmp_path / "pre" / "checkpoints" / "last.ckpt", weights_only=True)
    first: dict[str, torch.Tensor] = {}
    start = Seq2SeqModule.on_train_start

    def record(module: Seq2SeqModule) -> None:
        first.update({name: value.detach().clone() for name, value in module.state_dict().items()})
        start(module)

    monkeypatch.setattr(Seq2SeqModule, "on_train_start", record)
    main(["fit", "--config=summarization", "--model.init_from=pre", "--trainer.default_root_dir=fine", *small])
    weights = {name: value for name, value in pretrained["state_dict"].items() if name.startswith("model.")}
    assert weights and weights.keys() <= first.keys()
    for name, value in weights.items():
        torch.testing.assert_close(first[name], value, rtol=0, atol=0, msg=name)
    tuned = torch.load(tmp_path / "fine" / "checkpoints" / "last.ckpt", weights_only=True)
    assert tuned["hyper_parameters"]["init_from"] is None
    assert Tokenizer.from_str(tuned["SummarizationDataModule"]["tokenizer"]).mask_id is not None


def test_prepare_tokens_refuses_the_pretraining_config(tmp_path: Path) -> None:
    """Its noise needs each block's sentences, which a token folder does not keep: refused before writing."""
    from torch_handle.cli import prepare_tokens

    with pytest.raises(SystemExit) as exit_info:
        prepare_tokens(["--config", "pretrain", "--out", str(tmp_path / "out")])
    assert str(exit_info.value.code) == (
        "error: --config pretrain reads its text files directly: prepare tokens has nothing to write for it"
    )
    assert not (tmp_path / "out").exists()
