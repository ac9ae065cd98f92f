"""Stops training at the first non-finite loss or gradient, before the optimizer writes it into the weights."""

from __future__ import annotations

import math

import lightning as L
import torch
from torch import Tensor
from torch.distributed.tensor import DTensor
from torch.optim import Optimizer
from typing_extensions import override

from torch_handle.errors import SetupError


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
    """

    def __init__(self) -> None:
        self._losses: list[Tensor] = []  # this step's micro-batch losses

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: Tensor) -> None:
        self._losses.append(loss.detach().float().reshape(()))

    @override
    def on_before_optimizer_step(self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: Optimizer) -> None:
        losses = torch.stack(self._losses) if self._losses else torch.zeros(1)
        self._losses = []
        grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
        grads = [g.to_local() if isinstance(g, DTensor) else g for g in grads]  # this process's shards
        scaled = getattr(trainer.precision_plugin, "scaler", None) is not None
        norm = torch.zeros((), device=losses.device)
        if grads and not scaled:
            norm = torch.nn.utils.get_total_norm(grads).to(losses.device)
        # One all-reduce: a non-finite value on any process makes the mean non-finite on all of them.
        loss, norm = trainer.strategy.reduce(torch.stack([losses.mean(), norm]), reduce_op="mean").tolist()
        if math.isfinite(loss) and math.isfinite(norm):
            return
        message = (
            f"training diverged at step {trainer.global_step}: loss {loss:.4g}, gradient norm {norm:.4g}"
            f" (learning rate {optimizer.param_groups[0]['lr']:.3g}); the last good checkpoint is kept: lower"
            " --model.lr, raise --model.warmup_steps or set --trainer.gradient_clip_val, then resume with"
            " --ckpt_path last"
        )
        if trainer.is_global_zero:
            raise DivergenceError(message)
        raise SystemExit(1)  # rank 0 says it, once
