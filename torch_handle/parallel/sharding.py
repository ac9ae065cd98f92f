"""Fully sharded data parallelism with PyTorch's FSDP2 (``fully_shard``) over the data-parallel mesh dimension.

Each encoder and decoder layer is its own unit, gathered just before it runs and freed after, and the root holds the
rest (embeddings, the tied output layer, the final norms), as torchtitan wraps its blocks. On a 2-D mesh the
parameters are already tensor-parallel DTensors (:mod:`torch_handle.parallel.tensor`) and FSDP2 shards each rank's
share again across the data-parallel ranks; gradients are averaged over them, as DDP does.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import fully_shard, register_fsdp_forward_method
from torch.distributed.tensor import DTensor, Shard

from torch_handle.model import Transformer
from torch_handle.parallel.pipeline import StageModule
from torch_handle.parallel.tensor import HEADS


def _placement(param: nn.Parameter) -> Shard | None:
    """Dim 1 for the packed query/key/value weight that tensor parallelism splits by heads on dim 0; FSDP2's dim-0
    default elsewhere (it composes with a plain ``Shard(0)``, not with that strided split)."""
    return Shard(1) if isinstance(param, DTensor) and HEADS in param.placements else None


def apply_fully_shard(model: Transformer, mesh: DeviceMesh) -> Transformer:
    """Shards ``model``'s parameters, gradients and optimizer state over the 1-D data-parallel ``mesh``, in place."""
    for layer in (*model.encoder_layers, *model.decoder_layers):
        fully_shard(layer, mesh=mesh, shard_placement_fn=_placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=_placement)
    for method in ("encode", "decode"):  # evaluation and generation call these, not forward: gather the root there too
        register_fsdp_forward_method(model, method)
    return model


def apply_fully_shard_stage(stage: StageModule, mesh: DeviceMesh) -> StageModule:
    """Shards a pipeline stage (:mod:`torch_handle.parallel.pipeline`) over the data-parallel ``mesh``, in place: its
    layers one by one, the stage as the root; the schedule reduces gradients once per batch, after its last
    micro-batch."""
    model = stage.model
    for layer in (*model.encoder_layers, *model.decoder_layers):
        if any(True for _ in layer.parameters()):  # the other stages' placeholders hold none
            fully_shard(layer, mesh=mesh)
    fully_shard(stage, mesh=mesh)
    return stage
