"""Pipeline parallelism with PyTorch's ``torch.distributed.pipelining``: encoder stages, then decoder stages.

The layers, encoder then decoder, are cut into ``pp x v`` contiguous stages of nearly equal size, as Megatron-LM splits
T5; process ``r`` keeps stages ``r, r + pp, ...`` (``v`` stages per process: one, or several for the interleaved 1F1B
schedule, whose smaller stages shrink the pipeline's idle share by ``v``) and drops the other layers. Activations cross
a stage boundary as a pair: the encoder's hidden states and the embedded target while the encoder runs, then the
encoder's output (``memory``) and the decoder's hidden states, because PyTorch's schedules carry no skip connection past
a stage: every decoder stage needs ``memory`` for cross-attention. T5's relative position biases ride along the same
way: the first stage holds both bias tables and computes the encoder's and the decoder's biases, which travel with the
pair (the encoder's until the encoder is done), so each table is one parameter trained on one stage and every stage's
gradient flows back to it. The first stage embeds both source and target
(integer ids cannot cross a boundary with a gradient), and every stage receives the token ids too, as keyword arguments,
to build its masks.

Tied embeddings live on the first stage (lookup) and the last (output layer); :meth:`Pipeline.sync_tied_grads` adds
their gradients before the optimizer step, as Megatron's embedding group does, so both copies stay equal.

Shapes: a schedule's receive buffers are fixed by its first micro-batch, but token-budget batches vary, so each batch
gets a stage and schedule built for its shapes from static metadata (no shape inference, no extra pass), and its rows
are evened up to a multiple of the micro-batch count with filler rows (one end-of-sentence source token, an all-padding
target) that add nothing to the loss or the gradients.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B
from torch.distributed.pipelining.schedules import PipelineScheduleSingle
from torch.distributed.tensor import DTensor

from torch_handle.errors import SetupError
from torch_handle.model import Transformer, TransformerConfig

Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}  # one stage per process


@dataclass(frozen=True)
class PipelineConfig:
    """How a batch flows through the stages.

    Args:
        schedule: ``gpipe`` runs every micro-batch's forward pass, then every backward pass (activations of all
            micro-batches alive at once); ``1f1b`` alternates them once the pipeline is full, holding at most ``pp``
            micro-batches' activations per stage; ``interleaved_1f1b`` is 1F1B over ``stages_per_rank`` stages per
            process (Megatron-LM's virtual stages, PyTorch's ``ScheduleInterleaved1F1B``).
        microbatches: Micro-batches per batch (at least the number of processes, or stages sit idle): the pipeline's
            idle share is ``(pp - 1) / (v * microbatches + pp - 1)`` for ``v`` stages per process.
        stages_per_rank: Stages per process, ``v``: 1, or at least 2 with ``interleaved_1f1b``, which then sends
            activations ``v`` times as often.
    """

    schedule: Schedule = "1f1b"
    microbatches: int = 4
    stages_per_rank: int = 1

    def check(self, processes: int) -> None:
        """Raises :class:`SetupError` in one line when this schedule cannot run on, or would leave idle, a pipeline
        of ``processes`` processes."""
        n, v = self.microbatches, self.stages_per_rank
        if (self.schedule == "interleaved_1f1b") != (v > 1):
            raise SetupError(
                f"pipeline_schedule={self.schedule} with stages_per_rank={v}: interleaved_1f1b runs several stages per "
                "process and the other schedules one; set --trainer.strategy.init_args.stages_per_rank 2 (or more) "
                "with interleaved_1f1b, 1 otherwise"
            )
        if n < processes or (v > 1 and n % processes):
            fix = "a multiple of" if v > 1 else "at least"
            raise SetupError(
                f"microbatches={n} cannot keep the {processes} pipeline processes busy: set "
                f"--trainer.strategy.init_args.microbatches to {fix} pipeline_parallel_size"
            )


@dataclass(frozen=True)
class StagePlan:
    """The layers one stage runs: ``encoder`` and ``decoder`` index ranges (either may be empty)."""

    index: int
    stages: int
    encoder: range
    decoder: range
    num_encoder_layers: int

    @property
    def first(self) -> bool:
        return self.index == 0

    @property
    def last(self) -> bool:
        return self.index == self.stages - 1

    @property
    def finishes_encoder(self) -> bool:
        """The encoder's last layer is here, so are its final norm and pooling."""
        return bool(self.encoder) and self.encoder.stop == self.num_encoder_layers

    @property
    def receives_memory(self) -> bool:
        """The pair this stage receives is ``(memory, decoder states)``, not ``(encoder states, target embeddings)``."""
        return not self.first and not self.encoder

    @property
    def sends_memory(self) -> bool:
        return self.finishes_encoder or self.receives_memory


