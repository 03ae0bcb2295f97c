"""The README and docs/ stand alone and stay navigable: every relative link names a file that exists,
every ``#anchor`` a heading of that file, and the README stays a front door (at most 200 lines)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def heading_anchors(text: str) -> set[str]:
    """The anchors a markdown renderer gives the headings of ``text`` (GitHub's rule: lower case,
    punctuation dropped except ``-`` and ``_``, spaces to ``-``; repeats get ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    out: set[str] = set()
    for line in FENCE.sub("", text).splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        out.add(slug if n == 0 else f"{slug}-{n}")
    return out


def broken_links(page: Path) -> list[str]:
    """One line per relative link of ``page`` whose file or anchor does not exist."""
    text = FENCE.sub("", page.read_text())
    problems = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z]+:", target):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            problems.append(f"{page.relative_to(ROOT)}: {target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in heading_anchors(dest.read_text()):
            problems.append(f"{page.relative_to(ROOT)}: {target}: no heading with that anchor")
    return problems


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path):
    problems = broken_links(page)
    assert not problems, "\n".join(problems)


def test_a_broken_link_is_reported_with_its_page(tmp_path):
    (tmp_path / "b.md").write_text("# Real heading\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#real-heading) [gone](c.md) [bad](b.md#no-such)\n")
    global ROOT
    saved, ROOT = ROOT, tmp_path
    try:
        assert broken_links(page) == ["a.md: c.md: no such file",
                                      "a.md: b.md#no-such: no heading with that anchor"]
    finally:
        ROOT = saved


def test_no_page_links_outside_the_project():
    """The docs stand alone: no link leaves the repository's tree."""
    outside = []
    for page in PAGES:
        for target in LINK.findall(FENCE.sub("", page.read_text())):
            if re.match(r"^[a-z]+:", target) or not target.split("#")[0]:
                continue
            dest = (page.parent / target.split("#")[0]).resolve()
            if ROOT not in dest.parents and dest != ROOT:
                outside.append(f"{page.relative_to(ROOT)}: {target}")
    assert not outside, "\n".join(outside)


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines; results and reference belong in docs/"
