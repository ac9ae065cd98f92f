"""A training split tokenized once onto disk, read example by example, so that a corpus need not fit in memory.

The folder ``torch-handle prepare tokens`` writes holds plain arrays and JSON, nothing that runs code on load:

  pretokenized.json   format, version, example count, each file's size, the offsets' and tokenizer's sha256
  tokenizer.json      the tokenizer the ids come from (fit uses it, and refuses a run that has another)
  source.tokens       every example's source ids back to back, little-endian int32
  source.offsets      example ``i``'s ids are ``tokens[offsets[i]:offsets[i + 1]]``, little-endian int64
  target.tokens, target.offsets

Only the offsets are read into memory (16 bytes an example): they give every example's length up front, which
length bucketing needs. Ids are read per example with ``os.pread``, not ``numpy.memmap``: a mapping counts its
whole file against the address space (``ulimit -v``) and the pages it touches against resident memory, while a
read leaves both flat and the page cache to the kernel. A read stops at the ids a row can keep
(:meth:`PretokenizedDataset.read_at_most`): a long document costs what the collator keeps of it.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path

import numpy as np

from torch_handle.atomic import atomic_folder
from torch_handle.commands import typed_command
from torch_handle.data.batching import Example, ExampleDataset
from torch_handle.data.tokenizer import Tokenizer
from torch_handle.errors import DataError

FORMAT = "torch-handle-pretokenized"
VERSION = 1
META = "pretokenized.json"
TOKENIZER = "tokenizer.json"
SIDES = ("source", "target")
TOKEN = np.dtype("<i4")
OFFSET = np.dtype("<i8")


def refuse_existing(out: str | Path) -> None:
    """Refuses ``out`` in one line if it is a file or a folder that holds anything: a write never replaces it."""
    out = Path(out)
    if out.is_file() or (out.is_dir() and any(out.iterdir())):
        raise DataError(f"{out} already exists and is not empty: pass a new --out, or remove {out} first")


def write_pretokenized(
    out: str | Path, tokenizer: Tokenizer, rows: Iterable[tuple[list[list[int]], list[list[int]]]]
) -> int:
    """Writes a folder of pre-tokenized pairs, whole or not at all; the number of examples written.

    Args:
        out: The folder to write; it must not exist, or be empty.
        tokenizer: The tokenizer the ids come from.
        rows: Chunks of (source ids, target ids) lists, in example order; a chunk at a time is held in memory.
    """
    refuse_existing(out)
    with atomic_folder(out) as tmp:
        files = {
            f"{side}.{kind}": open(tmp / f"{side}.{kind}", "wb") for side in SIDES for kind in ("tokens", "offsets")
        }
        ends = dict.fromkeys(SIDES, 0)
        examples = 0
        try:
            for side in SIDES:
                files[f"{side}.offsets"].write(np.zeros(1, OFFSET).tobytes())
            for sources, targets in rows:
                if len(sources) != len(targets):
                    raise ValueError(f"a chunk has {len(sources)} sources but {len(targets)} targets")
                for side, chunk in zip(SIDES, (sources, targets), strict=True):
                    counts = np.fromiter(map(len, chunk), OFFSET, len(chunk))
                    files[f"{side}.offsets"].write((ends[side] + np.cumsum(counts, dtype=OFFSET)).tobytes())
                    ids = np.fromiter((i for row in chunk for i in row), TOKEN, int(counts.sum()))
                    files[f"{side}.tokens"].write(ids.tobytes())
                    ends[side] += int(counts.sum())
                examples += len(sources)
        finally:
            for file in files.values():
                file.close()
        describe(tmp, tokenizer, examples)
    return examples


def describe(folder: Path, tokenizer: Tokenizer, examples: int) -> None:
    """Writes ``folder``'s tokenizer and :data:`META` for the token and offset files it holds.

    The sizes of all files are recorded, and the sha256 of those read whole on opening (the offsets and the
    tokenizer); hashing the token files would read the whole corpus at every start.

    Args:
        folder: Holds ``{source,target}.{tokens,offsets}``.
        tokenizer: The tokenizer the ids come from.
        examples: The number of examples the offsets index.
    """
    tokenizer_json = tokenizer.to_str()
    (folder / TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
    files = {}
    for side in SIDES:
        files[f"{side}.tokens"] = {"bytes": (folder / f"{side}.tokens").stat().st_size}
        offsets, size = hashlib.sha256(), 0
        with open(folder / f"{side}.offsets", "rb") as file:  # a block at a time: they grow with the corpus
            while block := file.read(1 << 20):
                offsets.update(block)
                size += len(block)
        files[f"{side}.offsets"] = {"bytes": size, "sha256": offsets.hexdigest()}
    meta = {
        "format": FORMAT,
        "version": VERSION,
        "examples": examples,
        "vocab_size": tokenizer.vocab_size,
        "tokenizer_sha256": _sha256(tokenizer_json.encode()),
        "files": files,
    }
    (folder / META).write_text(json.dumps(meta, indent=1) + "\n", encoding="utf-8")


class PretokenizedDataset(ExampleDataset):
    """The examples of a :func:`write_pretokenized` folder, read from disk on demand (no texts: training needs ids).

    Opening checks the folder: a missing, foreign, newer or changed one (a file of another size, offsets or a
    tokenizer that fail their sha256, offsets that do not index the tokens) is refused in one line.
    """

    def __init__(self, folder: str | Path) -> None:
        """Opens and checks the folder.

        Args:
            folder: Written by ``torch-handle prepare tokens``.
        """
        self.folder = Path(folder)
        meta = _read_meta(self.folder)
        self.tokenizer_json = self._checked(TOKENIZER, meta["tokenizer_sha256"]).decode("utf-8")
        # The ids' bound comes from the tokenizer itself (its sha256 is checked), not from a field anyone can edit.
        self.vocab_size = Tokenizer.from_str(self.tokenizer_json).vocab_size
        if self.vocab_size != meta["vocab_size"]:
            self._refuse(f"{META} says {meta['vocab_size']} token ids, its tokenizer has {self.vocab_size}")
        self.offsets: dict[str, np.ndarray] = {}
        for side in SIDES:
            entry = meta["files"][f"{side}.offsets"]
            if self._size(f"{side}.offsets", entry["bytes"]) % OFFSET.itemsize:  # sized before it is read
                self._refuse(f"{side}.offsets is not a whole number of offsets")
            offsets = np.frombuffer(self._checked(f"{side}.offsets", entry["sha256"]), OFFSET)
            tokens = self._size(f"{side}.tokens", meta["files"][f"{side}.tokens"]["bytes"])
            if len(offsets) != meta["examples"] + 1 or offsets[0] != 0 or np.any(np.diff(offsets) < 0):
                self._refuse(f"{side}.offsets does not index {meta['examples']} examples")
            if int(offsets[-1]) * TOKEN.itemsize != tokens:  # a Python int: no int64 wrap-around
                self._refuse(f"{side}.offsets ends at {offsets[-1]} tokens, {side}.tokens has {tokens // 4}")
            self.offsets[side] = offsets
        self._descriptors: dict[str, int] = {}
        self._pid = -1
        self._most: dict[str, int | None] = dict.fromkeys(SIDES)

    def read_at_most(self, source: int, target: int) -> PretokenizedDataset:
        """Reads only each example's first ``source`` and ``target`` ids from now on (what the collator keeps, and
        more); returns the dataset."""
        self._most = {"source": source, "target": target}
        return self

    def __len__(self) -> int:
        return len(self.offsets["source"]) - 1

    def example(self, index: int) -> Example:
        """Example ``index``: its ids read from disk (at most :meth:`read_at_most`'s), empty texts."""
        source, target = (self._ids(side, index) for side in SIDES)
        return Example(source, "", target, "")

    def token_counts(self) -> tuple[np.ndarray, np.ndarray]:
        """Every example's source and target token counts, from the offsets alone."""
        return np.diff(self.offsets["source"]), np.diff(self.offsets["target"])

    def __getstate__(self) -> dict:
        """Pickled to spawned DataLoader workers without the open files (each process opens its own)."""
        return {**self.__dict__, "_descriptors": {}, "_pid": -1}

    def _ids(self, side: str, index: int) -> list[int]:
        if self._pid != os.getpid():  # a forked worker shares the parent's descriptors; pread keeps no position
            self._descriptors = {s: os.open(self.folder / f"{s}.tokens", os.O_RDONLY) for s in SIDES}
            self._pid = os.getpid()
        start, end = int(self.offsets[side][index]), int(self.offsets[side][index + 1])
        most = self._most[side]
        count = end - start if most is None else min(end - start, most)
        ids = np.frombuffer(os.pread(self._descriptors[side], count * TOKEN.itemsize, start * TOKEN.itemsize), TOKEN)
        # One reduction bounds both ends: a negative id reads as unsigned past any vocabulary.
        if len(ids) != count or (len(ids) and ids.view("<u4").max() >= self.vocab_size):
            self._refuse(f"{side}.tokens changed after it was written (example {index} reads wrong)")
        return ids.tolist()

    def _size(self, name: str, expected: int) -> int:
        path = self.folder / name
        size = path.stat().st_size if path.is_file() else -1
        if size != expected:
            found = "is missing" if size < 0 else f"has {size} bytes"
            self._refuse(f"{name} {found}, not the {expected} written (truncated or changed)")
        return size

    def _checked(self, name: str, sha256: str) -> bytes:
        path = self.folder / name
        if not path.is_file():
            self._refuse(f"{name} is missing")
        data = path.read_bytes()
        if _sha256(data) != sha256:
            self._refuse(f"{name} fails its sha256 (changed after it was written)")
        return data

    def _refuse(self, problem: str) -> None:
        raise DataError(f"{self.folder}: {problem}; write the folder again with {typed_command('prepare')} tokens")


def _read_meta(folder: Path) -> dict:
    """The folder's ``pretokenized.json``, refused unless this version of the format wrote it."""
    write = f"write one with {typed_command('prepare')} tokens --config CONFIG --out {folder}"
    if not folder.is_dir():
        raise DataError(f"--data.init_args.pretokenized {folder}: no such folder; {write}")
    try:
        meta = json.loads((folder / META).read_text(encoding="utf-8"))
        if meta.get("format") != FORMAT:
            raise ValueError
    except (OSError, UnicodeDecodeError, ValueError, AttributeError):
        raise DataError(f"{folder} is not a pre-tokenized folder (no {META} of torch-handle's); {write}") from None
    if meta.get("version") != VERSION:
        raise DataError(f"{folder}: format version {meta.get('version')}, this torch-handle reads {VERSION}; {write}")
    files = meta.get("files")
    names = [f"{side}.{kind}" for side in SIDES for kind in ("tokens", "offsets")]
    if not (
        type(meta.get("examples")) is int  # not a bool
        and meta["examples"] >= 0
        and isinstance(meta.get("vocab_size"), int)
        and isinstance(meta.get("tokenizer_sha256"), str)
        and isinstance(files, dict)
        and all(isinstance(files.get(n), dict) and isinstance(files[n].get("bytes"), int) for n in names)
        and all(isinstance(files[f"{side}.offsets"].get("sha256"), str) for side in SIDES)
    ):
        raise DataError(f"{folder}/{META} is damaged (a field is missing or of the wrong type); {write}")
    return meta


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()
