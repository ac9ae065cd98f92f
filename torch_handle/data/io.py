"""Reading text and JSON-lines files, with one-line errors that name the file, the line and the fix."""

import codecs
import dataclasses
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from lightning.pytorch.utilities import rank_zero_warn

from torch_handle.data.corpora import missing
from torch_handle.errors import DataError

BLOCK = 1 << 20  # bytes read at a time when a file is checked for streaming
PART_TEXT = 1 << 22  # characters of text a streamed part holds at most, whatever its number of examples
T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Record:
    """One input from a file: its string fields, its list-of-strings fields, and the line it came from (for error
    messages)."""

    fields: dict[str, str]
    line: int
    lists: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class TextSplit:
    """A split as read from disk, before tokenization.

    ``lines`` holds each example's line number, and ``source_origin``/``target_origin`` the files, so
    that an error about one example can point at it. ``references`` holds each example's references to score
    against when there are several (None: its target alone).
    """

    sources: list[str]
    targets: list[str] | None
    lines: list[int]
    source_origin: str
    target_origin: str
    references: list[tuple[str, ...]] | None = None

    def parts(self, size: int) -> Iterator["TextSplit"]:
        """The split in parts of ``size`` examples (the last one shorter)."""
        for i in range(0, len(self.sources), size):
            part = slice(i, i + size)
            yield TextSplit(
                self.sources[part],
                None if self.targets is None else self.targets[part],
                self.lines[part],
                self.source_origin,
                self.target_origin,
                None if self.references is None else self.references[part],
            )


def read_text(path: str | Path) -> str:
    """The whole file as text.

    Args:
        path: A UTF-8 file (a leading byte-order mark is dropped).

    Raises:
        DataError: The file is missing (naming the ``prepare`` command when it is a corpus file), a folder or
            no regular file (a device such as ``/dev/zero`` would be read forever), empty, or not UTF-8 (naming
            the first bad line). NUL bytes, which a text file never holds, are read with a warning.
    """
    path = _regular_file(path)
    check = _TextCheck(path)
    text = check.feed(path.read_bytes(), final=True)
    check.finish()
    return text


class TextLines:
    """A text file's lines as ``read_text(path).split("\\n")`` gives them, less a last empty one, read from disk a line
    at a time whenever they are iterated, so that the file need not fit in memory.

    Creating it reads the file once, a block at a time, for :func:`read_text`'s checks and messages: bad input is
    refused before any line is used.
    """

    def __init__(self, path: str | Path) -> None:
        """Checks the file and counts its lines.

        Args:
            path: A UTF-8 file (a leading byte-order mark is dropped).
        """
        self.path = _regular_file(path)
        check = _TextCheck(self.path)
        with open(self.path, "rb") as file:
            while block := file.read(BLOCK):
                check.feed(block)
        check.feed(b"", final=True)
        self.count = check.finish()

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[str]:
        # Only "\n" ends a line, as in read_text(...).split("\n"); "\r" and Unicode separators stay in it.
        with open(self.path, encoding="utf-8-sig", newline="\n") as file:
            for line in file:
                yield line.removesuffix("\n")


def chunked(items: Iterable[T], size: int, length: Callable[[T], int]) -> Iterator[list[T]]:
    """``items`` in lists of ``size``, or fewer where their ``length`` in characters reaches :data:`PART_TEXT` (long
    documents), drawn as each list is needed."""
    part: list[T] = []
    text = 0
    for item in items:
        part.append(item)
        text += length(item)
        if len(part) == size or text >= PART_TEXT:
            yield part
            part, text = [], 0
    if part:
        yield part


def read_lines(path: str | Path) -> list[str]:
    """The file's lines, whitespace-normalized (runs of spaces and tabs become one space).

    Only ``\\n`` ends a line (``\\r\\n`` too), never the other Unicode separators that ``str.splitlines``
    knows, so line ``i`` of one file stays aligned with line ``i`` of its parallel file.

    Args:
        path: A UTF-8 text file with one input per line.
    """
    return [_normalized(line) for line in _lines(read_text(path))]


