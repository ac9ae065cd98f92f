"""The packed query/key/value weight in sharded checkpoints: stored as ``(3, C, C)``, so every layout can describe it.

Tensor parallelism splits the packed ``(3C, C)`` weight as three matrices, each by heads (rank ``r`` holds
``[q_r; k_r; v_r]``, :data:`~torch_handle.parallel.tensor.HEADS`): three blocks of rows, which
``torch.distributed.checkpoint`` cannot describe, since it gives each rank's shard one offset and one size. Viewed
as ``(3, C, C)`` the same shard is one block, ``[:, r*C/tp:(r+1)*C/tp, :]``, a plain ``Shard(1)``; FSDP2 shards the
weight by columns (:mod:`torch_handle.parallel.sharding`), which stays a plain shard, of dim 2. So sharded
checkpoints of :class:`~torch_handle.strategies.ModelParallelStrategy` store every packed weight (and its AdamW
moments) as ``(3, C, C)``, whatever the layout that wrote them, and any layout reads them back through the same view
of its own tensors: a checkpoint written by tensor parallelism resumes on FSDP2 alone, a pipeline or one process,
and the other way round. The views share storage with the tensors they view, so loading into them loads in place.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.placement_types import Placement, _StridedShard

from torch_handle.model.attention import MultiHeadAttention

PACKED = ("in_proj.weight", "global_proj.weight")
"""The names' endings of packed query/key/value weights (:meth:`MultiHeadAttention.packed_weights`)."""

OPTIMIZER_STATE = "state."
"""The prefix of a flattened optimizer state's per-parameter keys (``state.<parameter name>.exp_avg``)."""


def packed_names(module: nn.Module) -> set[str]:
    """The ``state_dict`` names of every packed query/key/value weight in ``module``."""
    return {
        f"{name}.{weight}"
        for name, m in module.named_modules()
        if isinstance(m, MultiHeadAttention)
        for weight, _ in m.packed_weights()
    }


def is_packed(key: str, value: Any, packed: set[str]) -> bool:
    """Whether ``key`` of a model or flattened optimizer state holds a packed weight or a moment of one (a 2-D
    tensor: AdamW's ``step`` shares the prefix)."""
    name = key if key in packed else key.removeprefix(OPTIMIZER_STATE).rpartition(".")[0]
    return name in packed and isinstance(value, Tensor) and value.dim() == 2


def _heads_placement(placement: Placement) -> Placement:
    if isinstance(placement, _StridedShard) and placement.dim == 0 and placement.split_factor == 3:
        return Shard(1)  # tensor parallelism's heads: rows r of each of the three matrices
    if isinstance(placement, Shard) and not isinstance(placement, _StridedShard) and placement.dim == 1:
        return Shard(2)  # FSDP2's columns
    if isinstance(placement, Replicate):
        return placement
    raise ValueError(f"a packed query/key/value weight placed as {placement} has no (3, C, C) view")


def as_heads(value: Tensor) -> Tensor:
    """The packed ``(3C, C)`` weight ``value`` (a tensor or a DTensor, as tensor parallelism and FSDP2 place it)
    viewed as ``(3, C, C)``, sharing its storage."""
    if not isinstance(value, DTensor):
        return value.view(3, -1, value.shape[-1])
    local = value.to_local()  # (3 * rows, cols): this rank's rows of each matrix, stacked
    rows, cols = value.shape[0] // 3, value.shape[1]
    return DTensor.from_local(
        local.view(3, local.shape[0] // 3, local.shape[1]),
        value.device_mesh,
        [_heads_placement(p) for p in value.placements],
        run_check=False,
        shape=torch.Size((3, rows, cols)),
        stride=(rows * cols, cols, 1),
    )


def to_heads_layout(state: Mapping[str, Any], packed: set[str]) -> dict[str, Any]:
    """``state`` (a model state dict or a flattened optimizer state) with its packed weights as ``(3, C, C)`` views."""
    return {k: as_heads(v) if is_packed(k, v, packed) else v for k, v in state.items()}


def from_heads_layout(state_dict: Mapping[str, Tensor]) -> dict[str, Tensor]:
    """A whole (gathered) model state dict read from a sharded checkpoint, packed weights back to ``(3C, C)``."""
    return {k: v.flatten(0, 1) if k.endswith(PACKED) and v.dim() == 3 else v for k, v in state_dict.items()}
