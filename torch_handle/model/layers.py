"""Encoder and decoder layers: attention and feed-forward blocks with residuals and LayerNorm or RMSNorm."""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from torch_handle.model.attention import KVCache, MultiHeadAttention
from torch_handle.model.config import TransformerConfig
from torch_handle.model.masks import MaskSpec

_ACTIVATIONS = {"relu": F.relu, "gelu": F.gelu, "gelu_tanh": partial(F.gelu, approximate="tanh"), "silu": F.silu}


class RMSNorm(nn.Module):
    """T5's LayerNorm: scales by the root mean square, with neither mean nor bias; the statistics are taken in fp32
    whatever the input's precision, and the result is cast back to it. Not ``torch.nn.RMSNorm``, which computes the
    same in fp32 but, with fp32 weights over bf16 activations (autocast), warns on every call, cannot take its fused
    kernel, and returns bf16 where T5's own norm returns fp32."""

    def __init__(self, d_model: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d_model))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        variance = x.float().pow(2).mean(-1, keepdim=True)
        return self.weight * (x.float() * torch.rsqrt(variance + self.eps)).to(x.dtype)


def make_norm(config: TransformerConfig) -> nn.Module:
    """The normalisation ``config.norm`` names, over ``d_model`` features."""
    if config.norm == "rms":
        return RMSNorm(config.d_model, config.layer_norm_eps)
    return nn.LayerNorm(config.d_model, eps=config.layer_norm_eps)


class FeedForward(nn.Module):
    """Position-wise ``linear2(dropout(act(linear1(x))))``, the layout of ``nn.TransformerEncoderLayer``; gated
    (``gated_ff``), the activation is multiplied by a second projection, ``gate(x)``, as in T5 v1.1."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.linear1 = nn.Linear(config.d_model, config.d_ff, bias=config.bias)
        self.linear2 = nn.Linear(config.d_ff, config.d_model, bias=config.bias)
        self.gate = nn.Linear(config.d_model, config.d_ff, bias=config.bias) if config.gated_ff else None
        self.dropout = nn.Dropout(config.activation_p)
        self.activation = _ACTIVATIONS[config.activation]

    def forward(self, x: Tensor) -> Tensor:
        hidden = self.activation(self.linear1(x))
        return self.linear2(self.dropout(hidden if self.gate is None else hidden * self.gate(x)))


class _Residual(nn.Module):
    """One sub-layer with its residual, dropout and LayerNorm, post-LN or pre-LN.

    With ``rows``, the indices of the tokens that are not padding in ``x`` flattened to ``(B * T, C)``, a
    position-wise sub-layer runs on those tokens only, and a padding position keeps its input: nothing reads it
    (attention masks it as a key, the loss skips it), and a batch padded by a quarter skips a quarter of the work.
    """

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.norm = make_norm(config)
        self.dropout = nn.Dropout(config.dropout)
        self.norm_first = config.norm_first

    def forward(
        self, x: Tensor, sublayer: nn.Module, *args: object, rows: Tensor | None = None, **kwargs: object
    ) -> Tensor:
        if rows is not None:  # under autocast the sub-layer's output may be bf16 where x is fp32, as ``x + out`` allows
            flat = x.flatten(0, 1)
            tokens = flat.index_select(0, rows)
            if self.norm_first:
                out = self.dropout(sublayer(self.norm(tokens), *args, **kwargs))
                return flat.index_add(0, rows, out.to(flat.dtype)).view_as(x)
            out = self.norm(tokens + self.dropout(sublayer(tokens, *args, **kwargs)))
            return flat.index_copy(0, rows, out.to(flat.dtype)).view_as(x)
        if self.norm_first:
            return x + self.dropout(sublayer(self.norm(x), *args, **kwargs))
        return self.norm(x + self.dropout(sublayer(x, *args, **kwargs)))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention.of(config, encoder=True)
        self.ff = FeedForward(config)
        self.attn_block = _Residual(config)
        self.ff_block = _Residual(config)

    def forward(
        self, x: Tensor, spec: MaskSpec, rope: tuple[Tensor, Tensor] | None, rows: Tensor | None = None
    ) -> Tensor:
        """``rows``: the tokens that are not padding, for the feed-forward block (see :class:`_Residual`)."""
        x = self.attn_block(x, self.self_attn, spec, rope=rope)
        return self.ff_block(x, self.ff, rows=rows)


class DecoderLayer(nn.Module):
    """Causal self-attention, cross-attention over the encoder output, then feed-forward."""

    def __init__(self, config: TransformerConfig) -> None:
        super().__init__()
        self.self_attn = MultiHeadAttention.of(config)
        self.cross_attn = MultiHeadAttention.of(config)
        self.ff = FeedForward(config)
        self.self_block = _Residual(config)
        self.cross_block = _Residual(config)
        self.ff_block = _Residual(config)

    def forward(
        self,
        x: Tensor,
        memory: Tensor,
        self_spec: MaskSpec,
        cross_spec: MaskSpec,
        rope: tuple[Tensor, Tensor] | None,
        cache: tuple[KVCache, KVCache] | None = None,
        capacity: int = 0,
        rows: Tensor | None = None,
    ) -> Tensor:
        """``rows``: the tokens that are not padding, for the feed-forward block (see :class:`_Residual`)."""
        self_cache, cross_cache = cache if cache is not None else (None, None)
        x = self.self_block(x, self.self_attn, self_spec, rope=rope, cache=self_cache, capacity=capacity)
        x = self.cross_block(x, self.cross_attn, cross_spec, memory=memory, cache=cross_cache)
        return self.ff_block(x, self.ff, rows=rows)
