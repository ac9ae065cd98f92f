"""torch-handle: a handwritten Transformer trained with PyTorch Lightning."""

from typing import Any

__version__ = "0.1.0"

__all__ = ["load", "summarize"]


def __getattr__(name: str) -> Any:
    # Lazy, so that ``import torch_handle.model`` stays free of Lightning and the data stack.
    if name == "summarize":
        from torch_handle.hierarchical import summarize

        return summarize
    if name == "load":
        from torch_handle.api import load

        return load
    raise AttributeError(f"module 'torch_handle' has no attribute {name!r}")
