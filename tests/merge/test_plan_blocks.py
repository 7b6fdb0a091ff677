"""The plan's steps after the sort go a block of rows at a time into maps of files: whatever the
block size, and whether the per-row arrays are in memory or maps, the plan is the same — rows,
lists, variants, columns, key orders and the filenames' string table; a merge planned in tiny
blocks gives every dict back in its key order."""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np
import pytest
import torch
from _helpers import committed_segments, plan_of

import spillmerge
from spillmerge._format import keyorder as _keyorder
from spillmerge._merge import plan as _plan
from spillmerge._merge import plancolumns as _plancolumns
from spillmerge._merge import plansql as _plansql
from spillmerge._merge.nametable import NameTable

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


def _arrays(p: _plan.Plan) -> dict[str, np.ndarray]:
    out = {a: np.asarray(getattr(p, a)) for a in ("file_offsets", "frame_idx", "rank", "copies", "file_layout")}
    for c in p.columns:
        out[f"{c.name}.src"] = np.asarray(c.src)
        for a in ("offsets", "shapes"):
            if getattr(c, a) is not None:
                out[f"{c.name}.{a}"] = np.asarray(getattr(c, a))
    for lst in p.lists:
        out[f"list {lst.name}"] = np.asarray(lst.offsets)
    return out


@pytest.mark.parametrize("in_memory", [True, False])
def test_the_plan_is_the_same_whatever_the_block_size_and_with_maps(tmp_path, monkeypatch, in_memory):
    _write(tmp_path / "s")
    monkeypatch.setattr(_plansql, "in_memory", lambda n, limit: in_memory)
    whole = plan_of(tmp_path / "s")
    monkeypatch.setattr(_plancolumns, "ROW_BLOCK", 5)  # keys, files and lists cut by blocks
    monkeypatch.setattr(_keyorder, "BLOCK", 3)
    monkeypatch.setattr(_plansql, "MAPPED_ROWS", 4)  # every per-row array a map of a file
    monkeypatch.setattr(_plansql, "BATCH", 7)
    cut = plan_of(tmp_path / "s")
    assert isinstance(cut.filenames, NameTable) and isinstance(cut.columns[0].src, np.memmap)
    assert list(cut.filenames) == sorted(NAMES, key=lambda n: n.encode("utf-8")) == list(whole.filenames)
    assert cut.filenames.search(NAMES[3]) == list(cut.filenames).index(NAMES[3])
    assert cut.filenames.search("no such file") == -1
    frames = {name: 1 + i % 3 for i, name in enumerate(NAMES)}  # each file's rows are its frames
    assert np.diff(cut.file_offsets).tolist() == [frames[name] for name in cut.filenames]
    assert cut.duplicates == whole.duplicates > 0 and cut.lists and cut.key_orders is not None
    assert {c.variant for c in cut.columns} != {None}  # the str / float16 leaf is two columns
    assert [c.header().to_obj() for c in cut.columns] == [c.header().to_obj() for c in whole.columns]
    assert cut.file_layouts == whole.file_layouts and cut.key_orders == whole.key_orders
    a, b = _arrays(whole), _arrays(cut)
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k
    assert _plan.fingerprint(cut) == _plan.fingerprint(whole)


def _write_orders(root: Path, wide: bool) -> dict[str, list[dict]]:
    """Files whose dicts change order every 3 files and come back to earlier orders, some in
    sorted order (no positions), some whose second frame holds the dict in another order than
    the first (they clash: the first written decides), over 2 ranks' segments. ``wide``: 10 keys
    in 11 orders, 90 distinct positioned layouts (more than 62). Returns each
    file's values by frame."""
    keys = [f"k{j}" for j in range(10 if wide else 3)]
    perms = [keys[s:] + keys[:s] for s in range(len(keys))] + [keys[::-1]]  # rotation 0 is sorted
    values: dict[str, list[dict]] = {}
    for i in range(40):
        order = [perms[(i // 3 + f * (i % 7 == 3)) % len(perms)] for f in range(1 + (i % 7 == 3) + (i % 5 == 0))]
        m = {"m": {"y": i, "x": i}} if i % 4 else {}  # a file of sorted keys, no ``m``: no positions
        values[f"file{i:03d}"] = [{**{k: 10 * i + f for k in o}, **m} for f, o in enumerate(order)]
    for rank in range(2):
        with spillmerge.SpillWriter(str(root), rank=rank, world_size=2) as w:
            for i, (name, frames) in enumerate(values.items()):
                if i % 2 == rank:
                    for f, v in enumerate(frames):
                        w.write(name, f, v)
    return values


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_key_orders_are_the_same_whatever_the_block_size(tmp_path, monkeypatch, wide):
    """``output_orders`` a file (and an index row) at a time, its per-file arrays maps of files,
    gives the orders and runs of one block: runs go on across the blocks' edges."""
    _write_orders(tmp_path / "s", wide)
    _, segments = committed_segments(tmp_path / "s")
    names = sorted({n for s in segments for n in s.filenames})
    positioned = {(lay.leaf, lay.pos) for s in segments for lay in s.layouts if lay.pos is not None}
    assert (len(positioned) > 62) == wide
    number = {n: k for k, n in enumerate(names)}
    file_ids = [np.array([number[n] for n in s.filenames], dtype=np.int64) for s in segments]
    whole = _keyorder.output_orders(names, segments, file_ids, new=lambda _, shape, dtype: np.zeros(shape, dtype))
    assert whole is not None and len(whole["orders"]) > 4
    assert max(b - a for a, b, _ in whole["runs"]) >= 3  # runs longer than the blocks below
    assert sum(b - a for a, b, _ in whole["runs"]) < len(names)  # and files of no orders between them
    monkeypatch.setattr(_plansql, "MAPPED_ROWS", 4)
    (tmp_path / "work").mkdir()
    new = functools.partial(_plansql.alloc, str(tmp_path / "work"))
    for block in (1, 2, 5):
        monkeypatch.setattr(_keyorder, "BLOCK", block)
        assert _keyorder.output_orders(names, segments, file_ids, new=new) == whole, block
    assert any(p.suffix == ".bin" for p in (tmp_path / "work").iterdir())  # the states were maps


@pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])
def test_a_merge_planned_in_tiny_blocks_gives_every_dict_in_its_key_order(tmp_path, monkeypatch, wide):
    """Through a whole merge with blocks of 2 files and every per-file array a map: each dict
    comes back in its file's order, that of the first frame written that records positions where
    frames disagree (a value whose dicts are all in sorted order records none)."""
    values = _write_orders(tmp_path / "s", wide)
    monkeypatch.setattr(_keyorder, "BLOCK", 2)
    monkeypatch.setattr(_plancolumns, "ROW_BLOCK", 5)
    monkeypatch.setattr(_plansql, "MAPPED_ROWS", 4)
    spillmerge.merge(str(tmp_path / "s"), str(tmp_path / "o"), progress=False)
    res = spillmerge.open(str(tmp_path / "o"))
    assert len(res.header["key_orders"]["runs"]) < len(values)
    clashed = 0
    for name, frames in values.items():
        carries = [v for v in frames if any(list(d) != sorted(d) for d in (v, v.get("m", {})))]
        first = list(carries[0]) if carries else sorted(frames[0])
        for f, want in enumerate(frames):
            got = res.value(name, f)
            assert got == want and list(got) == first, (name, f)
            assert list(got.get("m", ["y", "x"])) == ["y", "x"], (name, f)
            clashed += list(want) != first
    assert clashed
