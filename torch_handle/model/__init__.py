"""The handwritten Transformer: plain PyTorch, no Lightning, no torch.distributed."""

from torch_handle.model.config import ConfigError, TransformerConfig
from torch_handle.model.generation import generate
from torch_handle.model.kernels import BackendUnavailableError
from torch_handle.model.positions import alibi_slopes, sinusoidal_table
from torch_handle.model.steps import CompiledDecode
from torch_handle.model.transformer import DecoderCache, Transformer

__all__ = [
    "BackendUnavailableError",
    "CompiledDecode",
    "ConfigError",
    "DecoderCache",
    "Transformer",
    "TransformerConfig",
    "alibi_slopes",
    "generate",
    "sinusoidal_table",
]
