"""``cli.py`` commands without a launch each: run in the test process (:func:`in_this_process`), or several in turn
in one launched process (:func:`cli_commands`), which pay one start-up, Lightning's import above all, between them.

``python tests/one_process.py OUT.json ARGS_JSON...`` is that launched process: each ``ARGS_JSON``, one command's
arguments as a JSON list, runs through ``torch_handle.cli.command`` (the ``cli.py`` entry point) in turn, with the
process's standard output and error (file descriptors 1 and 2, so logging and C code are caught too) captured apart;
``OUT.json`` gets ``[{"returncode", "stdout", "stderr"}, ...]`` in order. An exception that escapes a command is
printed with its traceback and exits 1, as Python would.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import traceback
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tests.helpers import ROOT, RUN_TIMEOUT, check, cli  # noqa: E402
from torch_handle.cli import command, main  # noqa: E402


def in_this_process(args: list[str], root: Path) -> None:
    """``cli.py ARGS`` in this process, writing under ``root``: one process of the default strategy (no process
    group), from the repository root and on one intra-op thread as a launch is (:func:`~tests.helpers.cli`,
    ``OMP_NUM_THREADS``), the working directory and environment (Lightning exports its seed) restored after. A fit's
    run folder stays locked until this process ends: never one that a launch uses next."""
    threads, environ, cwd = torch.get_num_threads(), dict(os.environ), Path.cwd()
    torch.set_num_threads(1)
    os.chdir(ROOT)
    try:
        main([*args, "--trainer.default_root_dir", str(root), "--trainer.strategy", "auto"])
    except SystemExit as err:
        pytest.fail(f"{args[0]} in this process exited: {err}")
    finally:
        os.chdir(cwd)
        torch.set_num_threads(threads)
        os.environ.clear()
        os.environ.update(environ)


def cli_commands(commands: list[list[str]], timeout: float = RUN_TIMEOUT) -> list[subprocess.CompletedProcess]:
    """What ``python cli.py ARGS`` gives for each ``ARGS`` of ``commands``, the commands run in turn in one launched
    process: for commands that end before loading anything, as a refused input does."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "results.json"
        check(cli([str(out), *map(json.dumps, commands)], timeout, script=__file__))
        results = json.loads(out.read_text())
    return [
        subprocess.CompletedProcess([sys.executable, "cli.py", *args], r["returncode"], r["stdout"], r["stderr"])
        for args, r in zip(commands, results, strict=True)
    ]


def _exit_status(args: list[str]) -> int:
    """``python cli.py ARGS``'s exit status, its output written to this process's descriptors 1 and 2."""
    sys.argv = ["cli.py", *args]
    try:
        command()
    except SystemExit as exit_:
        if isinstance(exit_.code, str):  # as Python reports it at exit
            sys.stderr.write(exit_.code + "\n")
            return 1
        return exit_.code or 0
    except BaseException:  # noqa: BLE001 - reported as the process would report it
        traceback.print_exc()
        return 1
    return 0


def _captured(args: list[str], folder: Path) -> dict[str, int | str]:
    streams = {"stdout": folder / "stdout", "stderr": folder / "stderr"}
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    try:
        with streams["stdout"].open("w") as out, streams["stderr"].open("w") as err:
            os.dup2(out.fileno(), 1)
            os.dup2(err.fileno(), 2)
            try:
                status = _exit_status(args)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os.dup2(saved[0], 1)
                os.dup2(saved[1], 2)
    finally:
        for fd in saved:
            os.close(fd)
    return {"returncode": status, **{name: path.read_text(errors="replace") for name, path in streams.items()}}


def _main() -> None:
    out, *commands = sys.argv[1:]
    results = []
    for args in commands:
        with tempfile.TemporaryDirectory() as folder:
            results.append(_captured(json.loads(args), Path(folder)))
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    _main()
