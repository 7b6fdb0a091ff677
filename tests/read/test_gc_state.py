"""The cyclic garbage collector is paused only inside bounded steps that build acyclic objects
(a catalog parsed, a small plan sorted, a block of values decoded): after a merge, a read or a
failure, its state is the one the caller set."""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path

import pytest

import spillmerge


@pytest.fixture(params=[True, False], ids=["gc-on", "gc-off"])
def gc_state(request: pytest.FixtureRequest) -> Iterator[bool]:
    was = gc.isenabled()
    (gc.enable if request.param else gc.disable)()
    try:
        yield request.param
    finally:
        (gc.enable if was else gc.disable)()


def _spill(root: Path) -> None:
    with spillmerge.SpillWriter(str(root), 0, 1, fsync=False) as w:
        for i in range(50):
            w.write(f"p{i:03d}", 0, {"text": "é" * (i % 7), "token_ids": list(range(i % 9 + 1)), "logprob": -0.5 * i})


def test_merge_and_reads_leave_the_collectors_state_as_the_caller_set_it(tmp_path: Path, gc_state: bool) -> None:
    _spill(tmp_path / "spill")
    spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out"), progress=False, fsync=False)
    assert gc.isenabled() is gc_state
    res = spillmerge.open(str(tmp_path / "out"))
    values = [v for _, _, v in res.iter_values()]
    assert gc.isenabled() is gc_state
    assert values[8] == res.value("p008") == {"text": "é", "token_ids": list(range(9)), "logprob": -4.0}
    assert gc.isenabled() is gc_state


def test_a_failed_catalog_read_leaves_the_collectors_state_as_the_caller_set_it(tmp_path: Path, gc_state: bool) -> None:
    _spill(tmp_path / "spill")
    (catalog,) = (tmp_path / "spill").glob("rank-*/seg-*/catalog/c/*")
    catalog.write_bytes(b"x" + catalog.read_bytes()[1:])
    with pytest.raises(spillmerge.SpillMergeError, match="catalog"):
        spillmerge.merge(str(tmp_path / "spill"), str(tmp_path / "out"), progress=False, fsync=False)
    assert gc.isenabled() is gc_state
