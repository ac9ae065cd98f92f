"""Summarization data: long documents and their summaries in JSON-lines files."""

from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from typing_extensions import override

from torch_handle.data.base import Seq2SeqDataModule, Split, TextSplit
from torch_handle.data.corpora import missing
from torch_handle.data.io import Record, chunked, first_line, read_documents, read_jsonl, stream_jsonl
from torch_handle.errors import DataError

QUERY_SEPARATOR = "\n\n"  # SCROLLS's: the query, a blank line, then the document


class SummarizationDataModule(Seq2SeqDataModule):
    """(document, summary) pairs from JSON-lines files, e.g. QMSum or SQuALITY.

    ``torch-handle prepare squality --out data`` writes ``data/squality/{train,dev,test}_plot.jsonl``, one story
    per line with ``id, document, summaries, summary``, and ``{split}_all.jsonl``, one line per story and question
    (five a story) with ``id, query, document, summaries, summary``; ``prepare qmsum`` writes
    ``data/qmsum/{train,val,test}.jsonl``, one meeting per line with ``id, query, document, summary, doc_words``
    (the general query), and ``{split}_all.jsonl``, one line per query, general and specific, with
    ``id, query, document, summary``; the document is the transcript as ``speaker: words`` turns, one per line.
    With ``query_field: query`` the input is the query, a blank line, then the document, as SCROLLS poses QMSum.
    """

    @property
    def whole_source_splits(self) -> tuple[Split, ...]:  # type: ignore[override]
        """Test and predict summarize longer documents hierarchically, unless the model cuts them
        (``--model.long_documents cut``): its truncation is then warned as training's is."""
        module = self.trainer.lightning_module if self.trainer is not None else None
        cut = getattr(getattr(module, "hparams", None), "long_documents", "windows") == "cut"
        return () if cut else ("test", "predict")

    def __init__(
        self,
        train_file: str | None = None,
        val_file: str | None = None,
        test_file: str | None = None,
        predict_file: str | None = None,
        document_field: str = "document",
        summary_field: str = "summary",
        references_field: str = "summaries",
        query_field: str | None = None,
        tokenizer_path: str | None = None,
        bpe_vocab_size: int = 8000,
        max_tokens: int = 65536,
        max_source_tokens: int = 32768,
        max_target_tokens: int = 512,
        truncation: Literal["warn", "error"] = "warn",
        predict_batch_size: int = 4,
        num_workers: int = 0,
        pin_memory: bool = False,
        seed: int = 0,
        pretokenized: str | None = None,
    ) -> None:
        """Configures where the documents come from and how they are batched.

        Args:
            train_file: JSON lines: one object per line with the string fields ``document`` and ``summary``
                (the names ``document_field`` and ``summary_field`` give; other fields are ignored), as
                ``torch-handle prepare squality|qmsum --out data`` writes under ``data/``. A story with several
                references (SQuALITY has four) lists them all in ``summaries`` and repeats the first in
                ``summary``, the one trained on and scored against. Needed to fit, and to train a tokenizer when
                ``tokenizer_path`` is not set. Relative paths are from the working directory.
            val_file: Like ``train_file``; None skips validation.
            test_file: Like ``train_file``, for ``test``.
            predict_file: Documents to summarize: JSON lines with ``document_field``, or plain text with one
                document per line. Output keeps its order.
            document_field: JSON field holding the input document.
            summary_field: JSON field holding the reference summary.
            references_field: JSON field holding every reference of a row, a list of strings; where a row has
                it, ``test`` scores against the best-matching of them (max over references, as SQuALITY does).
            query_field: JSON field holding a query (a question about the document) that every row has; the input
                becomes the query, a blank line, then the document, as SCROLLS poses QMSum. None: the document
                alone.
            tokenizer_path: A saved ``tokenizer.json`` to use, or a Hugging Face model folder (``--model.init_from``
                sets it) whose tokenizer and special tokens to use. None trains a BPE on the training documents and
                summaries (deterministic, so every rank trains the same one); checkpoints store it.
            bpe_vocab_size: Vocabulary size to train for, special and byte tokens included.
            max_tokens: Padded tokens per batch (batch size x longest sequence); a document longer than this
                is a batch of its own.
            max_source_tokens: Longest document read in one pass, ``<eos>`` included; QMSum meetings reach ~32k
                tokens. Longer ones are cut for the loss and summarized whole, hierarchically, when decoding; test and
                predict documents are decoded, so only training and validation warn of the cut.
            max_target_tokens: Longest summary kept, ``<bos>`` and ``<eos>`` included.
            truncation: What to do with texts that are cut: ``warn`` cuts them and warns once per split with a
                count; ``error`` stops at the first, naming its file and line.
            predict_batch_size: Documents per prediction batch; small, since documents are long.
            num_workers: DataLoader worker processes; 0 collates in the main process.
            pin_memory: Pin batches in page-locked memory for faster copies to a GPU.
            seed: Seeds batch shuffling (with the epoch).
            pretokenized: A folder that ``torch-handle prepare tokens`` wrote from this config: training then reads
                its ids from disk, example by example, instead of reading and tokenizing the training file in memory
                (for corpora larger than memory), with the folder's tokenizer; the batches are the same.
        """
        super().__init__(
            tokenizer_path=tokenizer_path,
            bpe_vocab_size=bpe_vocab_size,
            max_tokens=max_tokens,
            max_source_tokens=max_source_tokens,
            max_target_tokens=max_target_tokens,
            truncation=truncation,
            predict_batch_size=predict_batch_size,
            num_workers=num_workers,
            pin_memory=pin_memory,
            seed=seed,
            pretokenized=pretokenized,
        )
        self.files = {"train": train_file, "val": val_file, "test": test_file, "predict": predict_file}
        self.document_field = document_field
        self.summary_field = summary_field
        self.references_field = references_field
        self.query_field = query_field

    @override
    def read_split(self, split: Split) -> TextSplit | None:
        path = self._file(split)
        if path is None:
            return None
        fields, settings = self._fields()
        if split == "predict" and self.query_field is None:
            records = read_documents(path, self.document_field, settings[self.document_field])
        elif split == "predict":
            if not first_line(path).lstrip().startswith("{"):  # JSON lines, even broken ones, get their line's error
                raise DataError(
                    f"{path} is plain text, which holds no {self.query_field!r} to ask: write JSON lines with "
                    f"{self.query_field!r} and {self.document_field!r}, or pass --data.init_args.query_field null"
                )
            records = read_jsonl(path, fields, settings)
        else:
            records = read_jsonl(path, [*fields, self.summary_field], settings, lists=[self.references_field])
        return self._text_split(path, records, targets=split != "predict")

    @override
    def stream_split(self, split: Split, size: int) -> Iterator[TextSplit] | None:
        """The JSON-lines file a line at a time (the predict file: read whole, then cut)."""
        if split == "predict":
            return super().stream_split(split, size)
        path = self._file(split)
        if path is None:
            return None
        fields, settings = self._fields()
        records = stream_jsonl(path, [*fields, self.summary_field], settings, lists=[self.references_field])
        parts = chunked(records, size, lambda record: sum(map(len, record.fields.values())))
        return (self._text_split(path, part, targets=True) for part in parts)

    def _file(self, split: Split) -> str | None:
        """The split's file, refused in one line when it is needed and missing; None for no validation."""
        path = self.files[split]
        if path is None:
            if split == "val":
                return None
            hint = " (to only test or predict, --data.tokenizer_path is enough)" if split == "train" else ""
            raise DataError(f"no {split} data: set --data.{split}_file to a JSON-lines file{hint}")
        hint = missing(path, f"--data.init_args.{split}_file")
        if hint is not None and not Path(path).exists():
            raise DataError(hint)
        return path

    def _fields(self) -> tuple[list[str], dict[str, str]]:
        """The fields an input is made of, and the option that names each field read."""
        settings = {self.document_field: "--data.document_field", self.summary_field: "--data.summary_field"}
        fields = [self.document_field] if self.query_field is None else [self.query_field, self.document_field]
        settings |= {} if self.query_field is None else {self.query_field: "--data.query_field"}
        return fields, settings

    def _text_split(self, path: str, records: list[Record], targets: bool) -> TextSplit:
        """``records`` as inputs (the query, a blank line, then the document), with their summaries and references
        where ``targets``."""
        fields, _ = self._fields()
        sources = [QUERY_SEPARATOR.join(r.fields[name].strip() for name in fields) for r in records]
        if not targets:
            return TextSplit(sources, None, [r.line for r in records], path, path)
        summaries = [r.fields[self.summary_field].strip() for r in records]
        references = [tuple(text.strip() for text in r.lists.get(self.references_field, ())) for r in records]
        return TextSplit(sources, summaries, [r.line for r in records], path, path, references)

    def summary_ratio(self) -> float | None:
        """The training pairs' mean summary-to-input length ratio in characters, SCROLLS's length for its naive
        baseline; None without a training file."""
        path = self.files["train"]
        if path is None or not Path(path).is_file():
            return None
        train = self._text("train")
        pairs = zip(train.sources, train.targets or [], strict=True)
        return sum(len(t) / max(len(s), 1) for s, t in pairs) / len(train.sources)
