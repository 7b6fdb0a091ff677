"""The merge plan's sort in DuckDB: out of core under a small memory limit, the same plan as with
a large one, and no work folder left behind after a success, an error, or a kill and a rerun."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from _helpers import plan_of

import spillmerge
from spillmerge._errors import DuplicateFrameError
from spillmerge._merge import plan as _plan
from spillmerge._merge import plansql as _plansql
from spillmerge._storage import Storage


def _write(root: Path, n: int, *, differ: bool = False) -> None:
    """``n`` keys of long names from 2 ranks; rank 1 also writes 1 in 50 of rank 0's keys, with
    the same content (or different content when ``differ``)."""
    pad = "x" * 60
    for rank in range(2):
        mine = [f"dir-{i % 17}/{pad}-{i:08d}.bin" for i in range(rank, n, 2)]
        with spillmerge.SpillWriter(str(root), rank=rank, world_size=2) as w:
            w.write_batch(mine, {"v": torch.arange(len(mine) * 2, dtype=torch.float32).reshape(-1, 2)})
            if rank == 1:
                for i in range(0, n, 100):
                    j = i // 2
                    w.write(f"dir-{i % 17}/{pad}-{i:08d}.bin", 0, {"v": torch.tensor([2.0 * j, 2.0 * j + 1 + differ])})


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir()) if folder.exists() else []


def test_a_plan_larger_than_its_memory_limit_is_built_out_of_core_and_equals_the_plan_in_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(_plansql, "MAPPED_ROWS", 1000)  # a big plan's row table: maps of files
    monkeypatch.setattr(_plansql, "MIN_SORT_MEMORY", 32 << 20)  # what DuckDB needs for these rows
    n = 200_000  # about 22 MB of sort rows (names of 80 bytes): more than DuckDB sorts in 32 MiB
    _write(tmp_path / "s", n)
    spilled: list[str] = []  # DuckDB's temporary files when the first sorted batch comes back
    collect = _plansql._collect

    def watched(reader: Any, resolve: Any, folder: str, n_names: list[int], *rest: Any) -> Any:
        def batches() -> Any:
            for batch in reader:
                if not spilled:
                    spilled.extend(os.listdir(os.path.join(folder, "tmp")) or ["(none)"])
                yield batch

        return collect(batches(), resolve, folder, n_names, *rest)

    monkeypatch.setattr(_plansql, "_collect", watched)
    small = plan_of(tmp_path / "s", memory_limit=32 << 20, work_dir=str(tmp_path / "w"))
    assert any("storage" in name for name in spilled), spilled  # the sort went out of core
    monkeypatch.setattr(_plansql, "_collect", collect)
    large = plan_of(tmp_path / "s", memory_limit=1 << 30)
    assert small.n_frames == n and small.duplicates == n // 100
    assert _plan.fingerprint(small) == _plan.fingerprint(large)
    assert list(small.filenames) == sorted(small.filenames) == list(large.filenames)
    for a, b in zip(small.columns, large.columns, strict=True):
        assert np.array_equal(a.src, b.src)
    assert np.array_equal(small.copies, large.copies) and int(small.copies.max()) == 2
    assert all(isinstance(a, np.memmap) for a in (small.seg, small.offset, small.nbytes, small.crc))
    assert _leftovers(tmp_path / "w") == []


def test_the_work_folder_goes_after_a_success_an_error_and_a_kill_then_a_rerun(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    work = tmp_path / "w"
    _write(tmp_path / "same", 400)
    _write(tmp_path / "differ", 400, differ=True)
    plan_of(tmp_path / "same", work_dir=str(work))  # in memory: no work folder at all
    assert not work.exists()
    monkeypatch.setattr(_plansql, "in_memory", lambda n, limit: False)  # DuckDB's sort, in a work folder
    plan_of(tmp_path / "same", work_dir=str(work))
    assert _leftovers(work) == []
    with pytest.raises(DuplicateFrameError, match="different content"):
        plan_of(tmp_path / "differ", work_dir=str(work))
    assert _leftovers(work) == []
    # Killed in the middle of the plan (while it compares two copies' bytes): its folder stays...
    script = textwrap.dedent(f"""
        import os, signal, sys
        sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        import test_plan_sql as t
        from spillmerge._merge import plan as _plan
        from spillmerge._merge import plansql as _plansql
        _plansql.in_memory = lambda n, limit: False
        real = _plan.build
        def build(segments, on_duplicate, *, same_bytes, **kw):
            def killer(a, b):
                os.kill(os.getpid(), signal.SIGKILL)
            return real(segments, on_duplicate, same_bytes=killer, **kw)
        _plan.build = build
        t.plan_of(t.Path({str(tmp_path / "same")!r}), work_dir={str(work)!r})
    """)
    r = subprocess.run([sys.executable, "-c", script], env=dict(os.environ), capture_output=True, timeout=300)
    assert r.returncode == -signal.SIGKILL, r.stderr.decode()[-2000:]
    left = _leftovers(work)
    assert len(left) == 1 and left[0].startswith("spillmerge-sqlplan-"), left
    # ... and the next plan under the same folder removes it.
    plan_of(tmp_path / "same", work_dir=str(work))
    assert _leftovers(work) == []


def test_keys_whose_copies_straddle_sorted_batches_are_decided_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    n = 2000  # every key on both ranks, 3 leaves: 6 rows a key, cut by batch ends of 2,048 rows
    names = [f"k{i:05d}" for i in range(n)]
    for rank in range(2):
        with spillmerge.SpillWriter(str(tmp_path / "s"), rank=rank, world_size=2) as w:
            w.write_batch(names, {"a": torch.arange(n), "b": torch.ones(n, 2), "c": [f"c{i}" for i in range(n)]})
    monkeypatch.setattr(_plansql, "in_memory", lambda n, limit: False)  # DuckDB's batches, however few the rows
    whole = plan_of(tmp_path / "s")  # one batch
    monkeypatch.setattr(_plansql, "BATCH", 2048)
    cut = plan_of(tmp_path / "s", memory_limit=32 << 20)
    assert cut.n_frames == whole.n_frames == n and cut.duplicates == whole.duplicates == n
    assert (cut.copies == 2).all() and (cut.rank == 0).all()
    assert _plan.fingerprint(cut) == _plan.fingerprint(whole)


def test_a_plan_budget_below_what_the_sort_needs_is_raised_to_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plan_budget of a few KiB (smaller than DuckDB can sort in) plans all the same."""
    monkeypatch.setattr(_plansql, "in_memory", lambda n, limit: False)  # DuckDB's sort, however few the rows
    _write(tmp_path / "s", 2000)
    tiny = plan_of(tmp_path / "s", memory_limit=64 << 10)
    assert _plan.fingerprint(tiny) == _plan.fingerprint(plan_of(tmp_path / "s", memory_limit=1 << 30))


