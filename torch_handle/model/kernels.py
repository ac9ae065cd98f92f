"""Attention kernels behind one signature: ``attend(q, k, v, spec, backend, dropout_p)``.

``naive`` writes the softmax out and is the reference; ``sdpa`` calls
``F.scaled_dot_product_attention``; ``flex`` runs ``flex_attention`` with a block mask (sliding
window) and a score mod (ALiBi), compiled on CUDA and eager on CPU; ``xformers`` calls
``memory_efficient_attention`` on CUDA.

Local attention on ``naive`` and ``sdpa`` runs block by block: queries in chunks of ``w`` positions see
the ``3w`` keys around them, and the ``G`` global keys (Longformer's) beside them, so memory grows as ``S * (w + G)``
and no ``S x S`` tensor is ever built.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from collections.abc import Callable
from contextlib import AbstractContextManager
from functools import cache

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention import SDPBackend, sdpa_kernel

from torch_handle.model.masks import MaskSpec, alibi_bias, allowed, dense_mask

log = logging.getLogger(__name__)

Kernel = Callable[[Tensor, Tensor, Tensor, Tensor | None, float], Tensor]


class BackendUnavailableError(RuntimeError):
    """An attention backend was asked for explicitly but cannot run here."""


def decoding_kernels() -> AbstractContextManager[None]:
    """SDPA's kernels while decoding: all but cuDNN's. On Hopper SDPA picks cuDNN's attention for every shape, and
    cuDNN builds an execution plan for each new one; decoding meets a new key length at every step and new batch
    and source sizes with every batch, so the plans cost more than the kernel saves (see benchmarks/RESULTS.md,
    section "GPU suite", fourth H200 session). Training, at few shapes, keeps cuDNN's kernels."""
    return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])


def _naive(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    scores = (q @ k.transpose(-2, -1)) * (q.shape[-1] ** -0.5)  # (..., Tq, Tk)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else scores + mask
    weights = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    if dropout_p:
        weights = F.dropout(weights, dropout_p)
    return weights @ v


def _sdpa(q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, dropout_p: float) -> Tensor:
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=dropout_p)


def _dense(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, dropout_p: float) -> Tensor:
    plain = spec.key_padding is None and spec.alibi is None and spec.bias is None and spec.window is None
    if kernel is _sdpa and spec.causal and plain:
        if spec.q_offset == 0 and q.shape[-2] == k.shape[-2]:
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        if q.shape[-2] == 1:  # one new token sees the whole cache
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p)
    mask = dense_mask(spec, q.shape[-2], k.shape[-2], q.device, q.dtype)
    if kernel is _sdpa and q.shape[-2] == 1 and q.device.type == "cpu" and torch.compiler.is_compiling():
        # A compiled decoding step on a CPU: written out, Inductor fuses the products and the softmax into one loop,
        # where SDPA's flash kernel for one query spends most of its time setting up (benchmarks/RESULTS.md).
        kernel = _naive
    return kernel(q, k, v, mask, dropout_p)


