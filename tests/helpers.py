"""Launching ``python cli.py`` runs for multi-process tests, and test-only callbacks they load by name."""

from __future__ import annotations

import atexit
import csv
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from typing_extensions import override

from torch_handle.export import read_checkpoint

ROOT = Path(__file__).resolve().parents[1]
_FIRST_FAILURE = re.compile(r"failed \(exitcode: (-?\d+)\) local_rank")  # torch.distributed.run's line
RUN_TIMEOUT = 180  # seconds for one two-process run; a hang fails the test instead of the suite

TINY_MODEL = [
    "--model.transformer.d_model", "32",
    "--model.transformer.num_heads", "2",
    "--model.transformer.num_encoder_layers", "1",
    "--model.transformer.num_decoder_layers", "1",
    "--model.transformer.d_ff", "64",
]  # fmt: skip
"""The smallest model sizes every multi-process test uses, whatever its data."""

TINY = [
    *TINY_MODEL,
    "--model.transformer.dropout", "0",
    "--model.transformer.max_len", "64",
    "--model.max_new_tokens", "16",
    "--model.lr", "0.01",
    "--model.warmup_steps", "2",
    "--data.init_args.demo_size", "400",
    "--data.init_args.bpe_vocab_size", "300",
    "--data.init_args.max_tokens", "512",
    "--trainer.limit_val_batches", "0",
    "--trainer.enable_progress_bar", "false",
    "--trainer.enable_model_summary", "false",
    "--trainer.logger", "false",
    "--trainer.callbacks+=tests.helpers.LossRecorder",
]  # fmt: skip
"""A model and data small enough that process start-up, not compute, dominates a run."""


_folders: dict[str, Path] = {}


