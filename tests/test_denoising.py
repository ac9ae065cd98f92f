"""Denoising pretraining: BART's noise and its statistics, noise as a function of (seed, epoch, index). That a
fine-tuning run starts from a pretraining run through the CLI: tests/test_recipe_summarization.py."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from torch_handle.data.batching import BatchIndices
from torch_handle.data.denoising import (
    Noise,
    denoising_source,
    infill,
    noise_generator,
    permute_sentences,
    span_lengths,
)
from torch_handle.data.pretrain import DenoisingDataModule, EpochBatchSampler
from torch_handle.data.tokenizer import MASK_TOKEN, Tokenizer
from torch_handle.errors import DataError

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


def test_mask_random_replaces_that_share_of_spans_and_keeps_the_layout() -> None:
    n, samples, random_ids = 200, 300, range(1000, 1100)  # random tokens outside the text's ids and MASK
    spans = randoms = 0
    for index in range(samples):
        ids = list(range(n))
        out = infill(ids, MASK, noise_generator(0, 0, index), mask_random=0.1, random_ids=random_ids)
        plain = infill(ids, MASK, noise_generator(0, 0, index))
        assert [MASK if token >= 1000 else token for token in out] == plain  # the same spans, some filled at random
        randoms += sum(token >= 1000 for token in out)
        spans += sum(token == MASK or token >= 1000 for token in out)
    assert randoms / spans == pytest.approx(0.1, abs=0.01)
    assert len({token for token in out if token >= 1000}) > 1


def test_whole_word_spans_start_and_end_on_word_boundaries() -> None:
    n, samples = 200, 300
    masked_words = spans = 0
    for index in range(samples):
        generator = torch.Generator().manual_seed(index)
        starts = [True, *(torch.rand(n - 1, generator=generator) < 0.4).tolist()]  # words of 1 to many tokens
        words = sum(starts)
        ids = list(range(n))
        out = infill(ids, MASK, noise_generator(0, 0, index), word_starts=starts)
        kept = [token for token in out if token != MASK]
        assert kept == sorted(kept)
        spans += len(out) - len(kept)
        for a, b in zip([-1, *kept], [*kept, n], strict=True):
            if b - a > 1:  # a masked stretch: it starts a word, and the next kept token (or the end) starts one
                assert starts[a + 1] and (b == n or starts[b]), (a, b)
                masked_words += sum(starts[a + 1 : b])
        assert sum(starts[token] for token in kept) == words - math.ceil(0.3 * words)  # 30% of the words
    assert masked_words / spans == pytest.approx(3.0, abs=0.15)  # Poisson(3) spans, counted in words


def test_word_starts_follow_the_tokenizers_pieces() -> None:
    tokenizer = Tokenizer.train(["the quick brownish foxes jumped over lazy dogs.\nAgain!"] * 5, 300).with_mask()
    starts = tokenizer.word_starts()
    ids = tokenizer.encode("the quick brownish foxes jumped.\nAgain!")
    bounds = [i for i, token in enumerate(ids) if starts[token] or i == 0]
    words = [tokenizer.decode(ids[a:b]) for a, b in zip(bounds, [*bounds[1:], len(ids)], strict=True)]
    assert words == ["the", " quick", " brownish", " foxes", " jumped.", "\nAgain!"]
    assert starts[tokenizer.mask_id] and tokenizer.mask_id not in tokenizer.ordinary_ids()
    assert set(tokenizer.ordinary_ids()) == set(range(4, tokenizer.mask_id))


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
        return denoising_source(ids, ends, Noise(MASK), noise_generator(seed, epoch, index))

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


def test_datamodule_takes_the_random_and_whole_word_options(tmp_path: Path) -> None:
    text = str(_text(tmp_path / "a.txt"))
    data = DenoisingDataModule([text], mask_random=0.5, whole_words=True, bpe_vocab_size=300)
    noise = data.dataset("train").noise
    assert noise.word_starts == data.tokenizer.word_starts() and noise.mask_random == 0.5
    assert noise.random_ids == tuple(data.tokenizer.ordinary_ids())
    assert DenoisingDataModule([text], bpe_vocab_size=300).dataset("train").noise == Noise(data.tokenizer.mask_id)
    with pytest.raises(DataError, match=r"^--data.mask_random must be in \[0, 1\], got 1.5$"):
        DenoisingDataModule([text], mask_random=1.5)


def test_prepare_tokens_refuses_the_pretraining_config(tmp_path: Path) -> None:
    """Its noise needs each block's sentences, which a token folder does not keep: refused before writing."""
    from torch_handle.cli import prepare_tokens

    with pytest.raises(SystemExit) as exit_info:
        prepare_tokens(["--config", "pretrain", "--out", str(tmp_path / "out")])
    assert str(exit_info.value.code) == (
        "error: --config pretrain reads its text files directly: prepare tokens has nothing to write for it"
    )
    assert not (tmp_path / "out").exists()
