"""Checks the issue-26 mutation audit found unguarded, each proven by a user-visible failure:
the leaf view's row bound, the open-time index invariants, a local lease whose lock file was
replaced, and links above an object. Every test here kills one entry of
``tests/mutation_check.py``."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import google_crc32c
import numpy as np
import pytest
import torch

import spillmerge
from spillmerge._merge import lease as _lease
from spillmerge._storage import Storage


def _output(tmp: Path) -> Path:
    """Two files of 3 rows each; ``s`` (a string) is absent in row 1 of ``a.mp4``, so it has a
    ``valid`` array; ``a`` (fixed float32) has none; ``m`` is ragged with varying ndim (shapes)."""
    root, out = tmp / "spill", tmp / "out"
    with spillmerge.SpillWriter(str(root), rank=0, world_size=1) as w:
        w.write("a.mp4", 0, {"a": torch.full((2,), 0.0), "s": "", "m": torch.ones(1, 2)})
        w.write("a.mp4", 1, {"a": torch.full((2,), 1.0), "m": torch.ones(2, 3)})
        w.write("a.mp4", 2, {"a": torch.full((2,), 2.0), "s": "xx", "m": torch.ones(1, 1)})
        for i in range(3):
            w.write("b.mp4", i, {"a": torch.full((2,), 10.0 + i), "s": "y", "m": torch.ones(1, 1)})
    spillmerge.merge(str(root), str(out))
    return out


def _edit_header(out: Path, **fields: object) -> None:
    meta = json.loads((out / "zarr.json").read_text())
    meta["attributes"]["spillmerge"].update(fields)
    (out / "zarr.json").write_text(json.dumps(meta))


def _rewrite_int64(chunk: Path, edit) -> None:  # type: ignore[no-untyped-def]
    """Rewrite an uncompressed int64 chunk (bytes + crc32c) through ``edit``, checksum fixed up."""
    arr = np.frombuffer(chunk.read_bytes()[:-4], dtype="<i8").copy()
    edit(arr)
    raw = arr.tobytes()
    chunk.write_bytes(raw + google_crc32c.value(raw).to_bytes(4, "little"))


def test_a_row_past_a_files_last_row_raises(tmp_path: Path) -> None:
    """``res["a.mp4"]["a"][3]`` on a 3-row file is an IndexError, not ``b.mp4``'s first row."""
    res = spillmerge.open(str(_output(tmp_path)))
    view = res["a.mp4"]["a"]
    assert len(view) == 3 and view[2].tolist() == [2.0, 2.0] and view[-3].tolist() == [0.0, 0.0]
    for leaf in ("a", "s", "m"):  # fixed, text and ragged views
        for i in (3, -4, np.int64(3)):
            with pytest.raises(IndexError, match="out of range for 3 rows"):
                res["a.mp4"][leaf][i]
    with pytest.raises(IndexError, match="out of range for 3 rows"):
        view[np.int64(3), 0]  # a row and an index within it
    assert res["a.mp4"]["s"][2] == "xx" and res["b.mp4"]["s"][0] == "y"


@pytest.mark.parametrize(("field", "value"), [("n_files", 3), ("n_frames", 7)])
def test_header_counts_that_disagree_with_the_index_are_refused(tmp_path: Path, field: str, value: int) -> None:
    out = _output(tmp_path)
    _edit_header(out, **{field: value})
    with pytest.raises(spillmerge.CorruptSpillError, match=f"the header's {field} is {value}, but the index holds"):
        spillmerge.open(str(out))
    assert any(field in p for p in spillmerge.verify(str(out)).problems)


