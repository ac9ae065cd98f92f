"""How :class:`~torch_handle.module.Seq2SeqModule` lays itself out under each strategy: the parallelisation plan it
applies once the processes are connected, the one-line refusals of plans that cannot apply, and what a replica's
loss is scaled by."""

from __future__ import annotations

import lightning as L
from lightning.pytorch.strategies import DeepSpeedStrategy, FSDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch.distributed.device_mesh import DeviceMesh
from typing_extensions import override

from torch_handle.errors import SetupError
from torch_handle.model import Transformer
from torch_handle.parallel import (
    DATA_PARALLEL,
    ParallelPlan,
    Pipeline,
    PipelineConfig,
    build_mesh,
    check_context_size,
    check_float8,
    check_sizes,
    parallelize,
)


class Parallelism(L.LightningModule):
    """The layout hooks of :class:`~torch_handle.module.Seq2SeqModule`, which sets the attributes below and
    documents ``context_parallel``, ``compile`` and ``fp8``."""

    model: Transformer
    context_parallel: int
    use_compile: bool
    use_fp8: bool
    _parallelized: bool  # configure_model applied the parallelisation plans
    _pipeline: Pipeline | None

    @override
    def configure_model(self) -> None:
        """Applies the run's parallelisation plan once the processes are connected
        (:func:`~torch_handle.parallel.parallelize`): on the mesh of
        :class:`~torch_handle.strategies.ModelParallelStrategy`, or context parallelism on a
        ``(data_parallel, context_parallel)`` mesh laid out here; compile under any strategy but fsdp in a mixed
        precision (refused in one line)."""
        if self._pipeline is not None and self.trainer.state.fn != TrainerFn.FITTING:
            raise SetupError(
                "this module was split into pipeline stages by fit: test or predict its checkpoint with a new module "
                "(torch-handle test --ckpt_path ..., or trainer.test(Seq2SeqModule(...), ckpt_path=...))"
            )
        if self._parallelized:  # a second fit or test of this module
            return
        self.check_parallel_plans()
        context = None
        if self._device_mesh is None and self.context_parallel > 1:
            trainer = self.trainer
            device = trainer.strategy.root_device.type
            self._device_mesh = context = build_mesh(trainer.world_size, self.context_parallel, device)
        plan = self._plan(context)
        if plan.compile and isinstance(self.trainer.strategy, FSDPStrategy) and "mixed" in str(self.trainer.precision):
            raise SetupError(
                f"--model.compile does not run under fsdp in {self.trainer.precision} (torch.compile fails on FSDP1's "
                "mixed-precision flat parameters): compile sharded layers with FSDP2 (--config tp "
                "--trainer.strategy.init_args.tensor_parallel_size 1), or leave --model.compile off"
            )
        if plan.float8:
            check_float8(self.trainer.strategy.root_device, self._float8_refused(plan))
        self._pipeline = parallelize(self.model, plan)
        self._parallelized = True

    def _plan(self, context: DeviceMesh | None = None) -> ParallelPlan:
        """What :func:`~torch_handle.parallel.parallelize` applies: the strategy's mesh and pipeline, if any."""
        mesh = None if context is not None else self._device_mesh  # a strategy's mesh comes with a trainer
        return ParallelPlan(
            mesh=mesh,
            pipeline=getattr(self.trainer.strategy, "pipeline", None) if mesh is not None else None,
            context=context,
            float8=self.use_fp8 and self.trainer.state.fn == TrainerFn.FITTING,  # decoding runs in the run's precision
            compile=self.use_compile,
        )

    def _float8_refused(self, plan: ParallelPlan) -> str | None:
        """What of this run ``--model.fp8`` cannot combine with (see :func:`~torch_handle.parallel.check_float8`)."""
        if plan.tensor_parallel_size > 1:
            return "tensor parallelism"
        if plan.pipeline_size > 1:
            return "pipeline parallelism"
        if isinstance(self.trainer.strategy, DeepSpeedStrategy):
            return "DeepSpeed's ZeRO"
        return None

    def check_parallel_plans(self) -> None:
        """Raises :class:`SetupError` in one line when the plans of the strategy's device mesh cannot apply to this
        model. :class:`~torch_handle.strategies.ModelParallelStrategy` asks as soon as it has laid the mesh out,
        before the run folder is made; :meth:`configure_model` asks again for Lightning's own strategy."""
        if self._device_mesh is None:
            return
        plan = self._plan()
        name = type(self.trainer.strategy).__name__
        self._check_sizes(name, plan.pipeline_size, plan.tensor_parallel_size, plan.pipeline)

    def check_launch(self, trainer: L.Trainer, fitting: bool) -> None:
        """The same checks from the trainer's settings alone, so that the command refuses an impossible plan in one
        line before it starts any process (each would print it), and before the run folder is made."""
        strategy = trainer.strategy
        sizes = getattr(strategy, "mesh_sizes", None)  # ModelParallelStrategy's (data, pipeline, tensor) sizes
        if sizes is not None:
            _, pipeline_size, tensor_parallel_size = sizes(fitting)
            pipeline = getattr(strategy, "pipeline", None)
            self._check_sizes(type(strategy).__name__, pipeline_size, tensor_parallel_size, pipeline)
        elif self.context_parallel > 1:
            check_context_size(trainer.num_nodes * trainer.num_devices, self.context_parallel)

    def _check_sizes(
        self, strategy: str, pipeline_size: int, tensor_parallel_size: int, pipeline: PipelineConfig | None
    ) -> None:
        cp = self.context_parallel
        if cp > 1:
            raise SetupError(
                f"--model.context_parallel={cp} lays out its own device mesh, but {strategy} brings another: use it "
                "with strategy ddp, fsdp or deepspeed, or set --model.context_parallel 1"
            )
        if pipeline_size > 1 and self.hparams.generate_every_n_val_epochs:
            raise SetupError(
                f"--model.generate_every_n_val_epochs={self.hparams.generate_every_n_val_epochs}: a pipeline cannot "
                "run beam search (test and predict decode with every process as a replica): set "
                "--model.generate_every_n_val_epochs 0"
            )
        check_sizes(self.model.config, pipeline_size, tensor_parallel_size, pipeline)

    def _step_scale(self) -> int:
        """What the backward pass divides a micro-batch's loss by, undone so that the step's mean is per token.

        Lightning divides by ``accumulate_grad_batches``, a strategy that accumulates itself (DeepSpeed)
        divides by it once more, and DDP, DeepSpeed and FSDP average gradients over ranks. Under context
        parallelism a batch's ranks all compute its loss, and their gradients add up to ``context_parallel``
        times its gradient (see :mod:`torch_handle.parallel.context`); tensor-parallel ranks compute one loss
        together: only data-parallel replicas count here.
        """
        trainer = self.trainer
        accumulate = trainer.accumulate_grad_batches
        mesh = self._device_mesh  # tensor- and context-parallel ranks share their replica's batch
        replicas = trainer.world_size if mesh is None else mesh[DATA_PARALLEL].size()
        return accumulate * replicas * (accumulate if trainer.strategy.handles_gradient_accumulation else 1)
