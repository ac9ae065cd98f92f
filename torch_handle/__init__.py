"""torch-handle: a handwritten Transformer trained with PyTorch Lightning."""

__version__ = "0.1.0"
