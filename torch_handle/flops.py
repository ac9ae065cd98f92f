"""Model FLOPs of the encoder-decoder, for throughput and MFU.

A matrix multiply of ``(m, k) @ (k, n)`` costs ``2 m k n``. Attention counts every score a kernel
computes for the real tokens: all ``T^2`` for causal self-attention (as dense kernels do), ``S (2w + 1)``
for a window of ``w`` on each side. Padding is not counted: MFU measures useful work.
"""

from __future__ import annotations

from collections.abc import Sequence

from torch_handle.model import TransformerConfig


def _attention(queries: int, keys: int, d: int) -> int:
    return 2 * 2 * queries * keys * d  # scores and weighted sum


def forward_flops(config: TransformerConfig, src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> int:
    """Forward FLOPs for a batch of (source length, decoder input length) pairs."""
    d, ff, vocab = config.d_model, config.d_ff, config.tgt_vocab_size
    total = 0
    for s, t in zip(src_lengths, tgt_lengths, strict=True):
        keys = min(s, 2 * config.window + 1) if config.encoder_attention == "local" else s
        memory = -(-s // config.cross_downsample)  # pooled length, ceil
        encoder = 2 * s * d * 3 * d + 2 * s * d * d + _attention(s, keys, d) + 2 * 2 * s * d * ff
        decoder = (
            2 * t * d * 3 * d
            + 2 * t * d * d
            + _attention(t, t, d)  # self-attention
            + 2 * t * d * d
            + 2 * memory * d * 2 * d
            + 2 * t * d * d
            + _attention(t, memory, d)  # cross-attention
            + 2 * 2 * t * d * ff
        )
        total += config.num_encoder_layers * encoder + config.num_decoder_layers * decoder + 2 * t * d * vocab
    return total


def training_flops(config: TransformerConfig, src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> int:
    """Forward plus backward (twice the forward); recomputation by activation checkpointing is not counted."""
    return 3 * forward_flops(config, src_lengths, tgt_lengths)