def read_parallel(source: str | Path, target: str | Path) -> tuple[list[tuple[str, str]], list[int]]:
    """Line-aligned (source, target) pairs from two files, and the line each pair is on.

    Pairs with a blank side are skipped (with one warning that counts them): a blank line is a gap in the
    corpus, not a sentence to translate into, or from, nothing.

    Args:
        source: Source-language file, one sentence per line.
        target: Target-language file, the translation on the same line number.
    """
    src, tgt = _lines(read_text(source)), _lines(read_text(target))
    aligned = list(_aligned(source, target, src, tgt, (len(src), len(tgt))))
    return [(s, t) for _, s, t in aligned], [line for line, _, _ in aligned]


def stream_parallel(source: str | Path, target: str | Path) -> Iterator[tuple[int, str, str]]:
    """:func:`read_parallel`'s pairs a line at a time, as ``(line, source, target)``: the files are checked now, their
    alignment when the first pair is drawn, and the skipped pairs are counted after the last.

    Args:
        source: Source-language file, one sentence per line.
        target: Target-language file, the translation on the same line number.
    """
    src, tgt = TextLines(source), TextLines(target)
    return _aligned(source, target, src, tgt, (len(src), len(tgt)))


def _aligned(
    source: str | Path, target: str | Path, src: Iterable[str], tgt: Iterable[str], counts: tuple[int, int]
) -> Iterator[tuple[int, str, str]]:
    """``(line, source, target)``, normalized, of each pair of lines with text on both sides; ``counts`` are the
    files' line counts."""
    if counts[0] != counts[1]:
        raise DataError(
            f"{source} has {counts[0]} lines but {target} has {counts[1]}; parallel files must be line-aligned"
        )
    skipped, first = 0, 0
    for line, (s, t) in enumerate(zip(map(_normalized, src), map(_normalized, tgt), strict=True), start=1):
        if s and t:
            yield line, s, t
        else:
            skipped, first = skipped + 1, first or line
    if skipped:
        rank_zero_warn(
            f"{source} / {target}: skipped {skipped} line pair(s) with a blank side (first at line "
            f"{first}); a pair needs a sentence on both sides"
        )


def read_jsonl(
    path: str | Path, fields: Sequence[str], setting: dict[str, str] | None = None, lists: Sequence[str] = ()
) -> list[Record]:
    """The given string fields of each JSON object in a JSON-lines file; blank lines are skipped.

    Args:
        path: One JSON object per line.
        fields: Field names every object must have, with string values.
        setting: For each field, the option that names it (e.g. ``--data.summary_field``), so the error
            for a missing field can say which option to change.
        lists: Field names an object may have, each a non-empty list of strings (read into ``Record.lists``).
    """
    return list(_records(path, read_text(path).split("\n"), fields, setting or {}, lists))


def stream_jsonl(
    path: str | Path, fields: Sequence[str], setting: dict[str, str] | None = None, lists: Sequence[str] = ()
) -> Iterator[Record]:
    """:func:`read_jsonl`'s records a line at a time (the file is checked now, each line when it is drawn); its
    arguments are :func:`read_jsonl`'s."""
    return _records(path, TextLines(path), fields, setting or {}, lists)


def _records(
    path: str | Path, lines: Iterable[str], fields: Sequence[str], setting: dict[str, str], lists: Sequence[str]
) -> Iterator[Record]:
    for line_no, line in enumerate(lines, start=1):
        if line.strip():
            yield _parse_json_line(path, line_no, line, fields, setting, lists)


def read_documents(path: str | Path, field: str, setting: str) -> list[Record]:
    """Inputs for prediction: JSON lines with ``field``, or plain text with one document per line.

    The format is decided once per file, by whether its first non-blank line is a JSON object, so a
    plain-text line that happens to start with ``{`` is not mistaken for broken JSON later on.

    Args:
        path: JSON-lines or plain-text file.
        field: The JSON field holding the document.
        setting: The option that names ``field``, for error messages.
    """
    if is_json_lines(path):
        return read_jsonl(path, [field], {field: setting})
    lines = read_text(path).split("\n")
    return [Record({field: line.strip()}, line_no) for line_no, line in enumerate(lines, start=1) if line.strip()]


