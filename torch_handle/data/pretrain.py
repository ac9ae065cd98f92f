"""Denoising pretraining data: any text, cut into blocks of sentences, each restored from BART's noise.

The blocks are tokenized once, as every task's data is; the noise (:mod:`torch_handle.data.denoising`) is drawn per
batch from ``(seed, epoch, index)``, so each epoch sees new noise, and a run resumed mid-epoch the noise the first
run would have drawn, with every strategy and world size alike.
"""

import dataclasses
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

from typing_extensions import override

from torch_handle.data.base import Seq2SeqDataModule, Split, TextSplit
from torch_handle.data.batching import Example, ExampleDataset, TokenBudgetBatchSampler
from torch_handle.data.denoising import Noise, denoising_source, noise_generator
from torch_handle.data.io import read_jsonl, read_text
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.errors import DataError

_SENTENCE_END = re.compile(r"(?<=[.!?])(?=\s)|(?=\n)")
"""Where a sentence ends: after ``.``, ``!`` or ``?`` before white space, and before a line break. The white space
goes with the next sentence, where byte-level BPE puts it, so a block's ids are its sentences' ids in a row."""


class EpochBatchSampler(TokenBudgetBatchSampler):
    """A :class:`TokenBudgetBatchSampler` whose batches carry their epoch, which DataLoader workers (persistent ones
    too) receive with each batch's indices, so that the dataset draws that epoch's noise."""

    @override
    def __iter__(self) -> Iterator[list[int]]:
        for batch in super().__iter__():
            batch.epoch = self.epoch  # type: ignore[attr-defined]
            yield batch


class NoisingDataset(ExampleDataset):
    """Blocks whose batches come noised: the source is the target with BART's noise of ``(seed, epoch, index)``.

    Indexing one example gives the clean pair; a batch (``__getitems__``, what the DataLoader calls) is noised with
    the epoch its indices carry (:class:`EpochBatchSampler`), or ``epoch`` where it is fixed. ``src_text`` stays the
    clean block's text.
    """

    def __init__(
        self, examples: list[Example], sentence_ends: list[list[int]], noise: Noise, seed: int, epoch: int | None
    ) -> None:
        """Holds the clean blocks.

        Args:
            examples: Each block as source and target alike.
            sentence_ends: Each block's sentence end offsets.
            noise: The noise settings.
            seed: The run's data seed.
            epoch: A fixed epoch (evaluation: the same noise each time); None takes each batch's.
        """
        super().__init__(examples)
        self.sentence_ends = sentence_ends
        self.noise = noise
        self.seed = seed
        self.epoch = epoch

    @override
    def __getitems__(self, indices: Sequence[int]) -> list[Example]:
        epoch = getattr(indices, "epoch", 0) if self.epoch is None else self.epoch
        examples = super().__getitems__(indices)
        return [self.noised(example, index, epoch) for example, index in zip(examples, indices, strict=True)]

    def noised(self, example: Example, index: int, epoch: int) -> Example:
        """``example`` with the noise of ``(seed, epoch, index)`` as its source; a repeat (see
        :class:`TokenBudgetBatchSampler`) draws as the example it repeats."""
        index %= len(self.examples)
        assert example.tgt_ids is not None
        generator = noise_generator(self.seed, epoch, index)
        source = denoising_source(example.tgt_ids, self.sentence_ends[index], self.noise, generator)
        return dataclasses.replace(example, src_ids=source)


