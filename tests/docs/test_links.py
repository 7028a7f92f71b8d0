"""The README and docs/ stay a guide that holds together: every relative link in README.md and
docs/*.md reaches a file of the repository, every `#anchor` a heading of its target (GitHub's
anchors), the README stays short (the details live in docs/), and no tracked file cites a design
or ABI document outside the repository."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import Counter
from pathlib import Path

import pytest

from tests.helpers import ROOT

README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [README, *DOCS]
README_MAX_LINES = 600
# Names of documents the repository does not have; spelled in pieces so this file names neither.
ABSENT_DOCUMENTS = ("DESIGN" + ".md", "ABI" + ".md")

_FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
_CODE_SPAN = re.compile(r"(`+)(?!`).*?(?<!`)\1(?!`)", re.S)
_INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\[\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+[\"'(][^)]*)?\)")
_REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+.*)?$", re.M)
_HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.+?)[ \t]*#*[ \t]*$", re.M)


def _prose(text: str) -> str:
    """The text outside fenced code blocks (their lines are neither links nor headings)."""
    return _FENCE.sub("", text)


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: inline markup reduced to its text, lower case,
    punctuation dropped (letters, digits, `_`, `-` and spaces stay), each space a hyphen."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = text.strip().lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    """Every anchor of a Markdown file: its headings' anchors, a repeated one with -1, -2, ..."""
    seen: Counter[str] = Counter()
    found: set[str] = set()
    for _, heading in _HEADING.findall(_prose(path.read_text())):
        base = github_anchor(heading)
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    return found


def links(path: Path) -> list[str]:
    """The targets of a Markdown file's inline links, images and reference definitions, outside
    code blocks and code spans."""
    prose = _CODE_SPAN.sub("", _prose(path.read_text()))
    return _INLINE_LINK.findall(prose) + _REFERENCE_DEF.findall(prose)


def _relative(target: str) -> bool:
    return bool(target) and not re.match(r"^[a-zA-Z][a-zA-Z0-9+.-]*:|^//", target)


def test_github_anchors_as_github_makes_them() -> None:
    assert github_anchor("Walk-through with curl") == "walk-through-with-curl"
    assert github_anchor("Invoke path: `bench invoke`") == "invoke-path-bench-invoke"
    assert github_anchor("4.1 Device and errors") == "41-device-and-errors"
    assert github_anchor("`device_count() -> i32`") == "device_count---i32"
    assert github_anchor("What runs tenant code, and what it can see") == "what-runs-tenant-code-and-what-it-can-see"
    assert github_anchor("See [the API](api.md) here") == "see-the-api-here"


def test_headings_in_code_blocks_are_not_anchors_and_repeats_are_numbered(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text("# Title\n\n```sh\n# a comment\n```\n\n## Notes\n\n## Notes\n")
    assert anchors(page) == {"title", "notes", "notes-1"}


def test_links_are_found_outside_code_only(tmp_path: Path) -> None:
    page = tmp_path / "page.md"
    page.write_text(
        "See [a](docs/a.md#x), ![img](pic.png \"title\") and [web](https://example.com).\n"
        "`[not](a-link.md)`\n\n```\n[nor](this.md)\n```\n\n[ref]: other.md#y\n"
    )
    assert links(page) == ["docs/a.md#x", "pic.png", "https://example.com", "other.md#y"]


def test_the_pages_exist() -> None:
    assert README.exists() and DOCS, "README.md and docs/*.md are the guide"
    names = {p.name for p in DOCS}
    assert {"README.md", "architecture.md", "operations.md", "benchmarks.md", "guest-abi.md"} <= names


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(page: Path) -> None:
    broken = []
    for target in links(page):
        if not _relative(target) and not target.startswith("#"):
            continue
        path_part, _, anchor = target.partition("#")
        dest = (page.parent / path_part).resolve() if path_part else page
        if not dest.exists():
            broken.append(f"{target}: no such file")
            continue
        if not dest.is_relative_to(ROOT.resolve()):
            broken.append(f"{target}: outside the repository")
            continue
        if anchor:
            if dest.suffix != ".md" or dest.is_dir():
                broken.append(f"{target}: an anchor into a file that is not Markdown")
            elif anchor not in anchors(dest):
                broken.append(f"{target}: {dest.name} has no heading with that anchor")
    assert not broken, f"{page.relative_to(ROOT)} has broken links:\n" + "\n".join(broken)


def test_every_page_is_in_the_docs_index() -> None:
    index = ROOT / "docs" / "README.md"
    listed = {t.partition("#")[0] for t in links(index)}
    missing = [p.name for p in DOCS if p != index and p.name not in listed]
    assert not missing, f"docs/README.md does not list {missing}"


def test_the_readme_is_a_guide_not_a_notebook() -> None:
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines (at most {README_MAX_LINES}): move details to docs/"


def test_no_tracked_file_cites_a_document_the_repository_does_not_have() -> None:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs a git checkout")
    tracked = subprocess.run(
        ["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True
    ).stdout.decode().split("\0")
    citing = []
    for name in filter(None, tracked):
        path = ROOT / name
        if not path.is_file():
            continue
        data = path.read_bytes()
        citing += [f"{name} cites {doc}" for doc in ABSENT_DOCUMENTS if doc.encode() in data]
    assert tracked and not citing, "\n".join(citing)