def is_json_lines(path: str | Path) -> bool:
    """Whether the file's first non-blank line is a JSON object: how :func:`read_documents` tells JSON lines from
    plain text."""
    return _is_json_object(first_line(path))


def first_line(path: str | Path) -> str:
    """The file's first non-blank line."""
    return next(line for line in read_text(path).split("\n") if line.strip())


def _regular_file(path: str | Path) -> Path:
    """``path``, refused in one line unless it is a regular file (see :func:`read_text`)."""
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a file; pass the path of a file in it")
    if path.exists() and not path.is_file():
        raise DataError(f"{path} is not a regular file (a device, a pipe or a socket); pass the path of a file")
    if not path.is_file():
        raise DataError(missing(path) or f"{path}: file not found; check the path")
    return path


class _TextCheck:
    """:func:`read_text`'s checks of a file's bytes, fed a block at a time: the NUL warning, then the UTF-8 and the
    empty-file errors, said once the whole file is seen."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.newlines = 0
        self.nuls = 0
        self.first_nul = 0  # its line
        self.bad: str | None = None  # the first UTF-8 error
        self.blank = True
        self.last = b""
        self._decoder = codecs.getincrementaldecoder("utf-8-sig")()

    def feed(self, data: bytes, final: bool = False) -> str:
        """``data``'s text (none once a byte is not UTF-8); ``final`` for the last block."""
        if not self.first_nul and b"\0" in data:
            self.first_nul = self.newlines + data.count(b"\n", 0, data.index(b"\0")) + 1
        self.nuls += data.count(0)
        text = ""
        if self.bad is None:
            try:
                text = self._decoder.decode(data, final)
            except UnicodeDecodeError as err:  # its bytes: this block's, after the few a sequence split left over
                line = self.newlines + err.object.count(b"\n", 0, err.start) + 1
                byte = err.object[err.start]
                self.bad = f"{self.path}:{line}: not UTF-8 (byte 0x{byte:02x}); re-save the file as UTF-8"
        self.blank = self.blank and not text.strip()
        self.newlines += data.count(b"\n")
        self.last = data[-1:] or self.last
        return text

    def finish(self) -> int:
        """Says what the file holds that text should not; the number of lines :func:`_lines` gives."""
        if self.nuls:
            rank_zero_warn(
                f"{self.path}:{self.first_nul}: {self.nuls} NUL byte(s), which text never holds: is this the file "
                "you meant?"
            )
        if self.bad is not None:
            raise DataError(self.bad)
        if self.blank:
            raise DataError(f"{self.path}: file is empty; point to a file with data")
        return self.newlines + (self.last != b"\n")


def _lines(text: str) -> list[str]:
    """``text``'s lines, split at ``\\n`` alone, less a last empty one."""
    lines = text.split("\n")
    if lines[-1] == "":
        lines.pop()
    return lines


def _normalized(line: str) -> str:
    """Runs of white space as one space, none at the ends."""
    return " ".join(line.split())


def _is_json_object(line: str) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except json.JSONDecodeError:
        return False


def _parse_json_line(
    path: str | Path, line_no: int, line: str, fields: Sequence[str], setting: dict[str, str], lists: Sequence[str]
) -> Record:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as err:
        raise DataError(
            f"{path}:{line_no}: not valid JSON ({err.msg} at column {err.colno}); each line must hold one JSON object"
        ) from None
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{line_no}: expected a JSON object, got {type(obj).__name__}")
    values = {}
    for field in fields:
        if field not in obj:
            present = ", ".join(sorted(obj)) or "none"
            option = f" or set {setting[field]}" if field in setting else ""
            raise DataError(f"{path}:{line_no}: no field {field!r} (fields present: {present}); add it{option}")
        if not isinstance(obj[field], str):
            raise DataError(f"{path}:{line_no}: field {field!r} is a {type(obj[field]).__name__}, expected a string")
        values[field] = obj[field]
    found = {}
    for name in (name for name in lists if name in obj):
        items = obj[name]
        if not isinstance(items, list) or not items or not all(isinstance(item, str) for item in items):
            raise DataError(f"{path}:{line_no}: field {name!r} must be a non-empty list of strings")
        found[name] = tuple(items)
    return Record(values, line_no, found)
