"""DeepSpeed ZeRO 1/2/3 on GPUs and, through DeepSpeed's CPU accelerator and gloo, on CPUs."""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.strategies.deepspeed import _DEEPSPEED_AVAILABLE
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from typing_extensions import override

from torch_handle.checkpoints import (
    check_checkpoint,
    deepspeed_state,
    is_deepspeed_checkpoint,
)
from torch_handle.errors import SetupError
from torch_handle.model import Transformer
from torch_handle.parallel import set_zero3_units
from torch_handle.strategies.folders import _SafeFolders


def use_deepspeed_cpu_accelerator() -> None:
    """Points DeepSpeed at its CPU accelerator.

    DeepSpeed picks its accelerator once, from ``DS_ACCELERATOR`` or by probing for CUDA, and caches it; the
    variable covers processes that import DeepSpeed later, and ``set_accelerator`` replaces a choice already
    made in this process (on a machine with a GPU that was asked to train on CPU).
    """
    os.environ["DS_ACCELERATOR"] = "cpu"
    import deepspeed.ops
    from deepspeed.accelerator import get_accelerator, set_accelerator
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    if get_accelerator().device_name() != "cpu":
        set_accelerator(CPU_Accelerator())
    # Its shared-memory all-reduce serves inference only (training reduces through gloo), yet the first process
    # compiles it with the C++ compiler under a lock file: minutes on a busy machine, and a compile cut short
    # leaves the lock for every later run to wait on forever.
    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


def require_deepspeed() -> None:
    """DeepSpeed is an optional extra: name its install line (Lightning's error says ``pip install deepspeed``)."""
    if not _DEEPSPEED_AVAILABLE:
        raise SetupError("the ZeRO configs need DeepSpeed: pip install 'torch-handle[deepspeed]'")


class DeepSpeedStrategy(_SafeFolders, _LightningDeepSpeedStrategy):
    """Lightning's ``DeepSpeedStrategy`` that also runs on ``accelerator="cpu"`` (DeepSpeed's CPU accelerator
    and gloo), and never leaves a half-written checkpoint folder that looks valid.

    Takes the same arguments as Lightning's (``stage``, ``offload_optimizer``, ``offload_parameters``, ...).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        require_deepspeed()
        super().__init__(*args, **kwargs)

    @property
    def _on_cpu(self) -> bool:
        return isinstance(self.accelerator, CPUAccelerator)

    @property
    @override
    def root_device(self) -> torch.device:
        """On CPU, ``cpu:LOCAL_RANK``: Lightning hands ``root_device.index`` to DeepSpeed as the device rank,
        which must be a number (tensors on ``cpu:1`` are plain CPU tensors)."""
        device = super().root_device
        return torch.device("cpu", self.local_rank) if device.type == "cpu" else device

    @override
    def setup_environment(self) -> None:
        # With offload_optimizer, DeepSpeed refuses a client optimizer (the module's torch AdamW) unless told
        # otherwise, to steer users to its vectorised DeepSpeedCPUAdam. The module owns its optimizer and its
        # LR scheduler is bound to it, so the strategy keeps AdamW on every device: on CPU every step is a CPU
        # step anyway; on GPU the offloaded step runs torch's AdamW on the CPU, which is correct but slower than
        # DeepSpeedCPUAdam. A DeepSpeed config that sets the key wins.
        self.config.setdefault("zero_force_ds_cpu_optimizer", False)
        if not self._on_cpu:
            super().setup_environment()
            return
        use_deepspeed_cpu_accelerator()
        # Skip the parent's CUDA check; DDPStrategy's setup calls our setup_distributed.
        DDPStrategy.setup_environment(self)

    @override
    def _format_config(self) -> None:
        """bf16 without DeepSpeed's gradient overflow check, unless the config asks for it: bf16 has fp32's range and
        no loss scale, and ZeRO-2 checked each gradient one by one (two reductions and a test per tensor, then a host
        sync), host time a GPU step waits on (see benchmarks/RESULTS.md, section "GPU suite", second H200
        session, "Where ZeRO-2's extra time goes"). A NaN or infinite loss still ends a run (``StopOnDivergence``).
        DeepSpeed versions without the key refuse unknown keys, so they keep their check."""
        super()._format_config()
        from deepspeed.runtime.precision_config import DeepSpeedBF16Config

        if self.config.get("bf16", {}).get("enabled") and "check_grad_overflow" in DeepSpeedBF16Config.model_fields:
            self.config["bf16"].setdefault("check_grad_overflow", False)

    @override
    def init_deepspeed(self) -> None:
        """Under ZeRO-3, each encoder and decoder layer is one unit whose parameters are gathered together (as FSDP2's
        units, the last step of :func:`~torch_handle.parallel.parallelize`), before DeepSpeed installs its hooks."""
        model = getattr(self.lightning_module, "model", None)
        if self.zero_stage_3 and isinstance(model, Transformer):
            set_zero3_units(model)
        super().init_deepspeed()

    @override
    def _configure_launcher(self) -> None:
        """Refuses fp16 on a CPU without fp16 kernels in the launching process, as one line: DeepSpeed's CPU
        accelerator would refuse it in every rank after start-up, inside a traceback. (Lightning's own plugin
        turns ``16-mixed`` on CPU into ``bf16-mixed`` with a warning; DeepSpeed's does not.)"""
        if self._on_cpu and self.precision_plugin.precision in ("16-mixed", "16-true"):
            use_deepspeed_cpu_accelerator()
            from deepspeed.accelerator import get_accelerator

            if not get_accelerator().is_fp16_supported():
                raise SetupError(
                    f"trainer.precision={self.precision_plugin.precision}: DeepSpeed has no fp16 kernels on this "
                    "CPU; use bf16-mixed or 32-true"
                )
        super()._configure_launcher()

    @override
    def setup_distributed(self) -> None:
        if not self._on_cpu:
            super().setup_distributed()
            return
        # CPU devices have no index, so the parent's check that device indices match local ranks cannot hold.
        reset_seed()
        self.set_world_ranks()
        self._init_deepspeed_distributed()

    @property
    def _loads_gathered_weights(self) -> bool:
        """ZeRO-3 outside ``fit``: DeepSpeed's engine cannot restore a folder's module states without its optimizer
        (ZeRO-3 weights live in the optimizer's partitions: ``_restore_from_bit16_weights``, and tied weights
        are stored under one name), so evaluation loads DeepSpeed's gathered fp32 weights instead."""
        module = self.lightning_module
        return self.zero_stage_3 and module is not None and module.trainer.state.fn != TrainerFn.FITTING

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(checkpoint_path)
        if self._loads_gathered_weights and is_deepspeed_checkpoint(path):
            check_checkpoint(path)
            return deepspeed_state(path, self.lightning_module)
        return super().load_checkpoint(checkpoint_path, weights_only)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if self._loads_gathered_weights:  # Lightning's own path for full weights into ZeRO-3 partitions
            self.model_to_device()
            self._restore_zero_state(checkpoint, strict=strict)
            return
        super().load_model_state_dict(checkpoint, strict)

    def _auto_select_batch_size(self) -> int:
        """DeepSpeed's micro batch size, used only in its throughput logs: token-budget batches have no fixed
        size (Lightning's version reads ``batch_sampler.batch_size`` and fails on them)."""
        return getattr(self.lightning_module.trainer.train_dataloader, "batch_size", None) or 1
