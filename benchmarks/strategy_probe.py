"""The callback that ``bench_strategies.py`` adds to every rank's ``cli.py fit``: :class:`StrategyProbe` measures step
times, model-state bytes, activations kept for backward and peak RSS (what each means: ``bench_strategies.py``'s
docstring) and writes them to ``probe.rank{R}.json`` in the run folder for the parent to collect."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import common
import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.distributed.tensor import DTensor
from typing_extensions import override


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (tensor parallelism, FSDP2), or the tensor."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _storages(tensors: Iterable[torch.Tensor]) -> dict[int, int]:
    """Distinct storages (data pointer -> bytes) behind ``tensors``: views of one flat buffer count once."""
    found = {}
    for tensor in tensors:
        storage = _local(tensor).untyped_storage()
        if storage.nbytes():
            found[storage.data_ptr()] = storage.nbytes()
    return found


def _walk(obj: object, name: str, depth: int = 6, seen: set[int] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(attribute path, tensor) reachable from an optimizer or a strategy's wrapper through attributes, lists
    and dicts."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth < 0:
        return
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        yield name, obj
        if obj.grad is not None:
            yield f"{name}.grad", obj.grad
        children: Iterable[tuple[str, object]] = ((f"{name}.{k}", v) for k, v in vars(obj).items())
    elif isinstance(obj, dict):
        children = [*((f"{name}[key]", k) for k in obj), *((f"{name}[]", v) for v in obj.values())]
    elif isinstance(obj, list | tuple | set):
        children = ((f"{name}[]", v) for v in obj)
    elif isinstance(obj, torch.nn.Module) or not hasattr(obj, "__dict__"):
        return  # modules are covered by their parameters
    elif type(obj).__module__.split(".")[0] in ("torch", "deepspeed", "lightning"):
        children = ((f"{name}.{k}", v) for k, v in vars(obj).items())
    else:
        return
    for child_name, child in children:
        yield from _walk(child, child_name, depth - 1, seen)


def _innermost(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer holding Adam's ``exp_avg``/``exp_avg_sq`` (DeepSpeed wraps it)."""
    while not isinstance(optimizer, torch.optim.Optimizer) or hasattr(optimizer, "optimizer"):
        inner = getattr(optimizer, "optimizer", None)
        if inner is None or inner is optimizer:
            break
        optimizer = inner
    return optimizer


def model_state_bytes(trainer: L.Trainer, pl_module: L.LightningModule) -> dict[str, int]:
    """This rank's bytes of parameters, gradients, Adam moments and the strategy's other state tensors."""
    params = [p for p in pl_module.parameters()]
    params += [p.ds_tensor for p in params if hasattr(p, "ds_tensor")]  # ZeRO-3 partitions
    wrapper = trainer.strategy.model
    params += [m._handle.flat_param for m in wrapper.modules() if getattr(m, "_handle", None)]  # FSDP
    parts: dict[str, Any] = {}
    counted: dict[int, int] = {}

    def add(part: str, found: dict[int, int]) -> None:
        new = {k: v for k, v in found.items() if k not in counted}
        counted.update(new)
        parts[part] = sum(new.values())

    add("params", _storages(params))
    walked = [item for obj in (trainer.optimizers[0], wrapper) for item in _walk(obj, type(obj).__name__)]
    grads = [p.grad for p in params if p.grad is not None]
    grads += [t for name, t in walked if "grad" in name.lower() and "bucket" not in name.lower()]
    add("grads", _storages(grads))  # DeepSpeed's flat gradient partitions included
    torch_optimizer = _innermost(trainer.optimizers[0])
    # DeepSpeed's fp32 partitions: the torch optimizer's parameters (ZeRO-3 lends them only during the step).
    master = [*torch_optimizer.state, *(p for group in torch_optimizer.param_groups for p in group["params"])]
    add("master", _storages(master))
    add(
        "adam_moments", _storages(t for st in torch_optimizer.state.values() for t in st.values() if torch.is_tensor(t))
    )
    other = {k: v for k, v in _storages(t for _, t in walked).items() if k not in counted}
    add("other", other)
    names = {_local(t).untyped_storage().data_ptr(): name for name, t in reversed(walked)}  # the first path found
    parts["largest_other"] = [[names[k], other[k]] for k in sorted(other, key=other.get, reverse=True)[:3]]
    parts["total"] = sum(counted.values())
    gc.collect()
    parts["all_live_tensors"] = sum(_storages(o for o in gc.get_objects() if isinstance(o, torch.Tensor)).values())
    return parts


class _SavedActivations:
    """Bytes of the distinct storages autograd keeps for the backward pass while active, the module's parameters
    (also as FSDP gathers or DTensor shards them) left out: the activations a rank holds for backward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.storages: dict[int, int] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        params = {_local(p).untyped_storage().data_ptr() for p in self.module.parameters()}
        storage = _local(tensor).untyped_storage()
        if storage.data_ptr() not in params:
            self.storages[storage.data_ptr()] = storage.nbytes()
        return tensor

    def __enter__(self) -> _SavedActivations:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self._hooks.__exit__(*exc)


class StrategyProbe(Callback):
    """Records step times, model-state bytes and peak RSS of this rank into ``{root}/probe.rank{R}.json``."""

    def __init__(self) -> None:
        self.record: dict[str, Any] = {"wall": [], "cpu": []}
        self._start = (0.0, 0.0)
        self._saved: _SavedActivations | None = None

    @override
    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.record["parameters"] = sum(p.numel() for p in pl_module.parameters())

    @override
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, idx: int) -> None:
        # The step whose model state is measured; not in a pipeline, whose micro-batches' saved tensors come and go
        # inside its schedule (a sum of them would overstate, and freed storages are reused).
        if trainer.global_step == 1 and getattr(pl_module, "_pipeline", None) is None:
            self._saved = _SavedActivations(pl_module).__enter__()
        self._start = (time.perf_counter(), time.process_time())

    @override
    def on_before_backward(self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor) -> None:
        if self._saved is not None:
            self._saved.__exit__(None, None, None)
            self.record["activations"] = sum(self._saved.storages.values())
            self._saved = None

    @override
    def on_before_optimizer_step(
        self, trainer: L.Trainer, pl_module: L.LightningModule, optimizer: torch.optim.Optimizer
    ) -> None:
        if trainer.global_step == 1:
            self.record["state"] = model_state_bytes(trainer, pl_module)
            split = [
                p for p in pl_module.parameters() if isinstance(p, DTensor) and not p.placements[-1].is_replicate()
            ]
            self.record["split_fraction"] = sum(p.numel() for p in split) / self.record["parameters"]
            # A pipeline stage's share of the whole model (each parameter's global size: FSDP2 shards count whole).
            self.record["held_fraction"] = sum(p.numel() for p in pl_module.parameters()) / self.record["parameters"]

    @override
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any, batch: Any, idx: int
    ) -> None:
        self.record["wall"].append(time.perf_counter() - self._start[0])
        self.record["cpu"].append(time.process_time() - self._start[1])

    @override
    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.record["peak_rss"] = common.peak_rss_bytes()
        self.record["torch"] = torch.__version__
        path = Path(trainer.default_root_dir) / f"probe.rank{trainer.global_rank}.json"
        path.write_text(json.dumps(self.record))
