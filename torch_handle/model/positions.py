"""Position information: sinusoidal tables, RoPE rotations, ALiBi slopes and T5's relative position buckets."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def sinusoidal_table(max_len: int, d_model: int, layout: str = "interleaved") -> Tensor:
    """The paper's table: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).

    ``halves`` puts the same sines in the first half of the columns and the cosines in the second (Marian, PEGASUS),
    computed in float64 as they are.

    Returns:
        A float32 tensor of shape ``(max_len, d_model)``.
    """
    if layout == "halves":
        position = torch.arange(max_len, dtype=torch.float64)[:, None]  # (L, 1)
        angles = position / 10000.0 ** (torch.arange(0, d_model, 2, dtype=torch.float64) / d_model)  # (L, ceil(d/2))
        return torch.cat([angles.sin(), angles[:, : d_model // 2].cos()], dim=1).float()
    position = torch.arange(max_len, dtype=torch.float32)[:, None]  # (L, 1)
    div = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float32) * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model)
    table[:, 0::2] = torch.sin(position * div)
    table[:, 1::2] = torch.cos(position * div)[:, : d_model // 2]
    return table


def alibi_slopes(num_heads: int) -> Tensor:
    """ALiBi's per-head slopes: a geometric sequence starting at 2^(-8/n).

    For head counts that are not powers of two the paper takes the slopes of the closest smaller power
    of two and fills up with every other slope of the next power of two.

    Returns:
        A float32 tensor of shape ``(num_heads,)``.
    """

    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-8.0 / n)
        return [start ** (i + 1) for i in range(n)]

    closest = 2 ** math.floor(math.log2(num_heads))
    slopes = power_of_two(closest)
    if closest < num_heads:
        slopes += power_of_two(2 * closest)[0::2][: num_heads - closest]
    return torch.tensor(slopes, dtype=torch.float32)


def rope_inv_freq(head_dim: int, base: float, scaling: str | None, factor: float) -> Tensor:
    """RoPE's inverse frequencies; ``ntk`` scaling raises the base so low frequencies stretch most."""
    if scaling == "ntk":
        base = base * factor ** (head_dim / (head_dim - 2))
    return 1.0 / base ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)


def rope_angles(positions: Tensor, inv_freq: Tensor, scaling: str | None, factor: float) -> tuple[Tensor, Tensor]:
    """cos and sin of shape ``(T, head_dim)`` for integer ``positions`` of shape ``(T,)``.

    ``linear`` scaling (position interpolation) squeezes positions back into the trained range.
    """
    pos = positions.to(inv_freq.dtype)
    if scaling == "linear":
        pos = pos / factor
    angles = torch.outer(pos, inv_freq)  # (T, D/2)
    angles = torch.cat((angles, angles), dim=-1)  # (T, D)
    return angles.cos(), angles.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate ``x`` of shape ``(B, H, T, D)`` by the angles (rotate-half layout, as GPT-NeoX and Llama)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos.to(x.dtype) + rotated * sin.to(x.dtype)


def relative_buckets(relative: Tensor, bidirectional: bool, num_buckets: int, max_distance: int) -> Tensor:
    """T5's bucket of each key-minus-query distance in ``relative``: one bucket per distance below a quarter (encoder,
    ``bidirectional``, which keeps half the buckets for keys after the query) or half (decoder) of ``num_buckets``,
    then buckets growing logarithmically up to ``max_distance``, past which distances share the last."""
    buckets = torch.zeros_like(relative)
    if bidirectional:
        num_buckets //= 2
        buckets += (relative > 0).long() * num_buckets
        distance = relative.abs()
    else:
        distance = (-relative).clamp(min=0)  # a causal query never sees later keys
    exact = num_buckets // 2
    # Distances below ``exact`` make log(0) here; ``where`` takes their exact bucket instead.
    log_ratio = torch.log(distance.float() / exact) / math.log(max_distance / exact)
    far = (exact + (log_ratio * (num_buckets - exact)).long()).clamp(max=num_buckets - 1)
    return buckets + torch.where(distance < exact, distance, far)


def relative_bias(
    table: nn.Embedding, q_len: int, k_len: int, offset: int | Tensor, bidirectional: bool, max_distance: int
) -> Tensor:
    """``(1, H, q_len, k_len)``: the learned bias of each head for the bucketed distance from queries at positions
    ``offset ...`` to keys at ``0 ...``, where ``table`` holds one row per bucket (T5 computes it in the first layer
    and every layer adds it)."""
    q_pos = torch.arange(q_len, device=table.weight.device) + offset
    k_pos = torch.arange(k_len, device=table.weight.device)
    relative = k_pos[None, :] - q_pos[:, None]  # (Tq, Tk)
    buckets = relative_buckets(relative, bidirectional, table.num_embeddings, max_distance)
    return table(buckets).permute(2, 0, 1)[None]  # (1, H, Tq, Tk)
