"""A JSON file that must hold an object, read as data: anything else is one line of the caller's error type."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def json_object(path: Path, error: type[Exception], fix: str) -> dict[str, Any]:
    """The object in the JSON file ``path``; text that is not JSON, or JSON that is not an object, raises ``error``
    with one line ending in ``fix``."""
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise error(f"{path} is not JSON ({err}): {fix}") from None
    if not isinstance(value, dict):
        raise error(f"{path} holds no JSON object: {fix}")
    return value
