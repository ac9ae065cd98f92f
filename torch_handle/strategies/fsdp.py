"""PyTorch's FSDP (the first version) on GPUs and, over gloo, on CPUs, clipping gradients by norm."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.fsdp import _get_full_state_dict_context
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from torch_handle.checkpoints import (
    check_checkpoint,
)
from torch_handle.layouts import optimizer_state_by_name
from torch_handle.strategies.folders import _SafeFolders


class _RootClipPrecision(FSDPPrecision):
    """``FSDPPrecision`` that clips by norm with the sharded root module's ``clip_grad_norm_``, which takes the norm
    over all shards; Lightning's refuses ``gradient_clip_algorithm='norm'`` for lack of a reference to that module.
    """

    def __init__(self, plugin: FSDPPrecision, strategy: FSDPStrategy) -> None:
        super().__init__(plugin.precision, plugin.scaler)
        self._strategy = strategy

    @override
    def clip_grad_by_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        root = self._strategy.model
        assert isinstance(root, FullyShardedDataParallel), "clipping before the model is wrapped"
        root.clip_grad_norm_(clip_val)


class FSDPStrategy(_SafeFolders, _LightningFSDPStrategy):
    """Lightning's ``FSDPStrategy`` that also runs on ``accelerator="cpu"`` (gloo) and clips gradients by norm.

    PyTorch's FSDP shards and trains over gloo on CPU when told its device is the CPU, but Lightning rejects
    ``FSDPStrategy`` without a GPU (``_check_strategy_and_fallback`` tests the exact type, which a subclass
    passes) and hands FSDP ``device_id=root_device.index``, None on CPU, from which FSDP concludes "FSDP
    needs a non-CPU accelerator device". So on CPU the model is wrapped here, with ``device_id=cpu``, and
    Lightning's setup continues with the wrapped model.

    Gradient clipping by norm (``trainer.gradient_clip_val``, set by every shipped data config) goes through
    FSDP's own ``clip_grad_norm_`` (see :class:`_RootClipPrecision`).
    """

    @property
    @override
    def precision_plugin(self) -> FSDPPrecision:
        return _LightningFSDPStrategy.precision_plugin.fget(self)

    @precision_plugin.setter
    @override
    def precision_plugin(self, plugin: Precision | None) -> None:
        if isinstance(plugin, FSDPPrecision) and not isinstance(plugin, _RootClipPrecision):
            plugin = _RootClipPrecision(plugin, self)
        _LightningFSDPStrategy.precision_plugin.fset(self, plugin)

    @override
    def _setup_model(self, model: Module) -> Module:
        if self.root_device.type == "cpu" and not isinstance(model, FullyShardedDataParallel):
            model = FullyShardedDataParallel(
                module=model,
                cpu_offload=self.cpu_offload,
                mixed_precision=self.mixed_precision_config,
                sharding_strategy=self.sharding_strategy,
                device_id=torch.device("cpu"),
                **self.kwargs,
            )
        return super()._setup_model(model)

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        """A full ``.ckpt`` (DDP or one device) resumed under FSDP: its weights and its optimizer state, keyed by
        parameter name first (:func:`~torch_handle.layouts.optimizer_state_by_name`), then sharded by FSDP."""
        path = Path(self.broadcast(str(checkpoint_path)))
        if path.is_dir() or self.lightning_module.trainer.state.fn != TrainerFn.FITTING:
            return super().load_checkpoint(path, weights_only)
        check_checkpoint(path)
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
        strict = self.lightning_module.strict_loading
        _load_raw_module_state(checkpoint.pop("state_dict"), self.model, world_size=self.world_size, strict=strict)
        with _get_full_state_dict_context(self.model, world_size=self.world_size, rank0_only=False):
            for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=True):
                by_name = optimizer_state_by_name(state, optimizer, self.model)
                optimizer.load_state_dict(
                    FullyShardedDataParallel.optim_state_dict_to_load(self.model, optimizer, by_name)
                )
        return checkpoint
