"""The one place that composes the parallelisation plans, in the order they apply (torchtitan's ``parallelize_llama``).

:func:`parallelize` takes a built :class:`~torch_handle.model.Transformer` and a :class:`ParallelPlan` and applies,
each step only when the plan asks for it:

1. the pipeline split: first, because every later step acts on the layers this process keeps;
2. tensor parallelism: the heads and feed-forward units of those layers (and, without a pipeline, the vocabulary);
3. context parallelism: each source split over the ranks of its own ``(data_parallel, context_parallel)`` mesh;
4. float8 linears (``--model.fp8``, :mod:`torch_handle.parallel.float8`) in the layers this process keeps;
5. ``torch.compile`` of each layer, once the plans above have changed its modules' classes and parameters;
6. FSDP2's sharding units over the data-parallel dimension, last because they wrap what the steps above built.
   (``Module.compile`` compiles a layer's call with its hooks, so FSDP2's hooks added after it run inside that call;
   the loss and gradients are those of sharding first.)

Activation checkpointing needs no step: the model recomputes each layer it runs when its config asks, whatever the
plans made of the layer. ``Seq2SeqModule.configure_model`` calls :func:`parallelize` once the processes are
connected. DeepSpeed's ZeRO-3 wraps the model itself later, so :class:`~torch_handle.strategies.DeepSpeedStrategy`
makes its units (:func:`~torch_handle.parallel.sharding.set_zero3_units`, the counterpart of step 6) just before
DeepSpeed installs its hooks. :func:`check_sizes` refuses an impossible plan in one line before any of it.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.distributed.device_mesh import DeviceMesh

from torch_handle.errors import SetupError
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.parallel.context import apply_context_parallel
from torch_handle.parallel.float8 import apply_float8
from torch_handle.parallel.mesh import CONTEXT_PARALLEL, DATA_PARALLEL, PIPELINE_PARALLEL, TENSOR_PARALLEL
from torch_handle.parallel.pipeline import Pipeline, PipelineConfig, apply_pipeline_parallel, check_pipeline_parallel
from torch_handle.parallel.sharding import apply_fully_shard, apply_fully_shard_stages
from torch_handle.parallel.tensor import apply_tensor_parallel, check_tensor_parallel


@dataclass(frozen=True)
class ParallelPlan:
    """The techniques a run applies to its model; each is off by default.

    Args:
        mesh: ``ModelParallelStrategy``'s ``(data_parallel, pipeline_parallel, tensor_parallel)`` mesh: pipeline
            stages, tensor parallelism and FSDP2 over its dimensions (FSDP2 also over one replica, since Lightning
            loads such a strategy's checkpoints as DTensors).
        pipeline: How batches flow through the stages, when the mesh's pipeline dimension has several processes.
        context: The ``(data_parallel, context_parallel)`` mesh of :func:`~torch_handle.parallel.build_mesh`.
        float8: Train the layers' matrix products in float8 (:func:`~torch_handle.parallel.float8.apply_float8`).
        compile: ``torch.compile`` each encoder and decoder layer.
    """

    mesh: DeviceMesh | None = None
    pipeline: PipelineConfig | None = None
    context: DeviceMesh | None = None
    float8: bool = False
    compile: bool = False

    @property
    def pipeline_size(self) -> int:
        mesh = self.mesh
        return mesh[PIPELINE_PARALLEL].size() if mesh is not None and PIPELINE_PARALLEL in mesh.mesh_dim_names else 1

    @property
    def tensor_parallel_size(self) -> int:
        return self.mesh[TENSOR_PARALLEL].size() if self.mesh is not None else 1


def check_sizes(
    config: TransformerConfig, pipeline_size: int, tensor_parallel_size: int, pipeline: PipelineConfig | None
) -> None:
    """Raises a one-line error when a mesh of these sizes cannot apply to a model of ``config``: the command asks
    before it starts any process, the strategy again once it has laid its mesh out. (Context parallelism, which lays
    out its own mesh, is checked when the module is built.)"""
    if config.copy_attention and (pipeline_size > 1 or tensor_parallel_size > 1):
        raise SetupError(
            "--model.transformer.copy_attention mixes its copy distribution over the whole vocabulary, beside the "
            "encoder's output: train it with ddp, fsdp or deepspeed, not tensor or pipeline parallelism"
        )
    if pipeline_size > 1:
        check_pipeline_parallel(config, pipeline_size, pipeline)
    if tensor_parallel_size > 1:
        check_tensor_parallel(config, tensor_parallel_size)


def parallelize(model: Transformer, plan: ParallelPlan) -> Pipeline | None:
    """Applies ``plan`` to ``model`` in place, in the order of this module's docstring; returns this process's
    :class:`~torch_handle.parallel.Pipeline` when the plan splits the model into stages, else None."""
    mesh, stages = plan.mesh, None
    if plan.pipeline_size > 1:  # 1. keep this process's stages only
        stages = apply_pipeline_parallel(model, mesh[PIPELINE_PARALLEL], plan.pipeline)
    if plan.tensor_parallel_size > 1:  # 2. each stage's heads and feed-forward units split in turn
        apply_tensor_parallel(model, mesh[TENSOR_PARALLEL], vocabulary=stages is None)
    if plan.context is not None:  # 3.
        apply_context_parallel(model, plan.context[CONTEXT_PARALLEL].get_group())
    if plan.float8:  # 4.
        apply_float8(model)
    if plan.compile:  # 5.
        for layer in (*model.encoder_layers, *model.decoder_layers):
            layer.compile()
    if stages is not None:  # 6.
        apply_fully_shard_stages(stages, mesh[DATA_PARALLEL])
    elif mesh is not None:
        apply_fully_shard(model, mesh[DATA_PARALLEL])
    return Pipeline(stages, mesh[PIPELINE_PARALLEL], plan.pipeline) if stages is not None else None
