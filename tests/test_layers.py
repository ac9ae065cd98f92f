"""The package's imports point down only (STYLE.md): cli -> module/data/parallel -> model."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "torch_handle"

# What each layer may import from torch_handle, besides itself.
ALLOWED: dict[str, tuple[str, ...]] = {
    "model": (),
    "data": ("torch_handle.errors", "torch_handle.atomic", "torch_handle.commands", "torch_handle.jsonfiles"),
}


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return {n for n in names if n == "torch_handle" or n.startswith("torch_handle.")}


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_layer_imports_point_down(layer: str) -> None:
    own = f"torch_handle.{layer}"
    upward = {
        f"{path.relative_to(PACKAGE.parent)} imports {name}"
        for path in (PACKAGE / layer).rglob("*.py")
        for name in _imports(path)
        if not (name == own or name.startswith(own + ".")) and name not in ALLOWED[layer]
    }
    assert not upward, sorted(upward)


def test_model_imports_form_no_cycle() -> None:
    """``generation`` uses the transformer; the transformer never reaches back for generation."""
    graph = {
        f"torch_handle.model.{p.stem}": {n for n in _imports(p) if n.startswith("torch_handle.model.")}
        for p in (PACKAGE / "model").glob("*.py")
        if p.stem != "__init__"
    }

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(n == goal or (n not in seen and reaches(n, goal, seen | {n})) for n in graph.get(start, ()))

    cycles = sorted(m for m in graph if reaches(m, m, set()))
    assert not cycles, cycles