def _blocked_local(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, dropout_p: float) -> Tensor:
    """Sliding-window self-attention in ``O(Tq * window)`` memory, never building a ``Tq x Tk`` tensor.

    Keys may reach past the queries on both sides: query ``i`` sits at key ``i + spec.q_offset`` (``Tq == Tk`` and
    offset 0 for a whole sequence; context parallelism adds a halo of neighbouring keys on each side). The
    ``spec.global_keys`` first keys join every block's keys, and leave the windows.
    """
    assert spec.window is not None and not spec.causal
    b, h, s, d = q.shape
    tk, offset = k.shape[-2], spec.q_offset
    # A window past the farthest query-key distance changes nothing: blocks of that size are enough.
    w = max(min(spec.window, max(offset + s, tk - offset) - 1), 1)
    num_blocks = math.ceil(s / w)
    span = 3 * w  # keys seen by one block of w queries: block n sees keys n*w - w ... n*w + 2w - 1 (query coordinates)
    padded = num_blocks * w
    qb = F.pad(q, (0, 0, 0, padded - s)).view(b, h, num_blocks, w, d).transpose(1, 2)  # (B, N, H, w, D)
    # Keys in query coordinates start at -offset; the blocks want them from -w to padded + w (negative pads crop).
    before, after = w - offset, padded + w - (tk - offset)

    def blocks(x: Tensor) -> Tensor:  # (B, H, Tk, D) -> (B, N, H, 3w, D)
        x = F.pad(x, (0, 0, before, after)).unfold(2, span, w)  # (B, H, N, D, 3w)
        return x.permute(0, 2, 1, 4, 3)

    kb, vb = blocks(k), blocks(v)
    # Relative positions are the same in every block: query i of a block sits at key index i + w.
    q_pos = torch.arange(w, device=q.device) + w
    k_pos = torch.arange(span, device=q.device)
    near = allowed(spec, q_pos, k_pos)  # (w, 3w)
    is_self = q_pos[:, None] == k_pos[None, :]
    pad = torch.ones(b, tk, dtype=torch.bool, device=q.device) if spec.key_padding is None else ~spec.key_padding
    valid = F.pad(pad, (before, after), value=False).unfold(1, span, w)  # (B, N, 3w)
    # A query always sees itself, so a window that holds only padding never yields an empty softmax.
    mask = near & (valid[:, :, None, None, :] | is_self)  # (B, N, 1, w, 3w)
    if spec.alibi is not None:
        bias = alibi_bias(spec.alibi.to(q.device), q_pos, k_pos).to(q.dtype)  # (H, w, 3w)
        mask = bias.masked_fill(~mask, float("-inf"))  # (B, N, H, w, 3w)
    g = spec.global_keys
    if g:  # every block also sees the global keys, which its window then skips (its own key aside)
        assert spec.alibi is None, "TransformerConfig refuses global tokens with ALiBi"
        first = torch.arange(num_blocks, device=q.device) * w - w + offset  # each block's first key, (N,)
        local = (first[:, None] + k_pos[None, :] >= g)[None, :, None, None, :] | is_self  # (1, N, 1, w, 3w)
        seen = pad[:, :g, None, None, None].transpose(1, 4).expand(b, num_blocks, 1, w, g)  # (B, N, 1, w, G)
        mask = torch.cat([seen, mask & local], dim=-1)  # (B, N, 1, w, G + 3w)
        k_global, v_global = (x[:, :, :g][:, None].expand(b, num_blocks, h, g, d) for x in (k, v))
        kb, vb = torch.cat([k_global, kb], dim=3), torch.cat([v_global, vb], dim=3)  # (B, N, H, G + 3w, D)
        span += g
    flat = b * num_blocks
    out = kernel(
        qb.reshape(flat, h, w, d),
        kb.reshape(flat, h, span, d),
        vb.reshape(flat, h, span, d),
        mask.reshape(flat, -1, w, span),
        dropout_p,
    )
    return out.view(b, num_blocks, h, w, d).transpose(1, 2).reshape(b, h, padded, d)[:, :, :s]


def _explicit(kernel: Kernel) -> Callable[[Tensor, Tensor, Tensor, MaskSpec, float], Tensor]:
    def run(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, dropout_p: float) -> Tensor:
        if spec.window is not None and not spec.causal:
            return _blocked_local(kernel, q, k, v, spec, dropout_p)
        return _dense(kernel, q, k, v, spec, dropout_p)

    return run


@cache
def _compiled_flex() -> Callable[..., Tensor]:
    from torch.nn.attention.flex_attention import flex_attention

    return torch.compile(flex_attention)


@cache
def _compiled_block_mask() -> Callable[..., object]:
    from torch.nn.attention.flex_attention import create_block_mask

    return torch.compile(create_block_mask)


# Eager ``create_block_mask`` evaluates the mask on the whole Tq x Tk grid; compiled, it works block by
# block. Compiling costs seconds per new shape, so only large grids (long inputs) take that path.
_COMPILE_BLOCK_MASK_AT = 2**24
# On CPU flex runs eagerly: Inductor's CPU flex kernel returns wrong numbers at some lengths (24, 40, 104, 120
# in torch 2.13), and eager flex is exact. Eager flex writes out the (B, H, Tq, Tk) scores, so calls over 2**26 of
# them (4096 x 4096, 4 heads) are refused there rather than run out of memory; sdpa's blocked local attention
# handles them in O(S * window).
_CPU_FLEX_MAX_SCORES = 2**26


