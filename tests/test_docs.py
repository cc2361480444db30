"""The pages a newcomer reads render and point where they say: every code fence in README.md and docs/*.md
closes, every relative link resolves to a file or folder of the repository, and nothing the repository ships
refers to a file outside it (a fresh clone has only the repository)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "tools" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^ {0,3}(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")  # [text](target): inline links


def _unfenced(lines: list[str]) -> list[tuple[int, str]]:
    """(line number, text) of the lines outside code fences (links in code are not links)."""
    out, fenced = [], False
    for i, line in enumerate(lines, 1):
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            out.append((i, line))
    return out


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_code_fence_closes(page):
    fences = [i for i, line in enumerate(page.read_text().splitlines(), 1) if FENCE.match(line)]
    assert len(fences) % 2 == 0, f"{page.name}: the fence at line {fences[-1]} never closes"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for i, line in _unfenced(page.read_text().splitlines()):
        for target in LINK.findall(line):
            path = target.split("#", 1)[0]
            if not path or re.match(r"[a-z][a-z0-9+.-]*:", path):  # an anchor on the page, or a URL
                continue
            if not (page.parent / path).exists():
                broken.append(f"line {i}: {target}")
    assert not broken, f"{page.name}: links to nothing: {broken}"


def test_nothing_shipped_refers_to_a_file_outside_the_repository():
    shipped = [*PAGES, *ROOT.glob("jaxserve/**/*.py"), *ROOT.glob("tools/**/*.py"), *ROOT.glob("protos/*.proto")]
    outside = [
        f"{p.relative_to(ROOT)}:{i}"
        for p in shipped
        for i, line in enumerate(p.read_text().splitlines(), 1)
        if "../shared/" in line
    ]
    assert not outside, f"these refer to ../shared/, which a clone does not have: {outside}"
