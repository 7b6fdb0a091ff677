"""A small plan is sorted in memory (no DuckDB started): the same plan, duplicates decided alike,
the same errors, as the DuckDB sort of the same rows."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import plan_of

import spillmerge
from spillmerge._errors import DuplicateFrameError
from spillmerge._merge import plan as _plan
from spillmerge._merge import plansql as _plansql

NAMES = ["b", "a\uffff", "a\x00z", "é", "A", "a", "z\n", "\U0001f600", "ab"]
"""Names whose UTF-8 bytes sort as their code points: NUL, newline, multi-byte, astral."""


def _write(root: Path, *, differ: bool = False, policy_rows: bool = False) -> None:
    """Two ranks; rank 1 rewrites some of rank 0's keys (same content, or different with ``differ``)."""
    for rank in range(2):
        with spillmerge.SpillWriter(str(root), rank=rank, world_size=2) as w:
            for i, name in enumerate(NAMES):
                for frame in range(rank, 6, 2):
                    w.write(name, frame, {"x": torch.tensor([i, frame]), "s": f"{name}{frame}", "l": [i] * frame})
            if rank == 1:
                for name in NAMES[::3]:
                    j = NAMES.index(name)
                    value = {"x": torch.tensor([j, 0 + differ]), "s": f"{name}0", "l": []}
                    w.write(name, 0, value)
                    if policy_rows:
                        w.write(name, 2, {"x": torch.tensor([j, 7]), "s": "other", "l": [1]})


def _plan_of(root: Path, in_memory: bool, monkeypatch: pytest.MonkeyPatch, on_duplicate: str = "error") -> _plan.Plan:
    monkeypatch.setattr(_plansql, "in_memory", lambda n, limit: in_memory)
    return plan_of(root, on_duplicate)


@pytest.mark.parametrize("on_duplicate", ["first", "last"])
def test_a_small_plan_in_memory_equals_the_duckdb_plan(tmp_path, monkeypatch, on_duplicate):
    _write(tmp_path / "s", policy_rows=True)
    mem = _plan_of(tmp_path / "s", True, monkeypatch, on_duplicate)
    sql = _plan_of(tmp_path / "s", False, monkeypatch, on_duplicate)
    assert list(mem.filenames) == sorted(NAMES) == list(sql.filenames)
    assert _plan.fingerprint(mem) == _plan.fingerprint(sql)
    assert mem.duplicates == sql.duplicates == 6
    for k in ("frame_idx", "rank", "copies", "seg", "offset", "nbytes", "crc", "file_offsets"):
        assert np.array_equal(getattr(mem, k), getattr(sql, k)), k
    assert [c.name for c in mem.columns] == [c.name for c in sql.columns]
    for a, b in zip(mem.columns, sql.columns, strict=True):
        assert np.array_equal(a.src, b.src)
    assert mem.key_orders == sql.key_orders


def test_a_small_plan_in_memory_refuses_copies_that_differ(tmp_path, monkeypatch):
    _write(tmp_path / "s", differ=True)
    for in_memory in (True, False):
        with pytest.raises(DuplicateFrameError, match="different content") as err:
            _plan_of(tmp_path / "s", in_memory, monkeypatch)
        assert "frame 0 of 'b'" in str(err.value)  # the first differing key in sorted order


def test_a_small_merge_starts_neither_duckdb_nor_a_thread_pool(tmp_path):
    """Nor imports pandas (a second of a fresh process, for nothing the merge needs) or
    pyarrow.compute (0.14 s: the sort and the names' comparisons are numpy's)."""
    script = textwrap.dedent(f"""
        import sys, threading, spillmerge
        started = []
        real_start = threading.Thread.start
        def start(self):
            started.append(self.name)
            real_start(self)
        threading.Thread.start = start
        with spillmerge.SpillWriter({str(tmp_path / "spill")!r}, rank=0, world_size=1) as w:
            w.write_batch([f"k{{i}}" for i in range(1000)], [{{"a": i, "b": [1.0, 2.0]}} for i in range(1000)])
        w.merge({str(tmp_path / "out.zarr")!r}, progress=False)
        assert spillmerge.open({str(tmp_path / "out.zarr")!r}).value("k7") == {{"a": 7, "b": [1.0, 2.0]}}
        print("duckdb" in sys.modules)
        print([n for n in started if n.startswith(("spillmerge-merge", "spillmerge-index"))])
        print("pandas" in sys.modules)
        print("pyarrow.compute" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[:4] == ["False", "[]", "False", "False"], r.stdout


def test_a_merge_sorted_by_duckdb_imports_no_pandas(tmp_path):
    """The DuckDB sort's batches are read by numpy (a boolean Arrow array's to_numpy() imports
    pandas: a second of a fresh process)."""
    script = textwrap.dedent(f"""
        import sys, spillmerge
        from spillmerge._merge import plansql
        plansql.in_memory = lambda n, limit: False
        with spillmerge.SpillWriter({str(tmp_path / "spill")!r}, rank=0, world_size=1) as w:
            w.write_batch([f"k{{i % 300}}" for i in range(1000)], [{{"a": i}} for i in range(1000)],
                          frame_idx=[i // 300 for i in range(1000)])
        w.merge({str(tmp_path / "out.zarr")!r}, progress=False)
        assert spillmerge.open({str(tmp_path / "out.zarr")!r}).value("k7", 1) == {{"a": 307}}
        print("duckdb" in sys.modules, "pandas" in sys.modules)
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split("\n")[0] == "True False", r.stdout


def test_the_plan_is_sorted_in_memory_while_the_budget_holds_its_rows():
    """Up to plan_budget / 2 KiB rows (256k under the default 512 MiB) the rows are sorted in
    memory: no DuckDB to start; a smaller budget sends them to DuckDB, which sorts within it."""
    from spillmerge._merge.options import DEFAULT_PLAN_BUDGET

    assert _plansql.in_memory(200_000, DEFAULT_PLAN_BUDGET)
    assert not _plansql.in_memory(300_000, DEFAULT_PLAN_BUDGET)
    assert not _plansql.in_memory(200_000, 64 << 20)
    assert _plansql.in_memory(60_000, 1 << 20)  # a few rows whatever the budget
