"""How :class:`~torch_handle.module.Seq2SeqModule` takes an optimizer step under each strategy: the backward pass
(a pipeline's schedule runs its own), gradient clipping, and AdamW with its learning-rate schedule."""

from __future__ import annotations

import functools
from typing import Any

import lightning as L
import torch
from lightning.pytorch.plugins.precision import MixedPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy
from lightning.pytorch.utilities import GradClipAlgorithmType
from torch import Tensor
from torch.distributed.tensor.parallel import loss_parallel
from typing_extensions import override

from torch_handle.optim import parameter_groups, warmup_cosine
from torch_handle.parallel import Pipeline


class Optimization(L.LightningModule):
    """The optimizer hooks of :class:`~torch_handle.module.Seq2SeqModule`, which sets ``_pipeline`` (this process's
    pipeline stages, or None) and documents the options read from ``hparams``."""

    _pipeline: Pipeline | None

    @override
    def backward(self, loss: Tensor, *args: Any, **kwargs: Any) -> None:
        if self._pipeline is None:  # the pipeline's schedule ran the backward passes in training_step
            with loss_parallel():  # the backward of a loss over vocabulary-split logits; no-op for plain tensors
                super().backward(loss, *args, **kwargs)

    @override
    def optimizer_zero_grad(self, epoch: int, batch_idx: int, optimizer: torch.optim.Optimizer) -> None:
        if self._pipeline is None:  # the pipeline's training_step zeroes them before its backward passes
            super().optimizer_zero_grad(epoch, batch_idx, optimizer)

    @override
    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._pipeline is not None:  # before clipping: the tied embedding's two copies get one gradient
            self._pipeline.sync_tied_grads()

    @override
    def configure_gradient_clipping(
        self,
        optimizer: torch.optim.Optimizer,
        gradient_clip_val: float | None = None,
        gradient_clip_algorithm: str | None = None,
    ) -> None:
        """Under pipeline parallelism, clipping by norm takes the norm over every stage's gradients."""
        if self._pipeline is not None and gradient_clip_val and gradient_clip_algorithm in (None, "norm"):
            self._pipeline.clip_grad_norm_(gradient_clip_val)
            return
        plugin = self.trainer.precision_plugin
        if gradient_clip_val and isinstance(plugin, MixedPrecision) and plugin.scaler is None:
            # Lightning refuses to clip for a fused optimizer under mixed precision, lest the optimizer unscale fp16
            # gradients after the clipping; bf16 has no scaler and nothing to unscale, so the plain clipping is right.
            algorithm = GradClipAlgorithmType(gradient_clip_algorithm or "norm")
            Precision.clip_gradients(plugin, optimizer, gradient_clip_val, algorithm)
            return
        super().configure_gradient_clipping(optimizer, gradient_clip_val, gradient_clip_algorithm)

    @override
    def configure_optimizers(self) -> Any:
        groups = parameter_groups(self, self.hparams.weight_decay)
        # Fused AdamW (one kernel for every parameter) where the parameters live on a GPU and the strategy steps the
        # module's optimizer there (DeepSpeed steps its own flat partitions, on the CPU under offload), without an
        # fp16 loss scaler (the fused step would unscale the gradients after Lightning clipped them).
        fused = (
            self.device.type == "cuda"
            and not isinstance(self.trainer.strategy, DeepSpeedStrategy)
            and getattr(self.trainer.precision_plugin, "scaler", None) is None
        )
        optimizer = torch.optim.AdamW(groups, lr=self.hparams.lr, betas=self.hparams.betas, fused=fused or None)
        # The number of steps is read at the first step, not here (see warmup_cosine). ``factor`` is a plain
        # function: LambdaLR keeps it out of checkpoints.
        hparams, trainer = self.hparams, self.trainer

        @functools.cache
        def total() -> int:
            return max(int(trainer.estimated_stepping_batches), 1)

        def factor(step: int) -> float:
            return warmup_cosine(step, hparams.warmup_steps, total, hparams.min_lr_ratio)

        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step", "name": "lr"}}
