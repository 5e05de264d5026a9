"""Every relative link in the README and docs/ names a file that exists, and an anchor its headings make."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
PAGES: Final = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])


def _anchors(text: str) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    return {
        re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
        for m in re.finditer(r"^#+ (.+)$", text, re.MULTILINE)
    }


def test_the_docs_folder_holds_the_long_read() -> None:
    assert {p.name for p in PAGES} >= {"README.md", "benchmarks.md", "internals.md", "structured-output.md"}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken = []
    for match in re.finditer(r"\]\(([^)\s]+)\)", text):
        link = match.group(1)
        if re.match(r"[a-z]+:", link):  # https:, mailto:
            continue
        target, _, anchor = link.partition("#")
        path = (page.parent / target) if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path.read_text(encoding="utf-8")):
            broken.append(f"{link}: no such heading")
    assert not broken, broken
