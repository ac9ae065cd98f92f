"""Fully sharded data parallelism with PyTorch's FSDP2 (``fully_shard``) over the data-parallel mesh dimension.

Each encoder and decoder layer is its own unit, gathered just before it runs and freed after, and the root holds the
rest (embeddings, the tied output layer, the final norms), as torchtitan wraps its blocks. On a 2-D mesh the
parameters are already tensor-parallel DTensors (:mod:`torch_handle.parallel.tensor`) and FSDP2 shards each rank's
share again across the data-parallel ranks; gradients are averaged over them, as DDP does.

The packed query/key/value weights are sharded by columns (dim 1), everything else by rows: FSDP2 composes dim 1
with tensor parallelism's split of the three matrices by heads, and sharded checkpoints can then store that weight
as ``(3, C, C)`` under every layout (:mod:`torch_handle.parallel.layout`).

DeepSpeed's ZeRO-3 gets the same units from :func:`set_zero3_units`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import Shard

from torch_handle.model import Transformer
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.layers import DecoderLayer, EncoderLayer
from torch_handle.parallel.pipeline import StageModule


def _placement(model: nn.Module) -> Callable[[nn.Parameter], Shard | None]:
    """Dim 1 for ``model``'s packed query/key/value weights, FSDP2's dim-0 default elsewhere."""
    packed = {id(w) for m in model.modules() if isinstance(m, MultiHeadAttention) for _, w in m.packed_weights()}
    return lambda param: Shard(1) if id(param) in packed else None


def apply_fully_shard(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Shards ``model``'s parameters, gradients and optimizer state over the 1-D data-parallel ``mesh``, in place."""
    placement = _placement(model)
    for layer in (*model.encoder_layers, *model.decoder_layers):
        fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    for method in ("encode", "decode"):  # evaluation and generation call these, not forward: gather the root there too
        register_fsdp_forward_method(model, method)
    return model


def apply_fully_shard_stages(stages: list[StageModule], mesh: DeviceMesh) -> list[StageModule]:
    """Shards this process's pipeline stages (:mod:`torch_handle.parallel.pipeline`) over the data-parallel ``mesh``,
    in place: each stage's layers one by one, the stage as the root of the rest; the schedule reduces gradients once
    per batch, after its last micro-batch."""
    placement = _placement(stages[0].model)
    for stage in stages:
        for layer in stage.layers:
            fully_shard(layer, mesh=mesh, shard_placement_fn=placement)
        fully_shard(stage, mesh=mesh, shard_placement_fn=placement)
    return stages


def set_zero3_units(model: nn.Module) -> int:
    """Makes each encoder and decoder layer in ``model`` one unit of DeepSpeed ZeRO-3 (a "leaf module"), as
    :func:`apply_fully_shard` does for FSDP2; returns how many. Left alone, ZeRO-3 gathers and releases parameters in
    Python hooks around every submodule, whose host time a GPU step waits on (see benchmarks/RESULTS.md, section
    "GPU suite", rows zero3 and zero3_submodules). Call before ``deepspeed.initialize``, which installs the hooks."""
    from deepspeed.utils import set_z3_leaf_modules

    units = (EncoderLayer, DecoderLayer)
    if not any(isinstance(module, units) for module in model.modules()):
        return 0  # a LightningModule without our layers; DeepSpeed's call would raise
    return len(set_z3_leaf_modules(model, list(units)))
