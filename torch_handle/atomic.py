"""Files written whole or not at all: readers never see half a file, a failed write keeps the old one; and the
temporary folder a process writes files for its own later reading in, removed when it exits."""

from __future__ import annotations

import atexit
import fcntl
import logging
import os
import re
import secrets
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from torch_handle.errors import SetupError

TEMP_SUFFIX = ".tmp"
"""Ends the name of the folder a write works in (``.NAME.RANDOM.tmp/`` beside ``NAME``); left behind only by a
killed write, and removed by the next write in that folder."""
_TEMP_NAME = re.compile(rf"\..+\.[0-9a-f]{{8}}{re.escape(TEMP_SUFFIX)}")
log = logging.getLogger(__name__)


@contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """A temporary file for ``path``, renamed to ``path`` when the block ends without error.

    The file is flushed to disk (``fsync``) before the rename and the folder after it, so a crash or power cut
    leaves the old file or the new one, never an empty one. It ends with the mode the umask gives (``mkstemp``
    would make it 0600, unreadable by the rest of a team, and so does ``safetensors.save_file``, which writes the
    file anew). It lies in a hidden folder of its own beside the target, not under ``$TMPDIR``: a rename within
    one file system is atomic, a move across two is a copy; and whatever a writer makes there (safetensors'
    own hidden temp file) goes with the folder, which a killed write leaves for the next write to remove
    (:func:`remove_leftovers`).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent)
    folder, lock = _locked_temp_folder(path)
    try:
        tmp = folder / path.name
        os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
        mode = tmp.stat().st_mode & 0o777  # 0o666 less the umask
        yield tmp
        os.chmod(tmp, mode)
        _fsync(tmp)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
        os.close(lock)
    _fsync(path.parent)


@contextmanager
def atomic_folder(path: str | Path) -> Iterator[Path]:
    """A temporary folder beside ``path``, renamed to ``path`` when the block ends without error.

    As :func:`atomic_path` for a folder of files; ``path`` must not exist, or be an empty folder (a rename never
    replaces a folder that holds files, so nothing a user has is lost).
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    remove_leftovers(path.parent)
    tmp, lock = _locked_temp_folder(path)
    try:
        yield tmp
        for file in tmp.iterdir():
            _fsync(file)
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        os.close(lock)
    _fsync(path.parent)


def remove_leftovers(folder: str | Path) -> None:
    """Removes the temporary files and folders that killed writes left in ``folder`` (``.NAME.RANDOM.tmp``).

    A write in progress holds a lock (``flock``) on its temporary folder until it ends, however it ends, so
    another process's live write is never touched.
    """
    for entry in Path(folder).glob(f".*{TEMP_SUFFIX}"):
        if not _TEMP_NAME.fullmatch(entry.name):
            continue
        try:
            fd = os.open(entry, os.O_RDONLY)
        except OSError:
            continue  # gone meanwhile, or not ours to read
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            log.info(f"removing {entry}, left by a write that was killed")
            if entry.is_dir():
                shutil.rmtree(entry, ignore_errors=True)
            else:
                entry.unlink(missing_ok=True)
        except BlockingIOError:
            pass  # a live write
        finally:
            os.close(fd)


def _locked_temp_folder(path: Path) -> tuple[Path, int]:
    """A new hidden folder beside ``path``, and the descriptor that holds its lock while this process writes."""
    folder = path.with_name(f".{path.name}.{secrets.token_hex(4)}{TEMP_SUFFIX}")
    folder.mkdir()
    lock = os.open(folder, os.O_RDONLY)
    fcntl.flock(lock, fcntl.LOCK_EX)
    return folder, lock


def temporary_folder() -> Path:
    """A new folder under ``$TMPDIR``, removed when the process exits: for files the run reads by path (a tokenizer
    taken from a checkpoint, merged weights)."""
    folder = Path(tempfile.mkdtemp(prefix="torch-handle-"))
    atexit.register(shutil.rmtree, folder, True)
    return folder


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
        error = _in_use(folder, fd)
        os.close(fd)
        raise error from None
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _held[folder] = fd


def check_run_folder_free(folder: str | Path) -> None:
    """Raises :class:`SetupError` naming the live run that holds ``folder`` (:func:`lock_run_folder`), if another
    process does (this process's runs are over: it holds their folders until it exits)."""
    folder = Path(folder).resolve()
    if folder in _held:
        return
    try:
        fd = os.open(folder / ".lock", os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        raise _in_use(folder, fd) from None
    finally:
        os.close(fd)


def _in_use(folder: Path, lock: int) -> SetupError:
    holder = os.read(lock, 32).decode(errors="replace").strip() or "?"
    return SetupError(
        f"{folder} is in use by another run (pid {holder}); wait for it to end, or give this run its own "
        "--trainer.default_root_dir"
    )


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
