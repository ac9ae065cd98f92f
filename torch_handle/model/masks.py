"""Which keys each query may see, as boolean masks and additive biases.

Every attention backend builds its masks from one :class:`MaskSpec`, so that the backends agree by
construction and the naive one can serve as the reference for the others.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import torch
from torch import Tensor


@dataclass(frozen=True)
class MaskSpec:
    """What restricts one attention call.

    Args:
        key_padding: ``(B, S)``, True where a key is padding; ``None`` when there is none.
        causal: A query never sees keys at later positions.
        window: Local attention: a query sees keys at most this many positions away.
        alibi: ``(H,)`` ALiBi slopes: the score drops by ``slope * |i - j|``.
        bias: ``(1, H, Tq, Tk)`` added to the scores (T5's relative positions, see
            :func:`torch_handle.model.positions.relative_bias`).
        dense: What :func:`dense_mask` makes of this spec, built once for every layer of a stack (see
            :func:`prebuilt`); the kernels that take a dense mask use it as it is.
        q_offset: Position of the first query (keys start at 0); non-zero while decoding with a cache, a ``(1,)``
            tensor with a static one.
        global_keys: Under a ``window``, the first keys that every query sees wherever it sits (Longformer's global
            tokens); the window then skips them, but for a query's own key.
        built: What a kernel derived from this spec (flex's block mask), kept so that every layer of one
            forward pass reuses it.
    """

    key_padding: Tensor | None = None
    causal: bool = False
    window: int | None = None
    alibi: Tensor | None = None
    bias: Tensor | None = None
    q_offset: int | Tensor = 0
    global_keys: int = 0
    dense: Tensor | None = None
    built: dict[Any, Any] = field(default_factory=dict, compare=False, repr=False)


def allowed(spec: MaskSpec, q_pos: Tensor, k_pos: Tensor) -> Tensor | None:
    """Position-only part of the mask, ``(..., Tq, Tk)``, True where the query may see the key."""
    if not spec.causal and spec.window is None:
        return None  # no position restriction: never build the (Tq, Tk) relative positions for nothing
    rel = k_pos[..., None, :] - q_pos[..., :, None]  # (..., Tq, Tk)
    mask = None
    if spec.causal:
        mask = rel <= 0
    if spec.window is not None:
        local = rel.abs() <= spec.window
        mask = local if mask is None else mask & local
    return mask


def alibi_bias(slopes: Tensor, q_pos: Tensor, k_pos: Tensor) -> Tensor:
    """``(H, ..., Tq, Tk)`` additive bias ``-slope * |i - j|``."""
    distance = (k_pos[..., None, :] - q_pos[..., :, None]).abs().to(slopes.dtype)
    return -slopes.view(-1, *([1] * distance.dim())) * distance


def dense_mask(spec: MaskSpec, q_len: int, k_len: int, device: torch.device, dtype: torch.dtype) -> Tensor | None:
    """The whole mask for a dense ``(B, H, Tq, Tk)`` score matrix.

    Returns ``None`` (no mask), a boolean mask (True = attend), or an additive float mask with ALiBi or a ``bias``.
    Shapes broadcast: ``(B or 1, H or 1, Tq or 1, Tk)``.
    """
    if spec.dense is not None:
        return spec.dense
    q_pos = torch.arange(q_len, device=device) + spec.q_offset
    k_pos = torch.arange(k_len, device=device)
    mask = allowed(spec, q_pos, k_pos)
    mask = None if mask is None else mask[None, None]  # (1, 1, Tq, Tk)
    if spec.key_padding is not None:
        keep = ~spec.key_padding[:, None, None, :]  # (B, 1, 1, Tk)
        mask = keep if mask is None else mask & keep
    if spec.alibi is None and spec.bias is None:
        return mask
    if spec.alibi is None:
        bias = spec.bias.to(dtype)  # type: ignore[union-attr] - not None here
    else:
        bias = alibi_bias(spec.alibi.to(device), q_pos, k_pos)[None].to(dtype)  # (1, H, Tq, Tk)
    return bias if mask is None else bias.masked_fill(~mask, float("-inf"))


def prebuilt(spec: MaskSpec, q_len: int, k_len: int) -> MaskSpec:
    """``spec`` with its :func:`dense_mask` built now, when it holds a ``bias``, in the dtype the queries will have
    (autocast's, else the bias's): T5's bias with the padding and causality folded in is a ``(B, H, Tq, Tk)`` tensor
    that every layer of a stack would otherwise build again, as transformers builds it once per stack."""
    if spec.bias is None:
        return spec
    device = spec.bias.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else spec.bias.dtype
    return replace(spec, dense=dense_mask(spec, q_len, k_len, device, dtype))


class EncoderContext(NamedTuple):
    """Inputs shared by every encoder layer."""

    spec: MaskSpec
    rope: tuple[Tensor, Tensor] | None
    rows: Tensor | None = None  # the source tokens that are not padding, flat indices; None when none is


class DecoderContext(NamedTuple):
    """Inputs shared by every decoder layer."""

    self_spec: MaskSpec
    cross_spec: MaskSpec
    rope: tuple[Tensor, Tensor] | None
    rows: Tensor | None = None  # the decoder inputs that are not padding, flat indices; None when none is


def any_padding(pad: Tensor) -> Tensor | None:
    """``pad``, or ``None`` when nothing is padding: attention without a mask runs the flash kernel on a GPU, where
    a mask (even all True) sends SDPA to a slower one. One host sync per encoder or decoder pass, not per layer."""
    return pad if bool(pad.any()) else None


def target_padding(tgt: Tensor, pad_id: int) -> Tensor:
    """``(B, T)``: True at the padding of decoder inputs ``tgt``. Padding is on the right, after the start token, which
    is never padding even where it is ``pad_id`` (Marian starts with it); causal attention hides the rest."""
    pad = tgt == pad_id
    pad[:, 0] = False
    return pad


def token_rows(pad: Tensor) -> tuple[Tensor | None, Tensor | None]:
    """``(pad, rows)``: the padding mask ``(B, T)`` and the flat indices of the tokens that are not padding, which
    the feed-forward blocks run on alone; both ``None`` when nothing is padding (see :func:`any_padding`)."""
    rows = (~pad).flatten().nonzero().squeeze(1)  # the one host sync
    return (None, None) if rows.numel() == pad.numel() else (pad, rows)
