"""``parallelize`` applies a run's techniques in one order, each only when its plan asks for it
(torch_handle/parallel/parallelize.py). The techniques themselves are tested on several processes elsewhere."""

from __future__ import annotations

import importlib
from typing import Any

import pytest
from conftest import tiny_config
from torch import nn

from torch_handle.model import Transformer
from torch_handle.parallel import (
    CONTEXT_PARALLEL,
    DATA_PARALLEL,
    PIPELINE_PARALLEL,
    TENSOR_PARALLEL,
    ParallelPlan,
    PipelineConfig,
    parallelize,
)

# The module, which the package's ``parallelize`` function shadows as an attribute.
parallelize_module = importlib.import_module("torch_handle.parallel.parallelize")


class _Mesh:
    """A device mesh's shape only: each named dimension a 1-D mesh of its size."""

    def __init__(self, **sizes: int) -> None:
        self.sizes = sizes
        self.mesh_dim_names = tuple(sizes)

    def __getitem__(self, name: str) -> _Mesh:
        return _Mesh(**{name: self.sizes[name]})

    def size(self) -> int:
        (size,) = self.sizes.values()
        return size

    def get_group(self) -> str:
        return f"group of {self.mesh_dim_names[0]}"


@pytest.fixture
def applied(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The steps ``parallelize`` takes, in order, with the techniques replaced by records of their calls."""
    steps: list[Any] = []

    def record(name: str, returns: Any = None) -> Any:
        def step(target: Any, *args: Any, **kwargs: Any) -> Any:
            steps.append((name, *(a.mesh_dim_names if isinstance(a, _Mesh) else a for a in args), *kwargs.items()))
            return returns if returns is not None else target

        return step

    monkeypatch.setattr(parallelize_module, "apply_pipeline_parallel", record("pipeline", returns=["stage"]))
    monkeypatch.setattr(parallelize_module, "apply_tensor_parallel", record("tensor"))
    monkeypatch.setattr(parallelize_module, "apply_context_parallel", record("context"))
    monkeypatch.setattr(parallelize_module, "apply_fully_shard_stages", record("fsdp2 stages"))
    monkeypatch.setattr(parallelize_module, "apply_fully_shard", record("fsdp2"))
    monkeypatch.setattr(parallelize_module, "Pipeline", lambda stages, mesh, config: ("pipeline of", stages))
    monkeypatch.setattr(nn.Module, "compile", lambda module, *args, **kwargs: steps.append(("compile",)))
    return steps


def test_the_techniques_apply_in_one_order(applied: list[Any]) -> None:
    model = Transformer(tiny_config())  # one encoder and one decoder layer
    mesh = _Mesh(**{DATA_PARALLEL: 2, PIPELINE_PARALLEL: 2, TENSOR_PARALLEL: 2})
    pipeline = PipelineConfig()
    plan = ParallelPlan(mesh, pipeline, _Mesh(**{CONTEXT_PARALLEL: 2}), compile=True)
    result = parallelize(model, plan)  # type: ignore[arg-type]  # fake meshes: shapes only
    assert applied == [
        ("pipeline", (PIPELINE_PARALLEL,), pipeline),
        ("tensor", (TENSOR_PARALLEL,), ("vocabulary", False)),  # a stage's vocabulary stays whole
        ("context", f"group of {CONTEXT_PARALLEL}"),
        ("compile",),
        ("compile",),
        ("fsdp2 stages", (DATA_PARALLEL,)),
    ]
    assert result == ("pipeline of", ["stage"])


def test_a_plan_applies_only_what_it_asks_for(applied: list[Any]) -> None:
    model = Transformer(tiny_config(activation_checkpointing=True))
    assert parallelize(model, ParallelPlan()) is None
    assert applied == [] and model.activation_checkpointing  # as built
    mesh = _Mesh(**{DATA_PARALLEL: 1, PIPELINE_PARALLEL: 1, TENSOR_PARALLEL: 2})
    assert parallelize(model, ParallelPlan(mesh)) is None  # type: ignore[arg-type]
    assert applied == [("tensor", (TENSOR_PARALLEL,), ("vocabulary", True)), ("fsdp2", (DATA_PARALLEL,))]
