"""Files written whole or not at all: readers never see half a file, a failed write keeps the old one."""

from __future__ import annotations

import fcntl
import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch_handle.errors import SetupError

TEMP_SUFFIX = ".tmp"
"""Ends the name of a file being written (``.NAME.RANDOM.tmp`` beside ``NAME``); left behind only by a killed write."""


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary file in ``path``'s folder, renamed to ``path`` when the block ends without error.

    The file is flushed to disk (``fsync``) before the rename and the folder after it, so a crash or power cut
    leaves the old file or the new one, never an empty one. It ends with the mode the umask gives (``mkstemp``
    would make it 0600, unreadable by the rest of a team, and so does ``safetensors.save_file``, which writes the
    file anew). Beside the target, not under ``$TMPDIR``: a rename within one file system is atomic, a move
    across two is a copy.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
    mode = tmp.stat().st_mode & 0o777  # 0o666 less the umask
    try:
        yield tmp
        os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync(path.parent)


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``path``, renamed to ``path`` when the block ends without error.

    As :func:`atomic_path` for a folder of files; ``path`` must not exist, or be an empty folder (a rename never
    replaces a folder that holds files, so nothing a user has is lost).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    tmp.mkdir()
    try:
        yield tmp
        for file in tmp.iterdir():
            _fsync(file)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _fsync(path.parent)


def atomic_write_text(path: str | Path, text: str) -> None:
    """Writes ``text`` to ``path`` through :func:`atomic_path`."""
    with atomic_path(path) as tmp:
        tmp.write_text(text, encoding="utf-8")


_held: dict[Path, int] = {}  # run folders this process has locked: their lock files stay open until it exits


def lock_run_folder(folder: str | Path) -> None:
    """Claims ``folder`` for this process's run until it exits, or raises :class:`SetupError` naming the holder.

    Two runs in one folder would share ``version_0``, ``config.yaml`` and ``last.ckpt``. The lock is the
    kernel's (``flock``): it ends with the process however it ends, ``kill -9`` included, so it is never stale.
    """
    folder = Path(folder).resolve()
    if folder in _held:
        return
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / ".lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.read(fd, 32).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise SetupError(
            f"{folder} is in use by another run (pid {holder}); wait for it to end, or give this run its own "
            "--trainer.default_root_dir"
        ) from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[folder] = fd


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
