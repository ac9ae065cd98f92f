"""The DataModule behaviour shared by every task: tokenizer, tokenization, loaders, checkpointed state."""

import dataclasses
import warnings
from abc import ABC, abstractmethod
from collections.abc import Iterator
from itertools import chain
from pathlib import Path
from typing import Any, Literal

import torch
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch import LightningDataModule
from lightning.pytorch.utilities import rank_zero_warn
from torch import Tensor
from torch.utils.data import DataLoader
from typing_extensions import override

from torch_handle.commands import typed_command
from torch_handle.data.batching import (
    Collator,
    Example,
    ExampleDataset,
    LengthSortedSampler,
    TokenBudgetBatchSampler,
)
from torch_handle.data.io import TextSplit
from torch_handle.data.lengths import LengthCheck
from torch_handle.data.pretokenized import PretokenizedDataset, refuse_existing, write_pretokenized
from torch_handle.data.resume import ResumableDataLoader, batches_processed
from torch_handle.data.tokenizer import Tokenizer, pretrained_tokenizer
from torch_handle.errors import DataError

Split = Literal["train", "val", "test", "predict"]
CHUNK = 10_000  # examples read, tokenized and written at a time by write_pretokenized
DATA_PARALLEL = "data_parallel"  # the device mesh dimension whose index chooses the shard
_STAGE_SPLITS: dict[str, tuple[Split, ...]] = {
    "fit": ("train", "val"),
    "validate": ("val",),
    "test": ("test",),
    "predict": ("predict",),
}


