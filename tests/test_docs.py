"""The documentation is checked like code: its Python examples run, its relative links resolve, and the README
stays a front door.

A ```python block runs, on its own in a fresh namespace, unless the line before it is ``<!-- no-run: REASON -->``;
the reason (a GPU, a running engine, a real model, a Redis server, the network) is what the skip reports. Each
example is self-contained so that a reader can paste it. ```bash blocks are never run: they are the commands that
work on real data and take minutes.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README_MAX_LINES = 200

PAGES = sorted([ROOT / "README.md", ROOT / "SPEC.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "spec").glob("*.md")])

FENCE = re.compile(r"^(\s*)(`{3,})(\S*)\s*$")
NO_RUN = re.compile(r"<!--\s*no-run:\s*(.*?)\s*-->")
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")


def _rel(page: Path) -> str:
    return page.relative_to(ROOT).as_posix()


def _blocks(page: Path) -> list[tuple[int, str, str, str | None]]:
    """(first line number, language, code, reason not to run) of every fenced block of ``page``."""
    lines = page.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence, lang = m.groups()
        prev = next((l for l in reversed(lines[:i]) if l.strip()), "")
        skip = NO_RUN.search(prev)
        body, j = [], i + 1
        while j < len(lines) and not (lines[j].strip() == fence):
            # fences inside list items are indented; the code is indented with them
            body.append(lines[j][len(indent):] if lines[j].startswith(indent) else lines[j])
            j += 1
        out.append((i + 2, lang, "\n".join(body) + "\n", skip.group(1) if skip else None))
        i = j + 1
    return out


def _prose(page: Path) -> str:
    """The page without its code blocks and inline code, where link syntax is not a link."""
    text = page.read_text(encoding="utf-8")
    text = re.sub(r"^(\s*)(`{3,}).*?^\1\2\s*$", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(page: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped (inline code's text kept), spaces to hyphens,
    repeats numbered."""
    # a fence's indent is spaces or tabs only: "\s*" would take a blank line before it too and pair the fence with
    # the next one that follows a blank line, dropping the headings between
    text = re.sub(r"^([ \t]*)(`{3,}).*?^\1\2[ \t]*$", "", page.read_text(encoding="utf-8"), flags=re.S | re.M)
    seen: dict[str, int] = {}
    anchors = set()
    for line in text.splitlines():
        m = re.match(r"^#{1,6}\s+(.*?)\s*#*\s*$", line)
        if not m:
            continue
        slug = re.sub(r"[^\w\- ]", "", m.group(1).lower()).replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def test_readme_is_short():
    n = len((ROOT / "README.md").read_text(encoding="utf-8").splitlines())
    assert n <= README_MAX_LINES, f"README.md has {n} lines; the rest belongs in docs/"


@pytest.mark.parametrize("page", PAGES, ids=_rel)
def test_relative_links_resolve(page: Path):
    broken = []
    for target in LINK.findall(_prose(page)):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto: are not checked offline
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target}: no heading with that anchor in {_rel(dest)}")
    assert not broken, f"{_rel(page)}: " + "; ".join(broken)


EXAMPLES = [(page, line, code, reason) for page in PAGES for line, lang, code, reason in _blocks(page) if lang == "python"]


@pytest.mark.parametrize("page,line,code,reason", EXAMPLES, ids=[f"{_rel(p)}:{n}" for p, n, _, _ in EXAMPLES])
def test_python_example_runs(page: Path, line: int, code: str, reason: str | None, tmp_path, monkeypatch):
    if reason is not None:
        pytest.skip(f"{_rel(page)}:{line}: {reason}")
    # examples may write files (kvcodec.save, DiskTier): they do it in a scratch folder, not the checkout
    monkeypatch.chdir(tmp_path)
    # padded so that a traceback's line numbers are the page's
    exec(compile("\n" * (line - 1) + code, _rel(page), "exec"), {"__name__": "__docs__"})  # noqa: S102


def test_the_package_docstring_example_runs():
    """``help(kvcodec)`` opens with an example; it runs as written."""
    import doctest

    import kvcodec

    result = doctest.testmod(kvcodec)
    assert result.attempted and not result.failed


def test_the_package_ships_its_license_and_type_marker():
    tomllib = pytest.importorskip("tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert (ROOT / "LICENSE").read_text().startswith("\n                                 Apache License")
    assert project["project"]["license-files"] == ["LICENSE"]
    assert (ROOT / "kvcodec" / "py.typed").exists() and "py.typed" in project["tool"]["setuptools"]["package-data"]["kvcodec"]
