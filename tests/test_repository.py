"""What the repository holds: the project's text, and the plots its docs show. A binary someone
needed once (a profiler's wheel was committed at the root) would ride along in every clone."""

import re
import subprocess
from fnmatch import fnmatch
from pathlib import Path

import pytest

from conftest import ROOT

LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)
FENCED = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)  # code blocks: their brackets are code
OWN_BINARIES = ("docs/*.png",)  # plots the docs pages show, made by plait's own proof tools


def tracked_files() -> list[str]:
    if not (ROOT / ".git").exists():
        pytest.skip("not a git checkout (an installed copy): nothing is tracked")
    return subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True,
                          text=True).stdout.split("\0")[:-1]


def is_binary(path: str) -> bool:
    return b"\0" in (ROOT / path).read_bytes()[:8192]


def test_nothing_binary_is_tracked_but_the_docs_plots():
    binaries = [p for p in tracked_files() if (ROOT / p).is_file() and is_binary(p)]
    assert [p for p in binaries if not any(fnmatch(p, pattern) for pattern in OWN_BINARIES)] == []


def test_every_module_is_small():
    """Files under ~400 lines: a module that outgrows it holds two things and splits along them."""
    sizes = {str(p.relative_to(ROOT)): len(p.read_text().splitlines()) for p in (ROOT / "plait").rglob("*.py")}
    assert {name: n for name, n in sizes.items() if n > 400} == {}


def broken_links(pages: list[Path]) -> list[str]:
    """`page: target` for each relative link of `pages` whose file does not exist (anchors are not checked)."""
    broken = []
    for page in pages:
        for target in LINK.findall(FENCED.sub("", page.read_text())):
            path = target.split("#")[0]
            if path and not re.match(r"[a-z]+:", path) and not (page.parent / path).exists():
                broken.append(f"{page.relative_to(ROOT)}: {target}")
    return broken


def test_every_link_of_the_readme_and_docs_leads_somewhere():
    """A page moved or renamed leaves no link behind it (README.md and docs/ link each other and the tests)."""
    broken = broken_links([ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_every_extra_the_docs_name_exists_and_the_tests_install_each_one():
    """A `pip install -e ".[NAME]"` in README.md or docs/ names an extra of pyproject.toml (the
    walk-through's `.[hf]` reload was a line no install made work), and `.[test]`, which CI
    installs, holds every package of every extra: their code paths are the tests' too."""
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    named = {name for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
             for group in re.findall(r'pip install -e "\.\[([\w,]+)\]"', page.read_text()) for name in group.split(",")}
    assert "hf" in named and named <= set(extras), named - set(extras)
    assert {package for name, packages in extras.items() if name != "test" for package in packages} <= \
        set(extras["test"]), "an extra's package missing from .[test]"
