"""Examples, token-budget batching and collation into the padded tensors the model consumes."""

import dataclasses
import itertools
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, Sampler
from typing_extensions import override

from torch_handle.data.tokenizer import PAD_ID, Specials

# {"src": (B, S), "tgt": (B, T), "src_lengths": [...], "tgt_lengths": [...] (each row's ids, padding left out),
#  "src_text": [...], "tgt_text": [...], "references": [[...], ...], "src_truncated": [...], "repeat": bool,
#  "step_tokens": int (training batches only)}
Batch = dict[str, Any]


@dataclass(frozen=True, slots=True)
class Example:
    """One pre-tokenized pair; ``tgt_ids``/``tgt_text`` are None for prediction inputs.

    ``repeat`` marks a copy that only evens out the batch count across ranks (see
    :class:`TokenBudgetBatchSampler`): it is trained on, but never counted twice in a metric.
    ``step_tokens`` is the number of target tokens scored in the whole optimizer step the example's batch
    belongs to (every micro-batch of every rank), the loss's normaliser; 0 when not known. ``references`` holds
    every reference a prediction is scored against (SQuALITY has four); empty means ``tgt_text`` alone.
    """

    src_ids: list[int]
    src_text: str
    tgt_ids: list[int] | None = None
    tgt_text: str | None = None
    repeat: bool = False
    step_tokens: int = 0
    references: tuple[str, ...] = ()


class BatchIndices(list[int]):
    """A batch's dataset indices, and the target tokens of the optimizer step it belongs to.

    A ``list`` so the DataLoader treats it as any batch of indices (and pickles it to workers);
    :meth:`ExampleDataset.__getitems__` hands ``step_tokens`` on to the collator.
    """

    def __init__(self, indices: Sequence[int], step_tokens: int) -> None:
        super().__init__(indices)
        self.step_tokens = step_tokens


class ExampleDataset(Dataset[Example]):
    """A split held in memory, tokenized once in ``setup()``.

    Subclasses that hold their examples elsewhere (:class:`~torch_handle.data.pretokenized.PretokenizedDataset`,
    on disk) override :meth:`__len__`, :meth:`example` and :meth:`token_counts`; repeats and step stamps are shared.
    """

    def __init__(self, examples: list[Example]) -> None:
        """Holds the examples.

        Args:
            examples: The split's examples, in file order (prediction output keeps that order).
        """
        self.examples = examples

    def __len__(self) -> int:
        return len(self.examples)

    def example(self, index: int) -> Example:
        """Example ``index``, in ``[0, len(self))``."""
        return self.examples[index]

    def token_counts(self) -> tuple[np.ndarray, np.ndarray | None]:
        """Every example's source and target token counts (targets None for prediction inputs), before truncation."""
        sources = np.fromiter((len(e.src_ids) for e in self.examples), np.int64, len(self.examples))
        if any(e.tgt_ids is None for e in self.examples):
            return sources, None
        return sources, np.fromiter((len(e.tgt_ids or ()) for e in self.examples), np.int64, len(self.examples))

    @override
    def __getitem__(self, index: int) -> Example:
        """Indices past the end are the sampler's repeats: ``index - len(self)``, marked as such."""
        if index >= len(self):
            return dataclasses.replace(self.example(index - len(self)), repeat=True)
        return self.example(index)

    def __getitems__(self, indices: Sequence[int]) -> list[Example]:
        """A batch (the DataLoader's batched fetch), stamped with its step's token count if it carries one."""
        examples = [self[i] for i in indices]
        step_tokens = getattr(indices, "step_tokens", 0)
        return [dataclasses.replace(e, step_tokens=step_tokens) for e in examples] if step_tokens else examples


