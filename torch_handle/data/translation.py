"""Translation data: parallel text files (Multi30k / fairseq layout) or the built-in demo task."""

from collections.abc import Iterator
from pathlib import Path

from typing_extensions import override

from torch_handle.data.base import Seq2SeqDataModule, Split, TextSplit
from torch_handle.data.corpora import missing
from torch_handle.data.demo import demo_corpus
from torch_handle.data.io import chunked, read_lines, read_parallel, stream_parallel
from torch_handle.errors import DataError

DEMO_EVAL_SIZE = 500  # pairs in the demo's val and test splits


class TranslationDataModule(Seq2SeqDataModule):
    """Sentence pairs from ``{data_dir}/{split}.{lang}`` files, or the generated demo task."""

    def __init__(
        self,
        data_dir: str | None = None,
        src_lang: str = "en",
        tgt_lang: str = "de",
        train_split: str = "train",
        val_split: str = "val",
        test_split: str = "test",
        predict_file: str | None = None,
        tokenizer_path: str | None = None,
        bpe_vocab_size: int = 8000,
        max_tokens: int = 4096,
        max_source_tokens: int = 256,
        max_target_tokens: int = 256,
        predict_batch_size: int = 32,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        demo_size: int = 20000,
        pretokenized: str | None = None,
    ) -> None:
        """Configures where the pairs come from and how they are batched.

        Args:
            data_dir: Folder of line-aligned UTF-8 text files named ``{split}.{lang}``, one sentence per line,
                e.g. Multi30k's ``train.en`` and ``train.de``, which ``torch-handle prepare multi30k --out data``
                writes to ``data/multi30k`` (relative paths are from the working directory). None uses the
                built-in demo task, generated in memory (no download).
            src_lang: File suffix of the source language.
            tgt_lang: File suffix of the target language.
            train_split: File stem of the training split.
            val_split: File stem of the validation split.
            test_split: File stem of the test split (Multi30k: ``test_2016_flickr``, ``test_2017_flickr``,
                ``test_2018_flickr`` or ``test_2017_mscoco``).
            predict_file: Text file to translate, one sentence per line; output keeps its line order.
            tokenizer_path: A saved ``tokenizer.json`` to use, or a Hugging Face model folder (``--model.init_from``
                sets it) whose tokenizer and special tokens to use. None trains a joint source+target BPE on the
                training split (deterministic, so every rank trains the same one); checkpoints store it.
            bpe_vocab_size: Vocabulary size to train for, special and byte tokens included.
            max_tokens: Padded tokens per batch (batch size x longest sequence); batches are length-bucketed
                so that memory per step stays flat.
            max_source_tokens: Longest source kept, ``<eos>`` included; longer ones are cut, with a warning.
            max_target_tokens: Longest target kept, ``<bos>`` and ``<eos>`` included.
            predict_batch_size: Sentences per prediction batch.
            num_workers: DataLoader worker processes; 0 collates in the main process, enough for this data.
            pin_memory: Pin batches in page-locked memory for faster copies to a GPU.
            seed: Seeds batch shuffling (with the epoch) and the demo corpus.
            demo_size: Training pairs in the demo task (val and test get 500 each).
            pretokenized: A folder that ``torch-handle prepare tokens`` wrote from this config: training then reads
                its ids from disk, example by example, instead of reading and tokenizing the training files in memory
                (for corpora larger than memory), with the folder's tokenizer; the batches are the same.
        """
        super().__init__(
            tokenizer_path=tokenizer_path,
            bpe_vocab_size=bpe_vocab_size,
            max_tokens=max_tokens,
            max_source_tokens=max_source_tokens,
            max_target_tokens=max_target_tokens,
            truncation="warn",
            predict_batch_size=predict_batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
            pretokenized=pretokenized,
        )
        if data_dir is not None and not Path(data_dir).is_dir():
            raise DataError(
                missing(data_dir, "--data.init_args.data_dir")
                or f"data_dir {data_dir} not found; pass an existing folder, or omit it for the demo"
            )
        self.data_dir = data_dir
        self.src_lang = src_lang
        self.tgt_lang = tgt_lang
        self.split_names = {"train": train_split, "val": val_split, "test": test_split}
        self.predict_file = predict_file
        self.demo_size = demo_size

    @override
    def read_split(self, split: Split) -> TextSplit:
        if split == "predict":
            if self.predict_file is None:
                raise DataError("nothing to predict: set --data.predict_file to a text file, one sentence per line")
            sources = read_lines(self.predict_file)
            return TextSplit(sources, None, list(range(1, len(sources) + 1)), self.predict_file, self.predict_file)
        if self.data_dir is None:
            size = self.demo_size if split == "train" else DEMO_EVAL_SIZE
            pairs = demo_corpus(split, size, self.seed)
            lines = list(range(1, len(pairs) + 1))
            source_origin = target_origin = f"demo:{split}"
        else:
            source_origin, target_origin = self._files(split)
            pairs, lines = read_parallel(source_origin, target_origin)
        return TextSplit([s for s, _ in pairs], [t for _, t in pairs], lines, source_origin, target_origin)

    @override
    def stream_split(self, split: Split, size: int) -> Iterator[TextSplit] | None:
        """The pair files a line at a time (the demo and the predict file: read whole, then cut)."""
        if self.data_dir is None or split == "predict":
            return super().stream_split(split, size)
        source, target = self._files(split)
        parts = chunked(stream_parallel(source, target), size, lambda pair: len(pair[1]) + len(pair[2]))
        columns = (zip(*part) for part in parts)
        return (TextSplit(list(s), list(t), list(lines), source, target) for lines, s, t in columns)

    def _files(self, split: Split) -> tuple[str, str]:
        """The split's source and target files."""
        assert self.data_dir is not None
        stem = Path(self.data_dir) / self.split_names[split]
        return f"{stem}.{self.src_lang}", f"{stem}.{self.tgt_lang}"
