"""int8 decoding on a CPU: ``torch_handle.load(..., quantize="int8")``.

Every matrix product of decoding (attention projections, feed-forward blocks, the output projection) becomes a
dynamic int8 linear of ``torch.ao`` (FBGEMM): weights int8 with one scale per output row, activations quantized per
call from their own range, products accumulated in int32. Embeddings, LayerNorms and attention itself stay fp32.
``torchao``'s int8 dynamic-activation linears were tried too and ran slower here in eager decoding (see
benchmarks/RESULTS.md, section "int8 decoding").
"""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from torch_handle.model import Transformer
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.layers import DecoderLayer

SCHEMES = ("int8",)


class Int8Attention(MultiHeadAttention):
    """A :class:`~torch_handle.model.attention.MultiHeadAttention` whose packed projection is int8: the whole of it
    for self-attention, its query rows and its key and value rows apart for cross-attention (one scale per row, so
    either part is quantized exactly as it would be within the whole). Made by :func:`quantize`, never built directly.
    """

    int8: nn.ModuleDict

    def project(self, x: Tensor, part: str) -> Tensor:
        return self.int8[part](x)


def quantize(model: Transformer, scheme: str, compile: bool = False) -> None:
    """Makes ``model``'s linears dynamic int8 ones in place, for eager decoding on a CPU; it no longer trains or
    exports. ``compile`` says whether decoding would be compiled (``load(..., compile=True)``), which int8 refuses:
    Inductor compiles the int8 step, slowly, and it ran no faster than the eager one.

    Raises:
        ValueError: ``scheme`` is not one of :data:`SCHEMES`, the model is not on a CPU, or ``compile``.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantize={scheme!r} is not a scheme: pass quantize='int8' or leave it None")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantize={scheme!r} decodes on a CPU, but device={str(device)!r}: pass device='cpu'")
    if compile:
        raise ValueError(f"quantize={scheme!r} decodes eagerly, and compiled it is no faster: drop compile=True")
    cross = {id(layer.cross_attn) for layer in model.modules() if isinstance(layer, DecoderLayer)}
    for attention in [m for m in model.modules() if isinstance(m, MultiHeadAttention)]:
        w, b = attention.packed_projection()
        c = w.shape[0] // 3
        parts = {"q": slice(None, c), "kv": slice(c, None)} if id(attention) in cross else {"qkv": slice(None)}
        attention.int8 = nn.ModuleDict(
            {name: _linear(w[rows], None if b is None else b[rows]) for name, rows in parts.items()}
        )
        del attention.in_proj
        attention.__class__ = Int8Attention
    with warnings.catch_warnings():  # torch deprecates its quantized tensors (pytorch#184982); still the fast path
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated", category=UserWarning)
        torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, inplace=True
        )


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` and ``bias`` (T5 has none), for ``quantize_dynamic`` to replace."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    linear.weight.data.copy_(weight.detach())
    if bias is not None:
        linear.bias.data.copy_(bias.detach())
    return linear
