"""The README and the guides hold together: every relative link and anchor resolves, and the README stays a map."""

from __future__ import annotations

import re
import unicodedata
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *sorted((ROOT / "benchmarks").glob("*.md"))]
README_MAX_LINES = 220

_FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
_CODE = re.compile(r"`[^`\n]*`")
_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
_ANCHOR = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.IGNORECASE)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces as hyphens."""
    text = re.sub(r"<[^>]+>", "", heading).strip().lower()
    kept = (ch for ch in text if ch in "-_ " or unicodedata.category(ch)[0] in "LNM")
    return "".join(kept).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor ``page`` defines: its headings' (numbered as GitHub numbers repeats) and explicit ``<a id>``."""
    text = _FENCE.sub("", page.read_text(encoding="utf-8"))
    found: set[str] = set(_ANCHOR.findall(text))
    seen: dict[str, int] = {}
    for heading in _HEADING.findall(text):
        slug = _slug(heading)
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def links(page: Path) -> list[str]:
    """The link targets of ``page`` outside code blocks and code spans, web addresses left out."""
    text = _CODE.sub("", _FENCE.sub("", page.read_text(encoding="utf-8")))
    return [target for target in _LINK.findall(text) if not re.match(r"[a-z]+:", target)]


def broken(page: Path) -> list[str]:
    """``page``'s relative links whose file or anchor does not exist, each with the reason."""
    problems = []
    for target in links(page):
        path, _, fragment = target.partition("#")
        resolved = (page.parent / path).resolve() if path else page
        if not resolved.exists():
            problems.append(f"{target}: no such file")
        elif fragment and fragment not in anchors(resolved):
            problems.append(f"{target}: no anchor #{fragment} in {resolved.name}")
    return problems


def test_the_pages_are_found() -> None:
    assert {"README.md", "getting-started.md", "parallelism.md", "decoding.md", "reliability.md"} <= {
        page.name for page in PAGES
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_every_relative_link_and_anchor_resolves(page: Path) -> None:
    assert broken(page) == []


def test_the_checker_sees_a_broken_file_and_a_broken_anchor(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text('# A heading: with `code`\n\n<a id="kept"></a>\n', encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#a-heading-with-code) [ok](other.md#kept) [web](https://example.com/x#y)\n"
        "[gone](missing.md) [bad](other.md#nothing)\n```\n[in a code block](ignored.md)\n```\n",
        encoding="utf-8",
    )
    assert broken(page) == ["missing.md: no such file", "other.md#nothing: no anchor #nothing in other.md"]


def test_the_readme_stays_a_map() -> None:
    lines = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; long explanations belong in docs/"