@dataclass(frozen=True)
class Collator:
    """Truncates, adds ``<bos>``/``<eos>`` and right-pads with ``<pad>`` (id 0).

    ``src`` is the source tokens (at most ``max_source_tokens - 1``) then ``<eos>``; ``tgt`` is ``<bos>``,
    the target tokens (at most ``max_target_tokens - 2``), then ``<eos>``. The model feeds ``tgt[:, :-1]``
    to the decoder and scores ``tgt[:, 1:]``. A dataclass so DataLoader workers can pickle it.
    """

    max_source_tokens: int
    max_target_tokens: int
    specials: Specials = Specials()  # a pretrained tokenizer's: its ids and the prefixes its rows start with

    def source_ids(self, example: Example) -> list[int]:
        """The source row before padding."""
        s = self.specials
        return [*s.source_prefix, *example.src_ids[: self._source_keep], s.eos_id]

    def target_ids(self, example: Example) -> list[int]:
        """The target row before padding; empty for prediction inputs."""
        if example.tgt_ids is None:
            return []
        s = self.specials
        return [s.bos_id, *s.target_prefix, *example.tgt_ids[: self._target_keep], s.eos_id]

    @property
    def _source_keep(self) -> int:
        """Source tokens a row keeps."""
        return self.max_source_tokens - 1 - len(self.specials.source_prefix)

    @property
    def _target_keep(self) -> int:
        """Target tokens a row keeps."""
        return self.max_target_tokens - 2 - len(self.specials.target_prefix)

    def scored_tokens(self, example: Example) -> int:
        """Target tokens the loss scores (all but ``<bos>``): what the example weighs in the loss."""
        return max(len(self.target_ids(example)) - 1, 0)

    def length(self, example: Example) -> int:
        """The longer of the two rows: what the example costs in a token budget."""
        return max(len(self.source_ids(example)), len(self.target_ids(example)))

    def costs(self, sources: np.ndarray, targets: np.ndarray | None) -> tuple[list[int], list[int]]:
        """:meth:`length` and :meth:`scored_tokens` of many examples at once, from their token counts alone.

        Args:
            sources: Each example's source token count, before truncation.
            targets: Each example's target token count; None for prediction inputs.
        """
        s = self.specials
        source_rows = len(s.source_prefix) + np.minimum(sources, self._source_keep) + 1
        if targets is None:
            return source_rows.tolist(), [0] * len(sources)
        target_rows = 2 + len(s.target_prefix) + np.minimum(targets, self._target_keep)
        return np.maximum(source_rows, target_rows).tolist(), (target_rows - 1).tolist()

    def __call__(self, examples: Sequence[Example]) -> Batch:
        has_target = [e.tgt_ids is not None for e in examples]
        if any(has_target) and not all(has_target):
            raise ValueError("a batch mixes examples with and without targets")
        sources = [self.source_ids(e) for e in examples]
        batch: Batch = {
            "src": _pad(sources, self.specials.pad_id),
            "src_lengths": list(map(len, sources)),
            "src_text": [e.src_text for e in examples],
            "src_truncated": [len(e.src_ids) > self.max_source_tokens - 1 for e in examples],
            "repeat": all(e.repeat for e in examples),
        }
        if examples and examples[0].step_tokens:  # training batches: the loss's normaliser
            batch["step_tokens"] = examples[0].step_tokens
        if all(has_target):
            targets = [self.target_ids(e) for e in examples]
            batch["tgt"] = _pad(targets, self.specials.pad_id)
            batch["tgt_lengths"] = list(map(len, targets))
            batch["tgt_text"] = [e.tgt_text for e in examples]
            batch["references"] = [list(e.references) or [e.tgt_text] for e in examples]
        return batch


def _pad(rows: list[list[int]], pad_id: int = PAD_ID) -> torch.Tensor:
    """Right-pads rows of ids into a (B, L) LongTensor."""
    lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
    out = np.full((len(rows), lengths.max(initial=0)), pad_id, dtype=np.int64)
    out[np.arange(out.shape[1]) < lengths[:, None]] = np.fromiter(itertools.chain.from_iterable(rows), np.int64)
    return torch.from_numpy(out)


