"""BART's noising of token ids: sentence permutation, then text infilling (Lewis et al., 2019, section 2.2).

Pure functions of the ids and a ``torch.Generator``: the same generator state gives the same noise, so a run's noise
is a function of ``(seed, epoch, index)`` (:func:`noise_generator`) and a resumed run sees what the first one would
have seen. As fairseq's ``DenoisingDataset`` with ``--mask-length span-poisson --replace-length 1``, the spans'
lengths are drawn from a Poisson distribution until they cover the masked share of the tokens, and each span becomes
one mask token; a span of length zero inserts one. Unlike fairseq, whose spans start at random tokens and may overlap
(merging into one mask), spans here are laid out without overlap, so exactly ``ceil(ratio * n)`` tokens are masked
and every span leaves its own mask token. Two of fairseq's options are here too, both off by default as in fairseq's
``DenoisingConfig``: ``mask_random`` (that share of the spans leaves a random ordinary token instead of the mask) and
whole-word masking (the ratio and the span lengths count words, as the tokenizer's word-start pieces delimit them:
what fairseq does for any ``--mask-length`` but ``subword``, BART's ``span-poisson`` included).
"""

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch


@dataclasses.dataclass(frozen=True)
class Noise:
    """BART's noise settings (see :func:`denoising_source`).

    Args:
        mask_id: The tokenizer's ``<mask>``.
        mask_ratio: The share of tokens (of words, with ``word_starts``) masked.
        poisson_lambda: The mean span length.
        permute_sentences: Shuffle the sentences first.
        mask_random: The share of spans whose one token is a random one of ``random_ids`` instead of ``mask_id``.
        random_ids: The ids a random replacement is drawn from (the tokenizer's ordinary pieces).
        word_starts: Whether each token id starts a word; spans then cover whole words. None: every token is a word.
    """

    mask_id: int
    mask_ratio: float = 0.3
    poisson_lambda: float = 3.0
    permute_sentences: bool = True
    mask_random: float = 0.0
    random_ids: tuple[int, ...] = ()
    word_starts: tuple[bool, ...] | None = None

    def __post_init__(self) -> None:
        if self.mask_random and not self.random_ids:
            raise ValueError("mask_random needs random_ids to draw from")


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
    ids: Sequence[int],
    mask_id: int,
    generator: torch.Generator,
    mask_ratio: float = 0.3,
    poisson_lambda: float = 3.0,
    word_starts: Sequence[bool] | None = None,
    mask_random: float = 0.0,
    random_ids: Sequence[int] = (),
) -> list[int]:
    """Text infilling: spans covering ``ceil(mask_ratio * n)`` of the ``n`` tokens (or words) each become one
    ``mask_id`` (or, a ``mask_random`` share of them, one random token of ``random_ids``).

    The spans and the unmasked words are laid out in a uniformly random order, so spans never overlap; two spans
    may touch, leaving two masks side by side.

    Args:
        ids: Token ids.
        mask_id: The tokenizer's ``<mask>``.
        generator: Draws the span lengths, their places and the random replacements.
        mask_ratio: The share of tokens (or words) masked.
        poisson_lambda: The mean span length, in tokens (or words).
        word_starts: Whether a word starts at each position of ``ids`` (the first always does); spans then start and
            end on word boundaries. None: every token is a word.
        mask_random: The share of spans replaced by a random token instead of ``mask_id``.
        random_ids: The ids a random replacement is drawn from.
    """
    starts = range(len(ids)) if word_starts is None else [i for i, start in enumerate(word_starts) if start or i == 0]
    words = [ids[a:b] for a, b in zip(starts, [*starts[1:], len(ids)], strict=True)]
    num_masked = math.ceil(mask_ratio * len(words))
    lengths = span_lengths(num_masked, poisson_lambda, generator)
    kept = len(words) - num_masked
    # Of the kept words and the spans, in one random sequence, which places the spans take.
    is_span = torch.zeros(kept + len(lengths), dtype=torch.bool)
    is_span[torch.randperm(len(is_span), generator=generator)[: len(lengths)]] = True
    fills = [mask_id] * len(lengths)
    if mask_random > 0:  # drawn after the layout, so that the same seed lays out the same spans with or without
        replace = (torch.rand(len(lengths), generator=generator) < mask_random).tolist()
        picks = torch.randint(len(random_ids), (len(lengths),), generator=generator).tolist()
        fills = [random_ids[pick] if r else mask_id for r, pick in zip(replace, picks, strict=True)]
    out: list[int] = []
    position = 0
    spans = iter(zip(lengths, fills, strict=True))
    for span in is_span.tolist():
        if span:
            length, fill = next(spans)
            out.append(fill)
        else:
            length = 1
            out.extend(words[position])
        position += length
    return out


def denoising_source(
    ids: Sequence[int], sentence_ends: Sequence[int], noise: Noise, generator: torch.Generator
) -> list[int]:
    """BART's noised input for ``ids``: its sentences permuted (when ``noise.permute_sentences``), then infilled.

    Args:
        ids: Token ids of one text, the target the model learns to restore.
        sentence_ends: The end offset of each sentence in ``ids`` (see :func:`permute_sentences`).
        noise: The settings.
        generator: The noise's randomness (:func:`noise_generator`).
    """
    if noise.permute_sentences:
        ids = permute_sentences(ids, sentence_ends, generator)
    word_starts = None if noise.word_starts is None else [noise.word_starts[token] for token in ids]
    return infill(
        ids,
        noise.mask_id,
        generator,
        noise.mask_ratio,
        noise.poisson_lambda,
        word_starts,
        noise.mask_random,
        noise.random_ids,
    )
