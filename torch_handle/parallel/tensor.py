"""Tensor parallelism in Megatron-LM's layout, on a DeviceMesh dimension, with PyTorch's DTensor.

Each attention layer keeps ``num_heads / tp`` heads per rank and each feed-forward ``d_ff / tp`` hidden units: the
first matrix of a block is split by output columns (query/key/value heads, ``linear1``'s units), the second by input
rows (``out_proj``, ``linear2``), so a block needs one all-reduce forward (after its second matrix) and one backward
(of its input's gradient), Megatron's ``g`` and ``f``.

The vocabulary is split too, as Megatron and torchtitan split it: each rank holds ``1/tp`` of the rows of the
embedding tables and of the output layer (one tied matrix stays one parameter, its lookup and its projection split the
same way), so a lookup is summed over the ranks and the logits come out split by vocabulary. Inside
:func:`sharded_logits` they stay split and the loss is computed on the shards (:func:`vocab_parallel_token_sums`,
PyTorch's ``loss_parallel``): no rank holds the ``(tokens, vocabulary)`` logits whole. Elsewhere (decoding, beam search,
the metrics) they are gathered, so everything downstream sees the usual tensor. Pipeline stages keep their tables
whole: the tied table's gradient is summed between the first and the last stage (``Pipeline.sync_tied_grads``), which
a split would have to follow. Norms and positions are replicated, but for T5's relative-bias tables, whose columns
(one per head) are split as the heads are.

Every parameter becomes a DTensor on the mesh (sharded or ``Replicate``), so ``state_dict``, gradient clipping,
``torch.distributed.checkpoint`` and FSDP2 see one model with its global shapes and names. The packed query/key/value
weight ``(3C, C)`` is split as three stacked matrices, each by heads (:data:`HEADS`), the layout the attention code
computes with; the weights keep their names and single-process layout, so checkpoints and exports are those of one
process.

Replicated activations stay equal on every rank because every rank draws the same dropout masks in the replicated
regions (Lightning seeds all ranks alike, and the sharded regions draw equally many numbers on every rank).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import torch.nn.functional as F
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, loss_parallel, parallelize_module
from torch.distributed.tensor.placement_types import _StridedShard

from torch_handle.errors import SetupError
from torch_handle.model import Transformer, TransformerConfig
from torch_handle.model.attention import MultiHeadAttention
from torch_handle.model.layers import FeedForward
from torch_handle.model.masks import MaskSpec

HEADS = _StridedShard(0, split_factor=3)
"""The packed ``(3C, C)`` query/key/value weight as three ``(C, C)`` matrices, each split by heads: rank ``r`` holds
``[q_r; k_r; v_r]``. FSDP2 shards such a weight on dim 1 (:mod:`torch_handle.parallel.sharding`)."""


_SHARDED_LOGITS: ContextVar[bool] = ContextVar("sharded_logits", default=False)


@contextmanager
def sharded_logits() -> Iterator[None]:
    """Within it, a vocabulary-split output layer returns its logits as a DTensor split by vocabulary, for
    :func:`vocab_parallel_token_sums`; outside, it gathers them (decoding and metrics need whole rows)."""
    token = _SHARDED_LOGITS.set(True)
    try:
        yield
    finally:
        _SHARDED_LOGITS.reset(token)


def vocab_parallel_token_sums(logits: DTensor, labels: Tensor, pad: int, eps: float) -> tuple[Tensor, Tensor, Tensor]:
    """:func:`torch_handle.loss.token_sums` of logits split by vocabulary, without gathering them: the same
    smoothed loss and NLL (summed over the targets that are not ``pad``) and their count, as plain tensors.

    The NLL is PyTorch's ``loss_parallel`` cross entropy. Its log-softmax backward passes the gradient through as the
    cross entropy's own (softmax minus one-hot), so the smoothing term cannot reuse that log-softmax: it is computed
    apart, as ``logsumexp - mean of the logits`` per token, from DTensor reductions over the split vocabulary.
    """
    labels = labels.reshape(-1)
    flat = logits.float().view(-1, logits.shape[-1])
    keep = labels != pad
    shift = flat.detach().amax(dim=-1, keepdim=True)  # cancels out; keeps exp() finite
    logsumexp = (flat - shift).exp().sum(dim=-1).log() + shift.squeeze(-1)
    weights = DTensor.from_local(keep.to(flat.dtype), flat.device_mesh, [Replicate()], run_check=False)
    smooth = ((logsumexp - flat.mean(dim=-1)) * weights).sum()
    with loss_parallel():
        nll = F.cross_entropy(flat, labels, ignore_index=pad, reduction="sum")
    return ((1 - eps) * nll + eps * smooth).to_local(), nll.to_local(), keep.sum()


def _shard_vocabulary(model: Transformer, mesh: DeviceMesh) -> None:
    """Splits the rows of the embedding tables and the output layer over the ranks (see the module's docstring)."""
    shared: dict[int, nn.Parameter] = {}

    def split(module: nn.Module) -> None:
        weight = module.weight
        if id(weight) not in shared:
            shared[id(weight)] = nn.Parameter(distribute_tensor(weight.data, mesh, [Shard(0)]))
        module.weight = shared[id(weight)]

    def keep(name: str, module: nn.Module, mesh: DeviceMesh) -> None:  # the weight is split already
        pass

    def replicated(module: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return (DTensor.from_local(args[0], mesh, [Replicate()], run_check=False), *args[1:])

    def summed(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> Tensor:  # each rank looked up its own rows
        return out.redistribute(mesh, [Replicate()]).to_local()

    def logits(module: nn.Module, out: DTensor, mesh: DeviceMesh) -> Tensor:
        if model.config.final_logits_bias:  # BART's and Marian's bias, each rank's share of the vocabulary
            bias = model.logits_bias.to(out.dtype)  # read at each call: moving the model replaces the buffer
            out = out + DTensor.from_local(bias, mesh, [Replicate()], run_check=False)
        return out if _SHARDED_LOGITS.get() else out.full_tensor()

    for embed in {id(m): m for m in (model.src_embed, model.tgt_embed) if m is not None}.values():
        split(embed)
        distribute_module(embed, mesh, keep, replicated, summed)
    if model.lm_head is not None:
        split(model.lm_head)
        distribute_module(model.lm_head, mesh, keep, replicated, logits)
        model.__class__ = VocabParallelTransformer


class VocabParallelTransformer(Transformer):
    """A :class:`~torch_handle.model.Transformer` whose output layer, split by vocabulary, adds ``final_logits_bias``
    to the split logits itself (a whole bias cannot be added to them). Made by :func:`_shard_vocabulary`."""

    def add_logits_bias(self, logits: Tensor) -> Tensor:
        return logits


def _enter_parallel_region(x: Tensor, mesh: DeviceMesh) -> Tensor:
    """Megatron's ``f``: identity forward; backward sums the gradient over the ranks, whose heads each used ``x``."""
    return DTensor.from_local(x, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class TensorParallelAttention(MultiHeadAttention):
    """A :class:`~torch_handle.model.attention.MultiHeadAttention` computing this rank's heads; ``out_proj`` (row
    parallel) sums the heads' contributions. Made by :func:`apply_tensor_parallel`, never built directly."""

    tp_mesh: DeviceMesh

    def packed_projection(self) -> tuple[Tensor, Tensor | None]:
        return _local_heads(self.in_proj, self.tp_mesh)

    def global_projection(self, x: Tensor) -> Tensor:
        return F.linear(x, *_local_heads(self.global_proj, self.tp_mesh))  # type: ignore[arg-type] - set

    def forward(self, x: Tensor, spec: MaskSpec, memory: Tensor | None = None, **kwargs: Any) -> Tensor:
        x = _enter_parallel_region(x, self.tp_mesh)
        if memory is not None:
            memory = _enter_parallel_region(memory, self.tp_mesh)
        return super().forward(x, spec, memory, **kwargs)


def _local_heads(packed: nn.Linear, mesh: DeviceMesh) -> tuple[Tensor, Tensor | None]:
    """This rank's rows ``[q_r; k_r; v_r]`` of a packed projection's weight and bias."""
    bias = packed.bias
    if bias is not None:  # T5 has none
        bias = bias.redistribute(mesh, [HEADS]).to_local()  # backward gathers its gradient
    return packed.weight.to_local(), bias


def _shard_attention(attention: MultiHeadAttention, mesh: DeviceMesh) -> None:
    for packed in filter(None, (attention.in_proj, attention.global_proj)):  # LED's global tokens have their own
        weight = distribute_tensor(packed.weight.data, mesh, [HEADS])
        packed.weight = nn.Parameter(weight, requires_grad=packed.weight.requires_grad)  # LED's may be frozen
        # The bias stays whole (3C numbers): FSDP2 could not shard a vector split this way once more and still gather
        # it right (its full_tensor() would interleave wrongly); each rank slices its heads out in the forward pass.
        if packed.bias is not None:
            bias = DTensor.from_local(packed.bias.data, mesh, [Replicate()])
            packed.bias = nn.Parameter(bias, requires_grad=packed.bias.requires_grad)
    parallelize_module(attention.out_proj, mesh, RowwiseParallel())
    attention.__class__ = TensorParallelAttention
    attention.tp_mesh = mesh
    attention.num_heads //= mesh.size()


def _replicate(module: nn.Module, mesh: DeviceMesh, shared: dict[int, nn.Parameter]) -> None:
    """Makes ``module``'s own parameters ``Replicate`` DTensors (a tied weight stays one parameter) and wraps its
    inputs and outputs, so it computes as before between plain-tensor neighbours."""

    def partition(name: str, m: nn.Module, mesh: DeviceMesh) -> None:
        if m is not module:
            return
        for key, param in list(m.named_parameters(recurse=False)):
            if id(param) not in shared:
                local = DTensor.from_local(param.data, mesh, [Replicate()], run_check=False)
                shared[id(param)] = nn.Parameter(local, requires_grad=param.requires_grad)
            setattr(m, key, shared[id(param)])

    def inputs(m: nn.Module, args: tuple, mesh: DeviceMesh) -> tuple:
        return tuple(
            DTensor.from_local(a, mesh, [Replicate()], run_check=False) if isinstance(a, Tensor) else a for a in args
        )

    def outputs(m: nn.Module, out: DTensor, mesh: DeviceMesh) -> Tensor:
        return out.to_local()

    distribute_module(module, mesh, partition, inputs, outputs)


def check_tensor_parallel(config: TransformerConfig, processes: int) -> None:
    """Raises :class:`SetupError` in one line when a model of ``config`` cannot split over ``processes`` (the
    strategy asks before the run folder is made; :func:`apply_tensor_parallel` asks again)."""
    if config.num_heads % processes or config.d_ff % processes:
        raise SetupError(
            f"tensor_parallel_size={processes} must divide transformer.num_heads ({config.num_heads}) and "
            f"transformer.d_ff ({config.d_ff}): choose a tensor_parallel_size that divides both"
        )


def apply_tensor_parallel(model: Transformer, mesh: DeviceMesh, vocabulary: bool = True) -> Transformer:
    """Splits ``model``'s attention heads and feed-forward units over the ranks of the 1-D ``mesh``, in place, and
    with ``vocabulary`` its embedding tables and output layer by vocabulary rows (a pipeline stage passes False).

    Raises:
        SetupError: The heads or the feed-forward width do not divide by the mesh size.
    """
    check_tensor_parallel(model.config, mesh.size())
    if vocabulary:
        _shard_vocabulary(model, mesh)
    shared: dict[int, nn.Parameter] = {}
    for module in list(model.modules()):
        if isinstance(module, MultiHeadAttention):
            _shard_attention(module, mesh)
        elif isinstance(module, FeedForward):
            plan = {"linear1": ColwiseParallel(), "linear2": RowwiseParallel()}
            if module.gate is not None:  # T5 v1.1's gate, multiplied unit by unit with linear1's output
                plan["gate"] = ColwiseParallel()
            parallelize_module(module, mesh, plan)
    for name in ("src_relative", "tgt_relative"):  # T5's bias tables (buckets, heads): this rank's heads' columns
        if getattr(model, name, None) is not None:
            parallelize_module(getattr(model, name), mesh, ColwiseParallel())
    for module in list(model.modules()):
        if any(not isinstance(p, DTensor) for p in module.parameters(recurse=False)):
            _replicate(module, mesh, shared)
    if model.config.position == "alibi":  # this rank's heads' slopes (a buffer outside the state dict)
        model.slopes = model.slopes.chunk(mesh.size())[mesh.get_local_rank()].clone()
    return model
