"""Every relative link and every repository path (`folder/file.py`, `workloads/suites/x.yaml`, ...) named in README.md
and docs/*.md exists, so a page cannot point at a file that moved. Dated pages in docs/results/ are records of
their day and are not checked."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

LINK = re.compile(r"\]\(([^)\s]+)\)")
# a relative path with at least one folder and a file suffix; not part of a URL or of an absolute path
PATH = re.compile(r"(?<![\w./:~$-])((?:[\w.-]+/)+[\w.-]+\.(?:py|yaml|yml|json|md|sh|toml|txt))\b")
# produced by a run, or on another machine: not in the repository
NOT_IN_REPO = ("results/", ".cache/", ".venv", "dashboards/data/", ".gpu-bundle/")


def _third_party(path: str) -> bool:
    """A path inside an installed package other than ours (e.g. `ray/...`): a source cited by module, not a file
    of this repository."""
    top = path.split("/", 1)[0]
    if (ROOT / top).exists() or not top.isidentifier():
        return False
    return importlib.util.find_spec(top) is not None


def _page_id(page: Path) -> str:
    return str(page.relative_to(ROOT))


def _links(page: Path) -> list[str]:
    return [t for t in LINK.findall(page.read_text(encoding="utf-8")) if not re.match(r"[a-z]+:|#", t)]


def _paths(page: Path) -> list[str]:
    return sorted(
        {
            p
            for p in PATH.findall(page.read_text(encoding="utf-8"))
            if "<" not in p and "*" not in p and not p.startswith(NOT_IN_REPO) and not _third_party(p)
        }
    )


def test_the_checks_find_links_and_paths():
    assert sum(len(_links(p)) for p in PAGES) > 20
    assert sum(len(_paths(p)) for p in PAGES) > 20


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_relative_link_exists(page):
    missing = []
    for target in _links(page):
        path = target.split("#", 1)[0]
        if path and not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{_page_id(page)} links to missing files: {missing}"


@pytest.mark.parametrize("page", PAGES, ids=_page_id)
def test_every_repository_path_named_exists(page):
    # a path is relative to the repository root; in a link it may also be relative to the page
    missing = [p for p in _paths(page) if not (ROOT / p).exists() and not (page.parent / p).exists()]
    assert not missing, f"{_page_id(page)} names files that do not exist: {missing}"
