"""The command a user typed to run torch-handle, so that messages and ``--help`` name what they can run again; and
the shipped configs that ``--config NAME`` finds."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from torch_handle.errors import SetupError

PACKAGE = Path(__file__).resolve().parent
TOOLS = {
    "prepare": "torch_handle.data.prepare",
    "export": "torch_handle.export.__main__",
    "average": "torch_handle.average",
    "serve": "torch_handle.serve",
}
"""The subcommands that are plain argparse tools, and their modules (each also runs as ``python -m MODULE``)."""


def start() -> None:
    """The ``torch-handle`` process and ``python cli.py``: torch and Lightning take seconds to import, and a Ctrl-C
    meanwhile is one line and exit 130, as it is later in setup."""
    try:
        from torch_handle.cli import command
    except KeyboardInterrupt:
        sys.stderr.write("stopped by SIGINT (Ctrl-C) while starting: nothing was saved\n")
        sys.exit(130)
    command()


def typed_command(subcommand: str = "") -> str:
    """``torch-handle SUBCOMMAND`` as this process was started: ``torch-handle`` when installed, ``python cli.py``
    in a checkout, ``python -m torch_handle.cli`` (or the tool's own module, ``python -m torch_handle.export``);
    ``torch-handle`` from Python (the API, a notebook)."""
    argv0 = sys.argv[0] if sys.argv else ""
    module = _package_module(argv0)
    if module is not None and module == TOOLS.get(subcommand):
        return f"python -m {module.removesuffix('.__main__')}"
    if module is not None:
        base = "python -m torch_handle.cli"
    elif os.path.basename(argv0) == "cli.py":
        base = f"python {argv0}"
    else:
        base = "torch-handle"
    return f"{base} {subcommand}".rstrip()


def _package_module(argv0: str) -> str | None:
    """The module of this package that ``python -m`` ran as ``argv0``, if any."""
    if not argv0.endswith(".py"):
        return None
    path = Path(argv0).resolve()
    if not path.is_relative_to(PACKAGE):
        return None
    return ".".join(("torch_handle", *path.relative_to(PACKAGE).with_suffix("").parts))


def shipped_configs() -> Path:
    """The shipped configs, inside the package (the checkout's top-level `configs/` links here)."""
    return PACKAGE / "configs"


def config_path(value: str) -> str:
    """``--config`` takes a path or a shipped config's name (``demo``, ``zero2``, ``zero2.yaml``). A file of that
    name wins; a folder does not (the run folder ``demo/`` or the data folder ``multi30k/`` beside the user)."""
    if os.path.isfile(value):
        return value
    shipped = shipped_configs()
    for candidate in (shipped / value, shipped / f"{value}.yaml"):
        if os.sep not in value and candidate.is_file():
            return str(candidate)
    names = ", ".join(sorted(path.stem for path in shipped.glob("*.yaml")))
    raise SetupError(f"--config {value}: no such file, and no shipped config of that name (shipped: {names})")