def pretrained_folder(family: str) -> Path:
    """A tiny Hugging Face model folder of ``family``, ``bart``, ``led`` (windows of 4 positions, a global first token)
    or ``t5`` (v1.1: relative positions, RMSNorm, a gated feed-forward, an untied output layer), written by
    transformers with its own initialisation and no dropout, whose
    tokenizer holds every word of the demo corpus: the ``--model.init_from`` of the demo runs that compare processes.
    Written once per process into a temporary folder removed at exit."""
    if family not in _folders:
        import transformers

        from tests.test_pretrained import bart_tokenizer
        from tests.test_pretrained_t5 import t5_tokenizer, untie_head
        from torch_handle.data.demo import demo_corpus

        words = sorted({w for pair in demo_corpus("train", 2000, seed=0) for text in pair for w in text.split()})
        folder = Path(tempfile.mkdtemp(prefix=f"torch-handle-{family}-"))
        atexit.register(shutil.rmtree, folder, True)
        torch.manual_seed(0)
        if family == "bart":
            tok = bart_tokenizer(words)
            size = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2}
            size |= {"decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64}
            config = transformers.BartConfig(
                vocab_size=len(tok), max_position_embeddings=64, dropout=0.0, attention_dropout=0.0, **size
            )
            model = transformers.BartForConditionalGeneration(config)
        elif family == "led":
            tok = bart_tokenizer(words)
            size = {"d_model": 32, "encoder_layers": 1, "decoder_layers": 1, "encoder_attention_heads": 2}
            size |= {"decoder_attention_heads": 2, "encoder_ffn_dim": 64, "decoder_ffn_dim": 64, "attention_window": 4}
            config = transformers.LEDConfig(
                vocab_size=len(tok), max_encoder_position_embeddings=64, max_decoder_position_embeddings=64,
                dropout=0.0, attention_dropout=0.0, **size,
            )  # fmt: skip
            model = transformers.LEDForConditionalGeneration(config)
        else:
            tok = t5_tokenizer(words)
            size = {"d_model": 32, "d_kv": 16, "num_heads": 2, "d_ff": 64, "num_layers": 1}
            size |= {"relative_attention_num_buckets": 8, "relative_attention_max_distance": 12, "n_positions": 64}
            config = transformers.T5Config(
                vocab_size=len(tok), feed_forward_proj="gated-gelu", dropout_rate=0.0, decoder_start_token_id=0,
                **size,
            )  # fmt: skip
            model = transformers.T5ForConditionalGeneration(config)
        model.save_pretrained(folder)
        tok.save_pretrained(folder)
        if family == "t5":
            untie_head(folder, torch.randn(len(tok), size["d_model"]) * 0.05)
        _folders[family] = folder
    return _folders[family]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


PROCESS_MARKS = {"slow", "distributed"}
"""A test that starts a process carries one of these, so that the default tier (``python -m pytest``) leaves it out."""
running_marks: set[str] | None = None
"""The marks of the test being set up or run (``tests/conftest.py`` sets them); None outside pytest."""


def env(**extra: str) -> dict[str, str]:
    """The environment of a run: one thread per process (two processes share two cores), a free port, and Python's
    fault handler, so a process that crashes inside torch prints where. Every process the tests start takes it,
    so here a test that starts one unmarked fails (see :data:`PROCESS_MARKS`)."""
    if running_marks is not None and not running_marks & PROCESS_MARKS:
        raise AssertionError("this test starts a process: mark it @pytest.mark.slow (and distributed for several)")
    return {**os.environ, "OMP_NUM_THREADS": "1", "MASTER_PORT": str(free_port()), "PYTHONFAULTHANDLER": "1", **extra}


def fit_args(root: Path, *extra: str) -> list[str]:
    """``cli.py fit`` arguments for a tiny run writing under ``root``."""
    return [
        "fit", *TINY,
        "--trainer.default_root_dir", str(root),
        *extra,
    ]  # fmt: skip


def cli(
    args: list[str], timeout: float = RUN_TIMEOUT, script: str = "cli.py", **extra_env: str
) -> subprocess.CompletedProcess:
    """Runs ``python cli.py ARGS`` (or another ``script``) from the repository root; output is captured for the
    assertion message. A run past ``timeout`` is killed with every process it started (the other ranks, a compiler),
    so none of them goes on holding a lock or the cores that the next tests need."""
    command = [sys.executable, script, *args]
    with subprocess.Popen(
        command, cwd=ROOT, env=env(**extra_env), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    ) as process:  # fmt: skip
        try:
            stdout, stderr = process.communicate(timeout=timeout)
        except subprocess.TimeoutExpired as err:
            os.killpg(process.pid, signal.SIGKILL)
            stdout, stderr = process.communicate()
            raise subprocess.TimeoutExpired(command, timeout, stdout, stderr) from err
        except BaseException:  # the test's own timeout, or ^C
            os.killpg(process.pid, signal.SIGKILL)
            raise
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def torchrun_results(worker: str, processes: int, out: Path, *args: str) -> list[dict[str, Any]]:
    """The JSON lines that ``tests/WORKER OUT ARGS``, run on ``processes`` gloo processes by torch.distributed.run,
    wrote to ``out``; a hang fails after :data:`RUN_TIMEOUT`. The checkout is on the path: workers import
    ``tests.helpers``.

    A run whose first failed process died of SIGSEGV runs once more, with a warning that holds its output: a rank of
    the 4-process pipeline mesh crashed that way once on CI, inside torch's gloo collectives, in code that passes
    every other run. Python's fault handler prints where. A second crash, or any other failure, fails the test with
    the run's output."""
    run_env = env(PYTHONPATH=str(ROOT))
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(processes)]
    for attempt in (1, 2):
        run = subprocess.run(
            [*command, "--master-port", str(free_port()), str(ROOT / "tests" / worker), str(out), *args],
            env=run_env,
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=RUN_TIMEOUT,
        )
        crash = _FIRST_FAILURE.search(run.stderr)
        if run.returncode == 0 or attempt == 2 or crash is None or int(crash[1]) != -signal.SIGSEGV:
            break
        warnings.warn(
            f"{worker}: a process died of SIGSEGV (gloo, inside torch); running it once more\n{run.stderr[-4000:]}",
            stacklevel=2,
        )
    check(run)
    return [json.loads(line) for line in out.read_text().splitlines()]


