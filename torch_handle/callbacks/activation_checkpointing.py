"""Per-layer activation checkpointing for any strategy, with the memory it saves logged."""

from __future__ import annotations

from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from typing_extensions import override


class _SavedBytes:
    """Counts the bytes autograd keeps for the backward pass while active."""

    def __init__(self) -> None:
        self.bytes = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        self.bytes += tensor.numel() * tensor.element_size()
        return tensor

    def __enter__(self) -> _SavedBytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class ActivationCheckpointing(Callback):
    """Recompute each encoder/decoder layer in the backward pass instead of keeping its activations.

    It uses ``torch.utils.checkpoint(use_reentrant=False)``, which works under DDP, DeepSpeed and FSDP
    alike. The first training step runs without checkpointing and the second with it; the bytes autograd
    saved in each are logged as ``activation_checkpointing/saved_mb`` (per step, per process).
    Checkpointing does not change the numbers, only when they are computed. A model whose config already
    turns checkpointing on (e.g. ``summarization_32k.yaml``, which may not fit without it) is never run
    without it, so nothing is measured there.
    """

    def __init__(self) -> None:
        super().__init__()
        self._phase = "without"  # then "with", then "done"
        self._counter: _SavedBytes | None = None
        self._without = 0

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if pl_module.model.activation_checkpointing:
            self._phase = "done"

    @override
    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        pl_module.model.activation_checkpointing = self._phase != "without"
        if self._phase != "done":
            self._counter = _SavedBytes().__enter__()

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._counter is None:
            return
        self._counter.__exit__(None, None, None)
        kept, self._counter = self._counter.bytes, None
        if self._phase == "without":
            self._without, self._phase = kept, "with"
            return
        self._phase = "done"
        pl_module.log("activation_checkpointing/saved_mb", (self._without - kept) / 2**20, rank_zero_only=True)
        pl_module.log("activation_checkpointing/kept_mb", kept / 2**20, rank_zero_only=True)