def plan_stages(num_encoder_layers: int, num_decoder_layers: int, stages: int) -> list[StagePlan]:
    """Contiguous runs of the ``E + D`` layers (at least ``stages``), sizes differing by at most one, earlier
    stages the longer."""
    total = num_encoder_layers + num_decoder_layers
    plans, start = [], 0
    for index in range(stages):
        stop = start + total // stages + (index < total % stages)
        encoder = range(min(start, num_encoder_layers), min(stop, num_encoder_layers))
        decoder = range(
            max(start, num_encoder_layers) - num_encoder_layers, max(stop, num_encoder_layers) - num_encoder_layers
        )
        plans.append(StagePlan(index, stages, encoder, decoder, num_encoder_layers))
        start = stop
    return plans


class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the gradient contiguous: the gradient of a received activation is sent back to
    the previous stage, and gloo refuses a non-contiguous tensor (the carried ``memory``'s gradient can be one)."""

    @staticmethod
    def forward(ctx: object, x: Tensor) -> Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: object, grad: Tensor) -> Tensor:
        return grad.contiguous()


class StageModule(nn.Module):
    """One stage of the pipeline over a :class:`~torch_handle.model.Transformer` whose other stages' layers were
    dropped: ``forward(*carried, src, tgt)`` returns the pair for the next stage, or logits on the last.

    Only the stage's own layers, embeddings, norms and output layer are its submodules; the Transformer they belong
    to is held but not registered, since under interleaving it also holds this process's other stages, which FSDP2
    shards as roots of their own (as torchtitan shards each of its model parts).
    """

    def __init__(self, model: Transformer, plan: StagePlan) -> None:
        super().__init__()
        self.__dict__["model"] = model  # not a submodule: see the class docstring
        self.plan = plan
        self.layers = nn.ModuleList(
            [model.encoder_layers[i] for i in plan.encoder] + [model.decoder_layers[i] for i in plan.decoder]
        )
        self.ends = nn.ModuleList(
            getattr(model, name)
            for name, kept in _ends(model, [plan]).items()
            if kept and getattr(model, name, None) is not None
        )

    def forward(self, *carried: Tensor, src: Tensor, tgt: Tensor) -> Tensor | tuple[Tensor, ...]:
        m, plan = self.model, self.plan
        if plan.first:
            x, y = m.embed_source(src), m.embed_target(tgt)
            biases = [b.contiguous() for b in m.relative_biases(src.shape[1], tgt.shape[1])]  # gloo sends no views
        else:
            x, y, *biases = (_ContiguousGrad.apply(t) for t in carried)
        # T5's position biases (see _carried): the encoder's while the encoder runs, and the decoder's
        encoder_bias = biases.pop(0) if len(biases) == 2 else None
        decoder_bias = biases[0] if biases else None
        if plan.encoder:
            x = m.run_encoder(x, m.encoder_context(src, bias=encoder_bias), plan.encoder)
        if plan.finishes_encoder:
            x, encoder_bias = m.finish_encoder(x, src), None  # now memory
        if plan.decoder:
            context = m.decoder_context(tgt, m.memory_padding(src), bias=decoder_bias)
            y = m.run_decoder(y, x, context, plan.decoder)
        if plan.last:
            return m.logits(y)
        return tuple(t for t in (x, y, encoder_bias, decoder_bias) if t is not None)


def _ends(model: Transformer, plans: list[StagePlan]) -> dict[str, bool]:
    """Whether ``plans`` run each module besides the layers: embeddings, final norms, the output layer."""
    first, last = any(p.first for p in plans), any(p.last for p in plans)
    return {
        "src_embed": first,
        "src_pos": first,
        "tgt_pos": first,
        "src_embed_norm": first,  # BART's LayerNorms over the embeddings
        "tgt_embed_norm": first,
        "src_relative": first,  # T5's tables: the first stage computes the biases every stage gets
        "tgt_relative": first,
        # The target table: looked up on the first stage, and the output layer's weight on the last when tied.
        "tgt_embed": first or (last and model.config.tie_embeddings),
        "lm_head": last,
        "encoder_norm": any(p.finishes_encoder for p in plans),
        "decoder_norm": last,
    }


