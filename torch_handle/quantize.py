"""int8 decoding on a CPU: ``torch_handle.load(..., quantize="int8")``.

Every matrix product of decoding (attention projections, feed-forward blocks, the output projection) becomes a
dynamic int8 linear of ``torch.ao`` (FBGEMM): weights int8 with one scale per output row, activations quantized per
call from their own range, products accumulated in int32. Embeddings, LayerNorms and attention itself stay fp32.

With ``compile=True`` the decoder's linears are also held as ``torchao``'s int8 weights (one scale per row,
activations quantized per row), which Inductor compiles into the step as int8 products fused with the activations'
quantization; eagerly, as in the encoder and after a batch hands over to the eager cache, FBGEMM's one-op linear is
the faster of the two. What each gains: benchmarks/RESULTS.md, section "int8 decoding".
"""

from __future__ import annotations

import copy
import warnings

import torch
from torch import Tensor, nn

from torch_handle.errors import SetupError
from torch_handle.model import Transformer
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.layers import DecoderLayer

SCHEMES = ("int8",)
STEP = ("decoder_layers.", "lm_head", "copy.")  # the linears of Transformer.decode, by name: a compiled step runs them


class Int8Attention(MultiHeadAttention):
    """A :class:`~torch_handle.model.attention.MultiHeadAttention` whose packed projection is int8: the whole of it
    for self-attention, its query rows and its key and value rows apart for cross-attention (one scale per row, so
    either part is quantized exactly as it would be within the whole). Made by :func:`quantize`, never built directly.
    """

    int8: nn.ModuleDict

    def project(self, x: Tensor, part: str) -> Tensor:
        return self.int8[part](x)


class Int8Linear(nn.Module):
    """One linear in int8 twice: ``eager`` FBGEMM's dynamic int8 linear, ``compiled`` a ``torchao`` int8 one that
    Inductor compiles (:class:`~torch_handle.model.CompiledDecode`). Made by :func:`quantize`, never built directly."""

    def __init__(self, eager: nn.Module, compiled: nn.Linear) -> None:
        super().__init__()
        self.eager, self.compiled = eager, compiled

    def forward(self, x: Tensor) -> Tensor:
        return self.compiled(x) if torch.compiler.is_compiling() else self.eager(x)


def quantize(model: Transformer, scheme: str, compile: bool = False) -> None:
    """Makes ``model``'s linears int8 ones in place, for decoding on a CPU; it no longer trains or exports.
    ``compile``: decoding runs a compiled step (``load(..., compile=True)``), so the linears of the decoder's step
    become :class:`Int8Linear`.

    Raises:
        ValueError: ``scheme`` is not one of :data:`SCHEMES`, or the model is not on a CPU.
        SetupError: ``compile`` without ``torchao`` installed.
    """
    if scheme not in SCHEMES:
        raise ValueError(f"quantize={scheme!r} is not a scheme: pass quantize='int8' or leave it None")
    device = next(model.parameters()).device
    if device.type != "cpu":
        raise ValueError(f"quantize={scheme!r} decodes on a CPU, but device={str(device)!r}: pass device='cpu'")
    if compile:
        try:
            import torchao.quantization  # noqa: F401
        except ImportError as err:
            raise SetupError(
                f"quantize={scheme!r} with compile=True needs torchao: pip install 'torch-handle[int8]'"
            ) from err
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
    compiled = {name: _compiled_int8(m) for name, m in model.named_modules() if compile and _in_step(name, m)}
    with warnings.catch_warnings():  # torch deprecates its quantized tensors (pytorch#184982); still the fast path
        warnings.filterwarnings("ignore", message=".*quantize_per_channel.*deprecated", category=UserWarning)
        torch.ao.quantization.quantize_dynamic(
            model, {nn.Linear: torch.ao.quantization.per_channel_dynamic_qconfig}, inplace=True
        )
    for name, linear in compiled.items():
        owner, _, attribute = name.rpartition(".")
        parent = model.get_submodule(owner)
        setattr(parent, attribute, Int8Linear(getattr(parent, attribute), linear))


def _in_step(name: str, module: nn.Module) -> bool:
    return isinstance(module, nn.Linear) and name.startswith(STEP)


def _compiled_int8(linear: nn.Linear) -> nn.Linear:
    """A copy of ``linear`` with ``torchao``'s int8 weight: one scale per row, activations quantized per row."""
    from torchao.quantization import Int8DynamicActivationInt8WeightConfig, quantize_

    linear = copy.deepcopy(linear)
    quantize_(linear, Int8DynamicActivationInt8WeightConfig(set_inductor_config=False))  # leaves Inductor's settings
    return linear


def _linear(weight: Tensor, bias: Tensor | None) -> nn.Linear:
    """An ``nn.Linear`` holding copies of ``weight`` and ``bias`` (T5 has none), for ``quantize_dynamic`` to replace."""
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device=weight.device)
    linear.weight.data.copy_(weight.detach())
    if bias is not None:
        linear.bias.data.copy_(bias.detach())
    return linear
