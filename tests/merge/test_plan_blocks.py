"""The plan's steps after the sort go a block of rows at a time into maps of files: whatever the
block size, and whether the per-row arrays are in memory or maps, the plan is the same — rows,
lists, variants, columns, key orders and the filenames' string table."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._format import spill as FS
from spillmerge._merge import plan as _plan
from spillmerge._merge import plancolumns as _plancolumns
from spillmerge._merge import plansql as _plansql
from spillmerge._merge.nametable import NameTable
from spillmerge._spill.barrier import wait_for_commits
from spillmerge._spill.root import load_all, same_bytes
from spillmerge._storage import Storage

NL = "\n"
NAMES = [f"f{i % 7}-\u00e9{NL if i % 5 == 0 else ''}/{i:03d}" for i in range(40)] + ["a\x00z", "\U0001f600"]


def _value(i: int) -> dict:
    v: dict = {"z": torch.tensor([i, 1]), "a": i % 3}  # not in sorted key order: key orders
    v["v"] = f"s{i}" if i % 3 == 0 else torch.full((2,), float(i), dtype=torch.float16)  # two variants
    v["n"] = None if i % 4 == 0 else torch.zeros(i % 3, 2)  # None, empty and ragged
    if i % 2:
        v["boxes"] = [{"b": [float(i), 2.0], "c": j} for j in range(i % 4)]  # lists of dicts, some empty
    v["t"] = [torch.full((j % 2 + 1,), float(j)) for j in range(i % 4)]  # a list of ragged tensors
    v["nest"] = [[torch.zeros(1)] * (j % 2) for j in range(i % 3)]  # lists of lists
    return v


def _write(root: Path) -> None:
    for rank in range(3):
        with spillmerge.SpillWriter(str(root), rank=rank, world_size=3) as w:
            for i, name in enumerate(NAMES):
                if i % 3 == rank:
                    for frame in range(1 + i % 3):
                        w.write(name, frame, _value(i + frame))
            if rank == 2:  # identical copies of rank 0's keys: duplicates decided in the sorted stream
                for i in range(0, len(NAMES), 9):
                    w.write(NAMES[i], 0, _value(i))


def _plan_of(root: Path) -> _plan.Plan:
    storage = Storage(str(root))
    state = wait_for_commits(storage, world_size=None, run_id=None, timeout=0.0, progress=False)
    segments = sorted(state.committed, key=lambda s: (FS.segment_sort_key(s.name)[1], s.rank, s.name))
    return _plan.build(load_all(storage, segments), "error", same_bytes=functools.partial(same_bytes, storage))


def _arrays(p: _plan.Plan) -> dict[str, np.ndarray]:
    out = {a: np.asarray(getattr(p, a)) for a in ("file_offsets", "frame_idx", "rank", "copies", "file_layout")}
    for c in p.columns:
        out[f"{c.name}.src"] = np.asarray(c.src)
        for a in ("counts", "shapes"):
            if getattr(c, a) is not None:
                out[f"{c.name}.{a}"] = np.asarray(getattr(c, a))
    for lst in p.lists:
        out[f"list {lst.name}"] = np.asarray(lst.offsets)
    return out


@pytest.mark.parametrize("in_memory", [True, False])
def test_the_plan_is_the_same_whatever_the_block_size_and_with_maps(tmp_path, monkeypatch, in_memory):
    _write(tmp_path / "s")
    monkeypatch.setattr(_plansql, "IN_MEMORY_ROWS", 1 << 30 if in_memory else 0)
    whole = _plan_of(tmp_path / "s")
    monkeypatch.setattr(_plancolumns, "ROW_BLOCK", 5)  # keys, files and lists cut by blocks
    monkeypatch.setattr(_plansql, "MAPPED_ROWS", 4)  # every per-row array a map of a file
    monkeypatch.setattr(_plansql, "BATCH", 7)
    cut = _plan_of(tmp_path / "s")
    assert isinstance(cut.filenames, NameTable) and isinstance(cut.columns[0].src, np.memmap)
    assert list(cut.filenames) == sorted(NAMES, key=lambda n: n.encode("utf-8")) == list(whole.filenames)
    assert cut.filenames.search(NAMES[3]) == list(cut.filenames).index(NAMES[3])
    assert cut.filenames.search("no such file") == -1
    assert cut.duplicates == whole.duplicates > 0 and cut.lists and cut.key_orders is not None
    assert {c.variant for c in cut.columns} != {None}  # the str / float16 leaf is two columns
    assert [c.header().to_obj() for c in cut.columns] == [c.header().to_obj() for c in whole.columns]
    assert cut.file_layouts == whole.file_layouts and cut.key_orders == whole.key_orders
    a, b = _arrays(whole), _arrays(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert _plan.fingerprint(cut) == _plan.fingerprint(whole)