def test_a_valid_array_the_header_does_not_declare_is_refused(tmp_path: Path) -> None:
    """``a`` has a value in every row (``has_valid`` false); a ``valid`` array added next to its
    values that marks rows absent is refused, not silently ignored or obeyed."""
    out = _output(tmp_path)
    shutil.copytree(out / "columns/s/valid", out / "columns/a/valid")
    meta = json.loads((out / "zarr.json").read_text())
    cm = meta["consolidated_metadata"]["metadata"]
    cm["columns/a/valid"] = cm["columns/s/valid"]
    # zarr nests the flat consolidated listing in key order: the new array goes in its place
    meta["consolidated_metadata"]["metadata"] = dict(sorted(cm.items()))
    (out / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(
        spillmerge.CorruptSpillError, match="columns/a/valid: present, but the column header's has_valid"
    ):
        spillmerge.open(str(out))


def test_verify_reports_a_consolidated_listing_out_of_order(tmp_path: Path) -> None:
    """An array appended at the end of the consolidated listing (not in key order) made zarr's
    member listing raise a raw KeyError out of ``verify``: it is a problem named in the report."""
    out = _output(tmp_path)
    meta = json.loads((out / "zarr.json").read_text())
    cm = meta["consolidated_metadata"]["metadata"]
    cm["columns/a/valid"] = cm["columns/s/valid"]
    (out / "zarr.json").write_text(json.dumps(meta))
    rep = spillmerge.verify(str(out))
    assert not rep.ok and any("consolidated metadata is inconsistent" in p for p in rep.problems), rep.problems
    with pytest.raises(spillmerge.CorruptSpillError):
        spillmerge.open(str(out))


def test_a_negative_dimension_in_shapes_is_refused(tmp_path: Path) -> None:
    """Row 1 of ``m`` is ``[2, 3]``; ``[-2, -3]`` has the same product, so only the sign check
    stands between it and a reshape to a negative shape."""
    out = _output(tmp_path)

    def neg(a: np.ndarray) -> None:
        a.shape = (-1, 2)
        assert a[1].tolist() == [2, 3]
        a[1] = [-2, -3]

    _rewrite_int64(out / "columns/m/shapes/c/0/0", neg)
    with pytest.raises(spillmerge.CorruptSpillError, match="row 1 has a negative dimension"):
        spillmerge.open(str(out))
    assert any("negative dimension" in p for p in spillmerge.verify(str(out)).problems)


def test_an_absent_row_whose_offsets_span_bytes_is_refused(tmp_path: Path) -> None:
    """``s`` is absent in row 1 (offsets step 0); moving its end one byte into row 2's ``"xx"``
    keeps offsets monotone and total, but an absent row stores nothing."""
    out = _output(tmp_path)

    def shift(a: np.ndarray) -> None:
        assert a[:4].tolist() == [0, 0, 0, 2]
        a[2] = 1

    _rewrite_int64(out / "columns/s/offsets/c/0", shift)
    with pytest.raises(spillmerge.CorruptSpillError, match="row 1 has no value but spans 1"):
        spillmerge.open(str(out))


def test_a_local_lease_whose_lock_file_was_replaced_is_lost(tmp_path: Path) -> None:
    """Someone unlinks the lock file of a held local lease and creates a new one at the same path
    (which another merge could lock): the holder stops at its next check."""
    dst = Storage(str(tmp_path / "out"))
    lease = _lease.whole(dst)
    try:
        lease.check()
        locks = sorted((tmp_path / "out").rglob("*.lock"))
        assert locks, list((tmp_path / "out").rglob("*"))
        for lock in locks:
            lock.unlink()
            lock.write_bytes(b"")
        with pytest.raises(spillmerge.LeaseLostError, match="was removed or replaced"):
            lease.check()
    finally:
        lease.release()


def test_storage_refuses_paths_that_are_not_normalised(tmp_path: Path) -> None:
    storage = Storage(str(tmp_path / "root"))
    for rel in ("a/./b", "a//b", "a/b/..", "a/../a/b"):
        with pytest.raises(spillmerge.UnsafePathError, match="not normalised"):
            storage.path(rel)
        with pytest.raises(spillmerge.UnsafePathError):
            storage.put(rel, b"x")
    assert not (tmp_path / "root/a").exists()
    assert storage.path("a/b").endswith("/root/a/b")


def test_a_linked_folder_above_an_object_is_refused(tmp_path: Path) -> None:
    """The output's ``columns/a`` folder replaced by a link to an identical copy outside the root:
    reading its values would follow the link, so it is refused by name."""
    out = _output(tmp_path)
    outside = tmp_path / "elsewhere"
    shutil.move(str(out / "columns/a/values"), str(outside))
    os.symlink(outside, out / "columns/a/values")
    with pytest.raises(spillmerge.UnsafePathError, match="columns/a/values is a symbolic link"):
        res = spillmerge.open(str(out))
        res["a.mp4"]["a"][0]
