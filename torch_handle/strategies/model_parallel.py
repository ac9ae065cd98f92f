"""Lightning's ``ModelParallelStrategy`` on one ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh, with
checkpoints that any layout reads."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed.checkpoint as dcp
from lightning.fabric.utilities.types import _PATH
from lightning.pytorch.strategies import ModelParallelStrategy as _LightningModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.constants import default_pg_timeout
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim import Optimizer
from typing_extensions import override

from torch_handle.checkpoints import (
    check_checkpoint,
)
from torch_handle.errors import SetupError
from torch_handle.parallel import (
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    PipelineConfig,
)
from torch_handle.parallel.layout import as_heads, is_packed, packed_names, to_heads_layout
from torch_handle.parallel.pipeline import Schedule
from torch_handle.strategies.folders import _SafeFolders
from torch_handle.unpickling import unpickling_only_data


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

    def mesh_sizes(self, fitting: bool) -> tuple[int, int, int]:
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
            dp = world // (pp * tp)
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
        sizes = self.mesh_sizes(fitting)
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
