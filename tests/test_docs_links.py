"""Every relative link in the README and docs/ names a file that exists, and an anchor its headings make."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Final

import pytest

ROOT: Final = Path(__file__).resolve().parent.parent
DOCS: Final = ROOT / "docs"
PAGES: Final = sorted(
    {
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *DOCS.glob("*.md"),
        *(page for tree in ("ansible", "ops", "systemd") for page in (ROOT / tree).rglob("*.md")),
        *(ROOT / "tests").glob("*/README.md"),  # not deeper: tests/gpu/carry/ may hold an unpacked sdist
        *(ROOT / "tests" / "data").glob("*/README.md"),
    }
)
README_MAX_WORDS: Final = 2500  # a ten-minute read (STYLE.md, "Words"), code blocks and tables aside


def _prose(text: str) -> str:
    """`text` without its fenced code blocks (a `# comment` there is no heading, a link no link)."""
    return re.sub(r"^(```|~~~).*?^\1[^\n]*$", "", text, flags=re.MULTILINE | re.DOTALL)


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: link markup to its text, lower case, punctuation dropped, spaces to -."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip())
    return re.sub(r"[^\w\- ]", "", text.lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """Every anchor a page's headings make; a repeated heading gets -1, -2, ... as on GitHub."""
    seen: Counter[str] = Counter()
    out = set()
    for match in re.finditer(r"^#{1,6} +(.+?) *#*$", _prose(text), re.MULTILINE):
        base = anchor(match.group(1))
        out.add(f"{base}-{seen[base]}" if seen[base] else base)
        seen[base] += 1
    out |= set(re.findall(r"<a (?:name|id)=\"([^\"]+)\"", text))
    return out


def links(text: str) -> list[str]:
    """The targets of a page's markdown links and images, and of its HTML `src`/`href` attributes."""
    prose = re.sub(r"`[^`\n]*`", "", _prose(text))  # a code span is no link either
    found = re.findall(r"\]\(<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\)", prose)
    found += re.findall(r"^\[[^\]]+\]:\s+<?(\S+?)>?(?:\s|$)", prose, re.MULTILINE)  # reference definitions
    found += re.findall(r"\b(?:src|href)=\"([^\"]+)\"", prose)
    return found


def broken_links(page: Path, root: Path = ROOT) -> list[str]:
    """Each link of `page` that names no file under `root`, or no heading of the file it names."""
    broken = []
    for link in links(page.read_text(encoding="utf-8")):
        if re.match(r"[a-z][a-z0-9+.-]*:", link):  # https:, mailto:
            continue
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link}: no such file")
        elif root not in path.parents and path != root:
            broken.append(f"{link}: outside the repository")
        elif fragment and path.suffix == ".md" and fragment not in anchors(path.read_text(encoding="utf-8")):
            broken.append(f"{link}: no such heading in {path.relative_to(root)}")
    return broken


def test_the_docs_folder_holds_the_long_read() -> None:
    names = {p.name for p in DOCS.glob("*.md")}
    assert names >= {
        "api.md",
        "benchmarks.md",
        "configuration.md",
        "internals.md",
        "observability.md",
        "operations.md",
        "reliability.md",
        "security.md",
        "structured-output.md",
    }


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    assert not broken_links(page)


def test_the_readme_links_to_every_page_in_docs() -> None:
    linked = {Path(link.partition("#")[0]).name for link in links((ROOT / "README.md").read_text("utf-8"))}
    assert not {p.name for p in DOCS.glob("*.md")} - linked


def test_the_readme_is_a_ten_minute_read() -> None:
    prose = _prose((ROOT / "README.md").read_text(encoding="utf-8"))
    words = len(re.sub(r"^\|.*\|$", "", prose, flags=re.MULTILINE).split())
    assert words <= README_MAX_WORDS, f"README.md has {words} words of prose: move detail into docs/"


@pytest.mark.parametrize(
    ("heading", "expected"),
    [
        ("Quick start", "quick-start"),
        ("Usage, quotas and the audit log", "usage-quotas-and-the-audit-log"),
        ("Coding agents: Codex CLI and Claude Code", "coding-agents-codex-cli-and-claude-code"),
        ("Hostile requests (issue 14)", "hostile-requests-issue-14"),
        ("`models[].slots` and [the queue](x.md)", "modelsslots-and-the-queue"),
        ("Fields, one policy for every family", "fields-one-policy-for-every-family"),
    ],
)
def test_anchors_are_made_as_github_makes_them(heading: str, expected: str) -> None:
    assert anchor(heading) == expected


def test_a_repeated_heading_gets_a_numbered_anchor_and_code_blocks_make_none() -> None:
    text = "# Top\n\n## Notes\n\n```sh\n# not a heading\n```\n\n## Notes\n"
    assert anchors(text) == {"top", "notes", "notes-1"}


def test_a_broken_link_or_anchor_is_found(tmp_path: Path) -> None:
    (tmp_path / "other.md").write_text("# Other\n\n## Here\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md#here) [file](missing.md) [anchor](other.md#there) [self](#nowhere)\n"
        "`[code](span.md)`\n\n```\n[in](block.md)\n```\n",
        encoding="utf-8",
    )
    found = [b.split(":")[0] for b in broken_links(page, tmp_path)]
    assert found == ["missing.md", "other.md#there", "#nowhere"]
