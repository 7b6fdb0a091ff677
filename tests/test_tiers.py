"""The suite's tiers and schedule (tests/conftest.py) name test files and tests that exist: a
renamed test would otherwise leave ``make test-fast`` running it or ``make test`` starting it late."""

from __future__ import annotations

from pathlib import Path

from conftest import FIRST, TIERS

HERE = Path(__file__).parent


def test_every_tier_and_schedule_entry_names_a_test() -> None:
    missing = []
    for entry in [name for names in TIERS.values() for name in names.split()] + FIRST.split():
        stem, _, func = entry.partition("::")
        path = HERE / f"{stem}.py"
        if not path.exists() or (func and f"def {func}(" not in path.read_text(encoding="utf-8")):
            missing.append(entry)
    assert not missing, missing