def check(run: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    """Fails with the run's output tail when it exited non-zero."""
    assert run.returncode == 0, f"exit {run.returncode}\n{run.stdout[-3000:]}\n{run.stderr[-6000:]}"
    return run


def full(t: torch.Tensor) -> torch.Tensor:
    """A tensor whole, gathered if it is a DTensor."""
    return t.full_tensor() if isinstance(t, DTensor) else t


def comparable(name: str, weight: torch.Tensor) -> torch.Tensor:
    """The weight without the key third of a packed bias (LED's global projection's too): softmax ignores a constant
    added to every score, so that bias's true gradient is zero and AdamW turns its rounding noise (1e-9, differently
    summed) into full steps."""
    if name.endswith(("in_proj.bias", "global_proj.bias")):
        q, _, v = weight.chunk(3)
        return torch.cat((q, v))
    return weight


def checkpoint_weights(root: Path, name: str = "last.ckpt") -> dict[str, torch.Tensor]:
    """The whole model's weights in ``root/checkpoints/NAME``, whichever strategy wrote it."""
    return read_checkpoint(root / "checkpoints" / name)[0]


def assert_weights_close(want: dict[str, torch.Tensor], got: dict[str, torch.Tensor], label: str = "") -> None:
    """The same names, every tensor within 1e-5 of ``want``'s norm (see :func:`comparable`): one process's fp32
    training against a parallel one's, whose sums run in another order."""
    assert got.keys() == want.keys(), label
    for name in want:
        w, g = comparable(name, want[name]), comparable(name, got[name])
        assert torch.linalg.norm(g - w) <= 1e-5 * torch.linalg.norm(w), f"{label} {name}"


def csv_logger(root: Path) -> list[str]:
    """``cli.py`` arguments that log every step's metrics, throughput's over windows of 2 steps, to CSV in ``root``."""
    return [
        "--trainer.logger", "lightning.pytorch.loggers.CSVLogger",
        "--trainer.logger.save_dir", str(root / "csv"),
        "--trainer.log_every_n_steps", "1",
        "--throughput.window_size", "2",
    ]  # fmt: skip


def logged(root: Path, name: str) -> list[float]:
    """The values of metric ``name`` that :func:`csv_logger` wrote, in order."""
    (metrics,) = (root / "csv").rglob("metrics.csv")
    with metrics.open() as f:
        return [float(row[name]) for row in csv.DictReader(f) if row.get(name)]


def train_losses(root: Path) -> dict[int, float]:
    """Global batch index -> training loss, over every rank, as :class:`LossRecorder` wrote them in ``root``."""
    losses: dict[int, float] = {}
    for path in root.glob("losses.rank*.txt"):
        for line in path.read_text().splitlines():
            index, loss = line.split()
            losses[int(index)] = float(loss)
    return dict(sorted(losses.items()))


def wait_for(path: Path, process: subprocess.Popen, timeout: float) -> None:
    """Polls until ``path`` exists; fails if ``process`` ends first or time runs out."""
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None, f"run ended (exit {process.returncode}) before {path} appeared"
        assert time.monotonic() < deadline, f"{path} did not appear within {timeout} s"
        time.sleep(0.1)


class LossRecorder(Callback):
    """Appends ``GLOBAL_BATCH LOSS`` per training batch to ``{default_root_dir}/losses.rank{R}.txt``.

    Batch ``j`` of rank ``r`` among ``w`` is global batch ``j * w + r``, the index the batch sampler dealt it
    from, so runs with different world sizes line up batch for batch. Lightning logs only rank 0's loss,
    and with gradient accumulation only the last micro-batch's, hence this record.
    """

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        # Lightning hands back the loss divided by the accumulation factor it backpropagated.
        loss = outputs["loss"].item() * trainer.accumulate_grad_batches
        path = Path(trainer.default_root_dir) / f"losses.rank{trainer.global_rank}.txt"
        with path.open("a") as f:
            f.write(f"{batch_idx * trainer.world_size + trainer.global_rank} {loss!r}\n")


class FailOnRank(Callback):
    """Raises in one rank at one training step, to test that a failing process ends the whole job.

    Args:
        rank: The global rank that fails.
        step: The global step at which it fails.
    """

    def __init__(self, rank: int = 1, step: int = 1) -> None:
        self.rank = rank
        self.step = step

    @override
    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_rank == self.rank and trainer.global_step == self.step:
            raise RuntimeError(f"injected failure on rank {self.rank} at step {self.step}")


class SlowDown(Callback):
    """Sleeps after each training step from ``after_step`` on, so a test can kill a run mid-epoch.

    Args:
        after_step: First global step that sleeps.
        seconds: Sleep per step.
    """

    def __init__(self, after_step: int = 2, seconds: float = 1.0) -> None:
        self.after_step = after_step
        self.seconds = seconds

    @override
    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step >= self.after_step:
            time.sleep(self.seconds)


STEPS = 6  # optimizer steps per run; checkpoints every 2, all kept, so resume tests can start from step 2
STRATEGY_CONFIGS = {
    "ddp": "configs/ddp.yaml",
    "zero1": "configs/zero1.yaml",
    "zero2": "configs/zero2.yaml",
    "zero3": "configs/zero3.yaml",
    "zero3_offload": "configs/zero3_offload.yaml",
    "fsdp": "configs/fsdp.yaml",
}
SINGLE = "single"
_runs: dict[str, Path] = {}
SHARES_REFERENCE_RUNS = pytest.mark.xdist_group("reference-runs")
"""The tests that read :func:`reference_run`'s runs go to one pytest-xdist worker, which trains each run once: the
runs are cached per process, and another worker would train them again."""


def strategy_args(name: str) -> list[str]:
    """Arguments selecting a strategy on CPU. The single-process reference accumulates two batches per
    step: the batch sampler deals batch ``2k`` to rank 0 and ``2k + 1`` to rank 1, exactly the two batches
    that one process accumulates for step ``k``, and both average the two per-token-mean gradients."""
    if name == SINGLE:
        return ["--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.accumulate_grad_batches", "2"]
    return ["--config", STRATEGY_CONFIGS[name], "--trainer.accelerator", "cpu"]


def pretrained_args() -> list[str]:
    """``fit`` options that start the demo from the tiny T5 folder (:func:`pretrained_folder`), as reference runs do."""
    # A word per token makes fewer tokens than TINY's BPE: smaller batches keep the STEPS steps in one epoch. T5's
    # relative positions have no max_len to cut sources to: TINY's is the data's.
    data = ["--data.init_args.max_tokens", "256", "--data.init_args.max_source_tokens", "64"]
    return ["--model.init_from", str(pretrained_folder("t5")), *data]


def reference_args(name: str, root: Path, *extra: str, pretrained: bool = True) -> list[str]:
    """The full ``cli.py fit`` command of a strategy's reference run (used again, with extras, to resume): with
    ``pretrained``, started from a tiny T5 folder (:func:`pretrained_folder`), so that every strategy's parity with
    one process holds for an imported model and T5's relative positions, RMSNorm and gated feed-forward."""
    init_from = pretrained_args() if pretrained else []
    return [
        "fit",
        *strategy_args(name),
        *fit_args(root, "--trainer.max_steps", str(STEPS), "--checkpoint.every_n_train_steps", "2")[1:],
        "--checkpoint.save_top_k", "-1",
        *init_from,
        *extra,
    ]  # fmt: skip


def reference_run(name: str, base: Path) -> Path:
    """The run folder of strategy ``name``'s uninterrupted reference run, trained once per test session.

    Args:
        name: ``single`` or a key of :data:`STRATEGY_CONFIGS`.
        base: A session-wide temporary folder (``tmp_path_factory.getbasetemp()``).
    """
    if name not in _runs:
        root = base / f"reference-{name}"
        if not (root / "checkpoints" / "last.ckpt").exists():  # not trained yet in this session
            if name == SINGLE:  # one process of the default strategy: no launch
                from tests.one_process import in_this_process  # which imports this module

                in_this_process(reference_args(name, root), root)
            else:
                check(cli(reference_args(name, root)))
        _runs[name] = root
    return _runs[name]
