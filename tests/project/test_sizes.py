"""The house stays readable: the README a newcomer reads in minutes, each doc in one sitting, no
module longer than one can hold in mind (issue 39's limits)."""

from __future__ import annotations

from pathlib import Path

import spillmerge

REPO = Path(spillmerge.__file__).parent.parent


def test_the_readme_and_each_doc_stay_short() -> None:
    docs = sorted((REPO / "docs").glob("*.md"))
    sizes = {p.name: len(p.read_text(encoding="utf-8")) for p in docs}
    assert len((REPO / "README.md").read_text(encoding="utf-8")) <= 10_000
    assert {name: n for name, n in sizes.items() if n > 25_000} == {}
    assert sum(sizes.values()) <= 100_000


def test_no_module_is_longer_than_600_lines() -> None:
    lengths = {
        str(p.relative_to(REPO)): len(p.read_text(encoding="utf-8").splitlines())
        for p in REPO.glob("spillmerge/**/*.py")
    }
    assert {p: n for p, n in lengths.items() if n > 600} == {}
