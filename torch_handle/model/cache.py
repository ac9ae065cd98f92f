"""The decoder's key/value caches for incremental decoding, one pair per layer, dynamic or static."""

from __future__ import annotations

import torch
from torch import Tensor

from torch_handle.model.attention import KVCache
from torch_handle.model.masks import MaskSpec


class DecoderCache:
    """Per-layer self-attention and cross-attention caches for incremental decoding.

    A static cache (``position`` given, a ``(1,)`` tensor on the device) keeps its shapes and buffers from step to
    step and advances its position on the device: see :meth:`Transformer.new_cache`.
    """

    def __init__(
        self, num_layers: int, capacity: int, position: Tensor | None = None, source: Tensor | None = None
    ) -> None:
        self.layers = [(KVCache(position), KVCache()) for _ in range(num_layers)]
        self.capacity = capacity
        self.length = 0
        self.position = position
        self.cross_spec: MaskSpec | None = None  # a static cache's cross-attention mask
        self.rope: tuple[Tensor, Tensor] | None = None  # a static cache's RoPE angles for every position
        self.bias: Tensor | None = None  # a static cache's relative position bias (1, H, capacity, capacity + 1)
        self.window: Tensor | None = None  # see :meth:`attend_written`
        self.source = source  # the source ids under copy_attention: a row per source, as cross-attention's keys

    def attend_written(self, filled: int) -> Tensor:
        """Have a static cache's next step attend over the ``filled`` positions written and its own, not the whole
        capacity: for an owner that counts positions on the host (a compiled CPU step, whose length dimension is
        then dynamic), where a CUDA graph must read the same buffers every step. Returns the window,
        ``arange(filled + 1)``."""
        assert self.position is not None, "a dynamic cache attends over what it holds"
        self.window = torch.arange(filled + 1, device=self.position.device)
        for self_cache, _ in self.layers:
            self_cache.window = self.window
        return self.window

    def select(self, index: Tensor, filled: int | None = None) -> None:
        """Row ``i`` becomes row ``index[i]`` of before: beam search's reorder, or finished rows dropping out.

        Cross-attention keys depend only on the source: they hold a row per source, shared by its beams (a group
        of consecutive rows, see :class:`MultiHeadAttention`), and follow only when sources drop out; ``index``
        then keeps whole groups. A static cache reorders in place and needs the number of positions ``filled``
        (see :meth:`KVCache.select`).
        """
        rows = self.rows
        if self.position is not None:  # refused before anything moves
            if rows is not None and index.shape[0] != rows:
                raise ValueError("a static cache keeps its rows: reorder them, or decode with a dynamic cache")
            if filled is None:
                raise ValueError("a static cache counts its positions on the device: pass the number filled")
        if self.source is not None and rows is not None and index.shape[0] != rows:
            self.source = self.source[_sources(index, rows // self.source.shape[0])]
        for self_cache, cross_cache in self.layers:
            if rows is not None and index.shape[0] != rows and cross_cache.k is not None:
                cross_cache.select(_sources(index, rows // cross_cache.k.shape[0]))
            self_cache.select(index, filled)

    def dynamic(self, rows: Tensor, filled: int) -> DecoderCache:
        """Rows ``rows`` of this static cache, ``filled`` positions written, as a dynamic cache: eager decoding goes on
        from there, dropping rows as they finish (a static cache keeps them all). Under beam search ``rows`` keeps
        whole groups of a source's beams, in any order within a group, and the cross-attention keeps their sources."""
        cache = DecoderCache(len(self.layers), self.capacity)
        for (static_self, static_cross), (new_self, new_cross) in zip(self.layers, cache.layers, strict=True):
            assert static_self.k is not None and static_self.v is not None and static_cross.k is not None
            new_self.k, new_self.v, new_self.length = static_self.k[rows], static_self.v[rows], filled
            sources = _sources(rows, static_self.k.shape[0] // static_cross.k.shape[0])
            new_cross.k, new_cross.v = static_cross.k[sources], static_cross.v[sources]
            new_cross.length = new_cross.k.shape[-2]
        if self.source is not None and self.rows is not None:
            cache.source = self.source[_sources(rows, self.rows // self.source.shape[0])]
        cache.length = filled
        return cache

    @property
    def rows(self) -> int | None:
        """The batch size the cache holds (decoder rows), ``None`` before the first step."""
        k = self.layers[0][0].k if self.layers else None
        return None if k is None else k.shape[0]


def _sources(rows: Tensor, group: int) -> Tensor:
    """The cross-attention rows (one per source) of decoder ``rows`` that keep whole groups of ``group`` beams."""
    sources = rows[::group] // group
    assert torch.equal(rows // group, sources.repeat_interleave(group)), "a source's rows move together"
    return sources
