"""Several ``python cli.py`` commands in one process: ``python tests/cli_commands.py OUT.json ARGS_JSON...``.

Each ``ARGS_JSON`` is one command's arguments as a JSON list, run by ``torch_handle.cli.command`` (the ``cli.py``
entry point) in turn, with the process's standard output and error (file descriptors 1 and 2, so logging and C
code are caught too) captured apart; ``OUT.json`` gets ``[{"returncode", "stdout", "stderr"}, ...]`` in order. An
exception that escapes a command is printed with its traceback, as Python prints it, and exits 1. For commands that
end before they load anything (a refused input's one line): they pay one start-up between them. Run by
:func:`tests.helpers.cli_commands`.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from torch_handle.cli import command  # noqa: E402


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


def main() -> None:
    out, *commands = sys.argv[1:]
    results = []
    for args in commands:
        sys.stdout.flush()
        sys.stderr.flush()
        with tempfile.TemporaryDirectory() as folder:
            results.append(_captured(json.loads(args), Path(folder)))
    Path(out).write_text(json.dumps(results))


if __name__ == "__main__":
    main()
