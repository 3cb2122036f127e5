"""The README stays a first page a newcomer reads in minutes, and the documentation holds together:
every relative link in README.md and docs/*.md leads to a file that exists and, where it names a
heading, to a heading that exists (GitHub's anchors); every docs page is listed in the README and says
what it is for under its title."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
DOCS = REPO / "docs"
MAX_README_LINES = 250

FENCE = re.compile(r"^\s*(```|~~~)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")
# [text](target) and ![alt](target); the text may hold `code` and one level of brackets
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
EXTERNAL = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")  # https:, mailto:, ...


def pages() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def prose_lines(text: str) -> list[tuple[int, str]]:
    """(line number, line) outside fenced code blocks: links and headings there are only text."""
    out, fenced = [], False
    for number, line in enumerate(text.splitlines(), 1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            out.append((number, line))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation (backticks, dots, quotes, parentheses)
    dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link in a heading anchors on its text
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """Every anchor a page's headings make, duplicates numbered as GitHub numbers them."""
    seen: dict[str, int] = {}
    out = set()
    for _, line in prose_lines(page.read_text(encoding="utf-8")):
        m = HEADING.match(line)
        if not m:
            continue
        base = slug(m.group(2))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """One line per relative link of ``page`` whose file or heading does not exist."""
    problems = []
    for number, line in prose_lines(page.read_text(encoding="utf-8")):
        for m in LINK.finditer(line):
            target = m.group(1)
            if EXTERNAL.match(target):
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(page.parent.parent) if page.parent != REPO else page.name}:{number}"
            if not dest.exists():
                problems.append(f"{where}: {target}: no file {dest}")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                problems.append(f"{where}: {target}: no heading with anchor #{anchor} in {dest.name}")
    return problems


def test_readme_is_short() -> None:
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) < MAX_README_LINES, (
        f"README.md has {len(lines)} lines (limit {MAX_README_LINES}): move detail into a docs/ page")


def test_every_relative_link_resolves() -> None:
    problems = [p for page in pages() for p in broken_links(page)]
    assert not problems, "\n".join(problems)


def test_links_are_found_and_checked(tmp_path: Path) -> None:
    """The checker sees links, images, anchors and code blocks the way a reader does (so the test
    above can fail)."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "plot.png").write_bytes(b"png")
    (tmp_path / "other.md").write_text("# Other page\n\n## The `GPU` step (measured)\n", encoding="utf-8")
    page = tmp_path / "page.md"
    page.write_text(
        "# Page\n\n## Arms side by side\n\n"
        "[ok](other.md) [ok](other.md#the-gpu-step-measured) ![plot](img/plot.png) [self](#arms-side-by-side)\n"
        "[`code` text](https://example.org/x) [gone](missing.md) ![gone](img/none.png)\n"
        "[bad anchor](other.md#the-gpu-step) [bad self](#arms)\n"
        "```\n[inside a code block](nowhere.md)\n```\n",
        encoding="utf-8")
    found = broken_links(page)
    assert len(found) == 4, found
    for target in ("missing.md", "img/none.png", "other.md#the-gpu-step", "#arms"):
        assert any(f": {target}: " in p for p in found), (target, found)
    assert anchors(tmp_path / "other.md") == {"other-page", "the-gpu-step-measured"}


@pytest.mark.parametrize("page", sorted(DOCS.glob("*.md")), ids=lambda p: p.name)
def test_docs_page_is_listed_and_says_what_it_is_for(page: Path) -> None:
    readme = README.read_text(encoding="utf-8")
    assert f"](docs/{page.name})" in readme, f"README's list of docs pages does not link {page.name}"
    lines = page.read_text(encoding="utf-8").splitlines()
    assert lines[0].startswith("# "), f"{page.name} starts without a title"
    first = next(line for line in lines[1:] if line.strip())
    assert not first.startswith(("#", "```", "|")), (
        f"{page.name}: the title is followed by {first!r}, not a line saying what the page is for")
