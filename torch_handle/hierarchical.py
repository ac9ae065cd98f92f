"""Hierarchical summarization of documents longer than the model's context.

The document is cut into overlapping windows of at most the context length; each window is summarized
(cached encoder, KV-cached beam search through :func:`torch_handle.model.generate`); the window summaries are
joined and summarized again, level after level, until the text fits one window and one summary remains.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from torch import Tensor

from torch_handle.data.batching import Collator, Example
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.model import ConfigError, Transformer, generate
from torch_handle.model.logits import DecodingControls

log = logging.getLogger(__name__)

SEPARATOR = "\n"  # between window summaries: a sentence break, as ``rougeLsum`` splits them


def window_tokens(max_source_tokens: int, tokenizer: Tokenizer) -> int:
    """The document tokens one window holds: the source length less ``<eos>`` and a pretrained tokenizer's prefix
    (BART's and LED's ``<s>``)."""
    return max_source_tokens - 1 - len(tokenizer.specials.source_prefix)


def check_overlap(overlap: int, window: int) -> None:
    """Refuses an ``overlap`` with which windows of ``window`` tokens would not advance, naming the option."""
    if window >= 1 and not 0 <= overlap < window:
        raise ConfigError(
            f"overlap={overlap} does not fit the {window}-token windows a long document is read in (the source "
            f"length less <eos>): set overlap to at most {window - 1}"
        )


def fitted_overlap(overlap: int, window: int) -> int:
    """``overlap``, or a quarter of the window, with a warning, when ``overlap`` leaves windows of ``window`` tokens no
    room to advance (a setting made for longer sources, as a config's run at a smaller source length)."""
    if window < 1 or 0 <= overlap < window:
        return overlap
    fitted = window // 4
    log.warning(
        "chunk_overlap=%d does not fit the %d-token windows of a long document: using %d", overlap, window, fitted
    )
    return fitted


def chunk_spans(length: int, max_tokens: int, overlap: int) -> list[tuple[int, int]]:
    """``[start, end)`` windows of at most ``max_tokens`` that cover ``range(length)``.

    Each window starts ``max_tokens - overlap`` after the previous one, so neighbours share exactly
    ``overlap`` tokens: a sentence cut at a window's end is still read whole by the next window.

    Args:
        length: Number of tokens to cover.
        max_tokens: Longest window (the model's context without ``<eos>``).
        overlap: Tokens shared by neighbouring windows; below ``max_tokens`` so that windows advance.
    """
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if not 0 <= overlap < max_tokens:
        raise ValueError(f"overlap must be in [0, max_tokens={max_tokens}), got {overlap}")
    stride = max_tokens - overlap
    spans = [(0, min(max_tokens, length))]
    while spans[-1][1] < length:
        start = spans[-1][0] + stride
        spans.append((start, min(start + max_tokens, length)))
    return spans


def generate_summaries(
    model: Transformer,
    tokenizer: Tokenizer,
    sources: list[list[int]],
    *,
    max_new_tokens: int,
    num_beams: int,
    length_penalty: float,
    batch_size: int,
    controls: DecodingControls | None = None,
    generate_fn: Callable[[Tensor], Tensor] | None = None,
) -> list[str]:
    """One summary per token list, decoded in batches of ``batch_size`` sources of similar length.

    Args:
        model: The seq2seq Transformer; it runs in evaluation mode (no dropout).
        tokenizer: Decodes the generated ids.
        sources: Token ids without ``<eos>``, each within the model's context.
        max_new_tokens: Longest summary, in tokens.
        num_beams: Beam width (1 = greedy).
        length_penalty: Beam-search length normalisation exponent.
        batch_size: Sources decoded together; sorted by length first so little padding is encoded.
        controls: N-gram blocking, repetition penalty, a minimum length and sampling (none by default).
        generate_fn: Decodes a ``(b, S)`` batch as ``generate`` with the settings above would; the
            LightningModule passes one that keeps processes in lockstep. None calls ``generate``.
    """
    # The collator appends <eos> and pads exactly as training batches are built.
    prefix = len(tokenizer.specials.source_prefix)
    collate = Collator(max(map(len, sources)) + 1 + prefix, max_target_tokens=3, specials=tokenizer.specials)
    device = next(model.parameters()).device
    order = sorted(range(len(sources)), key=lambda i: len(sources[i]))
    out = [""] * len(sources)
    training = model.training
    model.eval()
    try:
        for first in range(0, len(order), batch_size):
            rows = order[first : first + batch_size]
            src = collate([Example(sources[i], "") for i in rows])["src"].to(device)  # (b, S)
            if generate_fn is None:
                # this process alone decodes a plain module: its steps can replay as CUDA graphs
                ids = generate(
                    model, src, max_new_tokens, num_beams, length_penalty, cuda_graph=src.is_cuda, controls=controls
                )
            else:
                ids = generate_fn(src)
            for i, text in zip(rows, tokenizer.decode_batch(ids.tolist()), strict=True):
                out[i] = text.strip()
    finally:
        model.train(training)
    return out


def summarize(
    model: Transformer,
    tokenizer: Tokenizer,
    document: str,
    *,
    max_source_tokens: int,
    overlap: int = 256,
    max_new_tokens: int = 256,
    num_beams: int = 4,
    length_penalty: float = 1.0,
    batch_size: int = 4,
    max_levels: int = 4,
    controls: DecodingControls | None = None,
    generate_fn: Callable[[Tensor], Tensor] | None = None,
) -> str:
    """Summarize ``document`` of any length with a model whose context is ``max_source_tokens``.

    A document that fits is summarized directly. A longer one is split into overlapping windows whose
    summaries, joined with newlines, become the next level's text. Termination is guaranteed: after
    ``max_levels`` levels, or as soon as a level fails to shorten the text (an untrained model may write
    ``max_new_tokens`` for every window), the text is cut to the context and summarized one last time,
    with a warning. Keep ``max_new_tokens`` well below ``max_source_tokens - overlap`` so that each level
    shrinks the text several-fold.

    Args:
        model: The seq2seq Transformer (e.g. ``Seq2SeqModule.model``).
        tokenizer: The tokenizer the model was trained with.
        document: Text to summarize.
        max_source_tokens: The model's context, ``<eos>`` included, as ``--data.max_source_tokens``.
        overlap: Tokens shared by neighbouring windows, so no sentence is only seen cut in half.
        max_new_tokens: Longest summary of one window, and of the final summary.
        num_beams: Beam width (1 = greedy).
        length_penalty: Beam-search length normalisation exponent.
        batch_size: Windows decoded together.
        max_levels: Most window-then-join levels before the final summary.
        controls: N-gram blocking, repetition penalty, a minimum length and sampling, for every window and level.
        generate_fn: Replaces each ``generate`` call (see :func:`generate_summaries`), e.g. to keep the
            collectives of several processes in step while each summarizes its own documents.

    Returns:
        The summary, without special tokens.
    """
    # The model's input ends in <eos>, after a pretrained tokenizer's prefix (BART's and LED's <s>).
    limit = window_tokens(max_source_tokens, tokenizer)
    if max_levels < 0:
        raise ValueError(f"max_levels must be >= 0, got {max_levels}")
    check_overlap(overlap, limit)
    chunk_spans(0, limit, overlap)  # validates the window before any decoding
    decode = {
        "max_new_tokens": max_new_tokens,
        "num_beams": num_beams,
        "length_penalty": length_penalty,
        "batch_size": batch_size,
        "controls": controls,
        "generate_fn": generate_fn,
    }
    ids = tokenizer.encode(document)
    for level in range(max_levels):
        if len(ids) <= limit:
            break
        windows = [ids[start:end] for start, end in chunk_spans(len(ids), limit, overlap)]
        summaries = generate_summaries(model, tokenizer, windows, **decode)
        shorter = tokenizer.encode(SEPARATOR.join(summaries))
        log.info("level %d: %d tokens in %d windows -> %d tokens", level, len(ids), len(windows), len(shorter))
        shrank, ids = len(shorter) < len(ids), shorter
        if not shrank:
            log.warning("level %d did not shorten the text: cutting its summaries to the context", level)
            break
    if len(ids) > limit:
        log.warning("text still has %d tokens after the last level: cutting it to %d", len(ids), limit)
        ids = ids[:limit]
    return generate_summaries(model, tokenizer, [ids], **decode)[0]
