"""Lightning's ModelCheckpoint, made safe to kill: atomic files, exact resume, saves on schedule, on SIGTERM and on
Ctrl-C."""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any

import lightning as L
import torch
from fsspec.implementations.local import LocalFileSystem
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.fabric.utilities.cloud_io import get_filesystem
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_only
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from torch_handle.atomic import atomic_path, atomic_write_text, remove_leftovers
from torch_handle.callbacks.rng import get_rng_states, set_rng_states
from torch_handle.checkpoints import CONFIG_FILE, TOKENIZER_FILE, CheckpointError, check_checkpoint

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)  # preemption, and a user's Ctrl-C
RNG_KEY = "rng_states"  # one entry per global rank


class AtomicCheckpointIO(TorchCheckpointIO):
    """Single-file checkpoints written beside their target, fsynced, then renamed into place; read only once
    :func:`~torch_handle.checkpoints.check_checkpoint` has found nothing in them that could run code.

    Lightning's ``_atomic_save`` stages the file in ``$TMPDIR`` and moves it; when the checkpoint folder is on
    another file system (the usual cluster layout) the move is a copy over the old file, so a kill or a full
    disk during it leaves a truncated checkpoint under a valid name, and a killed save leaks a temp file in
    ``$TMPDIR``. Remote paths (``s3://``, ...) keep Lightning's way.
    """

    @override
    def save_checkpoint(self, checkpoint: dict[str, Any], path: _PATH, storage_options: Any | None = None) -> None:
        if storage_options is not None or not isinstance(get_filesystem(path), LocalFileSystem):
            super().save_checkpoint(checkpoint, path, storage_options)
            return
        buffer = io.BytesIO()  # written from Python, so a full disk raises OSError, not torch's iostream error
        torch.save(checkpoint, buffer)
        try:
            with atomic_path(path) as tmp:
                tmp.write_bytes(buffer.getbuffer())
        except OSError as err:
            raise CheckpointError(
                f"could not write checkpoint {path} ({err.strerror or err}); the previous checkpoints are kept: "
                "free space or fix the folder, then rerun the same command with --ckpt_path last"
            ) from err

    @override
    def load_checkpoint(self, path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        if isinstance(get_filesystem(path), LocalFileSystem):
            check_checkpoint(path)  # a trainer's ckpt_path from Python, which no command has checked
        return super().load_checkpoint(path, *args, **kwargs)


def use_checked_io(trainer: L.Trainer) -> None:
    """Makes :class:`AtomicCheckpointIO` the trainer's way to write and read single-file checkpoints, unless the
    strategy has its own (DeepSpeed's, a user's)."""
    if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
        trainer.strategy.checkpoint_io = AtomicCheckpointIO()


class Checkpoint(ModelCheckpoint):
    """``ModelCheckpoint`` that a job can be killed under at any moment and resumed exactly from.

    - Keeps ``tokenizer.json`` and ``transformer.json`` in its folder, so test, predict, resume and export
      decode exactly as training encoded, with no other file to carry along.
    - Single-file checkpoints are written through :class:`AtomicCheckpointIO`; files left by a killed save are
      removed when the next run starts.
    - ``every_n_train_steps`` writes ``last.ckpt`` on schedule even before ``monitor`` has a value (Lightning
      would wait for the first validation); the top-k save still waits for it.
    - On SIGTERM (preemption) or SIGINT (Ctrl-C) every process saves ``last.ckpt`` at the end of the same step,
      then the job exits with the status a shell gives that signal (143, 130); rerunning with ``--ckpt_path last``
      continues from there. A second Ctrl-C ends the job at once, saving nothing more. From Python (a notebook),
      ``fit`` raises ``SystemExit`` with that status, and a second Ctrl-C raises ``KeyboardInterrupt``.
    - Each process's random state (dropout) is saved and restored, so a resumed run draws what the
      uninterrupted one would have.
    - ``last.ckpt`` is also written when training ends between two scheduled saves, so it is always the end
      state of the run, and no checkpoint is ever written from non-finite weights.
    """

    _rng_states: dict[str, Any] | None = None  # the training stream's state after the last training batch
    _resumed_from: str | None = None  # the checkpoint this run restores, known before its state is loaded
    _stop_signal: signal.Signals | None = None  # set by the signal handler during training
    _announces = False  # whether this process says what a Ctrl-C does (global rank 0)
    in_a_command = False  # set by the command line: a stop ends the process; from Python (a notebook) it ends fit

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        super().setup(trainer, pl_module, stage)
        use_checked_io(trainer)
        if stage == "fit":
            self._remove_unfinished_saves()

    @override
    def on_fit_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        super().on_fit_start(trainer, pl_module)
        self._save_companions(trainer, pl_module)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """From here SIGTERM and SIGINT only raise a flag that all processes agree on at the end of the step.

        Lightning's SIGTERM handler runs a collective (a broadcast) inside the signal handler; on two processes it
        pairs with whatever collective the other process is in, and the job hangs. Its SIGINT (Python's
        ``KeyboardInterrupt``) stops every process wherever it is, saving nothing. Lightning's signal connector
        restores both previous handlers when training ends.
        """
        super().on_train_start(trainer, pl_module)
        self._stop_signal = None
        self._announces = trainer.is_global_zero
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                signal.signal(signum, self._on_stop_signal)

    def _on_stop_signal(self, signum: int, frame: object) -> None:
        self._stop_signal = signal.Signals(signum)
        if signum != signal.SIGINT:
            return
        # A command's second Ctrl-C takes the kernel's default action, which ends a process blocked in a collective
        # or a save too; from Python it raises KeyboardInterrupt, which leaves a notebook's kernel and its state alive.
        signal.signal(signal.SIGINT, signal.SIG_DFL if self.in_a_command else signal.default_int_handler)
        if self._announces:
            sys.stderr.write("Ctrl-C: saving at the end of this step, then stopping; Ctrl-C again stops at once\n")

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        """Training draws from one random stream: whatever validation or data loading drew since the last
        training batch is undone, so the stream a checkpoint records is the one the next batch uses."""
        if self._rng_states is not None:
            set_rng_states(self._rng_states)

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        self._rng_states = get_rng_states()
        stop = self._stop_signal is not None or trainer.received_sigterm
        if trainer.strategy.reduce_boolean_decision(stop, all=False):
            ctrl_c = trainer.strategy.reduce_boolean_decision(self._stop_signal == signal.SIGINT, all=False)
            self._save_and_exit_on_signal(trainer, signal.SIGINT if ctrl_c else signal.SIGTERM)
        scheduled = self._every_n_train_steps >= 1 and trainer.global_step % self._every_n_train_steps == 0
        waits_for_monitor = self.monitor is not None and self.monitor not in self._monitor_candidates(trainer)
        if scheduled and self.save_last and waits_for_monitor and not self._should_skip_saving_checkpoint(trainer):
            self._save_last_only(trainer)
        super().on_train_batch_end(trainer, pl_module, outputs, batch, batch_idx)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """``last.ckpt`` holds the final weights even when ``max_steps`` stops training between saves."""
        super().on_train_end(trainer, pl_module)
        if self.save_last and trainer.global_step != self._last_global_step_saved and not trainer.sanity_checking:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))

    @override
    def on_exception(self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException) -> None:
        """Lightning stops every process at the start of a step when rank 0 got SIGTERM during validation, with
        exit status 0; save there too, and report the stop as a preemption."""
        super().on_exception(trainer, pl_module, exception)
        if isinstance(exception, SIGTERMException):
            self._save_and_exit_on_signal(trainer, signal.SIGTERM, exception)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(trainer, pl_module, checkpoint)
        checkpoint[RNG_KEY] = _all_ranks(self._rng_states or get_rng_states(), trainer.world_size)

    @override
    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(trainer, pl_module, checkpoint)
        self._resumed_from = None if trainer.ckpt_path is None else str(trainer.ckpt_path)
        states = checkpoint.get(RNG_KEY)
        if states is None:
            return
        if len(states) != trainer.world_size:
            if trainer.state.fn != TrainerFn.FITTING:  # test, validate or predict: no dropout, nothing to repeat
                return
            rank_zero_warn(
                f"the checkpoint holds the random states of {len(states)} processes, this run has "
                f"{trainer.world_size}: training continues, but dropout will not repeat the original run's"
            )
            return
        self._rng_states = states[trainer.global_rank]

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """A run resumed in its own folder goes on writing its ``last.ckpt`` and keeping its top k.

        - The folder may have moved since the save (renamed, copied to another disk, reached by another path):
          Lightning would drop every path it recorded and save ``last-v1.ckpt`` beside the stale ``last.ckpt``,
          which ``test`` and ``predict`` read. The recorded paths are read in the folder the run resumes from.
        - A checkpoint saved before the run's first ``last.ckpt`` (the first epoch's top-k save) records no last
          path, and Lightning would then save the resumed run as ``last-v1.ckpt`` too.
        """
        recorded = state_dict.get("dirpath")
        if isinstance(recorded, str) and self.dirpath is not None and recorded != self.dirpath and self._resumes_here():
            state_dict = _relocated(state_dict, recorded, self.dirpath)
        super().load_state_dict(state_dict)
        if not self.last_model_path and self.dirpath is not None and state_dict.get("dirpath") == self.dirpath:
            self.last_model_path = self.format_checkpoint_name({}, self.CHECKPOINT_NAME_LAST)

    @override
    def _save_checkpoint(self, trainer: L.Trainer, filepath: str) -> None:
        """Every process checks its weights (its shard, when sharded) and all agree before anything is written."""
        finite = all(bool(torch.isfinite(p).all()) for p in trainer.lightning_module.parameters())
        if not trainer.strategy.reduce_boolean_decision(finite, all=True):
            raise CheckpointError(
                f"not saving {filepath}: the weights at step {trainer.global_step} are not finite (training "
                "diverged); the previous checkpoints are kept: lower --model.lr and resume from one of them"
            )
        super()._save_checkpoint(trainer, filepath)

    def _resumes_here(self) -> bool:
        """Whether the checkpoint being restored lies in this callback's folder (local paths only)."""
        if self._resumed_from is None or self.dirpath is None or "://" in self._resumed_from + self.dirpath:
            return False
        folder = os.path.dirname(os.path.normpath(self._resumed_from))  # a sharded checkpoint is a folder
        return os.path.realpath(folder) == os.path.realpath(self.dirpath)

    def _save_last_only(self, trainer: L.Trainer) -> None:
        """Writes ``last.ckpt`` without counting as this step's save, so the deferred top-k save still runs."""
        previous = self._last_global_step_saved
        self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        self._last_global_step_saved = previous

    def _save_and_exit_on_signal(
        self, trainer: L.Trainer, signum: signal.Signals, exception: SystemExit | None = None
    ) -> None:
        """Saves ``last.ckpt`` and ends the job with the status a shell reports for a process ended by ``signum``."""
        if exception is None:  # at a batch's end: its metrics, which Lightning logs after this hook, go to the loggers
            trainer._logger_connector.update_train_step_metrics()
        if trainer.global_step != self._last_global_step_saved or not self.last_model_path:
            self._save_last_checkpoint(trainer, self._monitor_candidates(trainer))
        if trainer.is_global_zero:  # written as is: a library may have given the root logger a prefix
            resume = (
                "rerun the same command with --ckpt_path last"
                if self.in_a_command
                else f'call fit again with ckpt_path="{self.last_model_path}"'
            )
            sys.stderr.write(
                f"stopped by {signum.name} at step {trainer.global_step}: saved {self.last_model_path}; {resume} to "
                "continue\n"
            )
        if exception is not None:
            exception.code = 128 + signum
            return
        raise SystemExit(128 + signum)

    @rank_zero_only
    def _remove_unfinished_saves(self) -> None:
        """Checkpoints of a save that was killed half-way (hidden temp files) are removed, never resumed from."""
        if self.dirpath is not None and Path(self.dirpath).is_dir():
            remove_leftovers(self.dirpath)

    @rank_zero_only
    def _save_companions(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.dirpath is None:
            return
        folder = Path(self.dirpath)
        tokenizer = getattr(trainer.datamodule, "tokenizer", None)
        if tokenizer is not None:
            atomic_write_text(folder / TOKENIZER_FILE, tokenizer.to_str())
        config = getattr(pl_module, "config", None)
        if config is not None:
            atomic_write_text(folder / CONFIG_FILE, json.dumps(config.to_dict(), indent=2))


def _all_ranks(state: dict[str, Any], world_size: int) -> list[dict[str, Any]]:
    """Every process's ``state``, in global rank order (each process draws its own dropout masks)."""
    if world_size == 1 or not torch.distributed.is_initialized():
        return [state]
    states: list[Any] = [None] * world_size
    torch.distributed.all_gather_object(states, state)
    return states


def _relocated(state: dict[str, Any], old: str, new: str) -> dict[str, Any]:
    """ModelCheckpoint's ``state`` with each path it recorded under folder ``old`` read under ``new``."""

    def move(path: Any) -> Any:
        inside = isinstance(path, str) and os.path.dirname(os.path.normpath(path)) == os.path.normpath(old)
        return os.path.join(new, os.path.basename(os.path.normpath(path))) if inside else path

    paths = ("best_model_path", "kth_best_model_path", "last_model_path")
    moved = {key: move(value) if key in paths else value for key, value in state.items()}
    moved["best_k_models"] = {move(path): score for path, score in state.get("best_k_models", {}).items()}
    return {**moved, "dirpath": new}
