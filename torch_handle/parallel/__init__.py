"""Parallelisation plans on a DeviceMesh: the one place where model code meets ``torch.distributed``.

The model (``torch_handle.model``) stays free of distributed code, as torchtitan keeps ``parallelize.py`` apart from
its models; a plan here changes how a built model runs, never its weights or their names.
"""

from torch_handle.parallel.context import ContextParallelTransformer, apply_context_parallel, check_context_parallel
from torch_handle.parallel.float8 import apply_float8, check_float8
from torch_handle.parallel.mesh import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    build_mesh,
    check_context_size,
)
from torch_handle.parallel.parallelize import ParallelPlan, check_sizes, parallelize
from torch_handle.parallel.pipeline import Pipeline, PipelineConfig, apply_pipeline_parallel, check_pipeline_parallel
from torch_handle.parallel.sharding import apply_fully_shard, apply_fully_shard_stages, set_zero3_units
from torch_handle.parallel.tensor import (
    TensorParallelAttention,
    apply_tensor_parallel,
    check_tensor_parallel,
    sharded_logits,
    vocab_parallel_token_sums,
)

__all__ = [
    "CONTEXT_PARALLEL",
    "DATA_PARALLEL",
    "PIPELINE_PARALLEL",
    "TENSOR_PARALLEL",
    "ContextParallelTransformer",
    "ParallelPlan",
    "Pipeline",
    "PipelineConfig",
    "TensorParallelAttention",
    "apply_context_parallel",
    "apply_float8",
    "apply_fully_shard",
    "apply_fully_shard_stages",
    "apply_pipeline_parallel",
    "apply_tensor_parallel",
    "build_mesh",
    "check_context_parallel",
    "check_context_size",
    "check_float8",
    "check_pipeline_parallel",
    "check_sizes",
    "check_tensor_parallel",
    "parallelize",
    "set_zero3_units",
    "sharded_logits",
    "vocab_parallel_token_sums",
]
