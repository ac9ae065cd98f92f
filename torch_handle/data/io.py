"""Reading text and JSON-lines files, with one-line errors that name the file, the line and the fix."""

import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning.pytorch.utilities import rank_zero_warn

from torch_handle.data.corpora import missing
from torch_handle.errors import DataError


@dataclass(frozen=True, slots=True)
class Record:
    """One input from a file: its string fields, its list-of-strings fields, and the line it came from (for error
    messages)."""

    fields: dict[str, str]
    line: int
    lists: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)


def read_text(path: str | Path) -> str:
    """The whole file as text.

    Args:
        path: A UTF-8 file (a leading byte-order mark is dropped).

    Raises:
        DataError: The file is missing (naming the ``prepare`` command when it is a corpus file), a folder or
            no regular file (a device such as ``/dev/zero`` would be read forever), empty, or not UTF-8 (naming
            the first bad line). NUL bytes, which a text file never holds, are read with a warning.
    """
    path = Path(path)
    if path.is_dir():
        raise DataError(f"{path} is a folder, not a file; pass the path of a file in it")
    if path.exists() and not path.is_file():
        raise DataError(f"{path} is not a regular file (a device, a pipe or a socket); pass the path of a file")
    if not path.is_file():
        raise DataError(missing(path) or f"{path}: file not found; check the path")
    data = path.read_bytes()
    if b"\0" in data:
        line = data.count(b"\n", 0, data.index(b"\0")) + 1
        rank_zero_warn(
            f"{path}:{line}: {data.count(0)} NUL byte(s), which text never holds: is this the file you meant?"
        )
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as err:
        line = data.count(b"\n", 0, err.start) + 1
        raise DataError(f"{path}:{line}: not UTF-8 (byte 0x{data[err.start]:02x}); re-save the file as UTF-8") from None
    if not text.strip():
        raise DataError(f"{path}: file is empty; point to a file with data")
    return text


def read_lines(path: str | Path) -> list[str]:
    """The file's lines, whitespace-normalized (runs of spaces and tabs become one space).

    Only ``\\n`` ends a line (``\\r\\n`` too), never the other Unicode separators that ``str.splitlines``
    knows, so line ``i`` of one file stays aligned with line ``i`` of its parallel file.

    Args:
        path: A UTF-8 text file with one input per line.
    """
    lines = read_text(path).split("\n")
    if lines[-1] == "":
        lines.pop()
    return [" ".join(line.split()) for line in lines]


def read_parallel(source: str | Path, target: str | Path) -> tuple[list[tuple[str, str]], list[int]]:
    """Line-aligned (source, target) pairs from two files, and the line each pair is on.

    Pairs with a blank side are skipped (with one warning that counts them): a blank line is a gap in the
    corpus, not a sentence to translate into, or from, nothing.

    Args:
        source: Source-language file, one sentence per line.
        target: Target-language file, the translation on the same line number.
    """
    src, tgt = read_lines(source), read_lines(target)
    if len(src) != len(tgt):
        raise DataError(
            f"{source} has {len(src)} lines but {target} has {len(tgt)}; parallel files must be line-aligned"
        )
    lines = [line for line, (s, t) in enumerate(zip(src, tgt, strict=True), start=1) if s and t]
    if len(lines) < len(src):
        first = next(line for line, (s, t) in enumerate(zip(src, tgt, strict=True), start=1) if not s or not t)
        rank_zero_warn(
            f"{source} / {target}: skipped {len(src) - len(lines)} line pair(s) with a blank side (first at line "
            f"{first}); a pair needs a sentence on both sides"
        )
    return [(src[line - 1], tgt[line - 1]) for line in lines], lines


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
    records = []
    for line_no, line in enumerate(read_text(path).split("\n"), start=1):
        if line.strip():
            records.append(_parse_json_line(path, line_no, line, fields, setting or {}, lists))
    return records


def read_documents(path: str | Path, field: str, setting: str) -> list[Record]:
    """Inputs for prediction: JSON lines with ``field``, or plain text with one document per line.

    The format is decided once per file, by whether its first non-blank line is a JSON object, so a
    plain-text line that happens to start with ``{`` is not mistaken for broken JSON later on.

    Args:
        path: JSON-lines or plain-text file.
        field: The JSON field holding the document.
        setting: The option that names ``field``, for error messages.
    """
    lines = read_text(path).split("\n")
    first = next(line for line in lines if line.strip())
    if _is_json_object(first):
        return read_jsonl(path, [field], {field: setting})
    return [Record({field: line.strip()}, line_no) for line_no, line in enumerate(lines, start=1) if line.strip()]


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
