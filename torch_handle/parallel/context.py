"""Context parallelism for the sliding-window encoder: each rank encodes a contiguous slice of the source.

Ring attention (torchtitan, PyTorch's ``context_parallel``) passes every key and value around all ranks, because
full attention needs them. A local-attention encoder needs far less: a query sees ``window`` positions on each
side, so each rank holds ``S / cp`` positions and, in every layer, receives only the ``window`` keys and values
just before and just after its slice (its halo) from its neighbours. Memory and compute per rank fall as ``1 / cp``
while the result is the single-process encoder's, forward and backward.

How the pieces fit, per encoder call on a context-parallel group of ``cp`` ranks that all hold the same batch:

1. The source is padded to a multiple of ``cp * cross_downsample`` and rank ``r`` takes slice ``r``; positions,
   RoPE angles and ALiBi distances are the whole source's (``Transformer.encode(offset=...)``).
2. Each encoder self-attention's ``kv_hook`` swaps its keys and values for ``[halo, slice, halo]``, gathered from
   the neighbours (:func:`exchange_halo`); the kernels attend from the slice's queries with ``q_offset = window``.
3. Each rank mean-pools its slice (pooling windows never straddle slices) and the pooled memory is all-gathered,
   so the decoder runs replicated on the ``cp`` ranks.

Gradients come out exact with plain data-parallel averaging over all ranks: every collective here sums the
gradients of the pieces it gathered back onto the rank that owns them (:class:`_AllGather`), so a rank's encoder
gradient is its slice's share of the ``cp`` replicated losses, and DDP, ZeRO or FSDP averaging over the
``dp x cp`` ranks divides by ``cp`` once (the loss's per-token scale counts data-parallel replicas only).
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor

from torch_handle.model import ConfigError, Transformer, TransformerConfig


class _AllGather(torch.autograd.Function):
    """Concatenates every rank's ``x`` along ``dim``; backward sums each piece's gradient over the ranks that used it
    and returns this rank's share (all-reduce then slice: every backend has it, gloo included)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        parts = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, x.contiguous(), group=group)
        return torch.cat(parts, dim=dim)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        size, rank = dist.get_world_size(ctx.group), dist.get_rank(ctx.group)
        return grad.chunk(size, dim=ctx.dim)[rank], None, None


def all_gather(x: Tensor, dim: int, group: dist.ProcessGroup) -> Tensor:
    """Every rank's ``x``, in rank order along ``dim``, differentiable."""
    return _AllGather.apply(x, dim, group)


def exchange_halo(x: Tensor, halo: int, dim: int, group: dist.ProcessGroup) -> Tensor:
    """This rank's slice with ``halo`` positions of its neighbours' on each side: ``(..., halo + L + halo, ...)``.

    Slices are contiguous in rank order and of equal length ``L``. A halo wider than a slice reaches past the next
    rank; positions before the first slice or after the last are zeros (the caller masks them as padding).
    """
    rank = dist.get_rank(group)
    length = x.shape[dim]
    edge = min(halo, length)
    first, last = x.narrow(dim, 0, edge), x.narrow(dim, length - edge, edge)
    pieces = all_gather(torch.cat((first, last), dim=dim), dim, group).split(edge, dim=dim)  # first_0, last_0, ...
    before = torch.cat([x.narrow(dim, 0, 0), *pieces[1 : 2 * rank : 2]], dim=dim)  # ranks < r, their last edges
    after = torch.cat([x.narrow(dim, 0, 0), *pieces[2 * rank + 2 :: 2]], dim=dim)  # ranks > r, their first edges
    before = before.narrow(dim, max(before.shape[dim] - halo, 0), min(before.shape[dim], halo))
    after = after.narrow(dim, 0, min(after.shape[dim], halo))
    widths = [0, 0] * (x.dim() - 1 - dim % x.dim())  # F.pad counts from the last dimension
    left = F.pad(before, [*widths, halo - before.shape[dim], 0])
    right = F.pad(after, [*widths, 0, halo - after.shape[dim]])
    return torch.cat((left, x, right), dim=dim)


def _exchange_kv(k: Tensor, v: Tensor, halo: int, group: dist.ProcessGroup) -> tuple[Tensor, Tensor]:
    """The attention ``kv_hook``: keys and values ``(B, H, L, D)`` with their halos, in one collective."""
    kv = exchange_halo(torch.stack((k, v)), halo, dim=3, group=group)  # (2, B, H, halo + L + halo, D)
    return kv[0], kv[1]


class ContextParallelTransformer(Transformer):
    """A :class:`~torch_handle.model.Transformer` whose encoder runs over slices of the source, one per rank of
    ``cp_group``; every other method is the model's. Made by :func:`apply_context_parallel`, never built directly,
    so weights and their names stay the model's."""

    cp_group: dist.ProcessGroup

    def encode(self, src: Tensor, offset: int = 0, halo_padding: Tensor | None = None) -> Tensor:
        """The single-process ``encode(src)`` for a whole source ``src (B, S)`` that every rank of the group holds."""
        assert offset == 0 and halo_padding is None, "context parallelism slices whole sources"
        c, group = self.config, self.cp_group
        size, rank = dist.get_world_size(group), dist.get_rank(group)
        s = src.shape[1]
        unit = size * c.cross_downsample  # pooled slots never straddle two ranks
        total = math.ceil(s / unit) * unit
        src = F.pad(src, (0, total - s), value=c.pad_id)  # (B, total)
        length, h = total // size, c.window
        start = rank * length
        # Padding of the keys this rank attends to, halos included; outside the source counts as padding.
        keys_padding = F.pad(src == c.pad_id, (h, h), value=True)[:, start : start + h + length + h]
        memory = super().encode(src[:, start : start + length], offset=start, halo_padding=keys_padding)
        memory = all_gather(memory, dim=1, group=group)  # (B, total / cross_downsample, C)
        return memory[:, : math.ceil(s / c.cross_downsample)]  # the slots past the source are all padding


def check_context_parallel(config: TransformerConfig, context_parallel: int) -> None:
    """Refuses, in one line, a model that cannot encode across ``context_parallel`` ranks.

    Raises:
        ConfigError: The encoder attends globally: every query would need every rank's keys.
    """
    if context_parallel > 1 and config.encoder_attention != "local":
        raise ConfigError(
            f"--model.context_parallel={context_parallel} splits the sliding-window encoder: set "
            "--model.transformer.encoder_attention local, or --model.context_parallel 1 for full attention"
        )


def apply_context_parallel(model: Transformer, group: dist.ProcessGroup) -> ContextParallelTransformer:
    """Makes ``model`` encode across the ranks of ``group``, in place (as ``fully_shard`` swaps a module's class).

    Raises:
        ConfigError: The encoder attends globally (:func:`check_context_parallel`).
    """
    if isinstance(model, ContextParallelTransformer):
        return model
    if type(model) is not Transformer:
        raise TypeError(f"context parallelism applies to torch_handle.model.Transformer, got {type(model).__name__}")
    check_context_parallel(model.config, dist.get_world_size(group))
    model.__class__ = ContextParallelTransformer
    model.cp_group = group
    hook = functools.partial(_exchange_kv, halo=model.config.window, group=group)
    for layer in model.encoder_layers:
        layer.self_attn.kv_hook = hook
    return model
