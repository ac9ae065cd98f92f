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


TINY_MODEL_ARGS = [
    "--model.transformer.d_model=32",
    "--model.transformer.num_heads=2",
    "--model.transformer.num_encoder_layers=1",
    "--model.transformer.num_decoder_layers=1",
    "--model.transformer.d_ff=64",
    "--model.transformer.dropout=0.0",
]
"""Command-line overrides that make any config's model tiny, for end-to-end runs in seconds."""


@pytest.fixture(scope="session")
def tiny_demo_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A run folder with ``checkpoints/last.ckpt`` (and its tokenizer) of a tiny model trained for a few steps
    on the built-in demo through ``python cli.py fit``; shared by the CLI, module and notebook tests."""
    from torch_handle.cli import main

    root = tmp_path_factory.mktemp("tiny_demo_run")
    main(
        [
            "fit",
            f"--config={Path(__file__).resolve().parents[1] / 'configs' / 'demo.yaml'}",
            f"--trainer.default_root_dir={root}",
            "--trainer.max_steps=8",
            "--trainer.limit_val_batches=1",
            "--trainer.enable_progress_bar=false",
            "--data.init_args.demo_size=600",
            "--data.init_args.bpe_vocab_size=300",
            "--model.num_beams=2",
            "--model.max_new_tokens=8",
            "--model.generate_every_n_val_epochs=0",
            *TINY_MODEL_ARGS,
        ]
    )
    return root