@pytest.mark.parametrize("first", [0, 1])
def test_a_file_whose_frames_order_one_dict_differently_keeps_the_first_written(tmp_path: Path, first: int) -> None:
    """Two frames of one file hold a dict out of sorted order, each in another order, between
    files of one order (written before and after it, so the order written first in the file is
    not the segment's first): every frame of that file comes back in the order of the frame
    written first (not the lowest frame), the other files in theirs."""
    orders = {0: ("z", "x", "y"), 1: ("y", "z", "x")}
    with spillmerge.SpillWriter(str(tmp_path / "s")) as w:
        w.write("b", 0, {k: 1 for k in orders[1]})
        for f in (first, 1 - first):
            w.write("a", f, {k: i for i, k in enumerate(orders[f])})
        w.write("c", 0, {k: 1 for k in orders[1]})
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"), progress=False)
    res = spillmerge.open(str(tmp_path / "o"))
    assert [tuple(res.value("a", f)) for f in (0, 1)] == [orders[first]] * 2
    assert [tuple(res.value(n, 0)) for n in ("b", "c")] == [orders[1]] * 2


def test_a_small_merge_reads_each_segment_once_a_large_one_again_for_each_pass(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The sort and the key-order pass both read each segment's catalog and index. Within the
    merge's keep budget a segment read for the sort stays loaded for the key-order pass; past it
    (a large merge) each pass reads it again, so one segment at a time is held. The output is the
    same either way."""
    from spillmerge._spill import lazy

    for rank in range(2):
        with spillmerge.SpillWriter(str(tmp_path / "spill"), rank=rank, world_size=2) as w:
            for i in range(rank, 40, 2):  # dicts out of sorted key order: the key-order pass runs
                w.write(f"f{i:03d}", 0, {"z": float(i), "a": [i] * (i % 3 + 1)})
    monkeypatch.setattr(_plansql, "in_memory", lambda n, limit: False)  # DuckDB's sort, which lets segments go
    reads: list[str] = []
    real = lazy.load_segment

    def counted(storage: Storage, seg: Any) -> Any:
        reads.append(seg.rel)
        return real(storage, seg)

    monkeypatch.setattr(lazy, "load_segment", counted)
    values = {}
    for keep in (lazy.KEEP_BYTES, 0):
        monkeypatch.setattr(lazy, "KEEP_BYTES", keep)
        reads.clear()
        out = tmp_path / f"out-{keep}"
        spillmerge.merge(str(tmp_path / "spill"), str(out), progress=False)
        per_segment = sorted(reads.count(r) for r in set(reads))
        assert per_segment == ([1, 1] if keep else [2, 2]), (keep, reads)
        values[keep] = [(name, v) for name, _, v in spillmerge.open(str(out)).iter_values()]
    assert values[lazy.KEEP_BYTES] == values[0]
    assert list(values[0][0][1]) == ["z", "a"]
