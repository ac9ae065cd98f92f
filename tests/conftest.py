"""Fixtures and markers shared by every test module."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
"""Stack with ``@pytest.mark.gpu`` on GPU-only tests, as Lightning's ``RunIf(min_cuda_gpus=1)``."""


@pytest.fixture(autouse=True)
def restore_default_dtype_and_seed() -> Iterator[None]:
    """Seed every test the same way and undo any ``torch.set_default_dtype`` it makes."""
    dtype = torch.get_default_dtype()
    torch.manual_seed(0)
    yield
    torch.set_default_dtype(dtype)


@pytest.fixture
def single_thread() -> Iterator[None]:
    """Run a test on one intra-op thread: tiny tensors gain nothing from more, and on a busy machine
    OpenMP's spinning threads slow small kernels down a hundredfold. Use with
    ``pytestmark = pytest.mark.usefixtures("single_thread")``."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def shared_data() -> Path:
    """The data sets shared across checkouts (``<workspace>/shared/data``); skips when absent."""
    path = Path(__file__).resolve().parents[2] / "shared" / "data"
    if not path.is_dir():
        pytest.skip(f"shared data directory {path} is absent")
    return path
