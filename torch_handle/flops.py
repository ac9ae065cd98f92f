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
    h = config.num_heads * config.head_dim  # the heads' width: d_model unless attention_head_dim says otherwise
    ff_matrices = 3 if config.gated_ff else 2
    total = 0
    for s, t in zip(src_lengths, tgt_lengths, strict=True):
        keys = min(s, 2 * config.window + 1) if config.encoder_attention == "local" else s
        memory = -(-s // config.cross_downsample)  # pooled length, ceil
        encoder = 2 * s * d * 3 * h + 2 * s * h * d + _attention(s, keys, h) + ff_matrices * 2 * s * d * ff
        decoder = (
            2 * t * d * 3 * h
            + 2 * t * h * d
            + _attention(t, t, h)  # self-attention
            + 2 * t * d * h
            + 2 * memory * d * 2 * h
            + 2 * t * h * d
            + _attention(t, memory, h)  # cross-attention
            + ff_matrices * 2 * t * d * ff
        )
        total += config.num_encoder_layers * encoder + config.num_decoder_layers * decoder + 2 * t * d * vocab
    return total


def training_flops(config: TransformerConfig, src_lengths: Sequence[int], tgt_lengths: Sequence[int]) -> int:
    """Forward plus backward (twice the forward); recomputation by activation checkpointing is not counted."""
    return 3 * forward_flops(config, src_lengths, tgt_lengths)
