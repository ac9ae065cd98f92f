"""Callbacks: FLOPs counting, throughput/MFU, activation checkpointing and profiling in real Trainer runs."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from unittest.mock import Mock

import lightning as L
import pytest
import torch
from conftest import tiny_config
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.trainer.states import TrainerFn
from torch.utils.flop_counter import FlopCounterMode

from torch_handle.callbacks.activation_checkpointing import ActivationCheckpointing
from torch_handle.callbacks.checkpointing import RNG_KEY, Checkpoint
from torch_handle.callbacks.profiling import Profiling
from torch_handle.callbacks.throughput import Throughput
from torch_handle.data import TranslationDataModule
from torch_handle.flops import forward_flops, training_flops
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.module import Seq2SeqModule

pytestmark = pytest.mark.usefixtures("single_thread")

TINY = tiny_config(num_heads=4, num_encoder_layers=2, num_decoder_layers=2, max_len=64)


T5 = {"position": "relative", "norm": "rms", "bias": False, "gated_ff": True, "attention_head_dim": 16}


@pytest.mark.parametrize(("cross_downsample", "options"), [(1, {}), (3, {}), (1, T5)], ids=["plain", "pooled", "t5"])
def test_forward_flops_match_torch_flop_counter(cross_downsample: int, options: dict[str, Any]) -> None:
    config = TransformerConfig(
        **options,
        src_vocab_size=100,
        tgt_vocab_size=90,
        d_model=32,
        num_heads=4,
        num_encoder_layers=2,
        num_decoder_layers=3,
        d_ff=48,
        cross_downsample=cross_downsample,
        attention_backend="naive",
    )
    model = Transformer(config)
    src, tgt = torch.randint(3, 90, (2, 13)), torch.randint(3, 90, (2, 7))
    with FlopCounterMode(display=False) as counter:
        model(src, tgt)
    assert forward_flops(config, [13, 13], [7, 7]) == counter.get_total_flops()
    assert training_flops(config, [13], [7]) == 3 * forward_flops(config, [13], [7])


def test_local_attention_flops_grow_linearly() -> None:
    local = TransformerConfig(encoder_attention="local", window=64, num_decoder_layers=0)
    full = TransformerConfig(encoder_attention="full", num_decoder_layers=0)
    # Doubling a long source doubles local-attention cost (plus the LM head, which does not depend on S).
    base, double = forward_flops(local, [8192], [1]), forward_flops(local, [16384], [1])
    head = forward_flops(local, [0], [1])
    assert (double - head) == pytest.approx(2 * (base - head), rel=1e-9)
    s, keys, d = 16384, 2 * 64 + 1, local.d_model
    attention_gap = local.num_encoder_layers * 2 * 2 * s * (s - keys) * d
    assert forward_flops(full, [s], [1]) - forward_flops(local, [s], [1]) == attention_gap


def _fit(tmp_path: Path, callbacks: list[L.Callback], steps: int) -> Path:
    data = TranslationDataModule(bpe_vocab_size=300, demo_size=600, max_tokens=512)
    module = Seq2SeqModule(transformer=TINY, vocab_size=data.vocab_size, warmup_steps=2, max_new_tokens=32)
    logger = CSVLogger(tmp_path)
    trainer = L.Trainer(
        accelerator="cpu",
        max_steps=steps,
        limit_val_batches=0,
        logger=logger,
        callbacks=callbacks,
        log_every_n_steps=1,
        enable_progress_bar=False,
        enable_checkpointing=False,
        enable_model_summary=False,
    )
    trainer.fit(module, datamodule=data)
    return Path(logger.log_dir) / "metrics.csv"


def _column(metrics: Path, name: str) -> list[float]:
    import csv

    with metrics.open() as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def test_throughput_logs_tokens_flops_and_mfu(tmp_path: Path) -> None:
    metrics = _fit(tmp_path, [Throughput(peak_flops=1e12, window_size=2)], steps=4)
    flops = _column(metrics, "train/device/flops_per_sec")
    mfu = _column(metrics, "train/device/mfu")
    tokens = _column(metrics, "train/device/items_per_sec")
    assert flops and all(f > 0 for f in flops)
    assert mfu == pytest.approx([f / 1e12 for f in flops])
    assert tokens and all(t > 0 for t in tokens)


def test_activation_checkpointing_logs_saved_memory(tmp_path: Path) -> None:
    callback = ActivationCheckpointing()
    metrics = _fit(tmp_path, [callback], steps=3)
    saved, kept = (
        _column(metrics, "activation_checkpointing/saved_mb"),
        _column(metrics, "activation_checkpointing/kept_mb"),
    )
    assert saved and saved[0] > 0  # fewer bytes kept for backward with checkpointing on
    assert kept[0] > 0
    assert callback._phase == "done"


def test_profiler_records_only_the_active_steps(tmp_path: Path) -> None:
    _fit(tmp_path, [Profiling(dirpath=str(tmp_path / "prof"), wait=1, warmup=1, active=2)], steps=8)
    traces = list((tmp_path / "prof").glob("*.pt.trace.json"))
    assert len(traces) == 1
    assert traces[0].stat().st_size < 50 * 2**20
    events = json.loads(traces[0].read_text())["traceEvents"]
    steps = {e["name"] for e in events if e.get("name", "").startswith("ProfilerStep#")}
    assert steps == {"ProfilerStep#2", "ProfilerStep#3"}


@pytest.mark.parametrize("fn", ["fit", "test"])
def test_random_states_of_another_process_count_warn_only_when_training(
    fn: str, tmp_path: Path, recwarn: pytest.WarningsRecorder
) -> None:
    """A checkpoint of one process read by two: ``fit`` warns that dropout will not repeat the original run's;
    ``test`` (no dropout) says nothing."""
    callback = Checkpoint(dirpath=tmp_path)
    stage = TrainerFn.FITTING if fn == "fit" else TrainerFn.TESTING
    trainer = SimpleNamespace(ckpt_path=None, world_size=2, global_rank=0, state=SimpleNamespace(fn=stage))
    callback.on_load_checkpoint(trainer, None, {RNG_KEY: [{}]})  # type: ignore[arg-type]
    said = [str(w.message) for w in recwarn if "random states" in str(w.message)]
    assert said == (
        ["the checkpoint holds the random states of 1 processes, this run has 2: training continues, but dropout will "
         "not repeat the original run's"] if fn == "fit" else []
    )  # fmt: skip


def test_from_python_a_stop_names_fit_and_a_second_ctrl_c_spares_the_kernel(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """In a notebook the line names ``fit``'s ``ckpt_path``, not the command's option, and the second Ctrl-C raises
    ``KeyboardInterrupt`` where a command's takes the kernel's default action (which would end a notebook's kernel)."""
    callback, previous = Checkpoint(dirpath=tmp_path), signal.getsignal(signal.SIGINT)
    try:
        callback._on_stop_signal(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
        callback.in_a_command = True
        callback._on_stop_signal(signal.SIGINT, None)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGINT, previous)
    last = str(tmp_path / "last.ckpt")
    trainer = SimpleNamespace(global_step=8, is_global_zero=True, _logger_connector=Mock())
    callback._last_global_step_saved, callback.last_model_path = 8, last  # saved at this step already
    for in_a_command, resume in ((False, f'call fit again with ckpt_path="{last}"'), (True, "rerun the same command")):
        callback.in_a_command = in_a_command
        with pytest.raises(SystemExit) as stop:
            callback._save_and_exit_on_signal(trainer, signal.SIGINT)
        assert stop.value.code == 130
        assert capsys.readouterr().err.startswith(f"stopped by SIGINT at step 8: saved {last}; {resume}")
