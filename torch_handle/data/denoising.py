"""BART's noising of token ids: sentence permutation, then text infilling (Lewis et al., 2019, section 2.2).

Pure functions of the ids and a ``torch.Generator``: the same generator state gives the same noise, so a run's noise
is a function of ``(seed, epoch, index)`` (:func:`noise_generator`) and a resumed run sees what the first one would
have seen. As fairseq's ``DenoisingDataset`` with ``--mask-length span-poisson --replace-length 1``, the spans'
lengths are drawn from a Poisson distribution until they cover the masked share of the tokens, and each span becomes
one mask token; a span of length zero inserts one. Unlike fairseq, whose spans start at random tokens and may overlap
(merging into one mask), spans here are laid out without overlap, so exactly ``ceil(ratio * n)`` tokens are masked
and every span leaves its own mask token.
"""

import math
from collections.abc import Sequence

import numpy as np
import torch


def noise_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A generator seeded from the triple through numpy's ``SeedSequence``, so that nearby triples give unrelated
    streams.

    Args:
        seed: The run's seed (``--data.seed``).
        epoch: The training epoch; evaluation passes a fixed one.
        index: The example's index in its split.
    """
    state = np.random.SeedSequence([seed, epoch, index]).generate_state(2, dtype=np.uint32)
    return torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))


def permute_sentences(ids: Sequence[int], sentence_ends: Sequence[int], generator: torch.Generator) -> list[int]:
    """The sentences of ``ids`` in a random order.

    Args:
        ids: Token ids.
        sentence_ends: The end offset of each sentence in ``ids``, ascending; the last is ``len(ids)``.
        generator: Draws the order.
    """
    starts = [0, *sentence_ends[:-1]]
    sentences = [ids[start:end] for start, end in zip(starts, sentence_ends, strict=True)]
    order = torch.randperm(len(sentences), generator=generator).tolist()
    return [token for i in order for token in sentences[i]]


def span_lengths(num_masked: int, poisson_lambda: float, generator: torch.Generator) -> list[int]:
    """Poisson span lengths drawn until they cover ``num_masked`` tokens, the last cut to make the sum exact.

    Args:
        num_masked: Tokens to mask in all.
        poisson_lambda: The mean span length.
        generator: Draws the lengths.
    """
    lengths: list[int] = []
    total = 0
    while total < num_masked:
        draws = torch.poisson(torch.full((max(num_masked, 8),), poisson_lambda), generator=generator).long().tolist()
        for length in draws:
            lengths.append(min(length, num_masked - total))
            total += lengths[-1]
            if total == num_masked:
                break
    return lengths


def infill(
    ids: Sequence[int], mask_id: int, generator: torch.Generator, mask_ratio: float = 0.3, poisson_lambda: float = 3.0
) -> list[int]:
    """Text infilling: spans covering ``ceil(mask_ratio * len(ids))`` tokens each become one ``mask_id``.

    The spans and the unmasked tokens are laid out in a uniformly random order, so spans never overlap; two spans
    may touch, leaving two masks side by side.

    Args:
        ids: Token ids.
        mask_id: The tokenizer's ``<mask>``.
        generator: Draws the span lengths and their places.
        mask_ratio: The share of tokens masked.
        poisson_lambda: The mean span length.
    """
    num_masked = math.ceil(mask_ratio * len(ids))
    lengths = span_lengths(num_masked, poisson_lambda, generator)
    kept = len(ids) - num_masked
    # Of the kept tokens and the spans, in one random sequence, which places the spans take.
    is_span = torch.zeros(kept + len(lengths), dtype=torch.bool)
    is_span[torch.randperm(len(is_span), generator=generator)[: len(lengths)]] = True
    out: list[int] = []
    position = 0
    spans = iter(lengths)
    for span in is_span.tolist():
        length = next(spans) if span else 1
        out.append(mask_id if span else ids[position])
        position += length
    return out


def denoising_source(
    ids: Sequence[int],
    sentence_ends: Sequence[int],
    mask_id: int,
    generator: torch.Generator,
    mask_ratio: float = 0.3,
    poisson_lambda: float = 3.0,
    permute: bool = True,
) -> list[int]:
    """BART's noised input for ``ids``: its sentences permuted (when ``permute``), then infilled.

    Args:
        ids: Token ids of one text, the target the model learns to restore.
        sentence_ends: The end offset of each sentence in ``ids`` (see :func:`permute_sentences`).
        mask_id: The tokenizer's ``<mask>``.
        generator: The noise's randomness (:func:`noise_generator`).
        mask_ratio: The share of tokens masked.
        poisson_lambda: The mean span length.
        permute: Shuffle the sentences first.
    """
    if permute:
        ids = permute_sentences(ids, sentence_ends, generator)
    return infill(ids, mask_id, generator, mask_ratio, poisson_lambda)
