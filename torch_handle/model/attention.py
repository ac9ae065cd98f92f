"""Multi-head attention with rotary positions and a key/value cache."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.kernels import attend
from torch_handle.model.masks import MaskSpec
from torch_handle.model.positions import apply_rope

if TYPE_CHECKING:
    from torch_handle.model.config import TransformerConfig


class KVCache:
    """Keys and values of one attention layer, preallocated for ``capacity`` positions.

    Beam search reorders it along the batch dimension, and finished rows leave it, with :meth:`select`.
    With a ``position`` tensor the cache is static: a new key is written at that position, on the device, and
    the whole capacity is returned (the caller masks the positions not yet written), so that every step runs
    the same kernels on the same buffers and a CUDA graph can replay it. With a ``window`` (``arange(n)``), only the
    first ``n`` positions are returned: a compiled step whose length dimension is dynamic reads no more than that.
    """

    def __init__(self, position: Tensor | None = None) -> None:
        self.k: Tensor | None = None  # (B, H, capacity, D)
        self.v: Tensor | None = None
        self.length = 0
        self.position = position  # (1,): the next position of a static cache, advanced by its owner
        self.window: Tensor | None = None  # a static cache's positions attended this step, set by its owner

    def allocate(self, like: Tensor, rows: int, capacity: int) -> None:
        """The buffers for ``rows`` rows of ``capacity`` positions, heads, width and dtype as ``like (B, H, T, D)``."""
        # A window never spans the whole buffer: one spare position, or the last step's view would be the whole
        # buffer, whose shapes a compiled step specializes on (it compiled again).
        shape = (rows, like.shape[1], capacity + (self.window is not None), like.shape[-1])
        # A static cache's unwritten keys and values are masked, not sliced off, and a masked NaN left in
        # uninitialised memory would still poison the output (0 * NaN): they start as zeros.
        new = torch.zeros if self.position is not None else torch.empty
        self.k, self.v = (new(shape, dtype=like.dtype, device=like.device) for _ in range(2))

    def append(self, k: Tensor, v: Tensor, capacity: int) -> tuple[Tensor, Tensor]:
        if self.k is None:
            self.allocate(k, k.shape[0], capacity)
        assert self.k is not None and self.v is not None
        if self.position is not None:
            self.k.index_copy_(2, self.position, k)
            self.v.index_copy_(2, self.position, v)
            if self.window is None:
                return self.k, self.v
            end = self.window.shape[0]
            return self.k[:, :, :end], self.v[:, :, :end]
        end = self.length + k.shape[-2]
        self.k[:, :, self.length : end] = k
        self.v[:, :, self.length : end] = v
        self.length = end
        return self.k[:, :, :end], self.v[:, :, :end]

    def select(self, index: Tensor, filled: int | None = None) -> None:
        """Row ``i`` becomes row ``index[i]`` of before: beam search's reorder, or finished rows dropping out.

        Most beams continue their own prefix, so a reorder copies only the rows that change, and only their
        filled positions, in place; a shrinking batch copies the rest into a smaller cache. A static cache keeps
        its rows and buffers (a compiled step or a CUDA graph reads them): it reorders in place only, and since it
        counts positions on the device, the caller says how many are ``filled``.
        """
        if self.k is None or self.v is None:
            return
        if index.shape[0] != self.k.shape[0]:
            assert self.position is None, "a static cache keeps its rows"  # DecoderCache.select refuses it first
            self.k, self.v = self.k.index_select(0, index), self.v.index_select(0, index)
            return
        end = self.length if self.position is None else filled
        assert end is not None, "a static cache needs the number of positions filled"
        moved = (index != torch.arange(index.shape[0], device=index.device)).nonzero().squeeze(1)
        if moved.numel():
            source = index[moved]
            for held in (self.k[:, :, :end], self.v[:, :, :end]):  # index_copy_ moves rows faster than index_put_
                held.index_copy_(0, moved, held.index_select(0, source))


class MultiHeadAttention(nn.Module):
    """Scaled dot-product attention over ``num_heads`` heads.

    The projection weights are packed as in ``torch.nn.MultiheadAttention`` (``in_proj`` holds query, key
    and value), so self-attention runs one matrix multiply for all three and weights copy over one to one.

    Args:
        d_model: Model width.
        num_heads: Number of heads.
        dropout: Dropout on the attention weights (training only).
        backend: Attention kernel name (see :mod:`torch_handle.model.kernels`).
        head_dim: Width of each head; ``None`` is ``d_model // num_heads``.
        bias: Biases in the projections.
        scale: Divide the scores by sqrt(head_dim); T5 does not.
        global_projection: Longformer's encoder self-attention (LED): the queries of the global tokens
            (``MaskSpec.global_keys``), and the keys and values they attend to, come from a second packed projection,
            ``global_proj``, and those tokens attend to every position.
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int,
        dropout: float,
        backend: str,
        head_dim: int | None = None,
        bias: bool = True,
        scale: bool = True,
        global_projection: bool = False,
    ) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.dropout = dropout
        self.backend = backend
        inner = num_heads * (head_dim or d_model // num_heads)
        self.in_proj = nn.Linear(d_model, 3 * inner, bias=bias)
        self.global_proj = nn.Linear(d_model, 3 * inner, bias=bias) if global_projection else None
        self.out_proj = nn.Linear(inner, d_model, bias=bias)
        # Every kernel divides the scores by sqrt(head_dim); unscaled attention multiplies the queries by as much.
        self.query_scale = None if scale else (inner // num_heads) ** 0.5
        self.kv_hook: Callable[[Tensor, Tensor], tuple[Tensor, Tensor]] | None = None
        """Self-attention without a cache: maps this input's keys and values ``(B, H, T, D)`` to the keys and
        values attended to. Context parallelism (:mod:`torch_handle.parallel.context`) sets it to add the
        neighbouring ranks' halos; the model itself never does."""

    @classmethod
    def of(cls, config: TransformerConfig, encoder: bool = False) -> MultiHeadAttention:
        """The attention layer ``config`` describes; the ``encoder``'s self-attention may project global tokens."""
        layer = cls(
            config.d_model,
            config.num_heads,
            config.attention_p,
            config.attention_backend,
            config.head_dim,
            config.bias,
            config.scale_attention,
            global_projection=encoder and config.encoder_attention == "longformer",
        )
        if layer.global_proj is not None and config.global_tokens == 0:
            # Kept so its weights load and export, frozen since no token uses it: DDP would wait for its gradients.
            layer.global_proj.requires_grad_(False)
        return layer

    def _heads(self, x: Tensor) -> Tensor:  # (B, T, C) -> (B, H, T, D)
        b, t, c = x.shape
        return x.view(b, t, self.num_heads, c // self.num_heads).transpose(1, 2)

    def forward(
        self,
        x: Tensor,
        spec: MaskSpec,
        memory: Tensor | None = None,
        rope: tuple[Tensor, Tensor] | None = None,
        cache: KVCache | None = None,
        capacity: int = 0,
    ) -> Tensor:
        """Attend from ``x (B, T, C)`` to itself, or to ``memory (B, S, C)`` for cross-attention.

        Args:
            x: Queries (and keys/values for self-attention).
            spec: Masking for this call.
            memory: Encoder output for cross-attention; ``None`` for self-attention. It may hold one row for each
                group of consecutive rows of ``x`` (beam search: a source's beams), which then attend to it as
                one row of ``group * T`` queries: its keys and values are computed, kept and read once.
            rope: ``(cos, sin)`` for the query positions, applied to queries and keys (self-attention).
            cache: Self-attention: new keys/values are appended. Cross-attention: filled on first use.
            capacity: Positions to preallocate when a self-attention cache is first filled.
        """
        if memory is None:
            q, k, v = (self._heads(t) for t in self.project(x, "qkv").chunk(3, dim=-1))
            if rope is not None:
                q, k = apply_rope(q, *rope), apply_rope(k, *rope)
            if self.kv_hook is not None and cache is None:
                k, v = self.kv_hook(k, v)
            if cache is not None:
                k, v = cache.append(k, v, capacity)
        else:
            if x.shape[0] % memory.shape[0]:
                raise ValueError(
                    f"cross-attention from {x.shape[0]} rows to a memory of {memory.shape[0]}: pass one memory row "
                    "per row, or per group of consecutive rows (a source's beams)"
                )
            # Rows of x grouped per memory row: (B * group, T, C) -> (B, group * T, C), undone by the last reshape.
            q = self._heads(self.project(x.reshape(memory.shape[0], -1, x.shape[-1]), "q"))
            if cache is not None and cache.k is not None:
                k, v = cache.k, cache.v
            else:
                k, v = self.memory_kv(memory)
                if cache is not None:
                    cache.k, cache.v, cache.length = k, v, k.shape[-2]
        if self.query_scale is not None:
            q = q * self.query_scale
        dropout_p = self.dropout if self.training else 0.0
        out = attend(q, k, v, spec, self.backend, dropout_p)  # (B, H, T, D)
        if self.global_proj is not None and spec.global_keys:
            out = torch.cat([self._global_rows(x, spec, dropout_p), out[:, :, spec.global_keys :]], dim=2)
        return self.out_proj(out.transpose(1, 2).reshape(*x.shape[:-1], -1))

    def memory_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Cross-attention's keys and values ``(B, H, S, D)`` of ``memory (B, S, C)``."""
        k, v = (self._heads(t) for t in self.project(memory, "kv").chunk(2, dim=-1))
        return k, v

    def _global_rows(self, x: Tensor, spec: MaskSpec, dropout_p: float) -> Tensor:
        """The outputs ``(B, H, G, D)`` of the ``G`` global tokens of ``x (B, T, C)``: their ``global_proj`` queries
        over every position's ``global_proj`` keys and values, padding aside (``G x T`` scores: a few rows). The
        module is called whole (int8 decoding replaces it); the queries of the other positions go unused."""
        q, k, v = (self._heads(t) for t in self.global_projection(x).chunk(3, dim=-1))
        q = q[:, :, : spec.global_keys]  # (B, H, G, D)
        return attend(q, k, v, MaskSpec(key_padding=spec.key_padding), self.backend, dropout_p)

    def global_projection(self, x: Tensor) -> Tensor:
        """``global_proj(x)``, the global tokens' packed queries, keys and values; tensor parallelism computes this
        process's heads' rows instead."""
        return self.global_proj(x)  # type: ignore[misc] - set under longformer attention

    def packed_weights(self) -> list[tuple[str, nn.Parameter]]:
        """The packed query/key/value weights ``(3C, C)`` by name: ``in_proj``'s, and LED's ``global_proj``'s."""
        packed = [("in_proj.weight", self.in_proj.weight)]
        if self.global_proj is not None:
            packed.append(("global_proj.weight", self.global_proj.weight))
        return packed

    def project(self, x: Tensor, part: str) -> Tensor:
        """``x`` times the packed projection's rows named by ``part``: ``"qkv"`` all of them (self-attention),
        ``"q"`` the queries' or ``"kv"`` the keys' and values' (cross-attention). int8 decoding
        (:mod:`torch_handle.quantize`) replaces it with int8 matrices."""
        w, b = self.packed_projection()
        if part == "qkv":
            return F.linear(x, w, b)
        c = w.shape[0] // 3  # query rows: all heads', or this process's heads' share under tensor parallelism
        rows = slice(None, c) if part == "q" else slice(c, None)
        return F.linear(x, w[rows], None if b is None else b[rows])

    def packed_projection(self) -> tuple[Tensor, Tensor | None]:
        """The query, key and value weight ``(3C, C)`` and bias ``(3C,)`` (None without biases) that :meth:`forward`
        multiplies by.

        Tensor parallelism (:mod:`torch_handle.parallel.tensor`) returns this process's heads' rows instead.
        """
        return self.in_proj.weight, self.in_proj.bias
