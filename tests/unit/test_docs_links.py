"""The documentation's links hold: every relative link of README.md and docs/*.md names a
file that exists and, into a page, a heading that exists; every file in docs/data is
cited by a page, and the folder stays small (docs/benchmarks.md: today's numbers only)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
DATA = REPO / "docs" / "data"
DATA_MAX_BYTES = 2 * 1024 * 1024

_LINK = re.compile(r"\]\(([^)\s]+)\)")
_HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*$")
_FENCE = re.compile(r"^\s*```")


def _slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"`([^`]*)`", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _prose(page: Path) -> list[str]:
    """The page's lines outside fenced code blocks."""
    out, fenced = [], False
    for line in page.read_text().splitlines():
        if _FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append(line)
    return out


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for line in _prose(page):
        m = _HEADING.match(line)
        if m:
            slug = _slug(m.group(2))
            n = seen.get(slug, -1) + 1
            seen[slug] = n
            out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def test_the_slug_is_githubs() -> None:
    assert _slug("The paused hold: 60 s") == "the-paused-hold-60-s"
    assert _slug("SGLang's host tier (HiCache)") == "sglangs-host-tier-hicache"
    assert _slug("Where the targets stand (both builds, f894fd6)") == (
        "where-the-targets-stand-both-builds-f894fd6"
    )


@pytest.mark.parametrize("page", PAGES, ids=[p.name for p in PAGES])
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for line in _prose(page):
        for link in _LINK.findall(line):
            if link.startswith(("http://", "https://", "mailto:")):
                continue
            path, _, fragment = link.partition("#")
            target = (page.parent / path).resolve() if path else page
            if not target.exists():
                broken.append(f"{link}: no such file")
            elif fragment and target.suffix == ".md" and fragment not in anchors(target):
                broken.append(f"{link}: no such heading in {target.name}")
    assert broken == [], f"{page.name}: {broken}"


def test_every_data_file_is_cited_and_the_folder_stays_small() -> None:
    text = "\n".join(p.read_text() for p in PAGES)
    files = sorted(p for p in DATA.iterdir() if p.is_file())
    assert [p.name for p in files if p.name not in text] == []
    assert sum(p.stat().st_size for p in files) <= DATA_MAX_BYTES