def _drop_other_stages(model: Transformer, plans: list[StagePlan]) -> None:
    """Replaces the layers no plan of ``plans`` runs by parameter-free placeholders (indices, hence names, stay) and
    drops the embeddings, norms and output layer none of them runs."""
    for i in set(range(len(model.encoder_layers))).difference(*(p.encoder for p in plans)):
        model.encoder_layers[i] = nn.Identity()
    for i in set(range(len(model.decoder_layers))).difference(*(p.decoder for p in plans)):
        model.decoder_layers[i] = nn.Identity()
    for name, kept in _ends(model, plans).items():
        if not kept and getattr(model, name, None) is not None:
            setattr(model, name, None)


class Pipeline:
    """This process's stages of the model on the ``pipeline_parallel`` mesh dimension, and the schedule that runs
    a batch through all stages. Made by :func:`apply_pipeline_parallel`."""

    def __init__(self, stages: list[StageModule], mesh: DeviceMesh, config: PipelineConfig) -> None:
        self.stages, self.config = stages, config
        self.model: Transformer = stages[0].model
        self.group = mesh.get_group()
        self.holds_first = any(s.plan.first for s in stages)
        self.is_last = any(s.plan.last for s in stages)
        self.tied = self.model.config.tie_embeddings and stages[0].plan.stages > 1

    def even_rows(self, src: Tensor, tgt: Tensor, labels: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The batch with filler rows up to a multiple of the micro-batches: a one-token source (end of sentence),
        an all-padding target; they change no other row and add nothing to the loss or its gradients."""
        c, n = self.model.config, self.config.microbatches
        extra = -src.shape[0] % n
        if not extra:
            return src, tgt, labels
        filler = src.new_full((extra, src.shape[1]), c.pad_id)
        filler[:, 0] = c.eos_id
        pad = tgt.new_full((extra, tgt.shape[1]), c.pad_id)
        return torch.cat((src, filler)), torch.cat((tgt, pad)), torch.cat((labels, pad))

    def _stage(self, module: StageModule, src: Tensor, tgt: Tensor, backward: bool) -> PipelineStage:
        """``module`` as a stage for this batch's shapes, from static metadata (gradients' shapes are the
        activations')."""
        c, plan = self.model.config, module.plan
        rows = src.shape[0] // self.config.microbatches
        dtype = next(module.parameters()).dtype
        meta = torch.device("meta")
        memory_len = -(-src.shape[1] // c.cross_downsample)

        heads = module.layers[0].self_attn.num_heads  # this process's, under tensor parallelism

        def carried(decoding: bool) -> tuple[Tensor, ...]:
            x_len = memory_len if decoding else src.shape[1]
            shapes = [(rows, x_len, c.d_model), (rows, tgt.shape[1], c.d_model)]
            if c.position == "relative":  # T5's position biases, the encoder's until the encoder is done
                shapes += [(1, heads, n, n) for n in ((tgt.shape[1],) if decoding else (src.shape[1], tgt.shape[1]))]
            return tuple(torch.empty(s, dtype=dtype, device=meta, requires_grad=backward) for s in shapes)

        inputs = () if plan.first else carried(plan.receives_memory)
        outputs = (
            torch.empty(rows, tgt.shape[1], c.tgt_vocab_size, dtype=dtype, device=meta, requires_grad=backward)
            if plan.last
            else carried(plan.sends_memory)
        )
        return PipelineStage(
            module, plan.index, plan.stages, src.device, input_args=inputs, output_args=outputs, group=self.group
        )

    def _schedule(
        self, src: Tensor, tgt: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor], backward: bool
    ) -> PipelineScheduleSingle | ScheduleInterleaved1F1B:
        """A schedule over this process's stages built for this batch's shapes."""
        stages = [self._stage(module, src, tgt, backward) for module in self.stages]
        n = self.config.microbatches
        if self.config.schedule == "interleaved_1f1b":
            return ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
        return SCHEDULES[self.config.schedule](stages[0], n, loss_fn=loss_fn, scale_grads=False)

    def step(self, src: Tensor, tgt: Tensor, labels: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        """Forward and backward of every micro-batch; ``loss_fn(logits, labels)`` of each is what it backpropagates
        (sum-reduced: gradients are not divided by the micro-batch count). Gradients accumulate into ``.grad``."""
        src, tgt, labels = self.even_rows(src, tgt, labels)
        # After a schedule's step an FSDP2 stage holds only that step's gradients: an earlier step's were lost
        # (measured with torch 2.13, tests/pipeline_worker.py). Set aside and added back, for gradient accumulation.
        params = [p for p in self.model.parameters() if p.grad is not None]
        earlier = [p.grad for p in params]
        for p in params:
            p.grad = None
        self._schedule(src, tgt, loss_fn, backward=True).step(target=labels, src=src, tgt=tgt)
        for p, grad in zip(params, earlier):
            p.grad = grad if p.grad is None else p.grad + grad

    def eval(self, src: Tensor, tgt: Tensor, labels: Tensor, loss_fn: Callable[[Tensor, Tensor], Tensor]) -> None:
        """Forward passes only, ``loss_fn`` called on each micro-batch's logits on the last stage."""
        src, tgt, labels = self.even_rows(src, tgt, labels)
        self._schedule(src, tgt, loss_fn, backward=False).eval(target=labels, src=src, tgt=tgt)

    def from_last_stage(self, values: Tensor) -> Tensor:
        """``values`` as the process holding the last stage has them, on every process (the others pass zeros)."""
        values = values if self.is_last else torch.zeros_like(values)
        dist.all_reduce(values, group=self.group)
        return values

    def _tied(self) -> nn.Parameter | None:
        """This process's copy of the tied embedding: on the first stage (lookup) and the last (output layer)."""
        if not self.tied or not (self.holds_first or self.is_last):
            return None
        return self.model.tgt_embed.weight

    def sync_tied_grads(self) -> None:
        """Adds the tied embedding's gradients of the first stage and the last, as the whole model's single parameter
        would have them (Megatron's embedding group). Other processes join the collective with zeros."""
        if not self.tied:
            return
        weight = self._tied()
        if weight is None:
            c = self.model.config
            grad = torch.zeros(c.tgt_vocab_size, c.d_model, device=next(self.model.parameters()).device)
        else:
            if weight.grad is None:
                weight.grad = torch.zeros_like(weight)
            grad = weight.grad
        dist.all_reduce(grad.to_local() if isinstance(grad, DTensor) else grad, group=self.group)

    def clip_grad_norm_(self, max_norm: float) -> Tensor:
        """Clips every stage's gradients by their norm over the whole model, the tied weight counted once."""
        params = [p for p in self.model.parameters() if p.grad is not None]
        duplicate = self._tied() if self.is_last and not self.holds_first else None
        norm = torch.nn.utils.get_total_norm([p.grad for p in params if p is not duplicate], foreach=True)
        if isinstance(norm, DTensor):  # sharded by FSDP2: the norm over the data-parallel shards
            norm = norm.full_tensor()
        squared = norm.float() ** 2
        dist.all_reduce(squared, group=self.group)
        total = squared.sqrt()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total, foreach=True)
        return total


def check_pipeline_parallel(config: TransformerConfig, processes: int, pipeline: PipelineConfig) -> None:
    """Raises :class:`SetupError` in one line when ``pipeline`` cannot cut a model of ``config`` over ``processes``
    (the strategy asks before the run folder is made; :func:`apply_pipeline_parallel` asks again)."""
    pipeline.check(processes)
    stages, layers = processes * pipeline.stages_per_rank, config.num_encoder_layers + config.num_decoder_layers
    if stages > layers:
        raise SetupError(
            f"pipeline_parallel_size={processes} x stages_per_rank={pipeline.stages_per_rank} stages exceed the "
            f"{layers} encoder and decoder layers: every stage needs one; choose fewer stages"
        )


def apply_pipeline_parallel(model: Transformer, mesh: DeviceMesh, config: PipelineConfig) -> list[StageModule]:
    """Keeps this process's stages of ``model`` on the 1-D ``mesh`` (in place: the other stages' layers are dropped)
    and returns them as modules whose ``forward`` is the stage's; shard them further, then wrap them in a
    :class:`Pipeline`.

    Raises:
        SetupError: More stages than layers, or settings :meth:`PipelineConfig.check` refuses.
    """
    c = model.config
    pp, v = mesh.size(), config.stages_per_rank
    check_pipeline_parallel(c, pp, config)
    plans = plan_stages(c.num_encoder_layers, c.num_decoder_layers, pp * v)[mesh.get_local_rank() :: pp]
    _drop_other_stages(model, plans)
    return [StageModule(model, plan) for plan in plans]
