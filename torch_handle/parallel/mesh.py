"""One device mesh for the run: data parallelism times context parallelism, checked against the world size."""

from __future__ import annotations

from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from torch_handle.errors import SetupError

# Dimension names as Lightning's ModelParallelStrategy spells them ("data_parallel", "tensor_parallel"); the data
# modules shard batches over the "data_parallel" dimension of the LightningModule's ``device_mesh``.
DATA_PARALLEL = "data_parallel"
TENSOR_PARALLEL = "tensor_parallel"
PIPELINE_PARALLEL = "pipeline_parallel"
CONTEXT_PARALLEL = "context_parallel"


def build_mesh(world_size: int, context_parallel: int, device_type: str) -> DeviceMesh:
    """The ``(data_parallel, context_parallel)`` mesh over every process.

    Ranks ``i * context_parallel ... (i + 1) * context_parallel - 1`` form context-parallel group ``i``: neighbours on
    one node, where the halo exchange is cheapest (``torchrun`` numbers a node's processes consecutively).

    Raises:
        SetupError: ``context_parallel`` does not divide ``world_size``.
    """
    check_context_size(world_size, context_parallel)
    return init_device_mesh(
        device_type,
        (world_size // context_parallel, context_parallel),
        mesh_dim_names=(DATA_PARALLEL, CONTEXT_PARALLEL),
    )


def check_context_size(world_size: int, context_parallel: int) -> None:
    """Refuses a ``context_parallel`` that does not divide the ``world_size`` processes, in one line."""
    if context_parallel < 1 or world_size % context_parallel:
        raise SetupError(
            f"--model.context_parallel={context_parallel} does not divide the {world_size} processes "
            "(trainer.devices x trainer.num_nodes): choose a context_parallel that divides it"
        )
