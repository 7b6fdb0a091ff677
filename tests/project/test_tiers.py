"""The suite's tiers and schedule (tests/conftest.py) name test files and tests that exist: a
renamed test would otherwise leave ``make test-fast`` running it or ``make test`` starting it late."""

from __future__ import annotations

from pathlib import Path

from conftest import FIRST, SPREAD, TIERS

HERE = Path(__file__).parents[1]  # tests/


def test_every_tier_and_schedule_entry_names_a_test() -> None:
    missing = []
    for entry in [name for names in TIERS.values() for name in names.split()] + FIRST.split():
        stem, _, func = entry.partition("::")
        path = next(HERE.rglob(f"{stem}.py"), HERE / f"{stem}.py")
        if not path.exists() or (func and f"def {func}(" not in path.read_text(encoding="utf-8")):
            missing.append(entry)
    assert not missing, missing


def test_spread_files_share_no_module_set_up() -> None:
    """A SPREAD file's tests run on several workers: a module fixture there would be built on each."""
    shared = [
        stem
        for stem in SPREAD.split()
        if any(s in next(HERE.rglob(f"{stem}.py")).read_text(encoding="utf-8") for s in ('scope="module"', "ranks_fixture("))
    ]
    assert not shared, shared
