"""DeepSpeed and FSDP on CPU: Lightning's strategies with their CUDA-only guards lifted, and atomic saves.

Lightning refuses any accelerator but CUDA for DeepSpeed and FSDP, yet DeepSpeed ships a CPU accelerator
that runs ZeRO 1/2/3 over gloo, and PyTorch's FSDP shards over gloo too. Running them lets CI exercise
the real partitioning, checkpoint layouts and export path on two CPU processes. On CUDA every step is
Lightning's own.

DeepSpeed also writes a checkpoint folder file by file, so a save killed half-way would leave a folder
that looks like a checkpoint; here every save goes to a hidden sibling folder and is renamed into place.
Every folder is checked before DeepSpeed or torch.distributed.checkpoint unpickles it (they would run code), and
loaded with every unpickler restricted to plain data (:func:`~torch_handle.unpickling.unpickling_only_data`).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.strategies.deepspeed import _DEEPSPEED_AVAILABLE
from lightning.fabric.strategies.fsdp import _get_full_state_dict_context
from lightning.fabric.strategies.model_parallel import _load_raw_module_state
from lightning.fabric.utilities.seed import reset_seed
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.accelerators import CPUAccelerator
from lightning.pytorch.plugins.precision import FSDPPrecision, Precision
from lightning.pytorch.strategies import DeepSpeedStrategy as _LightningDeepSpeedStrategy
from lightning.pytorch.strategies import FSDPStrategy as _LightningFSDPStrategy
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.pytorch.strategies.ddp import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FullyShardedDataParallel
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn import Module
from torch.optim import Optimizer
from typing_extensions import override

from torch_handle.checkpoints import (
    check_checkpoint,
    deepspeed_state,
    hidden_sibling,
    is_deepspeed_checkpoint,
    recover_interrupted_save,
)
from torch_handle.errors import SetupError
from torch_handle.layouts import optimizer_state_by_name
from torch_handle.parallel import DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL, PipelineConfig, set_zero3_units
from torch_handle.parallel.layout import as_heads, is_packed, packed_names, to_heads_layout
from torch_handle.parallel.pipeline import Schedule
from torch_handle.unpickling import unpickling_only_data


class _SafeFolders:
    """Checkpoint folders written whole or not at all, and checked before they are loaded, for strategies that
    save one file per rank.

    Lightning writes single-file checkpoints atomically; DeepSpeed and FSDP's sharded checkpoints are folders
    that every rank writes into, and a run killed half-way through would leave one that looks valid. So all
    ranks write ``.NAME.partial`` beside the target, and global rank 0 renames it into place after a barrier
    (which assumes one file system shared by all nodes, as resuming needs anyway). A folder cannot replace
    another in one rename, so the previous one is first moved to ``.NAME.stale``; a kill between the two renames
    leaves no ``NAME``, and :func:`~torch_handle.checkpoints.recover_interrupted_save` puts ``.stale`` back (here
    before the next save, and wherever a checkpoint is resolved).
    """

    @override
    def save_checkpoint(self, checkpoint: dict, filepath: _PATH, storage_options: Any | None = None) -> None:
        final = Path(self.broadcast(str(filepath)))
        partial, stale = hidden_sibling(final, "partial"), hidden_sibling(final, "stale")
        if self.is_global_zero:
            recover_interrupted_save(final)
            _remove(partial)
        self.barrier("atomic_save_start")
        super().save_checkpoint(checkpoint, partial, storage_options)
        self.barrier("atomic_save_written")
        if self.is_global_zero:
            _remove(stale)
            if final.exists():
                os.replace(final, stale)
            os.replace(partial, final)
            _remove(stale)
        self.barrier("atomic_save_done")

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        check_checkpoint(checkpoint_path)
        with unpickling_only_data(Path(checkpoint_path)):
            return super().load_checkpoint(checkpoint_path, weights_only)


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


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
        """Under ZeRO-3, each encoder and decoder layer is one unit whose parameters are gathered together
        (:func:`~torch_handle.parallel.set_zero3_units`), before DeepSpeed installs its hooks."""
        if self.zero_stage_3 and self.lightning_module is not None:
            set_zero3_units(self.lightning_module)
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


class ModelParallelStrategy(_SafeFolders, _LightningModelParallelStrategy):
    """Lightning's ``ModelParallelStrategy`` on one ``(data_parallel, pipeline_parallel, tensor_parallel)`` device mesh
    (on GPUs or, over gloo, on CPUs), whose checkpoint folders are written whole and checked before they are loaded.

    The module applies the plans on the mesh in ``configure_model`` (:mod:`torch_handle.parallel`): pipeline
    stages over ``pipeline_parallel_size`` processes, tensor parallelism over ``tensor_parallel_size``, FSDP2 over
    ``data_parallel_size``; their product is the number of processes. Takes Lightning's arguments, and:

    Args:
        pipeline_parallel_size: Pipeline processes (1 = none): encoder then decoder layers cut into contiguous
            stages, ``stages_per_rank`` per process; batches split into ``microbatches`` that flow through them by
            ``pipeline_schedule``.
            A pipeline trains and validates (the loss); ``test`` and ``predict`` decode on every process as data
            parallel replicas, since beam search is one sequential loop a pipeline cannot keep busy. Its
            checkpoints are sharded (``save_distributed_checkpoint: true``): each stage writes its own tensors.
        pipeline_schedule: ``1f1b`` (at most ``pipeline_parallel_size`` micro-batches' activations alive per stage),
            ``gpipe`` (all forward passes, then all backward passes) or ``interleaved_1f1b`` (1F1B over
            ``stages_per_rank`` >= 2 stages per process, Megatron-LM's virtual stages).
        microbatches: Micro-batches per batch, at least ``pipeline_parallel_size`` (a multiple of it with
            ``interleaved_1f1b``); the pipeline's idle share is ``(pp - 1) / (v * microbatches + pp - 1)`` for
            ``pp`` processes of ``v`` stages.
        stages_per_rank: Stages per process, ``v``: 1, or 2 and more with ``interleaved_1f1b`` (each process then
            holds stages ``r, r + pp, ...``; the pipeline idles ``v`` times less and sends ``v`` times more often).

    Checkpoints are folders of one shard per process (``save_distributed_checkpoint: true``), optimizer states keyed
    by parameter name and every packed query/key/value weight stored as ``(3, C, C)``
    (:mod:`torch_handle.parallel.layout`), so that any layout (tensor parallel, FSDP2, pipeline, one process) reads
    what any other wrote. ``save_distributed_checkpoint: false`` gathers one file of full tensors on rank 0 instead;
    this strategy loads such a file by splitting every tensor the way its parameter is split (Lightning's loader cuts
    contiguous blocks, which is wrong for the weight tensor parallelism splits by heads).
    """

    def __init__(
        self,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: Literal["auto"] | int = "auto",
        pipeline_parallel_size: int = 1,
        pipeline_schedule: Schedule = "1f1b",
        microbatches: int = 4,
        stages_per_rank: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
    ) -> None:
        super().__init__(
            data_parallel_size, tensor_parallel_size, save_distributed_checkpoint, process_group_backend, timeout
        )
        self._pipeline_parallel_size = pipeline_parallel_size
        self.pipeline = PipelineConfig(pipeline_schedule, microbatches, stages_per_rank)

    def _sizes(self, fitting: bool) -> tuple[int, int, int]:
        """``(data_parallel, pipeline_parallel, tensor_parallel)``, checked against the processes in one line. Outside
        ``fit`` a pipeline's processes are data-parallel replicas of the whole model, on any number of devices."""
        dp, tp, pp = self._data_parallel_size, self._tensor_parallel_size, self._pipeline_parallel_size
        world = self.num_nodes * self.num_processes
        if pp > 1 and not fitting:
            return world, 1, 1
        if pp < 1 or world % pp:
            raise SetupError(
                f"pipeline_parallel_size={pp} must divide the {world} processes (trainer.devices x trainer.num_nodes)"
                ": choose a pipeline_parallel_size that divides them"
            )
        if tp == "auto":
            tp = 1 if pp > 1 else self.num_processes
        if dp == "auto":
            dp = world // (pp * tp) if pp > 1 else self.num_nodes
        if dp * pp * tp != world:
            raise SetupError(
                f"data_parallel_size={dp} x pipeline_parallel_size={pp} x tensor_parallel_size={tp} must equal the "
                f"{world} processes (trainer.devices x trainer.num_nodes): set --trainer.strategy.init_args."
                "data_parallel_size, pipeline_parallel_size and tensor_parallel_size to multiply out, or 'auto'"
            )
        if pp > 1:
            self.pipeline.check(pp)
        if pp > 1 and not self._save_distributed_checkpoint:
            raise SetupError(
                f"pipeline_parallel_size={pp} saves one shard per stage: set "
                "--trainer.strategy.init_args.save_distributed_checkpoint true"
            )
        return dp, pp, tp

    @override
    def setup_environment(self) -> None:
        fitting = self.lightning_module is not None and self.lightning_module.trainer.state.fn == TrainerFn.FITTING
        sizes = self._sizes(fitting)
        self._setup_distributed()
        self._device_mesh = init_device_mesh(
            self.root_device.type, sizes, mesh_dim_names=(DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL)
        )
        self.lightning_module._device_mesh = self._device_mesh
        check = getattr(self.lightning_module, "check_parallel_plans", None)
        if check is not None:  # Seq2SeqModule: an impossible plan is one line here, before the run folder is made
            check()

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        state = super().lightning_module_state_dict()
        if not self._save_distributed_checkpoint:
            return state
        return to_heads_layout(state, packed_names(self.lightning_module))

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        if not self._save_distributed_checkpoint:
            return super().optimizer_state(optimizer)
        optimizer = getattr(optimizer, "_optimizer", optimizer)  # a LightningOptimizer's own
        state = get_optimizer_state_dict(self.model, optimizer, options=_SHARDED)
        return to_heads_layout(state, packed_names(self.lightning_module))

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, weights_only: bool | None = None) -> dict[str, Any]:
        path = Path(self.broadcast(str(checkpoint_path)))
        check_checkpoint(path)
        if path.is_dir():  # one shard per process, read by parameter name
            with unpickling_only_data(path):
                return self._load_sharded(path)
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=True)
        module = self.lightning_module
        with torch.no_grad():
            for name, tensor in module.state_dict().items():
                _local(tensor).copy_(_local(_split_like(checkpoint["state_dict"][name], tensor)))
        by_id = list(module.parameters())  # Lightning keys a full optimizer state by the parameters' order
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"]):  # none outside fit
            state = {
                "param_groups": state["param_groups"],
                "state": {
                    i: {k: _split_like(v, by_id[i]) if k != "step" else v for k, v in values.items()}
                    for i, values in state["state"].items()
                },
            }
            optimizer.load_state_dict(state)
        del checkpoint["state_dict"]
        return checkpoint

    def _load_sharded(self, path: Path) -> dict[str, Any]:
        """A ``save_distributed_checkpoint`` folder into whatever this process holds (a pipeline stage, FSDP2 shards,
        the whole model), by parameter name: weights, then the optimizer states (none outside fit)."""
        module = self.lightning_module
        state = {"state_dict": get_model_state_dict(module)}
        for i, optimizer in enumerate(self.optimizers):
            state[f"optimizer_{i}"] = get_optimizer_state_dict(module, optimizer, options=_SHARDED)
        # The packed weights are read into (3, C, C) views where the folder stores them so (every save of this
        # strategy; FSDP2 folders of torch-handle 0.1.0 hold (3C, C)): the views load them in place. Entries that
        # are not tensors (hyperparameters) are replaced in these dictionaries, so the views are swapped back after.
        stored = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
        packed, viewed = packed_names(module), {}
        for group, values in state.items():
            for key, value in values.items():
                if is_packed(key, value, packed) and len(stored[f"{group}.{key}"].size) == 3:
                    viewed[group, key], values[key] = value, as_heads(value)
        dcp.load(state, checkpoint_id=path)
        for (group, key), value in viewed.items():
            state[group][key] = value
        module.load_state_dict(state["state_dict"], strict=module.strict_loading)
        for i, optimizer in enumerate(self.optimizers):
            set_optimizer_state_dict(module, optimizer, state[f"optimizer_{i}"], options=_SHARDED)
        return torch.load(path / "meta.pt", weights_only=True)  # plain fields; nothing we load may run code


# Sharded optimizer states keyed by parameter name, hyperparameters included ("param_groups.<name>.lr"), rather than by
# group index and a list of names: each pipeline stage holds other parameters in its groups, and torch.distributed.
# checkpoint keeps one copy of a key every rank writes. By name, a checkpoint also loads on another layout (one process,
# other stage counts), as torchtitan saves them.
_SHARDED = StateDictOptions(cpu_offload=True, flatten_optimizer_state_dict=True)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _split_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``full`` cut as ``like`` is across the mesh (strided head splits included), or as is."""
    if not isinstance(like, DTensor):
        return full.to(like.dtype)
    return distribute_tensor(full.to(like.dtype), like.device_mesh, like.placements, src_data_rank=None)