class TokenBudgetBatchSampler(Sampler[list[int]]):
    """Length-bucketed batches of at most ``max_tokens`` padded tokens, sharded across ranks.

    Indices are sorted by length (ties in a seeded random order when shuffling) and cut greedily into
    batches with ``len(batch) * longest <= max_tokens``, so padding stays small and memory per step stays
    flat whatever the lengths; an example longer than the budget forms a batch of its own. The batch order
    is then shuffled with ``torch.Generator`` seeded by ``seed + epoch``. Every rank computes the same list
    and takes a strided shard, padded by repetition (or trimmed with ``drop_last``) so that all ranks run
    the same number of steps, as ``DistributedSampler`` does; the trainer must therefore not inject its
    own distributed sampler (``Trainer(use_distributed_sampler=False)``).

    Because every rank knows every rank's batches, each batch also carries (as :class:`BatchIndices`) the
    target tokens of its whole optimizer step: ``accumulate`` micro-batches on each of ``num_replicas``
    ranks, the last window of an epoch shorter, as Lightning steps at the epoch end. The loss divides by it,
    so every token of a step weighs the same, without a collective.
    """

    def __init__(
        self,
        lengths: Sequence[int],
        max_tokens: int,
        shuffle: bool,
        seed: int = 0,
        num_replicas: int = 1,
        rank: int = 0,
        drop_last: bool = False,
        scored: Sequence[int] | None = None,
        accumulate: int = 1,
    ) -> None:
        """Builds the sampler; batches are cut lazily in ``__iter__``.

        Args:
            lengths: Cost in tokens of each example (padded row length, see :meth:`Collator.length`).
            max_tokens: Budget of ``batch size * longest example`` per batch.
            shuffle: Shuffle ties and the batch order (training); off gives a fixed order (evaluation).
            seed: Base seed; epoch ``e`` uses ``seed + e``, so runs are reproducible and epochs differ.
            num_replicas: Number of ranks sharing the data.
            rank: This rank, in ``[0, num_replicas)``.
            drop_last: Drop the tail batches that do not divide evenly across ranks instead of repeating
                batches from the start.
            scored: Target tokens the loss scores in each example (:meth:`Collator.scored_tokens`); None
                leaves ``step_tokens`` at 0 (evaluation needs none).
            accumulate: Micro-batches per optimizer step on each rank (``Trainer(accumulate_grad_batches)``).
        """
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive, got {max_tokens}")
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        if accumulate < 1:
            raise ValueError(f"accumulate must be positive, got {accumulate}")
        self.lengths = [max(1, int(n)) for n in lengths]
        self.max_tokens = max_tokens
        self.shuffle = shuffle
        self.seed = seed
        self.num_replicas = num_replicas
        self.rank = rank
        self.drop_last = drop_last
        self.scored = None if scored is None else [int(n) for n in scored]
        self.accumulate = accumulate
        self.epoch = 0
        self._resume_at: tuple[int, int] | None = None  # (epoch, batches to skip) from load_state_dict
        self._batches_done = 0
        # The batch count does not depend on how ties are ordered, so one cut gives it for every epoch.
        num_batches = len(self._cut(np.argsort(self.lengths, kind="stable").tolist()))
        if drop_last:
            self._per_rank = num_batches // num_replicas
        else:
            self._per_rank = math.ceil(num_batches / num_replicas)

    @property
    def sampler(self) -> "TokenBudgetBatchSampler":
        """Itself: Lightning calls ``set_epoch`` on ``dataloader.batch_sampler.sampler``, not on the batch
        sampler (``lightning.fabric.utilities.data._set_sampler_epoch``)."""
        return self

    def set_epoch(self, epoch: int) -> None:
        """Selects the epoch whose order the next ``__iter__`` yields.

        Args:
            epoch: Epoch number; the order is a function of ``seed + epoch`` only.
        """
        if epoch != self.epoch:
            self._batches_done = 0
        self.epoch = epoch

    def state_dict(self) -> dict[str, int]:
        """Where the current epoch stands: ``{"epoch": e, "batches_done": k}``.

        ``batches_done`` counts batches this sampler has handed out, which runs ahead of the training step
        when the DataLoader prefetches; a resume that knows the number of completed steps should pass that
        instead.
        """
        return {"epoch": self.epoch, "batches_done": self._batches_done}

    def load_state_dict(self, state_dict: dict[str, int]) -> None:
        """Resumes mid-epoch: the next ``__iter__`` of epoch ``e`` skips its first ``k`` batches.

        Args:
            state_dict: As returned by :meth:`state_dict`.
        """
        self.epoch = int(state_dict["epoch"])
        self._batches_done = int(state_dict["batches_done"])
        self._resume_at = (self.epoch, self._batches_done)

    def __len__(self) -> int:
        """Batches per epoch on this rank. A resumed epoch yields fewer, but Lightning counts the skipped
        ones as done (it restores its batch counter), so the full count is what it needs."""
        return self._per_rank

    @override
    def __iter__(self) -> Iterator[list[int]]:
        skip = 0
        if self._resume_at is not None and self._resume_at[0] == self.epoch:
            skip = self._resume_at[1]
        self._resume_at = None
        self._batches_done = skip
        for batch in self._rank_batches()[skip:]:
            self._batches_done += 1
            yield batch

    def _rank_batches(self) -> list[BatchIndices]:
        """This rank's batches for the current epoch, each with its optimizer step's target tokens."""
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        n = len(self.lengths)
        tiebreak = torch.randperm(n, generator=generator).numpy() if self.shuffle else np.arange(n)
        # By length, ties by the tiebreak: argsorts rather than sorted(), which holds a key tuple per example.
        batches = self._cut(np.lexsort((tiebreak, self.lengths)).tolist())
        if self.shuffle:
            batches = [batches[i] for i in torch.randperm(len(batches), generator=generator).tolist()]
        total = self._per_rank * self.num_replicas
        if batches and total > len(batches):  # repeat from the start so that every rank has as many
            # Repeats are shifted by n: the dataset hands them out marked, so that evaluation runs them
            # (sharded strategies need every rank to step together) without counting them twice.
            repeats = [[i + n for i in batch] for batch in batches]
            batches = (batches + repeats * math.ceil(total / len(batches)))[:total]
        batches = batches[:total]
        # Micro-batch j of rank r is global batch j * num_replicas + r; a step spans `accumulate` of them per rank.
        window = self.accumulate * self.num_replicas
        steps = [self._scored(batches[start : start + window]) for start in range(0, total, window)]
        return [
            BatchIndices(batches[j * self.num_replicas + self.rank], steps[j // self.accumulate])
            for j in range(self._per_rank)
        ]

    def _scored(self, batches: list[list[int]]) -> int:
        """Target tokens scored in ``batches`` (repeats included: they are trained on); 0 without ``scored``."""
        if self.scored is None:
            return 0
        n = len(self.scored)
        return sum(self.scored[i % n] for batch in batches for i in batch)

    def _cut(self, order: list[int]) -> list[list[int]]:
        """Greedily cuts indices sorted by ascending length into batches within the budget."""
        batches: list[list[int]] = []
        current: list[int] = []
        for index in order:
            # sorted ascending, so the new example is the longest in the batch
            if current and (len(current) + 1) * self.lengths[index] > self.max_tokens:
                batches.append(current)
                current = []
            current.append(index)
        if current:
            batches.append(current)
        return batches


class LengthSortedSampler(Sampler[int]):
    """Prediction order: the longest source first, sharded across ranks as ``DistributedSampler`` shards.

    Batched in this order, neighbours have similar lengths: the encoder pads little and a batch's rows finish
    decoding close together, so few steps run for one straggler; the longest come first, so a batch too big
    for memory fails at once. The prediction writer restores input order. Every rank takes every
    ``num_replicas``-th index, ``ceil(n / num_replicas)`` of them, the last repeating the first ones.
    """

    def __init__(self, lengths: Sequence[int], num_replicas: int = 1, rank: int = 0) -> None:
        """Orders the indices once; iterating yields this rank's share.

        Args:
            lengths: Each example's length in tokens (:meth:`Collator.length`).
            num_replicas: Number of ranks sharing the data.
            rank: This rank, in ``[0, num_replicas)``.
        """
        if not 0 <= rank < num_replicas:
            raise ValueError(f"rank {rank} is outside [0, {num_replicas})")
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
        total = math.ceil(len(order) / num_replicas) * num_replicas
        order = (order * math.ceil(total / max(len(order), 1)))[:total]
        self.indices = order[rank::num_replicas]

    def __len__(self) -> int:
        return len(self.indices)

    @override
    def __iter__(self) -> Iterator[int]:
        return iter(self.indices)