def _flex(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, dropout_p: float) -> Tensor:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if dropout_p:
        raise BackendUnavailableError(
            "attention_backend='flex' has no attention dropout: set attention_dropout=0 (or dropout=0) or use "
            "attention_backend='sdpa'"
        )
    on_cpu = q.device.type == "cpu"
    if on_cpu and torch.is_grad_enabled() and q.requires_grad:
        raise BackendUnavailableError(
            "attention_backend='flex' has no backward pass on CPU: train with 'sdpa' (or 'auto') there"
        )
    if on_cpu and q.shape[0] * q.shape[1] * q.shape[-2] * k.shape[-2] > _CPU_FLEX_MAX_SCORES:
        raise BackendUnavailableError(
            f"attention_backend='flex' runs eagerly on CPU and would hold {q.shape[0] * q.shape[1]} x {q.shape[-2]} x "
            f"{k.shape[-2]} scores: use attention_backend='sdpa' (or 'auto') for inputs this long there"
        )
    pad, window, causal, offset, slopes = spec.key_padding, spec.window, spec.causal, spec.q_offset, spec.alibi
    bias, g = spec.bias, spec.global_keys

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        q_abs = q_idx + offset
        keep = kv_idx >= 0
        if causal:
            keep = keep & (kv_idx <= q_abs)
        if window is not None:
            near = (kv_idx - q_abs).abs() <= window
            if g:  # global keys: seen from everywhere, and outside every window but their own query's
                near = (near & ((kv_idx >= g) | (kv_idx == q_abs))) | (kv_idx < g)
            keep = keep & near
        if pad is not None:
            visible = ~pad[b, kv_idx]
            # As in the blocked kernel: under a window a query always sees itself.
            keep = keep & (visible | (kv_idx == q_abs) if window is not None else visible)
        return keep

    score_mod = None
    if slopes is not None:
        slopes = slopes.to(q.device, torch.float32)

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score - slopes[h] * (kv_idx - q_idx - offset).abs()

    elif bias is not None:
        bias = bias.to(q.device, torch.float32)

        def score_mod(score: Tensor, b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
            return score + bias[0, h, q_idx, kv_idx]

    batch = None if pad is None else q.shape[0]
    key = ("flex_block_mask", batch, q.shape[-2], k.shape[-2], q.device)
    if key not in spec.built:  # once per forward pass, not once per layer
        long = q.shape[-2] * k.shape[-2] >= _COMPILE_BLOCK_MASK_AT
        make = _compiled_block_mask() if long and not on_cpu else create_block_mask
        spec.built[key] = make(mask_mod, batch, None, q.shape[-2], k.shape[-2], device=q.device)
    block_mask = spec.built[key]
    kernel = flex_attention if on_cpu else _compiled_flex()
    return kernel(q, k, v, score_mod=score_mod, block_mask=block_mask)


def _xformers(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, dropout_p: float) -> Tensor:
    from xformers.ops import LowerTriangularMask, memory_efficient_attention

    if spec.window is not None:
        raise BackendUnavailableError(
            "attention_backend='xformers' does not do local attention here: use 'flex' or 'sdpa'"
        )
    bias = None
    extra = spec.alibi is not None or spec.bias is not None
    if spec.causal and spec.key_padding is None and not extra and spec.q_offset == 0:
        bias = LowerTriangularMask()
    elif spec.causal or spec.key_padding is not None or extra:
        mask = dense_mask(spec, q.shape[-2], k.shape[-2], q.device, q.dtype)
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        if mask is not None:
            # xformers wants an aligned, fully expanded (B, H, Tq, Tk) bias.
            tk = k.shape[-2]
            aligned = torch.empty(*q.shape[:2], q.shape[-2], math.ceil(tk / 8) * 8, dtype=q.dtype, device=q.device)
            bias = aligned[..., :tk].copy_(mask.expand(*q.shape[:2], q.shape[-2], tk))
    out = memory_efficient_attention(
        q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_bias=bias, p=dropout_p
    )  # (B, T, H, D)
    return out.transpose(1, 2)


BACKENDS: dict[str, Callable[[Tensor, Tensor, Tensor, MaskSpec, float], Tensor]] = {
    "naive": _explicit(_naive),
    "sdpa": _explicit(_sdpa),
    "flex": _flex,
    "xformers": _xformers,
}


def xformers_available() -> bool:
    return importlib.util.find_spec("xformers") is not None


def check_backend(name: str, device: torch.device | None = None) -> None:
    """Raise :class:`BackendUnavailableError` saying why and how to fix it when ``name`` cannot run."""
    if name == "xformers":
        if not xformers_available():
            raise BackendUnavailableError(
                "attention_backend='xformers' needs the xformers package: pip install 'torch-handle[gpu]' "
                "(or use attention_backend='auto')"
            )
        if device is not None and device.type != "cuda":
            raise BackendUnavailableError(
                f"attention_backend='xformers' runs on CUDA only, got device {device.type!r}: "
                "use attention_backend='auto'"
            )


def resolve_backend(name: str, device: torch.device, spec: MaskSpec, dropout_p: float, head_dim: int = 64) -> str:
    """Turn ``auto`` into a concrete backend for this call.

    On CUDA, sliding-window attention goes to flex (block-sparse, fused) when its heads have at least 16 dimensions,
    the least Inductor's flex kernel takes; everything else, and everything on CPU (where flex would first have to
    compile a C++ kernel), goes to SDPA.
    """
    if name != "auto":
        check_backend(name, device)
        return name
    if device.type == "cuda" and spec.window is not None and not dropout_p and head_dim >= 16:
        return "flex"
    return "sdpa"


def attend(q: Tensor, k: Tensor, v: Tensor, spec: MaskSpec, backend: str, dropout_p: float = 0.0) -> Tensor:
    """Attention of ``q (B, H, Tq, D)`` over ``k, v (B, H, Tk, D)`` under ``spec``; returns ``(B, H, Tq, D)``."""
    return BACKENDS[resolve_backend(backend, q.device, spec, dropout_p, q.shape[-1])](q, k, v, spec, dropout_p)
