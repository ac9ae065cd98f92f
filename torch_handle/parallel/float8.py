"""FP8 training (``--model.fp8``): the layers' matrix products in float8 on GPUs with FP8 tensor cores.

torchao's :func:`~torchao.float8.convert_to_float8_training` swaps chosen ``nn.Linear`` modules for its
``Float8Linear``: each product casts its input, its weight and its output gradient to float8 with dynamic per-tensor
scales, while the weights (and so checkpoints and exports) keep their own precision and names. Chosen here: the
self-attention projections, the attention outputs and the feed-forward blocks of every layer. Cross-attention's query
and key/value products (slices of its packed projection, computed from different inputs) and the output projection
stay in the run's precision, as torchtitan keeps its output layer. Self-attention's packed projection runs through its
module (:class:`Float8Attention`), so that it is a float8 product too.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from torch_handle.errors import SetupError
from torch_handle.model import Transformer
from torch_handle.model.attention import MultiHeadAttention

CONVERTED = frozenset({"self_attn.in_proj", "self_attn.out_proj", "cross_attn.out_proj", "linear1", "linear2", "gate"})
"""The endings of the qualified names of the linear layers made float8 (in every encoder and decoder layer)."""
CAPABILITY = (8, 9)
"""The first CUDA compute capability with FP8 tensor cores (Ada; Hopper is 9.0)."""


class Float8Attention(MultiHeadAttention):
    """A :class:`~torch_handle.model.attention.MultiHeadAttention` whose self-attention projection calls its module,
    torchao's ``Float8Linear``, instead of multiplying by its weight: the same product, in float8."""

    def project(self, x: Tensor, part: str) -> Tensor:
        return self.in_proj(x) if part == "qkv" else super().project(x, part)


def check_float8(device: torch.device, refused: str | None = None) -> None:
    """Raises :class:`SetupError` in one line unless this run can train in float8: ``refused`` names a strategy or
    plan it cannot combine with; else the device needs FP8 tensor cores and torchao must be installed."""
    if refused is not None:
        raise SetupError(
            f"--model.fp8 does not combine with {refused}: torchao's float8 linears need tensor-parallel styles and "
            "weight handling of their own; train in float8 with ddp, fsdp or fsdp2 (ModelParallelStrategy without "
            "tensor or pipeline parallelism), or leave --model.fp8 off"
        )
    found = None
    if device.type != "cuda":
        found = f"a {device.type.upper()}"
    elif (capability := torch.cuda.get_device_capability(device)) < CAPABILITY:
        found = f"compute capability {capability[0]}.{capability[1]}"
    if found is not None:
        raise SetupError(
            "--model.fp8 needs an NVIDIA GPU with FP8 tensor cores (compute capability 8.9 or newer: Ada, Hopper, "
            f"Blackwell), this run has {found}: leave --model.fp8 off"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError as err:
        raise SetupError("--model.fp8 needs torchao: pip install 'torch-handle[fp8]'") from err


def converted(module: nn.Module, name: str) -> bool:
    """Whether :func:`apply_float8` makes the linear layer ``name`` float8: one of :data:`CONVERTED` whose sizes
    float8 products take (multiples of 16)."""
    return (
        isinstance(module, nn.Linear)
        and any(name == end or name.endswith(f".{end}") for end in CONVERTED)
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def apply_float8(model: Transformer) -> None:
    """Makes the linear layers :func:`converted` chooses torchao's float8 linears, in place, and lets self-attention
    call its projection's module (:class:`Float8Attention`)."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    # Padded products: the training path multiplies the batch's non-padding tokens only, any number of them, and a
    # float8 product's inner dimension (the tokens, for the weight's gradient) must be a multiple of 16.
    config = Float8LinearConfig(pad_inner_dim=True)
    convert_to_float8_training(model, config=config, module_filter_fn=converted)
    for layer in (*model.encoder_layers, *model.decoder_layers):
        if type(layer.self_attn) is MultiHeadAttention:
            layer.self_attn.__class__ = Float8Attention