class DenoisingDataModule(Seq2SeqDataModule):
    """BART's denoising pretraining on plain text or on a corpus's texts: the model restores each block of
    sentences from its noised copy, and its checkpoint is a ``--model.init_from`` to fine-tune from.

    The tokenizer (trained on the text, or given) gets a ``<mask>`` token after its last id if it has none; the
    fine-tuning run reads the tokenizer from the checkpoint, mask included.
    """

    batch_sampler = EpochBatchSampler

    def __init__(
        self,
        train_files: list[str],
        val_files: list[str] | None = None,
        fields: list[str] | None = None,
        mask_ratio: float = 0.3,
        poisson_lambda: float = 3.0,
        permute_sentences: bool = True,
        mask_random: float = 0.0,
        whole_words: bool = False,
        tokenizer_path: str | None = None,
        bpe_vocab_size: int = 8000,
        max_tokens: int = 16384,
        max_source_tokens: int = 512,
        max_target_tokens: int = 512,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
    ) -> None:
        """Configures the text and the noise.

        Args:
            train_files: Text to pretrain on: plain text files (one document per line, e.g. a translation corpus's
                ``train.en`` and ``train.de``), folders (their ``*.txt`` files, one document each), and JSON-lines
                files (each object's ``fields``, each a document: a summarization corpus's documents and summaries).
                Relative paths are from the working directory.
            val_files: Like ``train_files``, noised the same way every validation; None skips validation.
            fields: The JSON fields whose strings are documents; None: ``document`` and ``summary``.
            mask_ratio: The share of each block's tokens masked (BART: 0.3).
            poisson_lambda: The mean length of a masked span (BART: 3).
            permute_sentences: Shuffle each block's sentences before masking (BART: on).
            mask_random: The share of masked spans that become a random token instead of ``<mask>`` (fairseq's
                ``--mask-random``; its default, 0, leaves every span a ``<mask>``).
            whole_words: Mask whole words: spans start and end where the tokenizer's pieces start words, and
                ``mask_ratio`` and ``poisson_lambda`` count words, as fairseq does for any ``--mask-length`` but
                ``subword`` (its default), BART's ``span-poisson`` included; off: tokens.
            tokenizer_path: A saved ``tokenizer.json`` or a Hugging Face model folder; None trains a BPE on the text.
            bpe_vocab_size: Vocabulary size to train for, special and byte tokens included.
            max_tokens: Padded tokens per batch (batch size x longest block).
            max_source_tokens: Longest noised block, ``<eos>`` included; blocks are cut to fit it.
            max_target_tokens: Longest block restored, ``<bos>`` and ``<eos>`` included: documents are cut into blocks
                of whole sentences of at most this many tokens (a longer sentence into pieces).
            num_workers: DataLoader worker processes; 0 collates in the main process.
            pin_memory: Pin batches in page-locked memory for faster copies to a GPU.
            seed: Seeds batch shuffling and the noise (with the epoch and the block's index).
        """
        super().__init__(
            tokenizer_path=tokenizer_path,
            bpe_vocab_size=bpe_vocab_size,
            max_tokens=max_tokens,
            max_source_tokens=max_source_tokens,
            max_target_tokens=max_target_tokens,
            truncation="warn",  # blocks are cut to fit: nothing is truncated
            predict_batch_size=1,  # no predict split
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
        )
        if not 0 < mask_ratio < 1:
            raise DataError(f"--data.mask_ratio must be in (0, 1), got {mask_ratio}")
        if poisson_lambda <= 0:
            raise DataError(f"--data.poisson_lambda must be > 0, got {poisson_lambda}")
        if not 0 <= mask_random <= 1:
            raise DataError(f"--data.mask_random must be in [0, 1], got {mask_random}")
        self.files: dict[Split, list[str] | None] = {"train": train_files, "val": val_files}
        self.fields = ["document", "summary"] if fields is None else fields
        self.mask_ratio = mask_ratio
        self.poisson_lambda = poisson_lambda
        self.permute_sentences = permute_sentences
        self.mask_random = mask_random
        self.whole_words = whole_words

    @override
    def read_split(self, split: Split) -> TextSplit | None:
        if split not in self.files:
            raise DataError(
                f"pretraining has no {split} data: fine-tune from its checkpoint (fit --model.init_from RUN_FOLDER), "
                "then test or predict that run"
            )
        paths = self.files[split]
        if not paths:
            if split == "val":
                return None
            raise DataError("no train data: set --data.train_files to text files, folders of .txt, or JSON lines")
        documents, lines = [], []
        for path in paths:
            for line, document in self._documents(Path(path)):
                documents.append(document)
                lines.append(line)
        origin = ", ".join(paths)
        return TextSplit(documents, documents, lines, origin, origin)

    @override
    def write_pretokenized(self, out: str | Path) -> int:
        """Refused: pretraining noises each block anew from its sentences, which a token folder does not keep."""
        raise DataError("--config pretrain reads its text files directly: prepare tokens has nothing to write for it")

    def _documents(self, path: Path) -> list[tuple[int, str]]:
        """``(line, document)`` of every non-blank document in a file or folder."""
        if path.is_dir():
            files = sorted(path.glob("*.txt"))
            if not files:
                raise DataError(f"{path} holds no .txt files: pass a folder of .txt documents, or files")
            texts = (read_text(file).strip() for file in files)
            return [(1, text) for text in texts if text]
        if path.suffix == ".jsonl":
            settings = dict.fromkeys(self.fields, "--data.fields")
            records = read_jsonl(path, self.fields, settings)
            return [(r.line, r.fields[f].strip()) for r in records for f in self.fields if r.fields[f].strip()]
        lines = read_text(path).split("\n")
        return [(line, text.strip()) for line, text in enumerate(lines, start=1) if text.strip()]

    @override
    def _use(self, tokenizer: Tokenizer) -> None:
        super()._use(tokenizer.with_mask())

    @override
    def _encode(self, text: TextSplit, split: Split) -> ExampleDataset:
        """Cuts every document into blocks of whole sentences; the noise is drawn per batch."""
        c, specials = self.collator, self.collator.specials
        size = min(c.max_target_tokens - 2 - len(specials.target_prefix), c.max_source_tokens - 1)
        size -= len(specials.source_prefix)
        pieces = [[p for p in _SENTENCE_END.split(document) if p.strip()] for document in text.sources]
        ids = iter(self.tokenizer.encode_batch([p for document in pieces for p in document]))
        blocks = [block for document in pieces for block in _blocks([next(ids) for _ in document], size)]
        texts = self.tokenizer.decode_batch([block for block, _ in blocks])
        examples = [Example(block, text, block, text) for (block, _), text in zip(blocks, texts, strict=True)]
        mask_id = self.tokenizer.mask_id
        assert mask_id is not None  # _use added it
        noise = Noise(
            mask_id,
            self.mask_ratio,
            self.poisson_lambda,
            self.permute_sentences,
            self.mask_random,
            tuple(self.tokenizer.ordinary_ids()) if self.mask_random else (),
            self.tokenizer.word_starts() if self.whole_words else None,
        )
        return NoisingDataset(examples, [ends for _, ends in blocks], noise, self.seed, None if split == "train" else 0)


def _blocks(sentences: list[list[int]], size: int) -> Iterator[tuple[list[int], list[int]]]:
    """Consecutive sentences' ids packed into blocks of at most ``size``: each block's ids and sentence end offsets;
    a sentence longer than ``size`` is cut into pieces, each a sentence of its own."""
    ids: list[int] = []
    ends: list[int] = []
    for sentence in sentences:
        for start in range(0, len(sentence), size):
            piece = sentence[start : start + size]
            if ids and len(ids) + len(piece) > size:
                yield ids, ends
                ids, ends = [], []
            ids.extend(piece)
            ends.append(len(ids))
    if ids:
        yield ids, ends
