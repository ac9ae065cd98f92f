"""Stops training at the first non-finite loss or gradient, before the optimizer writes it into the weights."""

from __future__ import annotations

import math
from typing import Any

import lightning as L
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from torch_handle.errors import SetupError
from torch_handle.model import ConfigError


class DivergenceError(SetupError):
    """Training diverged; the message names the step, the value and what to change."""


class StopOnDivergence(L.Callback):
    """Ends the run with one ``error: training diverged ...`` line when the loss or gradient norm is not finite.

    Checked before each optimizer step, so the non-finite update is not applied (but see DeepSpeed below) and no
    checkpoint is written from it: the last good ``last.ckpt`` stays (and
    :class:`~torch_handle.callbacks.checkpointing.Checkpoint` refuses non-finite weights besides). Every process
    checks its own losses and gradients (its shards under FSDP and tensor parallelism; under DeepSpeed ZeRO the
    gradients live in DeepSpeed's buffers, so the loss decides; DeepSpeed skips a step whose gradient norm is not
    finite, except ZeRO-2 in bf16, whose overflow check :class:`~torch_handle.strategies.DeepSpeedStrategy` turns
    off: there such a step is applied and the next loss ends the run) and one all-reduce makes every process stop at
    the same step. With a gradient scaler (``16-mixed``)
    infinite gradients are the scaler's business (it skips the step), so only the loss is checked.

    An optimizer that can skip a step on the device (fused AdamW, which the module uses on a GPU) is told to, as a
    gradient scaler tells it: the check then never makes the host wait for the device. The host reads the outcome
    every ``read_every_n_steps`` steps, at each epoch's end and before each checkpoint, and ends the run naming the
    first non-finite step; the steps after it until the read are skipped too, so the weights are those before it.

    Args:
        read_every_n_steps: How often the host reads the check of an optimizer that skips steps on the device (each
            read waits for the device); every step otherwise.
    """

    def __init__(self, read_every_n_steps: int = 50) -> None:
        if read_every_n_steps < 1:
            raise ConfigError(f"StopOnDivergence's read_every_n_steps must be >= 1, got {read_every_n_steps}")
        self.read_every_n_steps = read_every_n_steps
        self._losses: list[Tensor] = []  # this step's micro-batch losses
        self._unread: list[tuple[int, float, Tensor]] = []  # (step, learning rate, (loss, norm)) not read yet

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(()))

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        losses = torch.stack(self._losses) if self._losses else torch.zeros(1)
        self._losses = []
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        sharded = any(isinstance(g, DTensor) for g in grads)
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # this process's shards
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        norm = torch.zeros((), device=losses.device)
        if grads and not scaled:
            norm = torch.nn.utils.get_total_norm(grads).to(losses.device)
        # One all-reduce: a non-finite value on any process makes the mean non-finite on all of them.
        values = trainer.strategy.reduce(torch.stack([losses.mean(), norm]), reduce_op="mean")
        step, lr = trainer.global_step, optimizer.param_groups[0]["lr"]
        if getattr(optimizer, "_step_supports_amp_scaling", False) and not scaled and not sharded:
            found = torch.isfinite(values).all().logical_not().float()
            if self._unread:  # once a step is skipped, every step until the read is
                found = torch.maximum(found, optimizer.found_inf)
            optimizer.found_inf = found  # the fused step skips on it, as under a gradient scaler
            self._unread.append((step, lr, values))
            if len(self._unread) >= self.read_every_n_steps:
                self._read(trainer)
            return
        self._stop_if_diverged(trainer, [(step, lr, values)])

    @override
    def on_train_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read(trainer)

    @override
    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule, checkpoint: dict[str, Any]) -> None:
        self._read(trainer)

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._read(trainer)
        for optimizer in trainer.optimizers:
            if hasattr(optimizer, "found_inf"):
                del optimizer.found_inf

    def _read(self, trainer: L.Trainer) -> None:
        """Reads the checks not read yet (one wait for the device) and stops at the first non-finite one."""
        unread, self._unread = self._unread, []
        if unread:
            self._stop_if_diverged(trainer, unread)

    def _stop_if_diverged(self, trainer: L.Trainer, checks: list[tuple[int, float, Tensor]]) -> None:
        read = torch.stack([values for _, _, values in checks]).tolist()
        for (step, lr, _), (loss, norm) in zip(checks, read, strict=True):
            if math.isfinite(loss) and math.isfinite(norm):
                continue
            message = (
                f"training diverged at step {step}: loss {loss:.4g}, gradient norm {norm:.4g}"
                f" (learning rate {lr:.3g}); the last good checkpoint is kept: lower"
                " --model.lr, raise --model.warmup_steps or set --trainer.gradient_clip_val, then resume with"
                " --ckpt_path last"
            )
            if trainer.is_global_zero:
                raise DivergenceError(message)
            raise SystemExit(1)  # rank 0 says it, once