class Seq2SeqDataModule(LightningDataModule, ABC):
    """Tokenizer, one-time tokenization, token-budget loaders and the tokenizer in checkpoints.

    A task supplies :meth:`read_split`; everything else is shared. The tokenizer is built lazily on first
    use (loaded from ``tokenizer_path`` or trained on the train split), so :attr:`vocab_size` is known right
    after ``__init__``, which the CLI needs to size the model before ``setup()`` runs.
    """

    whole_source_splits: tuple[Split, ...] = ()
    """Splits whose long sources are decoded whole (hierarchically), so not truncated where it matters."""
    batch_sampler: type[TokenBudgetBatchSampler] = TokenBudgetBatchSampler
    """Batches training, validation and test (pretraining's also stamps each batch with its epoch)."""

    def __init__(
        self,
        tokenizer_path: str | None,
        bpe_vocab_size: int,
        max_tokens: int,
        max_source_tokens: int,
        max_target_tokens: int,
        truncation: Literal["warn", "error"],
        predict_batch_size: int,
        num_workers: int,
        pin_memory: bool,
        seed: int,
        pretokenized: str | None = None,
    ) -> None:
        """Stores the settings shared by all tasks; their meaning is documented on each task's DataModule,
        whose signature is the CLI."""
        super().__init__()
        for name, value, least in (
            ("max_source_tokens", max_source_tokens, 2),  # one token and <eos>
            ("max_target_tokens", max_target_tokens, 3),  # <bos>, one token and <eos>
            ("max_tokens", max_tokens, 1),
            ("bpe_vocab_size", bpe_vocab_size, 260),  # 4 special and 256 byte tokens
            ("predict_batch_size", predict_batch_size, 1),
        ):
            if value < least:
                raise DataError(f"--data.{name} must be at least {least}, got {value}")
        self.tokenizer_path = tokenizer_path
        self.bpe_vocab_size = bpe_vocab_size
        self.max_tokens = max_tokens
        self.truncation = truncation
        self.predict_batch_size = predict_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.seed = seed
        self.pretokenized = pretokenized
        self.collator = Collator(max_source_tokens, max_target_tokens)
        self._tokenizer: Tokenizer | None = None
        self._texts: dict[Split, TextSplit | None] = {}
        self._datasets: dict[Split, ExampleDataset | None] = {}
        self._pretokenized: PretokenizedDataset | None = None

    def fit_context(self, context_length: int | None, target_length: int | None = None, trained: bool = False) -> None:
        """Lowers the length limits to a model whose encoder reads at most ``context_length`` positions and whose
        decoder reads ``target_length`` (None: as many as the encoder; both None: any).

        Longer texts are then cut (with a warning) or refused by the ``truncation`` policy, in ``setup()``,
        instead of failing inside the model. A decoder reads ``<bos>`` and the target but not its ``<eos>``.
        ``trained``: the model's weights exist (a checkpoint, ``init_from``), so its tables cannot be raised.
        """
        target_length = target_length or context_length
        limits = {"max_source_tokens": context_length, "max_target_tokens": target_length and target_length + 1}
        over = {name: limit for name, limit in limits.items() if limit and getattr(self.collator, name) > limit}
        if not over:
            return
        lowered = ", ".join(f"--data.{name}={getattr(self.collator, name)} to {limit}" for name, limit in over.items())
        if trained:
            sizes = f"{context_length}" if target_length == context_length else f"{context_length} and {target_length}"
            rank_zero_warn(f"the trained model's position tables read at most {sizes} positions: lowered {lowered}")
        else:
            table = "max_len" if target_length == context_length else f"max_len={context_length}, max_target_len"
            rank_zero_warn(
                f"the model reads at most --model.transformer.{table}={target_length} positions: lowered {lowered}; "
                "raise them, or use position=rope or alibi, to keep longer texts"
            )
        self.collator = dataclasses.replace(self.collator, **over)
        self._datasets = {}

    @abstractmethod
    def read_split(self, split: Split) -> TextSplit | None:
        """Reads a split from disk; None for an optional split that is not configured.

        Args:
            split: Which split; ``"predict"`` has no targets.
        """

    @property
    def tokenizer(self) -> Tokenizer:
        """The tokenizer: the ``pretokenized`` folder's, from ``tokenizer_path``, a checkpoint, or trained on the train
        split."""
        if self._tokenizer is None:
            if self.tokenizer_path is not None and Path(self.tokenizer_path).is_dir():
                self._use(pretrained_tokenizer(Path(self.tokenizer_path)))  # a Hugging Face folder's (init_from)
            elif self.tokenizer_path is not None:
                self._use(Tokenizer.from_file(self.tokenizer_path))
            elif self.pretokenized is not None:
                self._use(Tokenizer.from_str(self._pretokenized_train().tokenizer_json))
            else:
                train = self._text("train")
                if train is None or train.targets is None:
                    raise DataError("no tokenizer: set --data.tokenizer_path, or give training data to train one")
                self._use(Tokenizer.train(chain(train.sources, train.targets), self.bpe_vocab_size))
            if self.tokenizer_path is not None:
                self._check_pretokenized(f"--data.init_args.tokenizer_path {self.tokenizer_path}")
        assert self._tokenizer is not None
        return self._tokenizer

    def _use(self, tokenizer: Tokenizer) -> None:
        """Encode and collate with ``tokenizer``: rows start and end with its special tokens."""
        self._tokenizer = tokenizer
        self.collator = dataclasses.replace(self.collator, specials=tokenizer.specials)

    @property
    def vocab_size(self) -> int:
        """Number of token ids the model must embed (the tokenizer's actual size)."""
        return self.tokenizer.vocab_size

    @override
    def setup(self, stage: str) -> None:
        """Reads and tokenizes the splits the stage needs, once; bad input fails here, before training."""
        for split in _STAGE_SPLITS[stage]:
            self.dataset(split)

    def dataset(self, split: Split) -> ExampleDataset | None:
        """The tokenized split (None for an optional split that is not configured).

        Args:
            split: Which split.
        """
        if split not in self._datasets and split == "train" and self.pretokenized is not None:
            self._check_pretokenized("the run")
            dataset, c, folder = self._pretokenized_train(), self.collator, self.pretokenized
            limits = (c.max_source_tokens - 1, c.max_target_tokens - 2)
            for side, counts, limit in zip(("source", "target"), dataset.token_counts(), limits, strict=True):
                check = LengthCheck(side, folder, limit, self.truncation)
                check.add(counts, None)
                check.finish()
            # One id more than a row keeps, so that the collator still sees which sources it cut.
            self._datasets[split] = dataset.read_at_most(c.max_source_tokens, c.max_target_tokens - 1)
        if split not in self._datasets:
            text = self._text(split)
            self._datasets[split] = None if text is None else self._encode(text, split)
        return self._datasets[split]

    def write_pretokenized(self, out: str | Path) -> int:
        """Writes the training split, tokenized as :meth:`setup` tokenizes it, to a folder that ``pretokenized``
        reads; the number of examples written.

        The split is read, tokenized and written :data:`CHUNK` examples at a time (:meth:`stream_split`), and a
        tokenizer to train is trained on it read the same way, so memory does not grow with the corpus.

        Args:
            out: The folder to write; it must not exist, or be empty.
        """
        if self.pretokenized is not None:
            raise DataError("the training split is already pre-tokenized: unset --data.init_args.pretokenized")
        refuse_existing(out)
        if self._tokenizer is None and self.tokenizer_path is None:
            # BPE training keeps word counts, not the text. The writing pass reads the files again, and warns.
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                texts = (text for part in self._train_parts() for text in chain(part.sources, part.targets or ()))
                self._use(Tokenizer.train(texts, self.bpe_vocab_size))
        return write_pretokenized(out, self.tokenizer, self._encoded_ids(self._train_parts()))

    def stream_split(self, split: Split, size: int) -> Iterator[TextSplit] | None:
        """:meth:`read_split`'s split in parts of at most ``size`` examples, read as they are drawn; None for an
        optional split that is not configured.

        This one reads the split whole and cuts it; a task whose files can be read a part at a time overrides it,
        with :meth:`read_split`'s checks and messages.

        Args:
            split: Which split.
            size: Examples a part holds.
        """
        text = self.read_split(split)
        return None if text is None else text.parts(size)

    @override
    def transfer_batch_to_device(self, batch: Any, device: torch.device, dataloader_idx: int) -> Any:
        """Moves a collated batch's tensors (:mod:`torch_handle.data.batching`), its texts left as they are:
        Lightning's default visits each of their strings, a host cost on every step."""
        return {key: move_data_to_device(v, device) if isinstance(v, Tensor) else v for key, v in batch.items()}

    @override
    def train_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._budget_loader("train", shuffle=True)

    @override
    def val_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._budget_loader("val", shuffle=False)

    @override
    def test_dataloader(self) -> DataLoader | list[DataLoader]:
        return self._budget_loader("test", shuffle=False)

    @override
    def predict_dataloader(self) -> DataLoader:
        # Batches of ``predict_batch_size`` inputs of similar length (longest first); on several processes each
        # predicts a shard. Lightning records each batch's indices, and the prediction writer puts the outputs
        # back in input order.
        dataset = self.dataset("predict")
        assert dataset is not None  # read_split raises when there is no predict input
        replicas, replica = self._shard()
        lengths = [self.collator.length(e) for e in dataset.examples]
        return DataLoader(
            dataset,
            batch_size=self.predict_batch_size,
            sampler=LengthSortedSampler(lengths, replicas, replica),
            collate_fn=self.collator,
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
        )

    @override
    def state_dict(self) -> dict[str, Any]:
        """The tokenizer, so a checkpoint decodes with the vocabulary it was trained with, and the source length
        (the model's context in use), which exports record for decoding."""
        return {"tokenizer": self.tokenizer.to_str(), "max_source_tokens": self.collator.max_source_tokens}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restores the checkpoint's tokenizer, re-tokenizing splits read with a different one.

        Lightning calls this after ``setup()``, so splits may already be tokenized.
        """
        restored = Tokenizer.from_str(state_dict["tokenizer"])
        if self._tokenizer is not None and restored.to_str() == self._tokenizer.to_str():
            return
        self._use(restored)
        if "train" in self._datasets:  # fitting: the folder's ids must be the checkpoint tokenizer's
            self._check_pretokenized("the checkpoint")
        self._datasets = {}
        for split, text in self._texts.items():
            self._datasets[split] = None if text is None else self._encode(text, split)

    def _budget_loader(self, split: Split, shuffle: bool) -> DataLoader | list[DataLoader]:
        """A loader batched by token budget and sharded across ranks; ``[]`` (no loop) without data."""
        dataset = self.dataset(split)
        if dataset is None:
            return []
        trainer = self.trainer
        replicas, replica = self._shard()
        train = split == "train"
        lengths, scored = self.collator.costs(*dataset.token_counts())
        sampler = self.batch_sampler(
            lengths,
            self.max_tokens,
            shuffle=shuffle,
            seed=self.seed,
            num_replicas=replicas,
            rank=replica,
            # Training batches carry their optimizer step's target tokens, the loss's normaliser.
            scored=scored if train else None,
            accumulate=trainer.accumulate_grad_batches if train and trainer is not None else 1,
        )
        options = {
            "batch_sampler": sampler,
            "collate_fn": self.collator,
            "num_workers": self.num_workers,
            "pin_memory": self.pin_memory,
            "persistent_workers": self.num_workers > 0,
        }
        if train and trainer is not None:  # checkpoints record its exact position mid-epoch
            return ResumableDataLoader(dataset, processed=lambda: batches_processed(trainer), **options)
        return DataLoader(dataset, **options)

    def _shard(self) -> tuple[int, int]:
        """``(replicas, replica)``: how many shards the data is split into, and which one this process reads.

        Processes that share each batch (context parallelism) sit on one index of the ``data_parallel`` dimension of
        the LightningModule's ``device_mesh`` (the name Lightning's ``ModelParallelStrategy`` gives it) and read the
        same shard; without such a mesh every process reads its own.
        """
        trainer = self.trainer
        if trainer is None:
            return 1, 0
        mesh = trainer.lightning_module.device_mesh if trainer.lightning_module is not None else None
        if mesh is None or DATA_PARALLEL not in (mesh.mesh_dim_names or ()):
            return trainer.world_size, trainer.global_rank
        data = mesh[DATA_PARALLEL]
        return data.size(), data.get_local_rank()

    def _pretokenized_train(self) -> PretokenizedDataset:
        """The ``pretokenized`` folder's training split, opened (and checked) once."""
        assert self.pretokenized is not None
        if self._pretokenized is None:
            self._pretokenized = PretokenizedDataset(self.pretokenized)
        return self._pretokenized

    def _check_pretokenized(self, whose: str) -> None:
        """Refuses a ``pretokenized`` folder written with another tokenizer than ``whose`` (its ids would be wrong)."""
        if self.pretokenized is not None and self.tokenizer.to_str() != self._pretokenized_train().tokenizer_json:
            raise DataError(
                f"--data.init_args.pretokenized {self.pretokenized} was tokenized with another tokenizer than "
                f"{whose}'s: write it again with that tokenizer ({typed_command('prepare')} tokens), or train from "
                "the text files"
            )

    def _text(self, split: Split) -> TextSplit | None:
        if split not in self._texts:
            self._texts[split] = self.read_split(split)
        return self._texts[split]

    def _encode(self, text: TextSplit, split: Split) -> ExampleDataset:
        """Tokenizes a split in one batch call, applying the truncation policy."""
        checks = self._length_checks(text, split)
        examples = self._examples(text, checks)
        for check in checks:
            check.finish()
        return ExampleDataset(examples)

    def _train_parts(self) -> Iterator[TextSplit]:
        """The training split in parts of :data:`CHUNK` examples, or the one-line error for a config without one."""
        parts = self.stream_split("train", CHUNK)
        if parts is None:
            raise DataError("nothing to pre-tokenize: the config gives no training split")
        return parts

    def _encoded_ids(self, chunks: Iterator[TextSplit]) -> Iterator[tuple[list[list[int]], list[list[int]]]]:
        """The training split's source and target ids a part at a time, as :meth:`_encode` gives them."""
        checks = None
        for text in chunks:
            checks = checks or self._length_checks(text, "train")
            examples = self._examples(text, checks)
            yield [e.src_ids for e in examples], [e.tgt_ids or [] for e in examples]
        for check in checks or ():
            check.finish()

    def _length_checks(self, text: TextSplit, split: Split) -> tuple[LengthCheck, LengthCheck]:
        """The truncation policy's checks of a split's sources and targets."""
        c = self.collator
        loss = f"; the test loss reads their first {c.max_source_tokens - 1}" if split == "test" else ""
        whole = (
            f", in windows (or cut: --model.long_documents cut){loss}" if split in self.whole_source_splits else None
        )
        return (
            LengthCheck("source", text.source_origin, c.max_source_tokens - 1, self.truncation, whole),
            LengthCheck("target", text.target_origin, c.max_target_tokens - 2, self.truncation),
        )

    def _examples(self, text: TextSplit, checks: tuple[LengthCheck, LengthCheck]) -> list[Example]:
        """A split's examples (or a part's), tokenized in one batch call and counted by ``checks``."""
        source, target = checks
        src_ids = self.tokenizer.encode_batch(text.sources)
        source.add(list(map(len, src_ids)), text.lines)
        source.refuse()  # the first long source is the split's first error: none that follows comes before it
        if text.targets is None:
            return [Example(ids, s) for ids, s in zip(src_ids, text.sources, strict=True)]
        tgt_ids = self.tokenizer.encode_target_batch(text.targets)
        target.add(list(map(len, tgt_ids)), text.lines)
        references = text.references or [()] * len(text.targets)
        return [
            Example(s_ids, s, t_ids, t, references=r)
            for s_ids, s, t_ids, t, r in zip(src_ids, text.sources, tgt_ids, text.targets, references, strict=True)
        ]
